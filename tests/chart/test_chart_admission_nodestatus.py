"""The nodes/status ValidatingAdmissionPolicy: RBAC lets every agent patch every node's status; the
policy (its CEL run as the API server would, on the expressions exactly as helm rendered them) lets
each agent change only its own node's NPUProblem condition."""

from __future__ import annotations

import copy

import pytest

from tests.chart.conftest import NAMESPACE, RELEASE
from tests.chart.manifests import ADMISSION_POLICY_VERSIONS, KUBE_VERSIONS
from tests.chart.test_chart_security import AGENT_USER, VAP_API, _node, _valid, admit

POLICY = f"{RELEASE}-nodestatus"
KUBE = ("agent.kubernetes.enabled=true",)


def _request(name: str, *, user: str = AGENT_USER, extra: dict | None = None) -> dict:
    """A patch of nodes/<name>/status as the admission chain sees it: an UPDATE of the subresource."""
    user_info: dict = {"username": user, "uid": "0d4c", "groups": ["system:serviceaccounts",
                                                                   f"system:serviceaccounts:{NAMESPACE}"]}
    if extra is not None:
        user_info["extra"] = extra
    return {"uid": "705ab4f5", "kind": {"group": "", "version": "v1", "kind": "Node"},
            "resource": {"group": "", "version": "v1", "resource": "nodes"}, "subResource": "status",
            "name": name, "operation": "UPDATE", "userInfo": user_info, "dryRun": False}


def _condition(kind: str, status: str, reason: str, beat: str = "2025-12-01T10:00:00Z") -> dict:
    return {"type": kind, "status": status, "reason": reason, "message": f"{reason} message",
            "lastHeartbeatTime": beat, "lastTransitionTime": "2025-12-01T09:00:00Z"}


def _node_object(name: str, *conditions: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "accelerator": "huawei-Ascend910"},
                         "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
            "spec": {"podCIDR": "10.244.7.0/24"},
            "status": {"capacity": {"cpu": "192", "huawei.com/Ascend910": "8"},
                       "allocatable": {"cpu": "190", "huawei.com/Ascend910": "8"},
                       "addresses": [{"type": "InternalIP", "address": "10.0.0.7"}],
                       "conditions": list(conditions)}}


READY = _condition("Ready", "True", "KubeletReady")
MEMORY = _condition("MemoryPressure", "False", "KubeletHasSufficientMemory")
OLD = _node_object("npu-node-7", MEMORY, READY)


@pytest.fixture(scope="module")
def policy(helm) -> dict:
    return helm.render(None, *KUBE, flags=VAP_API).one("ValidatingAdmissionPolicy", POLICY)


@pytest.mark.parametrize("sets, flags, rendered", [
    (KUBE, VAP_API, True),
    ((*KUBE, "agent.kubernetes.node_condition=true"), VAP_API, True),
    (KUBE, (), False),                                    # the cluster has no VAP v1 (< 1.30)
    ((*KUBE, "admissionPolicy.enabled=false"), VAP_API, False),
    ((), VAP_API, False),                                 # no API server: no nodes/status grant either
])
def test_the_policy_renders_with_the_api_server_and_the_api(helm, sets, flags, rendered):
    result = helm.render(None, *sets, flags=flags)
    kinds = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    assert {d["kind"] for d in result.docs if d["kind"] in kinds and d["metadata"]["name"] == POLICY} == (
        kinds if rendered else set())
    _valid(result, ADMISSION_POLICY_VERSIONS if rendered else KUBE_VERSIONS)


def test_the_policy_checks_every_verb_the_cluster_role_grants_on_nodes_status(helm):
    rendered = helm.render("kubernetes-full", flags=(*VAP_API, "--kube-version", "1.30.0"))
    _valid(rendered, ADMISSION_POLICY_VERSIONS)
    spec = rendered.one("ValidatingAdmissionPolicy", POLICY)["spec"]
    assert spec["failurePolicy"] == "Fail" and {v["reason"] for v in spec["validations"]} == {"Forbidden"}
    assert rendered.one("ValidatingAdmissionPolicyBinding", POLICY)["spec"] == {
        "policyName": POLICY, "validationActions": ["Deny"]}
    [rule] = spec["matchConstraints"]["resourceRules"]
    granted = {verb for r in rendered.one("ClusterRole", RELEASE)["rules"] if "nodes/status" in r["resources"]
               for verb in r["verbs"]}
    # A patch (or an update) of the subresource is an UPDATE to admission.
    assert granted == {"patch"} and rule["operations"] == ["UPDATE"] and rule["resources"] == ["nodes/status"]


def test_the_agent_may_write_remove_and_read_back_its_own_condition(policy):
    own = _request("npu-node-7", extra=_node("npu-node-7"))
    written = _node_object("npu-node-7", MEMORY, READY, _condition("NPUProblem", "True", "SeparateNPU"))
    assert admit(policy, own, written, OLD) == (True, [])
    changed = copy.deepcopy(written)
    changed["status"]["conditions"][2] = _condition("NPUProblem", "False", "NPUsHealthy", "2025-12-01T10:05:00Z")
    assert admit(policy, own, changed, written) == (True, [])
    assert admit(policy, own, OLD, written) == (True, [])  # `$patch: delete` with node_condition off
    assert admit(policy, own, OLD, OLD) == (True, [])  # the empty patch that reads the condition back


@pytest.mark.parametrize("name", ["npu-node-8", "npu-node-70"])
def test_the_agent_may_not_patch_another_nodes_status(policy, name):
    old = _node_object(name, READY)
    new = _node_object(name, READY, _condition("NPUProblem", "True", "SeparateNPU"))
    allowed, [message] = admit(policy, _request(name, extra=_node("npu-node-7")), new, old)
    assert not allowed
    assert message == (f"{AGENT_USER} on node npu-node-7 may patch only the status of node npu-node-7, "
                       f"not of node {name}")


def _changed(change) -> dict:
    new = copy.deepcopy(OLD)
    change(new)
    return new


@pytest.mark.parametrize("change, what", [
    (lambda n: n["status"]["conditions"].__setitem__(1, _condition("Ready", "False", "KubeletNotReady")),
     "not its other conditions"),
    (lambda n: n["status"]["conditions"].pop(0), "not its other conditions"),
    (lambda n: n["status"]["conditions"].append(_condition("KernelDeadlock", "True", "DockerHung")),
     "not its other conditions"),
    (lambda n: n["status"]["capacity"].__setitem__("huawei.com/Ascend910", "16"), "not other fields of its status"),
    (lambda n: n["status"].pop("addresses"), "not other fields of its status"),
    (lambda n: n["status"].__setitem__("phase", "Running"), "not other fields of its status"),
    (lambda n: n["metadata"]["labels"].__setitem__("accelerator", "none"), "not its labels or annotations"),
])
def test_the_agent_may_change_nothing_else_of_its_nodes_status(policy, change, what):
    new = _changed(change)
    new["status"]["conditions"].append(_condition("NPUProblem", "True", "SeparateNPU"))
    allowed, messages = admit(policy, _request("npu-node-7", extra=_node("npu-node-7")), new, OLD)
    assert not allowed
    assert messages == [f"{AGENT_USER} may change only the NPUProblem condition of node npu-node-7, {what}"]


@pytest.mark.parametrize("extra", [None, {}, {"authentication.kubernetes.io/credential-id": ["JTI=6f1b"]},
                                   {"authentication.kubernetes.io/node-name": ["npu-node-7", "npu-node-8"]}])
def test_the_policy_fails_closed_without_the_node_name(policy, extra):
    allowed, [message] = admit(policy, _request("npu-node-7", extra=extra), OLD, OLD)
    assert not allowed and message.startswith(f"{AGENT_USER} may patch only the status of its own node, and its "
                                              "token names no node")


@pytest.mark.parametrize("user", ["system:node:npu-node-7", "system:serviceaccount:kube-system:node-problem-detector",
                                  "system:serviceaccount:other-ns:npu-node-agent", "kubernetes-admin"])
def test_the_kubelet_and_everybody_else_are_left_alone(policy, user):
    new = _changed(lambda n: n["status"]["conditions"].pop(0))
    assert admit(policy, _request("npu-node-7", user=user, extra=_node("npu-node-8")), new, OLD) is None
