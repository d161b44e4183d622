"""What the agent's writers (the node condition, Events) share about one Kubernetes call: the patch
type they send, the times they write, and what a failure means (retry it or not, and one line that
says what happened, with the API server's own message)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone

import urllib3
from kubernetes.client.rest import ApiException

from agent.common.executor import CallTimeout
from agent.kube.client import KubeUnavailable

# The Python client picks a patch's content type from the body and its version; the agent names it.
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
# What a call may raise: the API server's answer, no configuration, the client library's own
# errors (connection refused, reset, read time-out), a body that does not parse, the lane's time-out.
FAILURES = (ApiException, KubeUnavailable, urllib3.exceptions.HTTPError, OSError, ValueError, CallTimeout)


# A status cause the API server's NamespaceLifecycle admission adds to the 403 refusing a create in a
# namespace being deleted (client-go's recorder drops such events quietly).
NAMESPACE_TERMINATING = "NamespaceTerminating"


@dataclass(frozen=True)
class Failure:
    status: int  # the HTTP status, 0 when the API server did not answer
    text: str  # e.g. "403 Forbidden: nodes "n1" is forbidden: User ... cannot patch resource ..."
    kind: str = ""  # details.kind of the API server's Status: the resource it is about ("namespaces")
    causes: tuple[str, ...] = ()  # details.causes[].reason, e.g. NamespaceTerminating

    @property
    def retryable(self) -> bool:
        """Another try may work: no answer, a time-out, throttling (429) or a server error (5xx)."""
        return self.status == 0 or self.status == 429 or self.status >= 500

    @property
    def forbidden(self) -> bool:
        """Refused by authorisation (a missing grant), not because the namespace is being deleted."""
        return self.status == 403 and NAMESPACE_TERMINATING not in self.causes

    @property
    def namespace_gone(self) -> bool:
        """The namespace is being deleted (403 with that cause) or does not exist (404 about it)."""
        return ((self.status == 403 and NAMESPACE_TERMINATING in self.causes)
                or (self.status == 404 and self.kind == "namespaces"))


def failure(exc: BaseException) -> Failure:
    if isinstance(exc, ApiException) and exc.status:
        status: dict = {}
        try:
            parsed = json.loads(exc.body or "")
            status = parsed if isinstance(parsed, dict) else {}
        except ValueError:
            pass
        message = str(status.get("message") or "")
        details = status.get("details") if isinstance(status.get("details"), dict) else {}
        causes = tuple(str(cause.get("reason") or "") for cause in details.get("causes") or ()
                       if isinstance(cause, dict))
        text = f"{exc.status} {exc.reason or ''}".strip()
        return Failure(exc.status, f"{text}: {message[:300]}" if message else text, str(details.get("kind") or ""),
                       causes)
    return Failure(0, f"{type(exc).__name__}: {str(exc)[:300]}")


def kube_time(seconds: float) -> str:
    """A metav1.Time as the API server writes it (RFC 3339, whole seconds, UTC)."""
    return datetime.fromtimestamp(int(seconds), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
