"""The RBAC of the node condition and the Events: `nodes/status` patch whenever the agent uses the API
server (with `node_condition` off it removes an earlier run's condition at start), `events`
create/patch and `pods` get with `events`; never a read or an update of nodes. Checked on the
rendered chart and, through the API stand-in's RBAC, against what the agent's calls need."""

from __future__ import annotations

import pytest

from tests.chart.conftest import RELEASE, rules

KUBE = "agent.kubernetes.enabled=true"
NODE_STATUS = {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]}
EVENTS = {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]}
POD_GET = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}


def agent_rules(rendered) -> list[dict]:
    return rules(rendered.maybe("ClusterRole", RELEASE)) or []


@pytest.mark.parametrize("sets, wanted", [
    ((KUBE, "agent.profiling.metrics=false"), [NODE_STATUS]),  # the removal of an earlier run's condition
    ((KUBE, "agent.profiling.metrics=false", "agent.kubernetes.node_condition=true"), [NODE_STATUS]),
    ((KUBE, "agent.profiling.metrics=false", "agent.kubernetes.events=true"), [NODE_STATUS, EVENTS, POD_GET]),
    ((KUBE, "agent.profiling.metrics=false", "agent.kubernetes.node_condition=true", "agent.kubernetes.events=true"),
     [NODE_STATUS, EVENTS, POD_GET]),
    (("agent.kubernetes.node_condition=true", "agent.kubernetes.events=true"), []),  # needs kubernetes.enabled
])
def test_the_node_condition_and_events_get_exactly_their_grants(helm, sets, wanted):
    rendered = helm.render(None, *sets)
    assert agent_rules(rendered) == wanted
    if wanted:  # the token is mounted and bound to exactly these rules
        assert rendered.pod["spec"]["automountServiceAccountToken"] is True
        assert rendered.one("ClusterRoleBinding", RELEASE)["roleRef"]["name"] == RELEASE
        assert rendered.agent_config["kubernetes"]["node_condition"] is ("agent.kubernetes.node_condition=true" in sets)


def test_no_rule_lets_the_agent_read_replace_or_delete_a_node(helm):
    rendered = helm.render("kubernetes-full", "agent.kubernetes.node_condition=true", "agent.kubernetes.events=true")
    found = agent_rules(rendered)
    assert NODE_STATUS in found and EVENTS in found and POD_GET in found
    for rule in found:
        if {"nodes", "nodes/status"} & set(rule["resources"]):
            assert rule["verbs"] == ["patch"] and rule["resources"] == ["nodes/status"]
        if "events" in rule["resources"]:
            assert "delete" not in rule["verbs"] and "update" not in rule["verbs"]


def test_the_rendered_grants_are_what_the_agents_calls_need(helm, tmp_path):
    """The rules as rendered, given to the API stand-in's RBAC: the agent's own calls (as its writers
    make them, through the official client) pass, and a read or replace of the node does not."""
    from kubernetes.client.rest import ApiException

    from testkit.fakes.kube import KubeStandIn

    rendered = helm.render(None, KUBE, "agent.profiling.metrics=false", "agent.kubernetes.node_condition=true",
                           "agent.kubernetes.events=true")
    with KubeStandIn(rbac=True) as standin:
        standin.add_service_account_token("t", "npu-system", RELEASE)
        for rule in agent_rules(rendered):
            standin.allow(user=f"system:serviceaccount:npu-system:{RELEASE}", verbs=rule["verbs"],
                          resources=rule["resources"])
        standin.put({"kind": "Node", "metadata": {"name": "n1"}, "status": {"conditions": []}})
        standin.put({"kind": "Pod", "metadata": {"name": "p", "namespace": "team"}})
        api = standin.client(token="t")
        smp = "application/strategic-merge-patch+json"
        api.patch_node_status("n1", {"status": {"conditions": [{"type": "NPUProblem", "status": "False"}]}},
                              _content_type=smp)
        api.patch_node_status("n1", {"status": {"conditions": [{"type": "NPUProblem", "$patch": "delete"}]}},
                              _content_type=smp)
        api.read_namespaced_pod("p", "team")
        api.create_namespaced_event("team", {"metadata": {"name": "p.1"}, "involvedObject": {
            "kind": "Pod", "name": "p", "namespace": "team"}, "reason": "NPUFaultOccurred", "type": "Warning"})
        api.patch_namespaced_event("p.1", "team", {"count": 2}, _content_type=smp)
        for call in (lambda: api.read_node("n1"), lambda: api.patch_node("n1", {"metadata": {"labels": {"a": "b"}}}),
                     lambda: api.list_namespaced_event("team")):
            with pytest.raises(ApiException) as err:
                call()
            assert err.value.status == 403
