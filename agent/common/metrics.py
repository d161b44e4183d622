"""The executor's and the state files' families (both agent.common's), rendered at scrape time."""

from __future__ import annotations

from typing import Iterable, Sequence

from prometheus_client.core import Metric

from agent.common import fsutil
from agent.common.executor import Executor
from agent.common.families import counter, described, gauge
from agent.model import StateWrite

THREADS = gauge("npu_agent_executor_threads", "Threads running blocking calls (driver, files, Kubernetes client); "
                "started on demand, ended after a minute idle")
CALLS = gauge("npu_agent_executor_calls", "Blocking calls by lane and state: running, waiting for their turn, stuck "
              "(given up on by their caller, still holding a thread)", "lane", "state")
CALL_TIMEOUTS = counter("npu_agent_executor_call_timeouts", "Blocking calls whose caller's time-out passed (dropped "
                        "if not started, else left stuck)", "lane")
REFUSED = counter("npu_agent_executor_calls_refused", "Blocking calls refused at once because an earlier call with "
                  "the same key (a device, a watch) is still stuck", "lane")
EXECUTOR = (THREADS, CALLS, CALL_TIMEOUTS, REFUSED)

WRITE_FAILURES = counter("npu_agent_state_write_failures_total",
                         "Failed writes of state the agent keeps on disk (retried with backoff)", "file")
MOVED_ASIDE = counter("npu_agent_state_files_moved_aside_total",
                      "State files of the wrong shape moved aside at start (that part started fresh)", "file")


class ExecutorCollector:
    """The executor for blocking calls (agent.common.executor): its threads and each lane's calls."""

    def __init__(self, node: str, executor: Executor):
        self._node = node
        self._executor = executor

    def describe(self) -> list[Metric]:
        return described(EXECUTOR)

    def collect(self) -> Iterable[Metric]:
        node, lanes = self._node, self._executor.lanes
        yield THREADS.one(node, self._executor.threads)
        calls = CALLS.empty()
        for lane in lanes:
            for state, count in (("running", lane.running), ("waiting", len(lane.waiting)), ("stuck", lane.stuck)):
                calls.add_metric([node, lane.purpose, state], count)
        yield calls
        yield CALL_TIMEOUTS.counts(node, {lane.purpose: lane.counters["timeouts"] for lane in lanes})
        yield REFUSED.counts(node, {lane.purpose: lane.counters["refused"] for lane in lanes})


class StateFileCollector:
    """The state the agent keeps on disk: `writes` are its pieces (the fault service's, each sink's)."""

    def __init__(self, node: str, writes: Sequence[StateWrite]):
        self._node = node
        self._writes = tuple(writes)

    def describe(self) -> list[Metric]:
        return described((WRITE_FAILURES, MOVED_ASIDE))

    def collect(self) -> Iterable[Metric]:
        yield WRITE_FAILURES.series(self._node, ((write.what, write.failures) for write in self._writes))
        yield MOVED_ASIDE.counts(self._node, fsutil.moved_aside)
