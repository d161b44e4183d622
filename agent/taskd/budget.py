"""Bytes of TaskNet messages the proxy holds, bounded per job and for the node (pure).

Every message the proxy keeps in memory counts from the moment it takes it until it is handed on:
a message on its way up (waiting for the manager, or held while the manager is away) and a message
queued for a worker's stream. A message that would pass either limit is refused at once with
TaskD's `RecvBufBusy` (5001), so a flood of large messages cannot grow the agent past its memory
limit, and one job cannot take the whole node's share.
"""

from __future__ import annotations

from collections import Counter


class ByteBudget:
    def __init__(self, job_limit: int, node_limit: int):
        self.job_limit = job_limit
        self.node_limit = node_limit
        self.used: Counter[str] = Counter()  # job -> bytes held now
        self.total = 0

    def take(self, job: str, size: int) -> str:
        """"" when `size` bytes were taken for `job`; otherwise why not (nothing taken)."""
        if self.used[job] + size > self.job_limit:
            why = f"job {job} already holds {self.used[job]} bytes of messages (limit {self.job_limit})"
        elif self.total + size > self.node_limit:
            why = f"the node proxy already holds {self.total} bytes of messages (limit {self.node_limit})"
        else:
            self.used[job] += size
            self.total += size
            return ""
        return why

    def give(self, job: str, size: int) -> None:
        self.used[job] -= size
        self.total -= size
        if self.used[job] <= 0:
            del self.used[job]
