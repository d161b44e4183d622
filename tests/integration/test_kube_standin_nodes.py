"""Self-test of the Kubernetes API stand-in's Nodes, their status subresource, patches and Events,
driven through the official `kubernetes` client as the agent drives them: the behaviour the agent's
node condition and Events rely on is the real API server's."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.rest import ApiException

from testkit.fakes.kube import KubeStandIn
from tests.support.clock import FakeClock

SMP = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


@pytest.fixture
def kube():
    with KubeStandIn() as server:
        server.put({"kind": "Node", "metadata": {"name": "n1", "labels": {"zone": "a"}},
                    "spec": {"podCIDR": "10.0.0.0/24"},
                    "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"},
                                              {"type": "MemoryPressure", "status": "False"}],
                               "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}})
        yield server


@pytest.fixture
def api(kube):
    return kube.client()


def status_of(exc: ApiException) -> dict:
    return json.loads(exc.body)


def conditions(node) -> list[tuple[str, str]]:
    return [(c.type, c.status) for c in node.status.conditions]


def test_nodes_are_cluster_scoped_and_listed_read_and_seeded(api, kube):
    node = api.read_node("n1")
    assert node.metadata.namespace is None and node.metadata.uid and node.spec.pod_cidr == "10.0.0.0/24"
    assert [n.metadata.name for n in api.list_node().items] == ["n1"]
    assert [n.metadata.name for n in api.list_node(field_selector="metadata.name=n1").items] == ["n1"]
    assert kube.get("Node", "", "n1")["metadata"]["name"] == "n1" and kube.list("nodes")[0]["kind"] == "Node"
    with pytest.raises(ApiException) as err:
        api.read_node("nope")
    assert err.value.status == 404 and status_of(err.value)["message"] == 'nodes "nope" not found'


def test_a_strategic_merge_patch_of_the_status_merges_conditions_by_type(api):
    patched = api.patch_node_status("n1", {"status": {"conditions": [
        {"type": "NPUProblem", "status": "True", "reason": "SeparateNPU"},
        {"type": "Ready", "lastHeartbeatTime": "2025-01-01T00:00:01Z"}]}}, _content_type=SMP)
    assert conditions(patched) == [("Ready", "True"), ("MemoryPressure", "False"), ("NPUProblem", "True")]
    ready = patched.status.conditions[0]
    assert ready.reason == "KubeletReady" and ready.last_heartbeat_time.second == 1  # merged, not replaced
    assert [a.address for a in patched.status.addresses] == ["10.0.0.1"]
    # `$patch: delete` removes one item by its key; nothing is read first.
    patched = api.patch_node_status("n1", {"status": {"conditions": [{"type": "NPUProblem", "$patch": "delete"}]}},
                                    _content_type=SMP)
    assert conditions(patched) == [("Ready", "True"), ("MemoryPressure", "False")]
    # `$setElementOrder` orders the merged list, as the kubelet's two-way patches ask.
    patched = api.patch_node_status("n1", {"status": {
        "$setElementOrder/conditions": [{"type": "MemoryPressure"}, {"type": "Ready"}],
        "conditions": [{"type": "Ready", "status": "False"}]}}, _content_type=SMP)
    assert conditions(patched) == [("MemoryPressure", "False"), ("Ready", "False")]
    # `$patch: replace` replaces the list.
    patched = api.patch_node_status("n1", {"status": {"conditions": [
        {"type": "Ready", "status": "True"}, {"$patch": "replace"}]}}, _content_type=SMP)
    assert conditions(patched) == [("Ready", "True")]
    with pytest.raises(ApiException) as err:  # an item without the merge key
        api.patch_node_status("n1", {"status": {"conditions": [{"status": "True"}]}}, _content_type=SMP)
    assert err.value.status == 400 and "merge key: type" in status_of(err.value)["message"]


def test_a_merge_patch_replaces_lists_and_a_json_patch_applies_operations(api):
    patched = api.patch_node_status("n1", {"status": {"conditions": [{"type": "NPUProblem", "status": "True"}]}},
                                    _content_type=MERGE)
    assert conditions(patched) == [("NPUProblem", "True")]  # RFC 7386: the kubelet's conditions are gone
    patched = api.patch_node_status("n1", [
        {"op": "test", "path": "/status/conditions/0/type", "value": "NPUProblem"},
        {"op": "add", "path": "/status/conditions/-", "value": {"type": "Ready", "status": "True"}},
        {"op": "replace", "path": "/status/conditions/0/status", "value": "False"}], _content_type=JSON_PATCH)
    assert conditions(patched) == [("NPUProblem", "False"), ("Ready", "True")]
    with pytest.raises(ApiException) as err:
        api.patch_node_status("n1", [{"op": "test", "path": "/status/conditions/0/type", "value": "Ready"}],
                              _content_type=JSON_PATCH)
    assert err.value.status == 422
    with pytest.raises(ApiException) as err:
        api.patch_node_status("n1", {"status": {}}, _content_type="application/apply-patch+yaml")
    assert err.value.status == 415 and status_of(err.value)["reason"] == "UnsupportedMediaType"


def test_the_status_subresource_writes_only_the_status_and_the_node_only_the_rest(api, kube):
    patched = api.patch_node_status("n1", {"metadata": {"labels": {"zone": "b"}}, "spec": {"unschedulable": True},
                                           "status": {"conditions": [{"type": "Ready", "status": "False"}]}},
                                    _content_type=SMP)
    assert patched.metadata.labels == {"zone": "a"} and not patched.spec.unschedulable
    assert conditions(patched)[0] == ("Ready", "False")
    patched = api.patch_node("n1", {"spec": {"unschedulable": True},
                                    "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert patched.spec.unschedulable and conditions(patched)[0] == ("Ready", "False")
    # An empty patch changes nothing and answers with the node (the agent reads its condition so).
    rv = kube.resource_version
    assert api.patch_node_status("n1", {}, _content_type=SMP).metadata.resource_version == rv
    assert kube.resource_version == rv


def test_a_stale_resource_version_is_a_conflict_and_a_missing_node_is_404(api):
    stale = api.read_node("n1")
    api.patch_node_status("n1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}, _content_type=SMP)
    for call in (lambda: api.replace_node_status("n1", stale),
                 lambda: api.replace_node("n1", stale),
                 lambda: api.patch_node_status("n1", {"metadata": {"resourceVersion": stale.metadata.resource_version},
                                                      "status": {"conditions": []}}, _content_type=SMP),
                 lambda: api.patch_node_status("n1", {"metadata": {"resourceVersion": stale.metadata.resource_version}},
                                               _content_type=MERGE)):
        with pytest.raises(ApiException) as err:
            call()
        assert err.value.status == 409 and status_of(err.value)["reason"] == "Conflict"
    fresh = api.read_node("n1")
    fresh.status.conditions[0].status = "Unknown"
    assert conditions(api.replace_node_status("n1", fresh))[0] == ("Ready", "Unknown")
    for call in (lambda: api.patch_node_status("nope", {"status": {}}, _content_type=SMP),
                 lambda: api.replace_node_status("nope", fresh), lambda: api.read_node_status("nope")):
        with pytest.raises(ApiException) as err:
            call()
        assert err.value.status == 404


def test_rbac_checks_the_status_subresource_apart_from_the_node():
    with KubeStandIn(rbac=True) as server:
        server.put({"kind": "Node", "metadata": {"name": "n1"}, "status": {"conditions": []}})
        server.add_token("t", "agent")
        server.allow(user="agent", verbs=("patch",), resources=("nodes",))
        api = server.client(token="t")
        with pytest.raises(ApiException) as err:
            api.patch_node_status("n1", {"status": {}}, _content_type=SMP)
        assert err.value.status == 403
        assert status_of(err.value)["message"] == ('nodes/status is forbidden: User "agent" cannot patch resource '
                                                   '"nodes/status" in API group "" at the cluster scope')
        server.allow(user="agent", verbs=("patch",), resources=("nodes/status",))
        assert api.patch_node_status("n1", {"status": {}}, _content_type=SMP).metadata.name == "n1"
        with pytest.raises(ApiException) as err:
            api.read_node("n1")
        assert err.value.status == 403


def event(event_name: str, event_namespace: str = "default", involved: dict | None = None) -> dict:
    return {"metadata": {"name": event_name, "namespace": event_namespace},
            "involvedObject": involved or {"kind": "Node", "name": "n1", "uid": "n1"},
            "reason": "NPUFaultOccurred", "message": "m", "type": "Warning", "count": 1,
            "source": {"component": "npu-node-agent", "host": "n1"}}


def test_events_are_created_once_patched_listed_and_validated(kube, api):
    kube.add_namespace("team")
    created = api.create_namespaced_event("default", event("n1.1"))
    assert created.count == 1 and created.involved_object.uid == "n1"
    with pytest.raises(ApiException) as err:
        api.create_namespaced_event("default", event("n1.1"))
    assert err.value.status == 409 and status_of(err.value)["reason"] == "AlreadyExists"
    patched = api.patch_namespaced_event("n1.1", "default", {"count": 2, "message": "m2"}, _content_type=SMP)
    assert (patched.count, patched.message, patched.reason) == (2, "m2", "NPUFaultOccurred")
    api.create_namespaced_event("team", event("p.1", "team",
                                              {"kind": "Pod", "name": "p", "namespace": "team", "uid": "u1"}))
    assert [e.metadata.name for e in api.list_event_for_all_namespaces(
        field_selector="involvedObject.kind=Pod,involvedObject.uid=u1").items] == ["p.1"]
    assert [e.metadata.name for e in api.list_namespaced_event(
        "default", field_selector="involvedObject.name=n1,source=npu-node-agent,type=Warning").items] == ["n1.1"]
    assert api.read_namespaced_event("n1.1", "default").count == 2
    # The API server's rule: an event about a namespaced object lives in its namespace, about a
    # cluster-scoped one in `default`.
    for wrong in (event("p.2", "default", {"kind": "Pod", "name": "p", "namespace": "team"}), event("n1.2", "team")):
        with pytest.raises(ApiException) as err:
            api.create_namespaced_event(wrong["metadata"]["namespace"], wrong)
        assert err.value.status == 422 and "does not match event.namespace" in status_of(err.value)["message"]
    with pytest.raises(ApiException) as err:
        api.patch_namespaced_event("gone", "default", {"count": 3}, _content_type=SMP)
    assert err.value.status == 404


def test_events_expire_their_ttl_after_their_last_write():
    clock = FakeClock()
    with KubeStandIn(event_ttl=60, clock=clock) as server:
        api = server.client()
        api.create_namespaced_event("default", event("n1.1"))
        api.create_namespaced_event("default", event("n1.2"))
        assert server.event_ttl == 60
        clock.advance(30)
        api.patch_namespaced_event("n1.2", "default", {"count": 2}, _content_type=SMP)  # renews its lease
        clock.advance(40)
        assert [e["metadata"]["name"] for e in server.list("Event", "default")] == ["n1.2"]
        with pytest.raises(ApiException) as err:
            api.patch_namespaced_event("n1.1", "default", {"count": 2}, _content_type=SMP)
        assert err.value.status == 404
        server.expire_events()
        assert server.list("Event") == []


def test_writes_in_a_missing_namespace_are_404_and_creates_in_a_terminating_one_403_with_the_cause(kube, api):
    assert kube.list("Event", "default") == []  # `default` and kube-system exist as in a new cluster
    api.create_namespaced_event("kube-system", event("x.1", "kube-system", {"kind": "Pod", "name": "x",
                                                                         "namespace": "kube-system"}))
    on_pod = event("p.1", "team", {"kind": "Pod", "name": "p", "namespace": "team", "uid": "u1"})
    with pytest.raises(ApiException) as err:
        api.create_namespaced_event("team", on_pod)
    body = status_of(err.value)
    assert (err.value.status, body["reason"], body["message"]) == (404, "NotFound", 'namespaces "team" not found')
    assert body["details"]["kind"] == "namespaces"
    kube.put({"kind": "Pod", "metadata": {"name": "p", "namespace": "team"}})  # a test's setup makes the namespace
    api.create_namespaced_event("team", on_pod)
    kube.terminate_namespace("team")
    with pytest.raises(ApiException) as err:
        api.create_namespaced_event("team", {**on_pod, "metadata": {"name": "p.2", "namespace": "team"}})
    body = status_of(err.value)
    assert err.value.status == 403 and body["reason"] == "Forbidden"
    assert body["message"] == ('events "p.2" is forbidden: unable to create new content in namespace team because it '
                               "is being terminated")
    assert [c["reason"] for c in body["details"]["causes"]] == ["NamespaceTerminating"]
    # What exists in it may still be written until the namespace is gone.
    assert api.patch_namespaced_event("p.1", "team", {"count": 2}, _content_type=SMP).count == 2
    kube.delete_namespace("team")
    assert kube.list("Event", "team") == [] and kube.get("Pod", "team", "p") is None
    with pytest.raises(ApiException) as err:
        api.patch_namespaced_event("p.1", "team", {"count": 3}, _content_type=SMP)
    assert err.value.status == 404 and status_of(err.value)["details"]["kind"] == "namespaces"
