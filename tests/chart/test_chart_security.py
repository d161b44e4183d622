"""Issue 35, secure by default: the device-info ConfigMap's ValidatingAdmissionPolicy (its CEL run
as the API server would, on the expressions exactly as helm rendered them), datatrace's ConfigMap
watch per namespace, TLS from a Secret or cert-manager, and token-authenticated scrapes."""

from __future__ import annotations

import celpy
import pytest
from celpy import celtypes

from tests.chart.conftest import CHART, NAMESPACE, RELEASE, VALUES, rules
from tests.chart.manifests import ADMISSION_POLICY_VERSIONS, KUBE_VERSIONS, problems
from tests.chart.test_chart_render import REVIEWS

VAP_API = ("--api-versions", "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy")
DEVICE_INFO = ("agent.kubernetes.enabled=true", "agent.kubernetes.device_info_configmap=true")
AGENT_USER = f"system:serviceaccount:{NAMESPACE}:{RELEASE}"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
TOKEN_AUTH = ("agent.kubernetes.enabled=true", "agent.http.token_auth=true")
DEVICE_INFO_POLICY = f"{RELEASE}-deviceinfo"  # beside it, with kubernetes.enabled: <release>-nodestatus


def _valid(rendered, versions=KUBE_VERSIONS) -> None:
    found = [line for doc in rendered.docs for line in problems(doc, versions)]
    assert not found, "\n".join(found)


def _kinds(rendered) -> set[str]:
    return {d["kind"] for d in rendered.docs}


# --- The device-info ConfigMap's admission policy -------------------------------------------------

@pytest.mark.parametrize("sets, flags, rendered", [
    (DEVICE_INFO, VAP_API, True),
    (DEVICE_INFO, (), False),                                    # the cluster has no VAP v1 (< 1.30)
    (DEVICE_INFO, ("--kube-version", "1.30.0"), False),          # the served API decides, not the version
    ((*DEVICE_INFO, "admissionPolicy.enabled=false"), VAP_API, False),
    (("agent.kubernetes.enabled=true",), VAP_API, False),       # the agent writes no ConfigMap
    ((), VAP_API, False),                                        # no API server at all
])
def test_admission_policy_renders_with_the_feature_and_the_api(helm, sets, flags, rendered):
    result = helm.render(None, *sets, flags=flags)
    policy = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    found = {d["kind"] for d in result.docs if d["kind"] in policy and d["metadata"]["name"] == DEVICE_INFO_POLICY}
    assert found == (policy if rendered else set())
    # With kubernetes.enabled the nodes/status policy renders too (test_chart_admission_nodestatus.py).
    _valid(result, ADMISSION_POLICY_VERSIONS if policy & _kinds(result) else KUBE_VERSIONS)


def test_admission_policy_shape(helm):
    rendered = helm.render("kubernetes-full", flags=(*VAP_API, "--kube-version", "1.30.0"))
    _valid(rendered, ADMISSION_POLICY_VERSIONS)
    policy = rendered.one("ValidatingAdmissionPolicy", DEVICE_INFO_POLICY)
    binding = rendered.one("ValidatingAdmissionPolicyBinding", DEVICE_INFO_POLICY)
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [{
        "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE", "DELETE"],
        "resources": ["configmaps"]}]
    assert "namespaceSelector" not in spec["matchConstraints"]  # the agent may write no other namespace either
    assert {v["reason"] for v in spec["validations"]} == {"Forbidden"}
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    # Every verb the Role grants is checked.
    [rule] = rendered.one("Role")["rules"]
    assert {verb.upper() for verb in rule["verbs"]} <= set(spec["matchConstraints"]["resourceRules"][0]["operations"])
    assert rendered.one("Role")["metadata"]["namespace"] == "kube-system"


def _cel(value):
    return celtypes.NullType() if value is None else celpy.json_to_cel(value)


def _request(operation: str, namespace: str, name: str, *, user: str = AGENT_USER,
             extra: dict | None = None) -> dict:
    """An AdmissionRequest as the API server gives it to CEL: `extra` (map of string to list of
    strings) is absent when the user has none (omitempty)."""
    user_info: dict = {"username": user, "uid": "0d4c", "groups": ["system:serviceaccounts",
                                                                   f"system:serviceaccounts:{NAMESPACE}"]}
    if extra is not None:
        user_info["extra"] = extra
    return {"uid": "705ab4f5", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "resource": {"group": "", "version": "v1", "resource": "configmaps"},
            "name": name, "namespace": namespace, "operation": operation, "userInfo": user_info,
            "dryRun": False}


def _node(name: str) -> dict:
    """The extra of a pod-bound service-account token (Kubernetes >= 1.30)."""
    return {NODE_NAME_EXTRA: [name], "authentication.kubernetes.io/pod-name": ["npu-node-agent-x7k2p"],
            "authentication.kubernetes.io/credential-id": ["JTI=6f1b"]}


def _configmap(namespace: str, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace},
            "data": {"DeviceInfoCfg": "{}"}}


def admit(policy: dict, request: dict, obj: dict | None = None, old: dict | None = None) -> tuple[bool, list[str]] | None:
    """What the API server decides for `request` under `policy`, evaluated from the policy's own
    CEL: None when the policy does not match it; else (allowed, the denial messages). An
    expression that fails to evaluate denies (failurePolicy Fail), with its error as the message.
    `obj`, `old`: the object and oldObject (by default the ConfigMap the request names)."""
    spec = policy["spec"]
    rules = spec["matchConstraints"]["resourceRules"]
    # A rule names a subresource as `<resource>/<subresource>` (nodes/status).
    resource = "/".join(filter(None, (request["resource"]["resource"], request.get("subResource"))))
    if not any(request["operation"] in r["operations"] and resource in r["resources"]
               and request["resource"]["group"] in r["apiGroups"] for r in rules):
        return None
    env = celpy.Environment()
    if obj is None and request["operation"] != "DELETE":
        obj = _configmap(request["namespace"], request["name"])
    if old is None and request["operation"] != "CREATE":
        old = _configmap(request["namespace"], request["name"])
    activation = {"request": _cel(request), "object": _cel(obj), "oldObject": _cel(old)}

    def evaluate(expression: str):
        return env.program(env.compile(expression)).evaluate(activation)

    assert spec["failurePolicy"] == "Fail"
    try:
        if not all(evaluate(c["expression"]) for c in spec["matchConditions"]):
            return None
    except celpy.CELEvalError as exc:  # an error in a match condition denies under Fail
        return False, [f"match condition error: {exc}"]
    variables = celtypes.MapType()
    activation["variables"] = variables
    try:
        for variable in spec.get("variables", []):
            variables[celtypes.StringType(variable["name"])] = evaluate(variable["expression"])
    except celpy.CELEvalError as exc:
        return False, [f"variable error: {exc}"]
    messages = []
    for validation in spec["validations"]:
        try:
            if evaluate(validation["expression"]):
                continue
            messages.append(str(evaluate(validation["messageExpression"])) if "messageExpression" in validation
                            else validation["message"])
        except celpy.CELEvalError as exc:
            messages.append(f"expression error: {exc}")
    return not messages, messages


@pytest.fixture(scope="module")
def policy(helm) -> dict:
    return helm.render(None, *DEVICE_INFO, flags=VAP_API).one("ValidatingAdmissionPolicy", DEVICE_INFO_POLICY)


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_policy_lets_the_agent_write_its_own_nodes_configmap(policy, operation):
    assert admit(policy, _request(operation, "kube-system", "mindx-dl-deviceinfo-npu-node-7",
                                  extra=_node("npu-node-7"))) == (True, [])


@pytest.mark.parametrize("namespace, name", [
    ("kube-system", "mindx-dl-deviceinfo-npu-node-8"),   # another node's
    ("kube-system", "mindx-dl-deviceinfo-npu-node-70"),  # a node whose name starts with ours
    ("kube-system", "coredns"),                          # anything else the Role's rule would allow
    ("default", "mindx-dl-deviceinfo-npu-node-7"),       # our name, another namespace
])
@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
def test_policy_denies_any_other_configmap_naming_the_allowed_one(policy, namespace, name, operation):
    allowed, [message] = admit(policy, _request(operation, namespace, name, extra=_node("npu-node-7")))
    assert not allowed
    assert message == (f"{AGENT_USER} on node npu-node-7 may write only ConfigMap "
                       f"kube-system/mindx-dl-deviceinfo-npu-node-7, not {namespace}/{name}")


@pytest.mark.parametrize("extra", [
    None,                                                    # a token with no extra at all (legacy Secret token)
    {},
    {"authentication.kubernetes.io/credential-id": ["JTI=6f1b"]},   # Kubernetes < 1.30: no node in the token
    {NODE_NAME_EXTRA: []},
    {NODE_NAME_EXTRA: ["npu-node-7", "npu-node-8"]},
])
def test_policy_fails_closed_without_the_node_name(policy, extra):
    allowed, [message] = admit(policy, _request("UPDATE", "kube-system", "mindx-dl-deviceinfo-npu-node-7",
                                                extra=extra))
    assert not allowed
    assert message.startswith(f"{AGENT_USER} may write only ConfigMap kube-system/mindx-dl-deviceinfo-<its node>, "
                              "and its token names no node")
    assert message.endswith("refusing UPDATE of kube-system/mindx-dl-deviceinfo-npu-node-7")


@pytest.mark.parametrize("user", [
    "system:serviceaccount:kube-system:ascend-device-plugin-sa",     # the device plugin writes these too
    f"system:serviceaccount:{NAMESPACE}:default",
    "system:serviceaccount:other-ns:npu-node-agent",                 # same name, another namespace
    "kubernetes-admin",
])
def test_policy_leaves_every_other_user_alone(policy, user):
    for extra in (None, _node("npu-node-8")):
        assert admit(policy, _request("UPDATE", "kube-system", "mindx-dl-deviceinfo-npu-node-7", user=user,
                                      extra=extra)) is None


def test_policy_names_the_service_account_the_pods_run_as(helm):
    rendered = helm.render(None, *DEVICE_INFO, "serviceAccount.name=npu-agent", flags=VAP_API)
    policy = rendered.one("ValidatingAdmissionPolicy", DEVICE_INFO_POLICY)
    assert rendered.pod["spec"]["serviceAccountName"] == "npu-agent"
    user = f"system:serviceaccount:{NAMESPACE}:npu-agent"
    request = _request("UPDATE", "kube-system", "mindx-dl-deviceinfo-n1", user=user, extra=_node("n1"))
    assert admit(policy, request) == (True, [])
    assert admit(policy, _request("UPDATE", "kube-system", "mindx-dl-deviceinfo-n1", extra=_node("n1"))) is None


def test_policy_does_not_match_other_resources(policy):
    request = _request("UPDATE", "kube-system", "mindx-dl-deviceinfo-npu-node-7", extra=_node("npu-node-8"))
    request["resource"] = {"group": "", "version": "v1", "resource": "secrets"}
    assert admit(policy, request) is None


# --- Datatrace's ConfigMap watch ------------------------------------------------------------------

DATATRACE = ("agent.kubernetes.enabled=true", "agent.datatrace.enabled=true")
LIST_CONFIGMAPS = {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list", "watch"]}


def test_datatrace_watch_is_cluster_wide_by_default(helm):
    rendered = helm.render(None, *DATATRACE)
    assert LIST_CONFIGMAPS in rules(rendered.one("ClusterRole"))
    assert not rendered.all("Role")


def test_datatrace_namespaces_get_a_role_each_instead(helm):
    rendered = helm.render(None, *DATATRACE, "agent.datatrace.namespaces={team-a,team-b}")
    _valid(rendered)
    assert LIST_CONFIGMAPS not in rules(rendered.one("ClusterRole"))  # pods stay cluster-scoped
    roles = {r["metadata"]["namespace"]: r for r in rendered.all("Role")}
    assert set(roles) == {"team-a", "team-b"}
    assert all(rules(role) == [LIST_CONFIGMAPS] for role in roles.values())
    bindings = {b["metadata"]["namespace"]: b for b in rendered.all("RoleBinding")}
    assert set(bindings) == {"team-a", "team-b"}
    for namespace, binding in bindings.items():
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": roles[namespace]["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]
    # Without datatrace the list renders nothing.
    assert not helm.render(None, "agent.kubernetes.enabled=true", "agent.datatrace.namespaces={team-a}").all("Role")
    assert "agent/datatrace/namespaces/0" in helm.render_error(None, *DATATRACE, "agent.datatrace.namespaces={Team_A}")


# --- TLS ------------------------------------------------------------------------------------------

TLS_DIR, CA_DIR = "/etc/npu-node-agent-tls", "/etc/npu-node-agent-client-ca"


def _volumes(rendered) -> dict[str, dict]:
    return {v["name"]: v for v in rendered.pod["spec"]["volumes"]}


def _mounts(rendered) -> dict[str, dict]:
    return {m["mountPath"]: m for m in rendered.container["volumeMounts"]}


def test_no_tls_by_default(helm):
    rendered = helm.render("monitoring")
    assert rendered.agent_config["tls"] == {"cert_file": "", "key_file": "", "client_ca_file": ""}
    assert "scheme" not in rendered.container["livenessProbe"]["httpGet"]
    [endpoint] = rendered.one("ServiceMonitor")["spec"]["endpoints"]
    assert "scheme" not in endpoint and "tlsConfig" not in endpoint
    assert not {"tls", "client-ca"} & set(_volumes(rendered))


def test_tls_from_a_secret(helm):
    rendered = helm.render(None, "tls.secretName=agent-cert", "tls.clientCASecretName=mindx-clients",
                           "serviceMonitor.enabled=true")
    _valid(rendered)
    assert rendered.agent_config["tls"] == {"cert_file": f"{TLS_DIR}/tls.crt", "key_file": f"{TLS_DIR}/tls.key",
                                            "client_ca_file": f"{CA_DIR}/ca.crt"}
    volumes, mounts = _volumes(rendered), _mounts(rendered)
    assert volumes["tls"]["secret"] == {"secretName": "agent-cert"}
    assert volumes["client-ca"]["secret"] == {"secretName": "mindx-clients"}
    # Read-only and whole (no subPath): the kubelet's symlink swap of a renewed Secret shows through.
    for path, name in ((TLS_DIR, "tls"), (CA_DIR, "client-ca")):
        assert mounts[path] == {"name": name, "mountPath": path, "readOnly": True}
    container = rendered.container
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http", "scheme": "HTTPS"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http", "scheme": "HTTPS"}
    [endpoint] = rendered.one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"serverName": f"{RELEASE}.{NAMESPACE}.svc", "insecureSkipVerify": False,
                                     "ca": {"secret": {"name": "agent-cert", "key": "ca.crt"}}}
    assert "bearerTokenFile" not in endpoint and "authorization" not in endpoint
    assert not rendered.all("Certificate")


def test_tls_from_agent_paths_switches_probes_and_scrapes_only(helm):
    rendered = helm.render(None, "agent.tls.cert_file=/host/tls.crt", "agent.tls.key_file=/host/tls.key",
                           "serviceMonitor.enabled=true", "serviceMonitor.tlsConfig.serverName=agent.example",
                           "serviceMonitor.tlsConfig.ca.configMap.name=agent-ca",
                           "serviceMonitor.tlsConfig.ca.configMap.key=ca.pem")
    assert rendered.container["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert not {"tls", "client-ca"} & set(_volumes(rendered))
    [endpoint] = rendered.one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["tlsConfig"] == {"serverName": "agent.example", "insecureSkipVerify": False,
                                     "ca": {"configMap": {"name": "agent-ca", "key": "ca.pem"}}}


def test_tls_from_cert_manager(helm):
    rendered = helm.render("tls")
    _valid(rendered)
    certificate = rendered.one("Certificate")
    spec = certificate["spec"]
    assert spec["secretName"] == f"{RELEASE}-tls" == _volumes(rendered)["tls"]["secret"]["secretName"]
    assert spec["issuerRef"] == {"name": "npu-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    # The name Prometheus checks (serviceMonitor.tlsConfig.serverName's default) is in the certificate.
    [endpoint] = rendered.one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["tlsConfig"]["serverName"] in spec["dnsNames"]
    assert spec["dnsNames"][:2] == [RELEASE, f"{RELEASE}.{NAMESPACE}.svc"]
    assert "server auth" in spec["usages"] and spec["privateKey"]["rotationPolicy"] == "Always"
    named = helm.render("tls", "tls.secretName=agent-cert").one("Certificate")
    assert named["spec"]["secretName"] == "agent-cert"


@pytest.mark.parametrize("sets, message", [
    (("tls.secretName=c", "agent.tls.cert_file=/c.pem"),
     "tls.secretName and agent.tls.cert_file are both set; give the Secret or its path, not both"),
    (("tls.certManager.enabled=true", "tls.certManager.issuerRef.name=ca", "agent.tls.key_file=/k.pem"),
     "tls.certManager.enabled and agent.tls.key_file are both set"),
    (("tls.secretName=c", "tls.clientCASecretName=ca", "agent.tls.client_ca_file=/ca.pem"),
     "tls.clientCASecretName and agent.tls.client_ca_file are both set"),
    (("tls.certManager.enabled=true",), "tls.certManager.enabled needs tls.certManager.issuerRef.name"),
    (("tls.clientCASecretName=ca",), "tls.clientCASecretName needs a server certificate"),
    (("tls.secretName=c", "probes.readiness.grpc=true"), "the kubelet's gRPC probe speaks plaintext only"),
])
def test_tls_contradictions_fail_with_the_fix(helm, sets, message):
    assert message in helm.render_error(None, *sets)


# --- Token-authenticated scrapes ------------------------------------------------------------------

def test_token_auth_rbac(helm):
    rendered = helm.render(None, *TOKEN_AUTH)
    _valid(rendered)
    agent_role = rendered.one("ClusterRole", RELEASE)
    assert all(rule in rules(agent_role) for rule in REVIEWS)
    reader = rendered.one("ClusterRole", f"{RELEASE}-metrics-reader")
    assert reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    assert rendered.maybe("ClusterRoleBinding", f"{RELEASE}-metrics-reader") is None  # no subjects given
    assert rendered.pod["spec"]["automountServiceAccountToken"] is True
    # The probes need no token.
    assert rendered.container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    without = helm.render(None, "agent.kubernetes.enabled=true")
    assert not any(rule in rules(without.one("ClusterRole")) for rule in REVIEWS)
    assert without.maybe("ClusterRole", f"{RELEASE}-metrics-reader") is None


def test_metrics_reader_binds_the_given_subjects(helm):
    prometheus = {"kind": "ServiceAccount", "name": "prometheus-k8s", "namespace": "monitoring"}
    rendered = helm.render(None, *TOKEN_AUTH, "metricsReader.subjects[0].kind=ServiceAccount",
                           "metricsReader.subjects[0].name=prometheus-k8s",
                           "metricsReader.subjects[0].namespace=monitoring")
    _valid(rendered)
    binding = rendered.one("ClusterRoleBinding", f"{RELEASE}-metrics-reader")
    assert binding["subjects"] == [prometheus]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": f"{RELEASE}-metrics-reader"}


def test_service_monitor_sends_a_token(helm):
    sets = (*TOKEN_AUTH, "serviceMonitor.enabled=true")
    [endpoint] = helm.render(None, *sets).one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["bearerTokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert "authorization" not in endpoint and "scheme" not in endpoint
    rendered = helm.render("tls", *sets, "serviceMonitor.bearerTokenSecret.name=prometheus-token",
                           "serviceMonitor.bearerTokenSecret.key=token")
    _valid(rendered)
    [endpoint] = rendered.one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "prometheus-token", "key": "token"}}
    assert "bearerTokenFile" not in endpoint and endpoint["scheme"] == "https"


def test_token_auth_needs_the_api_server(helm):
    message = helm.render_error(None, "agent.http.token_auth=true")
    assert "agent.http.token_auth needs agent.kubernetes.enabled: true" in message


def test_notes_say_what_the_install_got(helm):
    """Where the cluster has no ValidatingAdmissionPolicy v1 (here: `--dry-run=client` knows no
    cluster), with agent.datatrace.namespaces, and with tokens over plaintext, NOTES say what that leaves."""
    done = helm.run("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                    "-f", str(VALUES / "kubernetes-full.yaml"), "--set", "agent.datatrace.namespaces={team-a}")
    assert done.returncode == 0, done.stderr
    notes = " ".join(done.stdout[done.stdout.index("NOTES:"):].split())
    assert "No ValidatingAdmissionPolicy v1 here" in notes
    assert "every agent may write every ConfigMap in kube-system" in notes
    assert "ConfigMaps only in team-a" in notes and "jobs in other namespaces get no profiling switch files" in notes
    assert "agent.http.token_auth without TLS" in notes  # kubernetes-full scrapes with tokens, in clear text


# --- ClusterD's pods and saved faults: read where they live, by name where a name is known ---------

CLUSTERD = ("agent.kubernetes.enabled=true", "agent.clusterd.enabled=true")


def test_clusterd_s_pods_and_saved_faults_are_read_only_in_their_namespaces(helm):
    rendered = helm.render(None, *CLUSTERD)
    _valid(rendered)
    pods = rendered.one("Role", f"{RELEASE}-clusterd-pods")
    assert pods["metadata"]["namespace"] == "mindx-dl"
    assert pods["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    saved = rendered.one("Role", f"{RELEASE}-clusterd-saved-faults")
    assert saved["metadata"]["namespace"] == "cluster-system"
    assert saved["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                               "resourceNames": ["statistic-fault-info"], "verbs": ["get"]}]
    for role in (pods, saved):
        binding = rendered.one("RoleBinding", role["metadata"]["name"])
        assert binding["metadata"]["namespace"] == role["metadata"]["namespace"]
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]


@pytest.mark.parametrize("sets, roles", [
    ((*CLUSTERD, "agent.clusterd.pods=ops/component=clusterd", "agent.clusterd.saved_faults="),
     {("ops", "clusterd-pods")}),
    ((*CLUSTERD, "agent.clusterd.pods="), {("cluster-system", "clusterd-saved-faults")}),
    (("agent.clusterd.enabled=true",), set()),     # no API server: nothing to grant
    (("agent.kubernetes.enabled=true",), set()),   # no ClusterD sink
    ((*CLUSTERD, "rbac.create=false"), set()),
])
def test_clusterd_roles_follow_the_settings(helm, sets, roles):
    rendered = helm.render(None, *sets)
    found = {(d["metadata"]["namespace"], d["metadata"]["name"].removeprefix(f"{RELEASE}-"))
             for d in rendered.all("Role") if "clusterd" in d["metadata"]["name"]}
    assert found == roles
