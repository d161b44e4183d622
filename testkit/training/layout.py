"""Where each global rank of a Megatron-style job sits: tensor (tp), data (dp) and pipeline (pp) parallel.

Megatron orders the dimensions with tensor parallel innermost and pipeline outermost:

    global rank = tp_idx + tp * (dp_idx + dp * pp_idx)

so a tensor-parallel group is `tp` consecutive ranks, which is what lets it stay on one node's fast
links. Its ranks synchronise inside every layer, so they compute as one: a *worker* here is one TP
group, named by its lowest global rank. A worker's pipeline stage is its pp_idx; its *stage peers*
are the workers of the same stage in the other DP replicas, the ones that do the same work and so
are the fair comparison for a slow one. A node holds `ranks_per_node` consecutive ranks (its NPUs):
with tp=8 on 8-rank nodes a node is one worker, with tp=16 a worker spans two nodes.

`parallel_group` is what TaskD's `dump_group_info` writes into each rank's `parallel_group.json`:
HCCL communicator name -> that group's name, the rank's index in it and its members.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL_GROUP_MAX_RANKS = 64  # above this the default group (every rank) is left out: it would dwarf the file


@dataclass(frozen=True, slots=True)
class Layout:
    tp: int = 1
    dp: int = 1
    pp: int = 1
    ranks_per_node: int = 8

    def __post_init__(self) -> None:
        if min(self.tp, self.dp, self.pp, self.ranks_per_node) < 1:
            raise ValueError(f"every dimension must be at least 1: {self}")

    @property
    def ranks(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def workers(self) -> range:
        """Every worker, by name (its first rank)."""
        return range(0, self.ranks, self.tp)

    def rank(self, tp_idx: int, dp_idx: int, pp_idx: int) -> int:
        return tp_idx + self.tp * (dp_idx + self.dp * pp_idx)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(tp_idx, dp_idx, pp_idx) of a global rank."""
        self._check(rank)
        rest, tp_idx = divmod(rank, self.tp)
        pp_idx, dp_idx = divmod(rest, self.dp)
        return tp_idx, dp_idx, pp_idx

    def worker(self, rank: int) -> int:
        self._check(rank)
        return rank - rank % self.tp

    def stage(self, rank: int) -> int:
        """The pipeline stage of a rank (or of a worker: the same number)."""
        return self.coordinates(rank)[2]

    def node(self, rank: int) -> int:
        self._check(rank)
        return rank // self.ranks_per_node

    def members(self, worker: int) -> range:
        """The ranks of a worker: its TP group."""
        first = self.worker(worker)
        return range(first, first + self.tp)

    def stage_peers(self, worker: int) -> list[int]:
        """The workers doing the same stage in the other DP replicas."""
        _, dp_idx, pp_idx = self.coordinates(worker)
        return [self.rank(0, d, pp_idx) for d in range(self.dp) if d != dp_idx]

    def parallel_group(self, rank: int) -> dict:
        """The rank's `parallel_group.json` content: its tp, dp and pp groups (and every rank, when few)."""
        tp_idx, dp_idx, pp_idx = self.coordinates(rank)
        groups = {"tp": [self.rank(t, dp_idx, pp_idx) for t in range(self.tp)],
                  "dp": [self.rank(tp_idx, d, pp_idx) for d in range(self.dp)],
                  "pp": [self.rank(tp_idx, dp_idx, p) for p in range(self.pp)]}
        if self.ranks <= FULL_GROUP_MAX_RANKS:
            groups["default_group"] = list(range(self.ranks))
        return {f"{name.removesuffix('_group')}_group_{members[0]}":
                {"group_name": name, "group_rank": members.index(rank), "global_ranks": members}
                for name, members in groups.items()}

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} outside 0..{self.ranks - 1}")
