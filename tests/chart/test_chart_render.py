"""The rendered chart: every manifest valid, the agent accepts its configuration, and each feature
gets exactly the mounts, privileges and RBAC it needs."""

from __future__ import annotations

import json

import pytest
import yaml

from agent.config import load_config
from agent.devices.scenario import load_scenario
from agent.faults.rules.codes import load_fault_code_table
from agent.faults.rules.customization import load_customization
from tests.chart.conftest import CHART, NAMESPACE, RELEASE, VALUE_FILES, VALUES, rules
from tests.chart.manifests import problems

RENDERINGS = [None, *VALUE_FILES]  # None: the chart's defaults


@pytest.mark.parametrize("values", RENDERINGS)
def test_every_manifest_is_valid(helm, values):
    rendered = helm.render(values)
    found = [line for doc in rendered.docs for line in problems(doc)]
    assert not found, "\n".join(found)
    names = [(d["kind"], d["metadata"]["name"]) for d in rendered.docs]
    assert len(names) == len(set(names)), names


@pytest.mark.parametrize("values", RENDERINGS)
def test_the_agent_accepts_the_rendered_files(helm, values, tmp_path):
    """config.yaml passes the agent's own validation, and so do the rule and scenario files."""
    rendered = helm.render(values)
    files = rendered.maybe("ConfigMap", f"{RELEASE}-files")
    for name, text in (files or {}).get("data", {}).items():
        (tmp_path / name).write_text(text)
    text = rendered.one("ConfigMap", RELEASE)["data"]["config.yaml"]
    # The paths the chart points at are where the files ConfigMap is mounted; read them here.
    text = text.replace("/etc/npu-node-agent-files", str(tmp_path))
    (tmp_path / "config.yaml").write_text(text)
    # The environment the pod gives the agent: what its downward API fields would hold.
    given = {e["name"] for e in rendered.one("DaemonSet")["spec"]["template"]["spec"]["containers"][0]["env"]}
    environ = {"NODE_NAME": "npu-node-7", **({"POD_IP": "10.0.0.7"} if "POD_IP" in given else {})}
    config = load_config(str(tmp_path / "config.yaml"), environ=environ)
    assert config.node_name == "npu-node-7"
    if config.faults.fault_code_file:
        load_fault_code_table(config.faults.fault_code_file)
    if config.faults.customization_file:
        load_customization(config.faults.customization_file)
    if config.devices.simulated.scenario:
        load_scenario(config.devices.simulated.scenario, config.devices.simulated.devices)


@pytest.mark.parametrize("sets, host", [((), "0.0.0.0"), (("hostNetwork=true",), "${POD_IP}"),
                                        (("hostNetwork=true", "listenOn=all"), "0.0.0.0"), (("listenOn=podIP",), "${POD_IP}")])
def test_the_ports_are_bound_where_listen_on_says(helm, sets, host):
    """Under hostNetwork the agent binds the pod's IP (the node's primary address), not every network of the node."""
    rendered = helm.render(None, *sets)
    config = rendered.agent_config
    assert (config["http"]["listen"], config["grpc"]["listen"]) == (f"{host}:9410", f"{host}:9411")
    env = {e["name"]: e for e in rendered.one("DaemonSet")["spec"]["template"]["spec"]["containers"][0]["env"]}
    if host == "${POD_IP}":
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    else:
        assert "POD_IP" not in env


def test_config_follows_values(helm):
    config = helm.render("monitoring").agent_config
    assert config["http"]["listen"] == "0.0.0.0:19410" and config["grpc"]["listen"] == "0.0.0.0:19411"
    assert config["http"]["token_auth"] is False  # the section's other keys come from values
    assert "node_name" not in config  # NODE_NAME, per pod
    clusterd = helm.render("clusterd").agent_config
    assert clusterd["clusterd"]["enabled"] is True
    assert "SubHealthFault" not in clusterd["clusterd"]["public_codes"]  # removed with null
    assert clusterd["faults"]["customization_file"] == "/etc/npu-node-agent-files/faultCustomization.json"
    assert clusterd["faults"]["fault_code_file"] == ""


def test_daemonset_basics(helm):
    rendered = helm.render()
    ds = rendered.one("DaemonSet")
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}
    assert ds["spec"]["minReadySeconds"] == 10
    spec = rendered.pod["spec"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    assert {"operator": "Exists"} in spec["tolerations"]
    assert spec["terminationGracePeriodSeconds"] >= 15
    container = rendered.container
    assert container["image"] == "npu-node-agent:0.1.0"
    assert container["args"] == ["run", "--config", "/etc/npu-node-agent/config.yaml"]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in container["env"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 9410, "grpc": 9411}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    overridden = helm.render(None, "nodeSelector.accelerator=huawei-Ascend910B").pod["spec"]["nodeSelector"]
    assert overridden == {"accelerator": "huawei-Ascend910B"}
    assert "nodeSelector" not in helm.render("simulated").pod["spec"]  # nodeSelector: null


def test_image_by_digest(helm):
    digest = "sha256:" + "0123456789abcdef" * 4
    rendered = helm.render("simulated", "image.repository=registry.example.com/npu-node-agent", f"image.digest={digest}")
    # The digest wins over the tag, in the (non-root) init container as in the agent's.
    assert {c["image"] for c in rendered.pod["spec"]["initContainers"] + rendered.pod["spec"]["containers"]} == \
        {f"registry.example.com/npu-node-agent@{digest}"}
    assert "digest" in helm.render_error(None, "image.digest=latest")


def test_probes(helm):
    container = helm.render().container
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    grpc = helm.render("monitoring").container
    assert grpc["readinessProbe"]["grpc"] == {"port": 19411} and "httpGet" not in grpc["readinessProbe"]
    assert grpc["livenessProbe"]["httpGet"]["port"] == "http"


def _mounts(rendered) -> dict[str, dict]:
    """mountPath -> {readOnly, volume}: what the container sees, joined with its volume."""
    volumes = {v["name"]: v for v in rendered.pod["spec"]["volumes"]}
    return {m["mountPath"]: {"readOnly": m.get("readOnly", False), "volume": volumes[m["name"]]}
            for m in rendered.container["volumeMounts"]}


def _host(mount: dict) -> tuple[str, str]:
    return mount["volume"]["hostPath"]["path"], mount["volume"]["hostPath"]["type"]


DRIVER, DCMI = "/usr/local/Ascend/driver", "/usr/local/dcmi"
POD_RESOURCES, PROFILING = "/var/lib/kubelet/pod-resources", "/user/cluster-info/profiling"
DATATRACE, STATE = "/user/cluster-info/datatrace-config", "/var/lib/npu-node-agent"


def test_default_mounts(helm):
    mounts = _mounts(helm.render())
    assert _host(mounts[STATE]) == (STATE, "DirectoryOrCreate") and not mounts[STATE]["readOnly"]
    assert _host(mounts[DRIVER]) == (DRIVER, "Directory") and mounts[DRIVER]["readOnly"]
    assert _host(mounts[DCMI]) == (DCMI, "") and mounts[DCMI]["readOnly"]
    assert _host(mounts[POD_RESOURCES]) == (POD_RESOURCES, "Directory") and mounts[POD_RESOURCES]["readOnly"]
    assert _host(mounts[PROFILING]) == (PROFILING, "DirectoryOrCreate")
    assert not mounts[PROFILING]["readOnly"]  # the disk guard deletes aged files
    assert mounts["/etc/npu-node-agent"]["volume"]["configMap"]["name"] == RELEASE
    assert "emptyDir" in mounts["/tmp"]["volume"]
    assert DATATRACE not in mounts and "/etc/npu-node-agent-files" not in mounts


@pytest.mark.parametrize("values, present, absent", [
    ("minimal", {STATE}, {DRIVER, DCMI, POD_RESOURCES, PROFILING, DATATRACE, "/etc/npu-node-agent-files"}),
    ("simulated", {STATE, PROFILING, "/etc/npu-node-agent-files"}, {DRIVER, DCMI, POD_RESOURCES, DATATRACE}),
    ("kubernetes-full", {STATE, DRIVER, POD_RESOURCES, PROFILING, DATATRACE}, set()),
    ("taskd-proxy", {STATE, PROFILING}, {DRIVER, POD_RESOURCES, DATATRACE}),
])
def test_mounts_follow_features(helm, values, present, absent):
    mounts = _mounts(helm.render(values))
    assert present <= set(mounts), set(mounts)
    assert not absent & set(mounts), absent & set(mounts)


def test_mount_details_follow_values(helm):
    simulated = _mounts(helm.render("simulated"))
    assert simulated[PROFILING]["readOnly"]  # metrics only: nothing is deleted
    assert simulated["/etc/npu-node-agent-files"]["volume"]["configMap"]["name"] == f"{RELEASE}-files"
    datatrace = _mounts(helm.render("kubernetes-full"))[DATATRACE]
    assert _host(datatrace) == (DATATRACE, "DirectoryOrCreate") and not datatrace["readOnly"]
    moved = _mounts(helm.render(None, "agent.kubernetes.pod_resources_socket=/run/kubelet/pr/kubelet.sock",
                                "podResources.hostPath=/var/lib/rancher/k3s/agent/kubelet/pod-resources",
                                "agent.profiling.root=/data/profiling", "agent.state_dir=/data/agent"))
    assert _host(moved["/run/kubelet/pr"]) == ("/var/lib/rancher/k3s/agent/kubelet/pod-resources", "Directory")
    assert _host(moved["/data/profiling"])[0] == "/data/profiling"
    assert _host(moved["/data/agent"])[0] == "/data/agent"


@pytest.mark.parametrize("values, expected", [
    # (container securityContext, root-required-by annotation)
    (None, ({"privileged": True, "runAsUser": 0, "runAsNonRoot": False, "readOnlyRootFilesystem": True},
            "dcmi-devices,kubelet-pod-resources,profiling-disk-guard")),
    ("minimal", ({"runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": True, "readOnlyRootFilesystem": True,
                  "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}, "")),
    ("simulated", ({"runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": True, "readOnlyRootFilesystem": True,
                    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}, "")),
    ("taskd-proxy", ({"runAsUser": 0, "runAsNonRoot": False, "readOnlyRootFilesystem": True,
                      "allowPrivilegeEscalation": False,
                      "capabilities": {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_READ_SEARCH"]}}, "taskd-proxy")),
])
def test_security_context_follows_features(helm, values, expected):
    rendered = helm.render(values)
    context, root_for = expected
    assert rendered.container["securityContext"] == context
    assert rendered.pod["metadata"]["annotations"]["npu-node-agent/root-required-by"] == root_for
    assert rendered.pod["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}


def test_root_without_privileges_when_dcmi_devices_come_another_way(helm):
    context = helm.render(None, "dcmi.privileged=false").container["securityContext"]
    assert "privileged" not in context and context["runAsUser"] == 0 and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}  # the disk guard's


def test_non_root_pod_hands_state_dir_to_the_agent_uid(helm):
    init = helm.render("minimal").pod["spec"]["initContainers"]
    assert [c["name"] for c in init] == ["state-dir-owner"]
    assert init[0]["command"] == ["chown", "-R", "65532:65532", STATE]
    assert init[0]["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert "initContainers" not in helm.render().pod["spec"]  # root needs no hand-over


def test_host_namespaces(helm):
    default = helm.render().pod["spec"]
    assert default["hostNetwork"] is False and default["hostPID"] is False and "dnsPolicy" not in default
    proxy = helm.render("taskd-proxy").pod["spec"]
    assert proxy["hostNetwork"] is True and proxy["hostPID"] is True
    assert proxy["dnsPolicy"] == "ClusterFirstWithHostNet"  # ClusterD's service name still resolves


def test_telemetry_widens_only_the_pid_namespace_and_only_on_real_npus(helm):
    telemetry = helm.render(None, "agent.telemetry.enabled=true")
    spec = telemetry.pod["spec"]
    assert spec["hostPID"] is True and spec["hostNetwork"] is False  # process -> container via the host's /proc
    config = yaml.safe_load(telemetry.one("ConfigMap", RELEASE)["data"]["config.yaml"])
    assert config["telemetry"]["enabled"] is True
    assert config["telemetry"]["hccn_tool"] == "/usr/local/Ascend/driver/tools/hccn_tool"
    # hccn_tool and libdcmi both come from the driver directory, already mounted read-only for DCMI.
    mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["/usr/local/Ascend/driver"]["readOnly"] is True
    simulated = helm.render("simulated", "agent.telemetry.enabled=true").pod["spec"]
    assert simulated["hostPID"] is False  # fake NPUs have no processes on the host


def _rules(rendered, kind: str, name: str) -> list[dict] | None:
    return rules(rendered.maybe(kind, name))


PODS = {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}
CONFIGMAPS = {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list", "watch"]}
DEVICE_INFO = {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create", "update"]}
REVIEWS = [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
           {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]}]


# With the API server at all: the node condition's patch (or, with it off, the removal of an earlier run's).
NODE_STATUS = {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]}


@pytest.mark.parametrize("values, sets, cluster_rules, device_info_rules", [
    (None, (), None, None),                              # kubernetes off: no RBAC at all
    ("minimal", (), None, None),
    (None, ("agent.kubernetes.enabled=true",), [PODS, NODE_STATUS], None),   # step-metric job labels
    (None, ("agent.kubernetes.enabled=true", "agent.profiling.metrics=false"), [NODE_STATUS], None),
    (None, ("agent.kubernetes.enabled=true", "agent.profiling.metrics=false",
            "agent.kubernetes.device_info_configmap=true"), [NODE_STATUS], [DEVICE_INFO]),
    (None, ("agent.kubernetes.enabled=true", "agent.datatrace.enabled=true"), [PODS, CONFIGMAPS, NODE_STATUS], None),
    ("kubernetes-full", (), [PODS, CONFIGMAPS, NODE_STATUS, *REVIEWS], [DEVICE_INFO]),
    ("kubernetes-full", ("agent.http.token_auth=false",), [PODS, CONFIGMAPS, NODE_STATUS], [DEVICE_INFO]),
    ("taskd-proxy", (), None, None),
    ("taskd-proxy", ("agent.kubernetes.enabled=true", "agent.profiling.metrics=false"), [PODS, NODE_STATUS], None),
])
def test_rbac_is_what_the_features_use(helm, values, sets, cluster_rules, device_info_rules):
    rendered = helm.render(values, *sets)
    assert _rules(rendered, "ClusterRole", RELEASE) == cluster_rules
    assert _rules(rendered, "Role", f"{RELEASE}-deviceinfo") == device_info_rules
    assert bool(rendered.maybe("ClusterRoleBinding", RELEASE)) == bool(cluster_rules)
    assert bool(rendered.maybe("RoleBinding", f"{RELEASE}-deviceinfo")) == bool(device_info_rules)
    assert rendered.pod["spec"]["automountServiceAccountToken"] is bool(cluster_rules or device_info_rules)
    assert rendered.one("ServiceAccount")["automountServiceAccountToken"] is False


def test_rbac_bindings_point_at_the_service_account(helm):
    rendered = helm.render("kubernetes-full")
    account = rendered.one("ServiceAccount")["metadata"]["name"]
    assert rendered.pod["spec"]["serviceAccountName"] == account
    role = rendered.one("Role")
    assert role["metadata"]["namespace"] == "kube-system"
    for binding in (rendered.one("ClusterRoleBinding", RELEASE), rendered.one("RoleBinding")):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    assert rendered.one("RoleBinding")["roleRef"]["name"] == role["metadata"]["name"]
    assert not helm.render("kubernetes-full", "rbac.create=false").all("ClusterRole")


def _checksum(rendered) -> str:
    return rendered.pod["metadata"]["annotations"]["checksum/config"]


def test_checksum_follows_the_config(helm):
    base = _checksum(helm.render("simulated"))
    assert base == _checksum(helm.render("simulated", "podLabels.x=y"))  # not a config change
    assert base != _checksum(helm.render("simulated", "agent.log.level=debug"))
    assert base != _checksum(helm.render("simulated", "ports.http=9500"))
    # The rule files are re-read by the agent: changing them must not roll the pods.
    assert base == _checksum(helm.render("simulated", "files.scenario=steps: []"))


def test_service(helm):
    service = helm.render().one("Service")
    assert service["spec"]["clusterIP"] == "None"
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "http": (9410, "http"), "grpc": (9411, "grpc")}
    assert service["spec"]["selector"] == helm.render().one("DaemonSet")["spec"]["selector"]["matchLabels"]
    assert not helm.render("minimal").all("Service")


def test_monitoring_objects_are_opt_in(helm):
    kinds = {d["kind"] for d in helm.render().docs}
    assert kinds == {"ServiceAccount", "ConfigMap", "Service", "DaemonSet"}


def test_service_monitor(helm):
    rendered = helm.render("monitoring")
    monitor = rendered.one("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= rendered.one("Service")["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics", "15s")
    assert endpoint["relabelings"][0] == {"sourceLabels": ["__meta_kubernetes_pod_node_name"],
                                          "targetLabel": "node", "action": "replace"}
    assert endpoint["relabelings"][1]["targetLabel"] == "host_ip"


def test_the_default_scrape_interval_is_the_one_the_rules_count_on(helm):
    [endpoint] = helm.render(None, "serviceMonitor.enabled=true").one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["interval"] == "10s"  # see the training group of files/prometheus-rules.yaml


def _fault_level_expr(spec: dict) -> str:
    return next(r["expr"] for g in spec["groups"] for r in g["rules"] if r.get("alert") == "NPUFaultLevelHigh")


# What the chart writes into the presence alerts' selectors for this test's release (its full name is
# the chart's name), and the file's own text.
RELEASE_SELECTORS = {f'namespace="{NAMESPACE}", created_by_name="{RELEASE}"': 'created_by_name="npu-node-agent"',
                     f'namespace="{NAMESPACE}", daemonset="{RELEASE}"': 'daemonset="npu-node-agent"'}


def _as_shipped(spec: dict) -> dict:
    """The rendered spec with the release's DaemonSet selectors put back to the file's."""
    for group in spec["groups"]:
        for rule in group["rules"]:
            for rendered, shipped in RELEASE_SELECTORS.items():
                rule["expr"] = rule["expr"].replace(rendered, shipped)
    return spec


def test_prometheus_rule_is_the_rule_file_with_the_fault_level_and_the_daemonset_set(helm):
    shipped = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    rule = helm.render("monitoring").one("PrometheusRule")
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    for rendered, original in RELEASE_SELECTORS.items():  # every selector of the DaemonSet names the release's
        assert sum(rendered in e for e in exprs) == sum(original in r["expr"] for g in shipped["groups"]
                                                        for r in g["rules"]) >= 1
        assert not any(original in e.replace(rendered, "") for e in exprs)
    assert _as_shipped(rule["spec"]) == shipped  # nothing else; the default level is the file's own
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    changed = helm.render("monitoring", "prometheusRule.faultLevel=8").one("PrometheusRule")["spec"]
    assert "npu_agent_device_fault_level >= 8)" in _fault_level_expr(changed)
    assert "npu_agent_device_fault_level >= 3" not in _fault_level_expr(changed)
    expr = _fault_level_expr(shipped)
    for group in changed["groups"]:  # nothing else changes
        for rule in group["rules"]:
            if rule.get("alert") == "NPUFaultLevelHigh":
                rule["expr"] = expr
    assert _as_shipped(changed) == shipped
    assert "faultLevel" in helm.render_error("monitoring", "prometheusRule.faultLevel=10")
    # Another release, namespace and name: the alerts follow its DaemonSet.
    other = helm.run("template", "agents", str(CHART), "--namespace", "npu-ops", "-f", str(VALUES / "monitoring.yaml"))
    assert other.returncode == 0, other.stderr
    [spec] = [d["spec"] for d in yaml.safe_load_all(other.stdout) if d and d["kind"] == "PrometheusRule"]
    missing = next(r["expr"] for g in spec["groups"] for r in g["rules"] if r.get("alert") == "NPUAgentPodsMissing")
    assert missing.count('{namespace="npu-ops", daemonset="agents-npu-node-agent"}') == 3


def test_grafana_dashboard(helm):
    dashboard = helm.render("monitoring").one("ConfigMap", f"{RELEASE}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "NPU"}
    shipped = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    assert json.loads(dashboard["data"]["npu-node-agent.json"]) == shipped
    nodes = json.loads((CHART / "files" / "grafana-node-dashboard.json").read_text())
    assert json.loads(dashboard["data"]["npu-node-agent-nodes.json"]) == nodes


def test_network_policy(helm):
    policy = helm.render("monitoring").one("NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    by_port = {rule["ports"][0]["port"]: rule["from"] for rule in policy["spec"]["ingress"]}
    assert set(by_port) == {"http", "grpc"}
    assert by_port["http"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}


def test_notes_name_what_needs_attention(helm):
    done = helm.run("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                    "-f", str(VALUES / "clusterd.yaml"))
    assert done.returncode == 0, done.stderr
    notes = done.stdout[done.stdout.index("NOTES:"):]
    assert "Runs as root, for: dcmi-devices" in notes
    assert "publicCustomization.json" in notes
