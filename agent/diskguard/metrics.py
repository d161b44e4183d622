"""Metrics of the profiling disk guard, rendered at scrape time from its state (before anything under
the root has built the guard: nothing used, aged or scanned, against the configured limit)."""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client.core import Metric

from agent.common.families import counter, described, gauge

USAGE = gauge("npu_agent_profiling_disk_usage_bytes",
              "Bytes of regular files under profiling.root (the disk guard's ledger)")
LIMIT = gauge("npu_agent_profiling_disk_limit_bytes", "profiling.disk_limit_mb in bytes")
FILES_AGED = counter("npu_agent_profiling_files_aged_total",
                     "Record files deleted by the disk guard to get under the limit")
BYTES_AGED = counter("npu_agent_profiling_bytes_aged_total", "Bytes freed by the disk guard")
SCANS = counter("npu_agent_profiling_scans_total",
                "Full scans of the profiling tree (start-up, root appearing, inotify overflow)")
OVERFLOWS = counter("npu_agent_profiling_inotify_overflows_total", "inotify queue overflows (each one costs a full scan)")
UNWATCHED = gauge("npu_agent_profiling_unwatched_directories",
                  "Directories of profiling.root whose inotify watch could not be added (fs.inotify.max_user_watches): "
                  "walked again every 30 s at most instead")
ERRORS = counter("npu_agent_profiling_errors_total",
                 "Unreadable directories or files, refused rank directories and failed deletions met by the disk guard")
FAMILIES = (USAGE, LIMIT, FILES_AGED, BYTES_AGED, SCANS, OVERFLOWS, UNWATCHED, ERRORS)


class DiskGuardCollector:
    """`guard` gives the agent.diskguard.guard.DiskGuard, or None while it is not built."""

    def __init__(self, node: str, guard: Callable[[], object | None], limit_bytes: int):
        self._node = node
        self._guard = guard
        self._limit_bytes = limit_bytes

    def describe(self) -> list[Metric]:
        return described(FAMILIES)

    def collect(self) -> Iterable[Metric]:
        node, guard = self._node, self._guard() or _NotBuilt(self._limit_bytes)
        yield USAGE.one(node, guard.usage_bytes)
        yield LIMIT.one(node, guard.limit_bytes)
        yield FILES_AGED.one(node, guard.files_aged)
        yield BYTES_AGED.one(node, guard.bytes_aged)
        yield SCANS.one(node, guard.scans)
        yield OVERFLOWS.one(node, guard.overflows)
        yield UNWATCHED.one(node, guard.unwatched)
        yield ERRORS.one(node, guard.errors)


class _NotBuilt:
    usage_bytes = files_aged = bytes_aged = scans = overflows = unwatched = errors = 0

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
