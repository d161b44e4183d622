"""The API server's TokenReview and SubjectAccessReview, asked for agent.tokenauth.

The client is blocking: agent.tokenauth runs these calls in the executor's kube lane. Every failure
(refused, timed out, an error status, an answer of the wrong shape) is a ReviewFailed whose message
is the API server's word, never the token (the TokenReview's answer echoes it: it is never logged).
"""

from __future__ import annotations

import json
import threading
from typing import Callable

import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from agent.kube.client import KubeUnavailable, api_client
from agent.tokenauth import AccessReview, ReviewFailed, TokenReview, User, redact


class KubeReviewer:
    """An agent.tokenauth.Reviewer."""

    def __init__(self, api_factory: Callable[[], client.ApiClient] = api_client):
        self._api_factory = api_factory
        self._api: client.ApiClient | None = None
        self._lock = threading.Lock()  # two first reviews at once build one client

    def review_token(self, token: str, timeout_s: float) -> TokenReview:
        body = client.V1TokenReview(api_version="authentication.k8s.io/v1", kind="TokenReview",
                                    spec=client.V1TokenReviewSpec(token=token))
        status = self._create(lambda api: client.AuthenticationV1Api(api).create_token_review(
            body, _request_timeout=timeout_s), token).status
        if status is None or not status.authenticated or status.user is None:
            return TokenReview(None, (status.error if status else "") or "")
        info = status.user
        extra = tuple(sorted((key, tuple(values or ())) for key, values in (info.extra or {}).items()))
        return TokenReview(User(info.username or "", info.uid or "", tuple(info.groups or ()), extra))

    def review_access(self, user: User, path: str, verb: str, timeout_s: float) -> AccessReview:
        spec = client.V1SubjectAccessReviewSpec(
            user=user.name, uid=user.uid or None, groups=list(user.groups) or None,
            extra={key: list(values) for key, values in user.extra} or None,
            non_resource_attributes=client.V1NonResourceAttributes(path=path, verb=verb))
        body = client.V1SubjectAccessReview(api_version="authorization.k8s.io/v1", kind="SubjectAccessReview",
                                            spec=spec)
        status = self._create(lambda api: client.AuthorizationV1Api(api).create_subject_access_review(
            body, _request_timeout=timeout_s)).status
        if status is None:
            return AccessReview(False, "no status in the answer")
        # `denied` is an authorizer's explicit no; allowed and denied at once is no too (the kubelet errs).
        return AccessReview(bool(status.allowed) and not status.denied, status.reason or status.evaluation_error or "")

    def _create(self, call: Callable[[client.ApiClient], object], token: str = ""):
        try:
            with self._lock:
                if self._api is None:
                    self._api = self._api_factory()
            return call(self._api)
        except ApiException as exc:
            raise ReviewFailed(redact(f"{exc.status} {exc.reason}: {status_message(exc.body)}", token)) from None
        except (KubeUnavailable, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
            raise ReviewFailed(redact(f"{type(exc).__name__}: {exc}", token)) from None


def status_message(body: object) -> str:
    """The message of a metav1.Status body, or nothing."""
    try:
        return str(json.loads(body).get("message", ""))[:300]
    except (TypeError, ValueError, AttributeError):
        return ""
