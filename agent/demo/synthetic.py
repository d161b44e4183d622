"""A synthetic synchronous training job (pure, seeded): per-step timings of every rank.

The demo renders it into TaskD-format records; the detection tests and the benchmark feed it to the
detector directly. Ranks are laid out as Megatron does with the pipeline outermost: stage =
rank // (ranks / stages). Every rank waits for the slowest forward of the step (the collectives
synchronise them), so one slow rank makes every rank's step slower but only its own forward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RankTiming:
    rank: int
    duration_s: float
    forward_s: float
    dataloader_s: float
    checkpoint_s: float  # > 0: a save_checkpoint range inside the step


@dataclass
class SyntheticJob:
    ranks: int = 16
    stages: int = 4
    step_s: float = 1.0
    forward_share: float = 0.8
    dataloader_share: float = 0.02
    noise: float = 0.01  # relative Gaussian noise of every part of every step
    checkpoint_every: int = 500  # 0: never
    checkpoint_s: float = 3.0
    slow_rank: int | None = None
    slow_from_step: int = 0
    slow_factor: float = 1.15  # the slow rank's forward, from slow_from_step on
    seed: int = 0
    _random: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.ranks % self.stages:
            raise ValueError(f"{self.ranks} ranks do not split into {self.stages} pipeline stages")
        self._random = random.Random(self.seed)

    def stage_of(self, rank: int) -> int:
        return rank // (self.ranks // self.stages)

    def parallel_group(self, rank: int) -> dict:
        """The rank's `parallel_group.json` content (its pipeline group, as TaskD's dump writes it)."""
        per_stage = self.ranks // self.stages
        members = [rank % per_stage + k * per_stage for k in range(self.stages)]
        return {f"pp_group_{rank % per_stage}": {"group_name": "pp", "group_rank": self.stage_of(rank),
                                                 "global_ranks": members}}

    def step(self, number: int) -> list[RankTiming]:
        gauss, noise = self._random.gauss, self.noise
        forward = self.step_s * self.forward_share
        forwards = [forward * (1 + noise * gauss(0, 1)) for _ in range(self.ranks)]
        if self.slow_rank is not None and number >= self.slow_from_step:
            forwards[self.slow_rank] *= self.slow_factor
        slowest = max(forwards)
        rest = self.step_s * (1 - self.forward_share - self.dataloader_share)
        checkpoint = self.checkpoint_s if self.checkpoint_every and number % self.checkpoint_every == 0 and number else 0.0
        timings = []
        for rank in range(self.ranks):
            dataloader = self.step_s * self.dataloader_share * (1 + noise * gauss(0, 1))
            duration = slowest + rest * (1 + noise * gauss(0, 1)) + dataloader + checkpoint
            timings.append(RankTiming(rank, duration, forwards[rank], dataloader, checkpoint))
        return timings
