{{/* Names and labels. */}}
{{- define "npu-node-agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "npu-node-agent.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "npu-node-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "npu-node-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The labels the chart sets on every resource (commonLabels may not set these). */}}
{{- define "npu-node-agent.ownLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "npu-node-agent.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Every resource's labels: the chart's own and commonLabels. */}}
{{- define "npu-node-agent.labels" -}}
{{- include "npu-node-agent.labelsWith" (dict "root" . "extra" (dict)) -}}
{{- end -}}

{{/* The same with a resource's own extra labels (dict "root" $ "extra" MAP), which win over
     commonLabels where both set a key. */}}
{{- define "npu-node-agent.labelsWith" -}}
{{- $own := include "npu-node-agent.ownLabels" .root | fromYaml -}}
{{- toYaml (merge $own (deepCopy (.extra | default (dict))) (deepCopy (.root.Values.commonLabels | default (dict)))) -}}
{{- end -}}

{{- define "npu-node-agent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "npu-node-agent.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "npu-node-agent.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Where the ConfigMaps are mounted. Two directories, not nested: a mount point inside a
     read-only ConfigMap volume cannot be created. */}}
{{- define "npu-node-agent.configDir" -}}/etc/npu-node-agent{{- end -}}
{{- define "npu-node-agent.filesDir" -}}/etc/npu-node-agent-files{{- end -}}
{{- define "npu-node-agent.tlsDir" -}}/etc/npu-node-agent-tls{{- end -}}
{{- define "npu-node-agent.clientCADir" -}}/etc/npu-node-agent-client-ca{{- end -}}

{{/* The Secret holding the agent's certificate: tls.secretName, else the one tls.certManager's
     Certificate writes ("" = none). */}}
{{- define "npu-node-agent.tlsSecret" -}}
{{- if .Values.tls.secretName -}}
{{- .Values.tls.secretName -}}
{{- else if .Values.tls.certManager.enabled -}}
{{- printf "%s-tls" (include "npu-node-agent.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* "true" when the agent serves TLS (from the chart's Secret or agent.tls.cert_file), else "". */}}
{{- define "npu-node-agent.tlsOn" -}}
{{- if or (include "npu-node-agent.tlsSecret" .) .Values.agent.tls.cert_file -}}true{{- end -}}
{{- end -}}

{{/* "true" when scrapes of /metrics must carry a token (agent.http.token_auth), else "". */}}
{{- define "npu-node-agent.tokenAuth" -}}
{{- if dig "http" "token_auth" false .Values.agent -}}true{{- end -}}
{{- end -}}

{{/* Cross-key checks the schema cannot say clearly; each fails the render with the fix. */}}
{{- define "npu-node-agent.validate" -}}
{{- $a := .Values.agent -}}
{{- if and $a.taskd_proxy.enabled (not (and .Values.hostPID .Values.hostNetwork)) -}}
{{- fail "agent.taskd_proxy.enabled needs hostPID: true and hostNetwork: true (the proxy serves the training pods' 127.0.0.1:9602 on the node's loopback and finds the process behind each connection in the host's /proc); set both, or disable the proxy" -}}
{{- end -}}
{{- if and $a.datatrace.enabled (not $a.kubernetes.enabled) -}}
{{- fail "agent.datatrace.enabled needs agent.kubernetes.enabled: true (the switch files follow ConfigMaps and pods from the API server)" -}}
{{- end -}}
{{- if and $a.kubernetes.device_info_configmap (not $a.kubernetes.enabled) -}}
{{- fail "agent.kubernetes.device_info_configmap needs agent.kubernetes.enabled: true" -}}
{{- end -}}
{{- if eq (int .Values.ports.http) (int .Values.ports.grpc) -}}
{{- fail (printf "ports.http and ports.grpc are both %d; give them different ports" (int .Values.ports.http)) -}}
{{- end -}}
{{- $tlsSecret := include "npu-node-agent.tlsSecret" . -}}
{{- $tlsFrom := ternary "tls.secretName" "tls.certManager.enabled" (not (empty .Values.tls.secretName)) -}}
{{- /* (the chart's value, the agent key it sets, their names, what the value gives) */ -}}
{{- $given := list
      (list .Values.files.faultCode $a.faults.fault_code_file "files.faultCode" "agent.faults.fault_code_file" "the file's content")
      (list .Values.files.customization $a.faults.customization_file "files.customization" "agent.faults.customization_file" "the file's content")
      (list .Values.files.scenario $a.devices.simulated.scenario "files.scenario" "agent.devices.simulated.scenario" "the file's content")
      (list $tlsSecret $a.tls.cert_file $tlsFrom "agent.tls.cert_file" "the Secret")
      (list $tlsSecret $a.tls.key_file $tlsFrom "agent.tls.key_file" "the Secret")
      (list .Values.tls.clientCASecretName $a.tls.client_ca_file "tls.clientCASecretName" "agent.tls.client_ca_file" "the Secret") -}}
{{- range $given -}}
{{- if and (index . 0) (index . 1) -}}
{{- fail (printf "%s and %s are both set; give %s or its path, not both" (index . 2) (index . 3) (index . 4)) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.tls.certManager.enabled (not .Values.tls.certManager.issuerRef.name) -}}
{{- fail "tls.certManager.enabled needs tls.certManager.issuerRef.name: the Issuer (or ClusterIssuer, with issuerRef.kind) that signs the agent's certificate" -}}
{{- end -}}
{{- if and .Values.tls.clientCASecretName (not (include "npu-node-agent.tlsOn" .)) -}}
{{- fail "tls.clientCASecretName needs a server certificate (tls.secretName, tls.certManager.enabled or agent.tls.cert_file): gRPC clients present certificates only over TLS" -}}
{{- end -}}
{{- if and (include "npu-node-agent.tlsOn" .) .Values.probes.readiness.grpc -}}
{{- fail "probes.readiness.grpc: true cannot check the agent once it serves TLS (the kubelet's gRPC probe speaks plaintext only); set probes.readiness.grpc: false, the HTTPS probe of /readyz" -}}
{{- end -}}
{{- if and (include "npu-node-agent.tokenAuth" .) (not $a.kubernetes.enabled) -}}
{{- fail "agent.http.token_auth needs agent.kubernetes.enabled: true (the agent checks each scrape's token with a TokenReview and a SubjectAccessReview)" -}}
{{- end -}}
{{- if and .Values.serviceMonitor.enabled (not .Values.service.enabled) -}}
{{- fail "serviceMonitor.enabled needs service.enabled: true (a ServiceMonitor selects a Service)" -}}
{{- end -}}
{{- /* The chart's own labels select the pods and name the release: another value would break the
       DaemonSet's selector or hide the resource from Helm. */ -}}
{{- $own := include "npu-node-agent.ownLabels" . | fromYaml -}}
{{- range $value := list "commonLabels" "podLabels" -}}
{{- range $key := keys (get $.Values $value | default (dict)) | sortAlpha -}}
{{- if hasKey $own $key -}}
{{- fail (printf "%s.%s: the chart sets this label itself (%s); choose another key" $value $key (keys $own | sortAlpha | join ", ")) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "true" when the ports are bound to the pod's IP (listenOn): the agent takes it from $POD_IP. */}}
{{- define "npu-node-agent.listenOnPodIP" -}}
{{- or (eq .Values.listenOn "podIP") (and (eq .Values.listenOn "auto") .Values.hostNetwork) -}}
{{- end -}}

{{/* The agent's config.yaml: the values' `agent` section, plus the keys the chart owns. */}}
{{- define "npu-node-agent.agentConfig" -}}
{{- $cfg := deepCopy .Values.agent -}}
{{- $host := ternary "${POD_IP}" "0.0.0.0" (eq (include "npu-node-agent.listenOnPodIP" .) "true") -}}
{{- range $section, $port := dict "http" .Values.ports.http "grpc" .Values.ports.grpc -}}
{{- $keys := get $cfg $section | default dict -}}
{{- $_ := set $keys "listen" (printf "%s:%d" $host (int $port)) -}}
{{- $_ = set $cfg $section $keys -}}
{{- end -}}
{{- $dir := include "npu-node-agent.filesDir" . -}}
{{- if include "npu-node-agent.tlsSecret" . -}}
{{- $_ := set $cfg.tls "cert_file" (printf "%s/tls.crt" (include "npu-node-agent.tlsDir" .)) -}}
{{- $_ = set $cfg.tls "key_file" (printf "%s/tls.key" (include "npu-node-agent.tlsDir" .)) -}}
{{- end -}}
{{- if .Values.tls.clientCASecretName -}}
{{- $_ := set $cfg.tls "client_ca_file" (printf "%s/%s" (include "npu-node-agent.clientCADir" .) .Values.tls.clientCAKey) -}}
{{- end -}}
{{- if .Values.files.faultCode -}}
{{- $_ := set $cfg.faults "fault_code_file" (printf "%s/faultCode.json" $dir) -}}
{{- end -}}
{{- if .Values.files.customization -}}
{{- $_ := set $cfg.faults "customization_file" (printf "%s/faultCustomization.json" $dir) -}}
{{- end -}}
{{- if .Values.files.scenario -}}
{{- $_ := set $cfg.devices.simulated "scenario" (printf "%s/scenario.yaml" $dir) -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Which features use the Kubernetes API, as RBAC rules (empty: the agent never calls it). */}}
{{- define "npu-node-agent.clusterRules" -}}
{{- $a := .Values.agent -}}
{{- if $a.kubernetes.enabled -}}
{{- if or $a.profiling.metrics $a.datatrace.enabled $a.taskd_proxy.enabled }}
# The pods on this node (fieldSelector spec.nodeName), one watch for: the step metrics' job labels,
# which jobs have local pods (datatrace switch files), the TaskD proxy's check that a connecting
# process belongs to a pod of its job. The agent only lists and watches.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
{{- end }}
{{- if and $a.datatrace.enabled (not $a.datatrace.namespaces) }}
{{- include "npu-node-agent.datatraceRules" . }}
{{- end }}
# This node's NPUProblem condition (kubectl describe node): a strategic merge patch of the node's
# status naming only that condition, so the kubelet's conditions stay; with node_condition off, one
# patch at start removes a condition an earlier run left. The agent never reads or replaces nodes.
- apiGroups: [""]
  resources: [nodes/status]
  verbs: [patch]
{{- if $a.kubernetes.events }}
# Events on this node and on the pods holding its NPUs (kubectl get events): created, and patched
# when they repeat (count, lastTimestamp), as client-go's event recorder does.
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
# The uid of a pod holding a faulty NPU, read once per pod, so that its events show in kubectl
# describe pod.
- apiGroups: [""]
  resources: [pods]
  verbs: [get]
{{- end }}
{{- if include "npu-node-agent.tokenAuth" . }}
# Each scrape of /metrics: is its bearer token valid (TokenReview), and may that user GET /metrics
# (SubjectAccessReview)? The agent only creates these reviews; the API server stores nothing.
- apiGroups: [authentication.k8s.io]
  resources: [tokenreviews]
  verbs: [create]
- apiGroups: [authorization.k8s.io]
  resources: [subjectaccessreviews]
  verbs: [create]
{{- end }}
{{- end -}}
{{- end -}}

{{/* Datatrace's ConfigMap watch: in the ClusterRole, or in a Role per agent.datatrace.namespaces entry.
     RBAC cannot narrow it further: resourceNames do not restrict list/watch, nor can a rule
     select by label (data-trace-<job>, reset=true). */}}
{{- define "npu-node-agent.datatraceRules" }}
# data-trace-<job> ConfigMaps (label reset=true): the switch files' content.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [list, watch]
{{- end -}}

{{- define "npu-node-agent.deviceInfoRules" -}}
{{- if and .Values.agent.kubernetes.enabled .Values.agent.kubernetes.device_info_configmap }}
# kube-system/mindx-dl-deviceinfo-<node>: the agent replaces it (update), and creates it on 404.
# Neither can be narrowed here: create takes no resourceNames, and the names hold the nodes, which
# one Role for every node of a DaemonSet cannot list. The ValidatingAdmissionPolicy (>= 1.30)
# narrows each agent to its own node's ConfigMap.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [create, update]
{{- end -}}
{{- end -}}

{{/* A RoleBinding or ClusterRoleBinding of the agent's service account (or of `subjects`), to the
     Role or ClusterRole of the same name: dict "root" $ "kind" "RoleBinding" "name" N
     ["namespace" NS] ["subjects" LIST]. */}}
{{- define "npu-node-agent.binding" -}}
{{- $root := .root -}}
apiVersion: rbac.authorization.k8s.io/v1
kind: {{ .kind }}
metadata:
  name: {{ .name }}
  {{- with .namespace }}
  namespace: {{ . }}
  {{- end }}
  labels:
    {{- include "npu-node-agent.labels" $root | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: {{ trimSuffix "Binding" .kind }}
  name: {{ .name }}
subjects:
  {{- if .subjects }}
  {{- toYaml .subjects | nindent 2 }}
  {{- else }}
  - kind: ServiceAccount
    name: {{ include "npu-node-agent.serviceAccountName" $root }}
    namespace: {{ $root.Release.Namespace }}
  {{- end }}
{{- end -}}

{{/* Why the container runs as root, one word per feature ("" = it does not). Shown on the pod as
     an annotation, so `kubectl describe` tells an operator what to switch off to drop root. */}}
{{- define "npu-node-agent.rootReasons" -}}
{{- $a := .Values.agent -}}
{{- $r := list -}}
{{- if eq $a.devices.backend "dcmi" -}}{{- $r = append $r "dcmi-devices" -}}{{- end -}}
{{- if $a.taskd_proxy.enabled -}}{{- $r = append $r "taskd-proxy" -}}{{- end -}}
{{- if $a.kubernetes.pod_resources_socket -}}{{- $r = append $r "kubelet-pod-resources" -}}{{- end -}}
{{- if $a.profiling.disk_guard -}}{{- $r = append $r "profiling-disk-guard" -}}{{- end -}}
{{- if $a.datatrace.enabled -}}{{- $r = append $r "datatrace" -}}{{- end -}}
{{- join "," $r -}}
{{- end -}}

{{/* The container's securityContext: as little as the enabled features allow.
     - dcmi backend: privileged (the /dev/davinci* devices), root;
     - TaskD proxy: root + SYS_PTRACE and DAC_READ_SEARCH, to read other users' /proc/<pid>/fd and
       /proc/<pid>/environ;
     - disk guard: root + DAC_OVERRIDE, to delete record files in training processes' directories;
     - kubelet pod-resources socket, datatrace: root (root-owned socket and host directories);
     - otherwise uid 65532, and an init container hands state_dir over to it. */}}
{{- define "npu-node-agent.securityContext" -}}
{{- $a := .Values.agent -}}
{{- $ctx := dict "readOnlyRootFilesystem" true -}}
{{- if and (eq $a.devices.backend "dcmi") .Values.dcmi.privileged -}}
{{- $_ := set $ctx "privileged" true -}}
{{- $_ = set $ctx "runAsUser" 0 -}}
{{- $_ = set $ctx "runAsNonRoot" false -}}
{{- else -}}
{{- $caps := list -}}
{{- if $a.taskd_proxy.enabled -}}{{- $caps = concat $caps (list "SYS_PTRACE" "DAC_READ_SEARCH") -}}{{- end -}}
{{- if $a.profiling.disk_guard -}}{{- $caps = append $caps "DAC_OVERRIDE" -}}{{- end -}}
{{- $_ := set $ctx "allowPrivilegeEscalation" false -}}
{{- $_ = set $ctx "capabilities" (dict "drop" (list "ALL")) -}}
{{- if $caps -}}{{- $_ = set $ctx.capabilities "add" $caps -}}{{- end -}}
{{- if include "npu-node-agent.rootReasons" . -}}
{{- $_ = set $ctx "runAsUser" 0 -}}
{{- $_ = set $ctx "runAsNonRoot" false -}}
{{- else -}}
{{- $_ = set $ctx "runAsUser" 65532 -}}
{{- $_ = set $ctx "runAsGroup" 65532 -}}
{{- $_ = set $ctx "runAsNonRoot" true -}}
{{- end -}}
{{- end -}}
{{- toYaml (mergeOverwrite $ctx .Values.containerSecurityContext) -}}
{{- end -}}
