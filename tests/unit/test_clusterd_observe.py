"""What the agent reads of ClusterD in the API server: its saved faults, and its pods' starts.

The ConfigMap's data is built here as ClusterD writes it (`PublicFaults`: node -> entries whose
empty fields are left out; `FaultNum`: {"publicFaultNum": N}, only it rewritten above 4,500 faults)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from agent.sinks.clusterd.batch import ClusterdView, differences
from agent.sinks.clusterd.observe import Saved, Starts, incarnation, saved_faults
from agent.sinks.clusterd.pubfault import PublicFault

ID_A, ID_B, ID_C = "a" * 64, "b" * 64, "c" * 64
NOW_MS = 1_780_000_000_000


def entry(fault_id: str, resource: str = "npu-node-agent", device: int = 3, code: str = "020011001", **extra) -> dict:
    return {"resource": resource, "devIds": [device], "faultId": fault_id, "type": "NPU", "faultCode": code,
            "level": "SeparateNPU", "faultTime": NOW_MS, **extra}


def data(faults: dict[str, list], count: int | None = None) -> dict[str, str]:
    listed = sum(len(items) for items in faults.values())
    return {"PublicFaults": json.dumps(faults), "FaultNum": json.dumps({"publicFaultNum": listed if count is None
                                                                       else count})}


def test_the_node_s_faults_under_its_resource_are_read_and_others_left_alone():
    saved = saved_faults(data({"n1": [entry(ID_A), entry(ID_B, resource="CCAE")], "n2": [entry(ID_C)]}),
                         "n1", "npu-node-agent")
    assert isinstance(saved, Saved) and saved.skipped == 0
    assert saved.faults == {ID_A: PublicFault(ID_A, "020011001", NOW_MS, 3, "SeparateNPU", "")}
    assert saved_faults(data({"n2": [entry(ID_C)]}), "n1", "npu-node-agent") == Saved({})


def test_no_configmap_means_clusterd_saved_nothing():
    assert saved_faults(None, "n1", "npu-node-agent") == Saved({}, exists=False)


def test_a_stale_list_is_not_trusted():
    # Above 4,500 faults ClusterD rewrites only FaultNum: the list no longer matches the count.
    reason = saved_faults(data({"n1": [entry(ID_A)]}, count=4501), "n1", "npu-node-agent")
    assert isinstance(reason, str) and reason.startswith("stale: ClusterD holds 4501 public faults and lists 1")


def test_what_is_not_clusterd_s_format_is_a_reason_not_an_error():
    for bad in ({}, {"PublicFaults": "{}"}, {"PublicFaults": "[1]", "FaultNum": '{"publicFaultNum": 0}'},
                {"PublicFaults": "{not json", "FaultNum": '{"publicFaultNum": 0}'},
                {"PublicFaults": '{"n1": 5}', "FaultNum": '{"publicFaultNum": 0}'},
                {"PublicFaults": "{}", "FaultNum": '{"publicFaultNum": true}'},
                {"PublicFaults": "{}", "FaultNum": '"3"'},
                {"PublicFaults": "[" * 100_000 + "]" * 100_000, "FaultNum": '{"publicFaultNum": 0}'}):
        assert isinstance(saved_faults(bad, "n1", "npu-node-agent"), str), bad


def test_malformed_entries_of_the_node_are_skipped_and_counted_and_a_bad_time_still_recovers():
    entries = [entry(ID_A), "junk", entry("short"), entry(ID_B, device=40), {**entry(ID_C), "devIds": []},
               {k: v for k, v in entry("d" * 64).items() if k != "faultTime"}]
    saved = saved_faults(data({"n1": entries}), "n1", "npu-node-agent")
    assert set(saved.faults) == {ID_A, "d" * 64} and saved.skipped == 3  # "junk" is not an entry of the resource
    assert saved.faults["d" * 64].time_ms >= 1_735_689_600_000  # a recover needs a valid time; the key is what counts


def test_differences_recover_what_clusterd_should_not_hold_and_occur_what_it_lacks():
    held = {ID_A: PublicFault(ID_A, "020011001", NOW_MS, 3, "SeparateNPU", "x"),
            ID_B: PublicFault(ID_B, "020011001", NOW_MS, 4, "SeparateNPU", "x")}
    stale = PublicFault(ID_C, "020011001", NOW_MS, 5, "SeparateNPU", "")
    view = ClusterdView(held)
    assert differences(view, {ID_A: held[ID_A], ID_C: stale}) == [("recover", stale), ("occur", held[ID_B])]
    assert differences(view, dict(held)) == []


def pod(uid: str, restarts: int, ready: bool):
    return SimpleNamespace(metadata=SimpleNamespace(uid=uid, name="clusterd-x"), status=SimpleNamespace(
        container_statuses=[SimpleNamespace(restart_count=restarts)],
        conditions=[SimpleNamespace(type="Ready", status="True" if ready else "False")]))


def test_a_container_that_starts_again_or_a_new_pod_is_a_start_once_it_is_ready():
    starts = Starts()
    key = ("mindx-dl", "clusterd-x")
    assert not starts.update({key: incarnation(pod("u1", 0, True))})  # the first list is not news
    assert not starts.update({key: incarnation(pod("u1", 0, False))})  # not ready (crashed)
    assert not starts.update({key: incarnation(pod("u1", 1, False))})  # restarted, not serving yet
    assert starts.update({key: incarnation(pod("u1", 1, True))})  # serving: a new process
    assert not starts.update({key: incarnation(pod("u1", 1, True))})  # the same process again
    assert not starts.update({key: incarnation(pod("u1", 1, False))})  # a readiness flap is no restart
    assert not starts.update({key: incarnation(pod("u1", 1, True))})
    assert starts.update({("mindx-dl", "clusterd-y"): incarnation(pod("u2", 0, True))})  # rescheduled
    assert not starts.update({})
    assert not Starts().update({})


def test_a_pod_not_ready_at_the_first_list_that_becomes_ready_is_a_start():
    # The agent started while ClusterD was starting: what ClusterD reloads is checked once it serves.
    starts = Starts()
    key = ("mindx-dl", "clusterd-x")
    assert not starts.update({key: incarnation(pod("u1", 2, False))})
    assert starts.update({key: incarnation(pod("u1", 2, True))})
    assert not starts.update({key: incarnation(pod("u1", 2, True))})


def test_a_rollout_that_starts_the_new_pod_first_is_news_again_when_the_old_one_goes():
    # Until the old process is gone it may still be told what the new one never reloaded.
    starts = Starts()
    old, new = ("mindx-dl", "clusterd-a"), ("mindx-dl", "clusterd-b")
    assert not starts.update({old: incarnation(pod("u1", 0, True))})
    assert starts.update({old: incarnation(pod("u1", 0, True)), new: incarnation(pod("u2", 0, True))})
    assert not starts.update({old: incarnation(pod("u1", 0, False)), new: incarnation(pod("u2", 0, True))})
    assert starts.update({new: incarnation(pod("u2", 0, True))})  # the old one gone
    assert not starts.update({})  # nobody serves: nothing to check yet


def test_a_read_that_fails_unexpectedly_is_an_unknown_check_not_a_crash():
    import asyncio

    from agent.common.executor import Executor
    from agent.sinks.clusterd.observe import ClusterdObserver
    from testkit.wait import until

    class Api:
        def read_namespaced_config_map(self, *args, **kwargs):
            raise RuntimeError("boom")

    async def main():
        observer = ClusterdObserver("", "cluster-system/statistic-fault-info", api_factory=Api,
                                    kube=Executor("test").lane("kube", 1))
        await observer.start()
        try:
            await until(lambda: observer._api is not None, 5, "the client made")
            result = await observer.saved("n1", "npu-node-agent")
            assert isinstance(result, str) and "RuntimeError: boom" in result
            assert observer.counters["read_unknown"] == 1 and observer.readiness() == (True, "")
        finally:
            await observer.stop()

    asyncio.run(main())
