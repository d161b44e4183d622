"""The reason label values of the step families, in a leaf: the collector exports them (the skip
counters at 0 from the start, so that a rate() sees the first skip) before any record has loaded
the pipeline that counts them."""

LINE = ("not_json", "not_object", "bad_field", "missing_field")  # a line records.parse skips
PAIRING = ("unpaired", "id_reused", "negative_duration", "unnamed_range", "bad_step_name", "step_incomplete",
           "device_range_missing")  # the keys of pairing.RankAssembler.errors
# What the tailer reports through `on_bad_input` (files, directories, parallel_group.json).
BAD_INPUT = ("records_lost", "partial_line_at_rotation", "file_truncated", "file_replaced", "line_too_long",
             "job_dir", "rank_dir", "parallel_group")
NODE_LIMIT = "node_limit"  # the node-wide bound on held entries (agent.steps.consumer.MAX_HELD)
PARSE_ERRORS = (*LINE, *PAIRING, *BAD_INPUT, NODE_LIMIT)  # training_profiling_parse_errors

TEMPORAL, COMPUTE, IO = "temporal", "compute", "io"
SLOW = (TEMPORAL, COMPUTE, IO)  # training_rank_slow, training_slow_detections
