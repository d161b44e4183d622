"""The Kubernetes API client: in-cluster configuration, else $KUBECONFIG (or ~/.kube/config)."""

from __future__ import annotations

import os

from kubernetes import client, config

REQUEST_TIMEOUT_S = 10.0  # every call gets a client-side time-out: a dead connection must not hang


class KubeUnavailable(Exception):
    pass


def core_api(environ=os.environ) -> client.CoreV1Api:
    try:
        if environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
            return client.CoreV1Api()
        api_client = config.new_client_from_config(config_file=environ.get("KUBECONFIG") or None)
        return client.CoreV1Api(api_client)
    except (config.ConfigException, OSError, TypeError, ValueError) as exc:
        raise KubeUnavailable(f"no Kubernetes configuration (in-cluster or $KUBECONFIG): {exc}") from None
