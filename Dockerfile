# syntax=docker/dockerfile:1
# npu-node-agent image, for linux/amd64 and linux/arm64:
#   .ci/image                 podman, no Docker engine or registry; smoke-tests both, release in dist/
#   docker buildx build --platform linux/amd64,linux/arm64 -t <registry>/npu-node-agent:0.1.0 --push .
# (docs/image.md). The build steps live in .ci/build-image, so they run (and are tested) without
# any container tool.
#
# What each feature needs from the pod (the Helm chart sets exactly this; see
# helm/npu-node-agent/README.md):
#   - devices.backend dcmi (the default): the /dev/davinci*, /dev/davinci_manager, /dev/devmm_svm
#     and /dev/hisi_hdc devices, in practice a privileged container (root), as the Ascend Device
#     Plugin and NodeD run; and the driver mounted read-only at /usr/local/Ascend/driver (plus
#     /usr/local/dcmi where the driver installs libdcmi.so there). LD_LIBRARY_PATH below covers both.
#   - taskd_proxy: hostNetwork (training pods' 127.0.0.1:9602 must be the agent), hostPID and root
#     with CAP_SYS_PTRACE + CAP_DAC_READ_SEARCH (it reads /proc/net/tcp and the /proc/<pid>/fd and
#     /proc/<pid>/environ of other users' processes to tell which job a connection belongs to).
#   - pod attribution: the kubelet's /var/lib/kubelet/pod-resources mounted read-only; its socket
#     is root's, so root.
#   - profiling disk guard: the profiling hostPath read-write, root + CAP_DAC_OVERRIDE (it deletes
#     files the training processes wrote); datatrace: its hostPath read-write, root.
#   - everything else (e.g. the simulated backend with step metrics): the default non-root user.
# The agent writes only under state_dir and those mounted paths: the root filesystem can be
# read-only (Python's bytecode is compiled at build time).

ARG PYTHON_VERSION=3.11
ARG DEBIAN=bookworm

# Builder: the full image has the C compiler and headers for agent._native.
FROM python:${PYTHON_VERSION}-${DEBIAN} AS builder
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY agent ./agent
COPY native ./native
COPY .ci/build-image ./.ci/build-image
RUN bash .ci/build-image wheel /wheels

# Runtime: the same Python and Debian release as the builder, so the extension's ABI matches.
FROM python:${PYTHON_VERSION}-slim-${DEBIAN}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONFAULTHANDLER=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LD_LIBRARY_PATH=/usr/local/Ascend/driver/lib64/driver:/usr/local/Ascend/driver/lib64/common:/usr/local/dcmi
# The wheel and the script are bind-mounted for this step only: neither stays in a layer.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    --mount=type=bind,source=.ci/build-image,target=/usr/local/lib/build-image \
    bash /usr/local/lib/build-image install /wheels/npu_node_agent-*.whl \
 && bash /usr/local/lib/build-image layout /

# Non-root by default; the chart switches to root only for the features listed above.
USER 65532:65532
WORKDIR /var/lib/npu-node-agent
EXPOSE 9410 9411
# Docker only (Kubernetes uses the chart's probes); slim has no curl. Assumes the default http.listen;
# HTTPS when tls.cert_file is set (like the kubelet's probes, without verifying the certificate).
HEALTHCHECK --interval=30s --timeout=5s --start-period=15s --retries=3 \
  CMD ["python", "-c", "import ssl, sys, urllib.request as u\ntry: s = u.urlopen('http://127.0.0.1:9410/healthz', timeout=2).status\nexcept OSError: s = u.urlopen('https://127.0.0.1:9410/healthz', timeout=2, context=ssl._create_unverified_context()).status\nsys.exit(s != 200)"]
ENTRYPOINT ["npu-node-agent"]
CMD ["run", "--config", "/etc/npu-node-agent/config.yaml"]
