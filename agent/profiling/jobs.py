"""Which job a profiling directory belongs to: job id -> (namespace, job name), from this node's pods.

The directory under the profiling root is named by `MINDX_TASK_ID`, which the Ascend operator sets
to the job's UID (`clusterd.md`, `taskd.md` §4). A pod names its job by the env var when it is
set literally, else by its controller (the Volcano or Ascend job that owns it); the job's name comes
from the job labels the device plugin reads, else from that controller.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from agent.kube.client import KubeUnavailable
from agent.kube.watch import ListWatch
from agent.profiling.datatrace import job_of

log = logging.getLogger(__name__)

TASK_ID_ENV = "MINDX_TASK_ID"
KEEP_GONE = 256  # jobs without a pod any more whose labels are still kept


@dataclass(frozen=True)
class JobRef:
    job_id: str
    namespace: str
    job_name: str


def job_ref(pod) -> JobRef | None:
    """From a kubernetes V1Pod; None for a pod that names no job."""
    meta, spec = pod.metadata, pod.spec
    owner = next((o for o in (meta.owner_references or []) if o.controller), None)
    job_id = next((e.value for c in (spec.containers or []) for e in (c.env or [])
                   if e.name == TASK_ID_ENV and e.value), None) or (owner.uid if owner else None)
    if not job_id:
        return None
    name = job_of(meta.labels or {}) or (owner.name if owner else "")
    return JobRef(job_id, meta.namespace or "", name)


class JobDirectory:
    """A component: follows the pods on this node and answers `labels(job_id)`."""

    name = "job-directory"

    def __init__(self, node: str, api_factory: Callable[[], object], watch_timeout_s: int = 300):
        self._node = node
        self._api_factory = api_factory
        self._watch_timeout_s = watch_timeout_s
        self._jobs: dict[str, tuple[str, str]] = {}
        self._watch: ListWatch | None = None
        self._unavailable = ""

    async def start(self) -> None:
        try:
            api = self._api_factory()
        except KubeUnavailable as exc:
            self._unavailable = str(exc)
            log.error("cannot reach Kubernetes; step metrics carry the job id only", extra={"error": str(exc)})
            return
        self._watch = ListWatch("pods-jobs", api.list_pod_for_all_namespaces, job_ref, self._changed,
                                asyncio.get_running_loop(), timeout_s=self._watch_timeout_s,
                                field_selector=f"spec.nodeName={self._node}")
        self._watch.start()

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()

    def readiness(self) -> tuple[bool, str]:
        return (False, self._unavailable) if self._unavailable else (True, "")

    def labels(self, job_id: str) -> tuple[str, str]:
        """(namespace, job name) of the job, ("", "") while no pod of it is known."""
        return self._jobs.get(job_id, ("", ""))

    def _changed(self, refs: dict) -> None:
        current = {ref.job_id: (ref.namespace, ref.job_name) for ref in refs.values()}
        # A job whose pods are gone keeps its labels for a while: its series stay until the step
        # metrics drop them. The oldest of those are forgotten past KEEP_GONE.
        gone = [job for job in self._jobs if job not in current]
        kept = gone[-KEEP_GONE:]
        self._jobs = {**{job: self._jobs[job] for job in kept}, **current}
