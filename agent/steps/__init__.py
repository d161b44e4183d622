"""Step-latency metrics: tail the TaskD records, pair markers into steps, detect slow ranks, render `training_*`."""
