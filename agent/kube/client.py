"""The Kubernetes API client: in-cluster configuration, else $KUBECONFIG (or ~/.kube/config)."""

from __future__ import annotations

import os

from kubernetes import client, config

REQUEST_TIMEOUT_S = 10.0  # every call gets a client-side time-out: a dead connection must not hang


class KubeUnavailable(Exception):
    pass


def api_client(environ=os.environ) -> client.ApiClient:
    """A client of the API server, for any of the client's API classes (reads files: call it off the loop)."""
    try:
        if environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()  # the service account's token, re-read as the kubelet rotates it
            return client.ApiClient()
        return config.new_client_from_config(config_file=environ.get("KUBECONFIG") or None)
    except (config.ConfigException, OSError, TypeError, ValueError) as exc:
        raise KubeUnavailable(f"no Kubernetes configuration (in-cluster or $KUBECONFIG): {exc}") from None


def core_api(environ=os.environ) -> client.CoreV1Api:
    return client.CoreV1Api(api_client(environ))
