"""Which training job a pod belongs to, from this node's pods (a subscriber of the shared pod watch).

Two users: the step metrics name a profiling directory's job (the directory is named by
`MINDX_TASK_ID`, which the Ascend operator sets to the job's UID),
and the TaskD proxy checks that a connecting process's pod belongs to the job its environment
claims. A pod names its job by the env var when it is set literally, else by its controller (the
Volcano or Ascend job that owns it); the job's name comes from the job labels the device plugin
reads, else from that controller.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.kube.pods import NodePods

TASK_ID_ENV = "MINDX_TASK_ID"
JOB_LABELS = ("volcano.sh/job-name", "training.kubeflow.org/job-name", "deploy-name")  # first present wins
KEEP_GONE = 256  # jobs without a pod any more whose labels are still kept


@dataclass(frozen=True)
class JobRef:
    job_id: str
    namespace: str
    job_name: str
    pod_uid: str = ""
    pod_name: str = ""


def job_of(labels: dict[str, str]) -> str | None:
    """The job name a pod's labels give, None when it carries none."""
    for key in JOB_LABELS:
        if labels.get(key):
            return labels[key]
    return None


def job_ref(pod) -> JobRef | None:
    """From a kubernetes V1Pod; None for a pod that names no job."""
    meta, spec = pod.metadata, pod.spec
    owner = next((o for o in (meta.owner_references or []) if o.controller), None)
    job_id = next((e.value for c in (spec.containers or []) for e in (c.env or [])
                   if e.name == TASK_ID_ENV and e.value), None) or (owner.uid if owner else None)
    if not job_id:
        return None
    name = job_of(meta.labels or {}) or (owner.name if owner else "")
    return JobRef(job_id, meta.namespace or "", name, meta.uid or "", meta.name or "")


class JobDirectory:
    """Answers `labels(job_id)`, `pods(job_id)` and `job_of_pod(uid)` from this node's pods."""

    def __init__(self, pods: NodePods):
        self._pods = pods
        self._jobs: dict[str, tuple[str, str]] = {}
        self._by_uid: dict[str, JobRef] = {}
        self._job_pods: dict[str, tuple[str, ...]] = {}  # job id -> names of its pods on this node
        pods.subscribe(job_ref, self._changed)

    @property
    def synced(self) -> bool:
        return self._pods.synced

    def labels(self, job_id: str) -> tuple[str, str]:
        """(namespace, job name) of the job, ("", "") while no pod of it is known."""
        return self._jobs.get(job_id, ("", ""))

    def pods(self, job_id: str) -> tuple[str, ...]:
        """Names of the job's pods on this node now, sorted."""
        return self._job_pods.get(job_id, ())

    def job_of_pod(self, uid: str) -> JobRef | None:
        """The job of a pod on this node now, None for an unknown pod or one that names no job."""
        return self._by_uid.get(uid)

    def _changed(self, refs: dict) -> None:
        current = {ref.job_id: (ref.namespace, ref.job_name) for ref in refs.values()}
        # A job whose pods are gone keeps its labels for a while: its series stay until the step
        # metrics drop them. The oldest of those are forgotten past KEEP_GONE.
        gone = [job for job in self._jobs if job not in current]
        kept = gone[-KEEP_GONE:]
        self._jobs = {**{job: self._jobs[job] for job in kept}, **current}
        self._by_uid = {ref.pod_uid: ref for ref in refs.values() if ref.pod_uid}
        pods: dict[str, list[str]] = {}
        for ref in refs.values():
            pods.setdefault(ref.job_id, []).append(ref.pod_name)
        self._job_pods = {job: tuple(sorted(names)) for job, names in pods.items()}
