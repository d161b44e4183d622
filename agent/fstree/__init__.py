"""Following the profiling tree with inotify: the machinery the disk guard and the step tailer share."""
