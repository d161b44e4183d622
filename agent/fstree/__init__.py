"""Following the profiling tree with inotify: the component the disk guard and the step tailer each own."""
