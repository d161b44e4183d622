"""Issue 36, what operators expect of a DaemonSet chart: the rollout (a percentage of the nodes at a
time, minReadySeconds), labels on every resource, the pod fields operators set (securityContext,
runtimeClass, DNS, environment, arguments), and the PrometheusRule's alerts switched off one by one
or joined by groups of one's own."""

from __future__ import annotations

import importlib.util
import math
import re
from datetime import timedelta

import pytest
import yaml

from testkit import REPO
from tests.chart.conftest import CHART, RELEASE
from tests.chart.manifests import ADMISSION_POLICY_VERSIONS, problems
from tests.unit.test_dashboard_and_rules import duration
from tests.unit.test_promtool import needs_promtool, promtool


def _values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _valid(rendered, versions=None) -> None:
    found = [line for doc in rendered.docs for line in (problems(doc, versions) if versions else problems(doc))]
    assert not found, "\n".join(found)


# --- The rollout ---------------------------------------------------------------------------------

def _rolling(max_unavailable) -> dict:
    return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": max_unavailable}}


@pytest.mark.parametrize("sets, strategy", [
    ((), _rolling("10%")),
    (("updateStrategy.rollingUpdate.maxUnavailable=1",), _rolling(1)),
    (("updateStrategy.rollingUpdate.maxUnavailable=100%",), _rolling("100%")),
    # The API refuses rollingUpdate beside OnDelete: the chart leaves the default out.
    (("updateStrategy.type=OnDelete",), {"type": "OnDelete"}),
])
def test_update_strategy(helm, sets, strategy):
    rendered = helm.render(None, *sets)
    spec = rendered.one("DaemonSet")["spec"]
    assert spec["updateStrategy"] == strategy
    assert (spec["minReadySeconds"], spec["revisionHistoryLimit"]) == (10, 10)
    _valid(rendered)


@pytest.mark.parametrize("setting, reason", [
    ("updateStrategy.rollingUpdate.maxUnavailable=0", "minimum: got 0, want 1"),
    ("updateStrategy.rollingUpdate.maxUnavailable=0%", "does not match pattern"),
    ("updateStrategy.rollingUpdate.maxUnavailable=101%", "does not match pattern"),
    ("updateStrategy.rollingUpdate.maxUnavailable=ten", "does not match pattern"),
    # Two agents on a node would share state_dir (the fault log) and the host's ports.
    ("updateStrategy.rollingUpdate.maxSurge=1", "'maxSurge' not allowed"),
    ("minReadySeconds=-1", "minimum"),
])
def test_update_strategy_schema(helm, setting, reason):
    stderr = helm.render_error(None, setting)
    assert reason in stderr, stderr


def _per_node_seconds(values: dict) -> int:
    """The least time a node's rollout takes: the new pod ready at its first readiness probe, then
    minReadySeconds before the DaemonSet controller moves on."""
    return values["probes"]["readiness"]["initialDelaySeconds"] + values["minReadySeconds"]


def test_the_rollout_times_in_the_values_comment_are_the_values():
    values, text = _values(), (CHART / "values.yaml").read_text()
    per_node = _per_node_seconds(values)
    probe = values["probes"]["readiness"]["initialDelaySeconds"]
    assert f"{probe} + {values['minReadySeconds']} (minReadySeconds) = {per_node} s" in text
    one_by_one = timedelta(seconds=1000 * per_node)
    hours, minutes = divmod(int(one_by_one.total_seconds()) // 60, 60)
    assert f"1,000 x {per_node}-20 s = {hours} h {minutes} min" in text
    percent = int(values["updateStrategy"]["rollingUpdate"]["maxUnavailable"].rstrip("%"))
    at_a_time = math.ceil(1000 * percent / 100)  # the DaemonSet controller rounds up
    rounds = math.ceil(1000 / at_a_time)
    assert f"{at_a_time} at a time, {rounds} rounds: {rounds} x {per_node}-20 s = {rounds * per_node / 60:g}-" in text
    assert max(math.ceil(n / math.ceil(n * percent / 100)) for n in range(1, 5001)) == rounds  # "at most"


def test_presence_alerts_ride_out_a_rollout():
    """A node's agent is away, in the worst case a rollout allows, for the old pod's grace period,
    the new pod's readiness probes up to their failure threshold and minReadySeconds; the per-node
    alerts wait at least twice that."""
    values = _values()
    readiness = values["probes"]["readiness"]
    away = timedelta(seconds=values["terminationGracePeriodSeconds"] + readiness["initialDelaySeconds"]
                     + readiness["failureThreshold"] * readiness["periodSeconds"] + values["minReadySeconds"])
    rules = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    by_name = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    for name in ("NPUAgentNotReady", "NPUAgentNotScraped"):
        assert duration(by_name[name]["for"]) >= 2 * away, name


# --- Labels --------------------------------------------------------------------------------------

EVERYTHING = ("serviceMonitor.enabled=true", "prometheusRule.enabled=true", "grafanaDashboard.enabled=true",
              "networkPolicy.enabled=true", "tls.certManager.enabled=true", "tls.certManager.issuerRef.name=ca",
              "agent.datatrace.namespaces={team-a}", "files.scenario=steps: []")
VAP = ("--api-versions", "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy")


def test_common_labels_on_every_resource_and_the_pods(helm):
    rendered = helm.render("kubernetes-full", *EVERYTHING, "commonLabels.team=ml-platform",
                           "commonLabels.cost-center=npu", flags=VAP)
    kinds = {d["kind"] for d in rendered.docs}
    assert {"ServiceAccount", "ConfigMap", "Service", "DaemonSet", "ClusterRole", "ClusterRoleBinding", "Role",
            "RoleBinding", "ServiceMonitor", "PrometheusRule", "NetworkPolicy", "Certificate",
            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} <= kinds
    for doc in rendered.docs:
        labels = doc["metadata"]["labels"]
        assert labels["team"] == "ml-platform" and labels["cost-center"] == "npu", (doc["kind"], doc["metadata"]["name"])
        assert labels["app.kubernetes.io/instance"] == RELEASE
    pod = rendered.pod["metadata"]["labels"]
    assert pod["team"] == "ml-platform"
    # The selector is immutable: extra labels stay out of it.
    assert "team" not in rendered.one("DaemonSet")["spec"]["selector"]["matchLabels"]
    _valid(rendered, ADMISSION_POLICY_VERSIONS)


def test_a_resources_own_labels_win_over_common_labels(helm):
    rendered = helm.render("monitoring", "commonLabels.release=everything", "commonLabels.team=ml",
                           "podLabels.team=agents")
    assert rendered.one("ServiceMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rendered.one("PrometheusRule")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rendered.one("DaemonSet")["metadata"]["labels"]["release"] == "everything"
    assert rendered.pod["metadata"]["labels"]["team"] == "agents"
    assert rendered.one("DaemonSet")["metadata"]["labels"]["team"] == "ml"


@pytest.mark.parametrize("setting", ["commonLabels.app\\.kubernetes\\.io/name=x",
                                     "podLabels.app\\.kubernetes\\.io/instance=x", "commonLabels.helm\\.sh/chart=x"])
def test_the_charts_own_labels_cannot_be_overridden(helm, setting):
    stderr = helm.render_error(None, setting)
    assert "the chart sets this label itself" in stderr and "app.kubernetes.io/name" in stderr, stderr


def test_label_keys_are_checked(helm):
    stderr = helm.render_error(None, "commonLabels.bad key=x")
    assert "at '/commonLabels': additional properties 'bad key' not allowed" in stderr, stderr
    assert helm.render(None, "commonLabels.example\\.com/team=a").pod["metadata"]["labels"]["example.com/team"] == "a"


# --- Pod fields ----------------------------------------------------------------------------------

def test_pod_fields_operators_set(helm):
    rendered = helm.render(None, "runtimeClassName=ascend", "podSecurityContext.supplementalGroups={1000}",
                           "podSecurityContext.fsGroup=2000", "extraArgs={--log-level,debug}",
                           "envFrom[0].configMapRef.name=npu-env", "envFrom[1].secretRef.name=npu-secrets",
                           "envFrom[1].prefix=NPU_", "dnsConfig.options[0].name=edns0",
                           "revisionHistoryLimit=3")
    spec = rendered.pod["spec"]
    assert spec["runtimeClassName"] == "ascend"
    assert spec["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}, "supplementalGroups": [1000],
                                       "fsGroup": 2000}
    assert rendered.container["args"] == ["run", "--config", "/etc/npu-node-agent/config.yaml", "--log-level", "debug"]
    assert rendered.container["envFrom"] == [{"configMapRef": {"name": "npu-env"}},
                                             {"secretRef": {"name": "npu-secrets"}, "prefix": "NPU_"}]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in rendered.container["env"]
    assert spec["dnsConfig"] == {"options": [{"name": "edns0"}]}
    assert "dnsPolicy" not in spec  # the chart's choice: the cluster's default off hostNetwork
    assert rendered.one("DaemonSet")["spec"]["revisionHistoryLimit"] == 3
    # The container's own settings still decide who it runs as (root for the default DCMI backend).
    assert rendered.container["securityContext"]["runAsUser"] == 0
    _valid(rendered)


def test_extra_args_reach_the_agents_command_line(helm):
    """The container's arguments, extraArgs appended, as the agent's own parser reads them."""
    from agent.cli import make_parser
    args = make_parser().parse_args(helm.render(None, "extraArgs={--log-level,debug}").container["args"])
    assert (args.command, args.config, args.log_level) == ("run", "/etc/npu-node-agent/config.yaml", "debug")


def test_pod_security_context_merges_over_the_charts(helm):
    spec = helm.render("minimal", "podSecurityContext.seccompProfile.type=Localhost",
                       "podSecurityContext.seccompProfile.localhostProfile=profiles/agent.json").pod["spec"]
    assert spec["securityContext"] == {"seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/agent.json"}}


@pytest.mark.parametrize("sets, policy", [
    ((), None),
    (("hostNetwork=true",), "ClusterFirstWithHostNet"),
    (("hostNetwork=true", "dnsPolicy=ClusterFirst"), "ClusterFirst"),
    (("dnsPolicy=None", "dnsConfig.nameservers={10.0.0.10}"), "None"),
])
def test_dns_policy(helm, sets, policy):
    rendered = helm.render(None, *sets)
    assert rendered.pod["spec"].get("dnsPolicy") == policy
    _valid(rendered)


@pytest.mark.parametrize("setting, where", [
    ("runtimeClassName=Ascend_Runtime", "/runtimeClassName"),
    ("podSecurityContext.runAsUsr=0", "/podSecurityContext"),
    ("extraArgs[0]=5", "/extraArgs/0"),
    ("dnsPolicy=ClusterLast", "/dnsPolicy"),
    ("envFrom[0].configMap.name=x", "/envFrom/0"),
])
def test_pod_field_schema(helm, setting, where):
    stderr = helm.render_error(None, setting)
    assert f"at '{where}'" in stderr, stderr


def _smoke_module():
    spec = importlib.util.spec_from_file_location("image_smoke", REPO / ".ci" / "image-smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("values", [None, "simulated"])
def test_the_image_smoke_test_models_every_field_the_chart_renders_by_default(helm, values):
    """.ci/image-smoke.py runs the chart's pod with podman and fails on a field it does not model:
    what the chart renders without being asked must be one it does."""
    smoke = _smoke_module()
    spec = helm.render(values).pod["spec"]
    assert set(spec) <= smoke.POD_FIELDS
    for container in spec.get("initContainers", []) + spec["containers"]:
        assert set(container) <= smoke.CONTAINER_FIELDS, container["name"]
    assert set(spec["securityContext"]) == {"seccompProfile"}


# --- The PrometheusRule's alerts ----------------------------------------------------------------

def _rule_spec(helm, *sets) -> dict:
    return helm.render("monitoring", *sets).one("PrometheusRule")["spec"]


def _alerts(spec: dict) -> list[str]:
    return [r["alert"] for g in spec["groups"] for r in g["rules"] if "alert" in r]


def test_alerts_can_be_disabled_one_by_one(helm):
    full = _rule_spec(helm)
    spec = _rule_spec(helm, "prometheusRule.disabled={TrainingJobSlow,NPUAgentNotScraped}")
    assert _alerts(spec) == [a for a in _alerts(full) if a not in ("TrainingJobSlow", "NPUAgentNotScraped")]
    # Everything else is as it was: the recording rules TrainingJobSlow used stay (others may use them).
    kept = {g["name"]: [r for r in g["rules"] if r.get("alert") not in ("TrainingJobSlow", "NPUAgentNotScraped")]
            for g in full["groups"]}
    assert {g["name"]: g["rules"] for g in spec["groups"]} == kept
    # A group left without rules is left out (Prometheus and the CRD want rules in a group).
    npu = [r["alert"] for g in full["groups"] if g["name"] == "npu-node-agent.npu" for r in g["rules"]]
    spec = _rule_spec(helm, f"prometheusRule.disabled={{{','.join(npu)}}}")
    assert "npu-node-agent.npu" not in [g["name"] for g in spec["groups"]]
    assert not set(npu) & set(_alerts(spec))
    _valid(helm.render("monitoring", f"prometheusRule.disabled={{{','.join(npu)}}}"))


def test_an_unknown_alert_name_fails_with_the_known_ones(helm):
    stderr = helm.render_error("monitoring", "prometheusRule.disabled={NPUCardDropped,NPUCardDroped}")
    message = re.search(r"prometheusRule\.disabled: (.*)", stderr)
    assert message, stderr
    known = _alerts(_rule_spec(helm))
    assert message.group(1).startswith("NPUCardDroped not among the chart's alerts: " + ", ".join(known))
    assert "at '/prometheusRule/disabled/0'" in helm.render_error("monitoring", "prometheusRule.disabled={a b}")


def test_extra_groups_are_appended_as_given(helm, tmp_path):
    group = {"name": "site.npu", "interval": "1m", "rules": [
        {"record": "node:npu_agent_device_fault_level:max", "expr": "max by (node) (npu_agent_device_fault_level)"},
        {"alert": "SiteNPUNodeDegraded", "expr": "node:npu_agent_device_fault_level:max >= 7", "for": "15m",
         "labels": {"severity": "warning", "team": "ml-platform"},
         "annotations": {"summary": "{{ $labels.node }} has an isolated NPU"}}]}
    values = tmp_path / "extra.yaml"
    values.write_text(yaml.safe_dump({"prometheusRule": {"extraGroups": [group]}}))
    done = helm.run(*helm.template_args("monitoring", ()), "-f", str(values))
    assert done.returncode == 0, done.stderr
    [rule] = [d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"][-1] == group
    assert [g["name"] for g in rule["spec"]["groups"][:-1]] == [g["name"] for g in _rule_spec(helm)["groups"]]
    assert not problems(rule)
    taken = helm.render_error("monitoring", "prometheusRule.extraGroups[0].name=npu-node-agent.agent",
                              "prometheusRule.extraGroups[0].rules[0].alert=X",
                              "prometheusRule.extraGroups[0].rules[0].expr=vector(1)")
    assert 'the group name "npu-node-agent.agent" is taken' in taken, taken
    assert "at '/prometheusRule/extraGroups/0'" in helm.render_error(
        "monitoring", "prometheusRule.extraGroups[0].name=x")  # a group needs rules


@needs_promtool
def test_the_rendered_rules_pass_promtool(helm, tmp_path):
    """The chart's edits (the release's selectors, a fault level, alerts left out, groups added)
    leave a rule file Prometheus loads."""
    spec = _rule_spec(helm, "prometheusRule.faultLevel=7", "prometheusRule.disabled={NPUAgentNotScraped}",
                      "prometheusRule.extraGroups[0].name=site", "prometheusRule.extraGroups[0].rules[0].alert=SiteX",
                      "prometheusRule.extraGroups[0].rules[0].expr=sum(npu_agent_outbox_pending) > 100")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    done = promtool("check", "rules", str(tmp_path / "rules.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in spec['groups'])} rules found" in done.stdout
