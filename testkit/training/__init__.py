"""A stand-in for real distributed-training jobs: seeded, pure, standard library only.

`TrainingJob` models a synchronous Megatron-style job (tensor, data and pipeline parallel, laid out
by `Layout`) step by step, with what makes real ones uneven: stage imbalance, sequence-length
imbalance, slow workers, GC pauses, checkpoints, evaluation pauses. It writes the TaskD profiling
records its ranks would, flush by flush, and answers for the truth behind them (`timings`,
`step_start`, ...), which is what the slow-worker detection tests and the benchmark check against.
"""

from testkit.training.job import Flush, SlowWorker, StepTimings, TrainingJob
from testkit.training.layout import Layout

__all__ = ["Flush", "Layout", "SlowWorker", "StepTimings", "TrainingJob"]
