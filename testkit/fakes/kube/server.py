"""A small in-process stand-in for the Kubernetes API server (core/v1 ConfigMaps, Pods, Nodes and
Events, TokenReviews and SubjectAccessReviews).

It speaks just enough of the REST protocol for the official ``kubernetes`` Python client
(``CoreV1Api``, ``AuthenticationV1Api``, ``AuthorizationV1Api`` and ``kubernetes.watch.Watch``) to
be pointed at it over a real socket: CRUD, list with label/field selectors, and watch streams with
resourceVersion resume and 410 expiry.  Standard library only, so it can run anywhere the tests run.

Patches as the API server applies them: strategic merge patch (lists with a merge key, such as a
Node's `status.conditions` by `type`, merge item by item; `$patch: delete|replace`,
`$setElementOrder/<list>`, `$deleteFromPrimitiveList/<list>`, `$retainKeys`), JSON merge patch
(RFC 7386) and JSON patch (RFC 6902); any other content type is a 415. A PUT or PATCH whose result
carries a `metadata.resourceVersion` other than the stored one is a 409 Conflict. Nodes are
cluster-scoped; their `status` is written only through the `nodes/{name}/status` subresource (RBAC
resource `nodes/status`), their spec and metadata only through the node itself, as the real
strategies do. Events are validated as core/v1 Events are (the event's namespace must be the
involved object's, or `default` for a cluster-scoped object) and expire `event_ttl` seconds after
their last write (the API server's --event-ttl, 1 h by default) on the stand-in's `clock` (a test
may pass its own and move it; `expire_events()` expires every Event at once).

Namespaces, as the NamespaceLifecycle admission plugin sees them: `default`, `kube-system`,
`kube-public` and `kube-node-lease` exist from the start; `put()` of an object creates its namespace
(a test's setup), `add_namespace`, `terminate_namespace` and `delete_namespace` change them. A write
(create, update, patch) in a namespace that does not exist is a 404 NotFound about the namespace;
a create in one being terminated is a 403 Forbidden whose Status carries the cause
`NamespaceTerminating` (details.causes), as the real server answers.

Authentication and authorisation, as the real server does them: every request's bearer token is
looked up in the tokens a test configures (`add_token`); a token it does not know is a 401 on
every path, a request without one is `system:anonymous`. Authorisation is `AlwaysAllow` unless the
stand-in is made with `rbac=True`: then every request (a review's creation included) needs a rule
(`allow`) granting its caller the verb, and a 403 names what is missing. A TokenReview answers
with the token's user and audiences (echoing the token in `spec`, as the real server does); a
SubjectAccessReview with `allowed` (and the granting rule as `reason`) from the same rules, or
with nothing but `allowed: false` (RBAC has no opinion). Outage: `stop()` (connection refused),
`fail_next` (an error status), `hang` (a request held until `release()`).

Concurrency model: one Condition guards the whole state (objects, resourceVersion counter,
event history).  Every write appends to a bounded history ring and notifies; each watch
request runs in its own handler thread with a cursor into that history, so a slow watcher
never blocks writers and falls off the end of the ring exactly as it would against etcd.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import re
import secrets
import sys
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

# kind <-> REST resource name.  Anything else is an unknown path (404), like a missing API.
KINDS = {"ConfigMap": "configmaps", "Pod": "pods", "Node": "nodes", "Event": "events"}
RESOURCES = {resource: kind for kind, resource in KINDS.items()}
CLUSTER_SCOPED = {"Node"}  # no namespace: /api/v1/nodes/<name>
# Subresources served, by resource: a write through one changes only that part of the object.
SUBRESOURCES = {"nodes": ("status",)}
EVENT_TTL_S = 3600.0  # kube-apiserver --event-ttl
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")  # what a new cluster has
NAMESPACE_TERMINATING = "NamespaceTerminating"  # the StatusCause type NamespaceLifecycle adds

# Field selectors the real API server accepts for each resource (a subset).  An unsupported
# field is a 400 there too, which keeps a typo in product code from silently matching everything.
FIELDS = {
    "configmaps": ("metadata.name", "metadata.namespace"),
    "pods": ("metadata.name", "metadata.namespace", "spec.nodeName", "status.phase"),
    "nodes": ("metadata.name", "spec.unschedulable"),
    "events": ("metadata.name", "metadata.namespace", "involvedObject.kind", "involvedObject.namespace",
               "involvedObject.name", "involvedObject.uid", "involvedObject.apiVersion",
               "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason", "reportingComponent",
               "source", "type"),
}
# Field selector names that stand for another field (an Event's `source` is its source.component).
FIELD_ALIASES = {("events", "source"): "source.component"}

REASONS = {
    400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
    405: "MethodNotAllowed", 409: "Conflict", 410: "Expired", 415: "UnsupportedMediaType",
    422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
    504: "Timeout",
}

STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
_PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH)
_PATH = re.compile(r"^/api/v1/(?:namespaces/(?P<ns>[^/]+)/)?(?P<resource>[^/]+)"
                   r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?/?$")

# Lists a strategic merge patch merges item by item, by the key the API types declare
# (patchMergeKey), by kind and path ("*" is any item of a list). Any other list is replaced whole.
MERGE_KEYS = {
    "Node": {("status", "conditions"): "type", ("status", "addresses"): "type",
             ("metadata", "ownerReferences"): "uid"},
    "Pod": {("spec", "containers"): "name", ("spec", "initContainers"): "name", ("spec", "volumes"): "name",
            ("spec", "containers", "*", "env"): "name", ("spec", "containers", "*", "ports"): "containerPort",
            ("spec", "containers", "*", "volumeMounts"): "mountPath", ("status", "conditions"): "type",
            ("metadata", "ownerReferences"): "uid"},
}
# Lists of scalars a strategic merge patch merges as a set (patchStrategy merge without a key).
MERGED_SCALAR_LISTS = {("metadata", "finalizers")}

# The create-only review APIs: path -> (kind, API group, resource).
REVIEWS = {
    "/apis/authentication.k8s.io/v1/tokenreviews": ("TokenReview", "authentication.k8s.io", "tokenreviews"),
    "/apis/authorization.k8s.io/v1/subjectaccessreviews": ("SubjectAccessReview", "authorization.k8s.io",
                                                           "subjectaccessreviews"),
}
ANONYMOUS = {"username": "system:anonymous", "groups": ["system:unauthenticated"]}
# The API server's own audience (--api-audiences defaults to the service account issuer).
AUDIENCES = ("https://kubernetes.default.svc.cluster.local",)
_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


@dataclasses.dataclass(frozen=True)
class Rule:
    """One RBAC grant: a ClusterRole's rule bound to one user or group by a ClusterRoleBinding."""

    name: str
    subject: tuple[str, str]  # ("User" or "Group", name)
    verbs: tuple[str, ...]
    paths: tuple[str, ...] = ()  # nonResourceURLs: exact, "*", or a prefix ending in "*"
    resources: tuple[str, ...] = ()  # "configmaps", "tokenreviews.authentication.k8s.io", "*"

    def grants(self, user: dict, verb: str, path: str | None = None, resource: str | None = None) -> bool:
        kind, name = self.subject
        if not (name == user.get("username") if kind == "User" else name in (user.get("groups") or ())):
            return False
        if "*" not in self.verbs and verb not in self.verbs:
            return False
        if path is not None:  # RBAC's NonResourceURLMatches
            return any(url == "*" or url == path or (url.endswith("*") and path.startswith(url[:-1]))
                       for url in self.paths)
        return "*" in self.resources or resource in self.resources


def _kind_of(kind_or_resource: str) -> str:
    """Accept 'ConfigMap' or 'configmaps' (any served kind) from test code."""
    if kind_or_resource in KINDS:
        return kind_or_resource
    if kind_or_resource in RESOURCES:
        return RESOURCES[kind_or_resource]
    raise ValueError(f"unsupported kind {kind_or_resource!r}; expected one of {sorted(KINDS)}")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_body(code: int, message: str, reason: str | None = None,
                name: str | None = None, resource: str | None = None, causes: list | None = None) -> dict:
    """A metav1.Status failure, the body every API error carries."""
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason or REASONS.get(code, "Unknown"), "code": code}
    if name is not None or resource is not None:
        body["details"] = {"name": name, "kind": resource}
    if causes:
        body.setdefault("details", {})["causes"] = causes
    return body


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def validate_event(event: dict) -> None:
    """A core/v1 Event as the API server validates one written without eventTime (the legacy
    recorder's kind): the involved object's namespace must be the event's, and an event about a
    cluster-scoped object (no namespace, e.g. a Node) lives in `default`; a 422 otherwise."""
    meta = event.get("metadata") or {}
    involved = event.get("involvedObject") if isinstance(event.get("involvedObject"), dict) else {}
    problems = []
    name = meta.get("name") or ""
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        problems.append(f'metadata.name: Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of '
                        "lower case alphanumeric characters, '-' or '.'")
    namespace, wanted = meta.get("namespace") or "", involved.get("namespace") or ""
    if (wanted and namespace != wanted) or (not wanted and namespace not in ("", "default")):
        problems.append(f'involvedObject.namespace: Invalid value: "{wanted}": does not match event.namespace')
    if len(event.get("reportingInstance") or "") > 128:
        problems.append("reportingInstance: Too long: may not be more than 128 bytes")
    if problems:
        raise ApiError(422, f'Event "{name}" is invalid: {"; ".join(problems)}', "Invalid", name=name,
                       resource="events")


class ApiError(Exception):
    """Raised inside request handling; turned into a Status response."""

    def __init__(self, code: int, message: str, reason: str | None = None,
                 name: str | None = None, resource: str | None = None, causes: list | None = None):
        super().__init__(message)
        self.body = status_body(code, message, reason, name, resource, causes)
        self.code = code


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch: maps merge, null deletes a key, anything else (lists too) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _bad_patch(message: str) -> ApiError:
    return ApiError(400, f"the strategic merge patch is invalid: {message}")


def strategic_merge_patch(target, patch, kind: str, path: tuple = ()):
    """Kubernetes' strategic merge patch of one map (None: the map is deleted by `$patch: delete`).

    Like a merge patch, except: a list with a merge key (MERGE_KEYS) merges by it, an item naming
    `$patch: delete` removes the item with its key, `$patch: replace` replaces the list or map it
    is in; `$setElementOrder/<list>` orders the merged list, `$deleteFromPrimitiveList/<list>`
    removes scalars from a merged one, `$retainKeys` drops the keys it does not name."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return {key: copy.deepcopy(value) for key, value in patch.items() if key != "$patch"}
    if directive not in (None, "merge"):
        raise _bad_patch(f"unknown patch type {directive!r} at {'.'.join(path) or 'the top'}")
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    orders, retain = {}, None
    for key, value in patch.items():
        if key == "$patch":
            continue
        if key == "$retainKeys":
            retain = value
            continue
        if key.startswith("$setElementOrder/"):
            orders[key.partition("/")[2]] = value
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.partition("/")[2]
            if not isinstance(value, list):
                raise _bad_patch(f"{key} must be a list")
            result[name] = [item for item in result.get(name) or [] if item not in value]
            continue
        here = (*path, key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _merge_list(result.get(key), value, kind, here)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value, kind, here)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = value
    for name, order in orders.items():
        merge_key = MERGE_KEYS.get(kind, {}).get((*path, name))
        if merge_key and isinstance(result.get(name), list) and isinstance(order, list):
            rank = {item.get(merge_key): i for i, item in enumerate(order) if isinstance(item, dict)}
            result[name] = sorted(result[name], key=lambda item: rank.get(item.get(merge_key), len(rank)))
    if retain is not None:
        result = {key: value for key, value in result.items() if key in retain}
    return result


def _merge_list(current, patch: list, kind: str, path: tuple) -> list:
    merge_key = MERGE_KEYS.get(kind, {}).get(path)
    current = copy.deepcopy(current) if isinstance(current, list) else []
    if path in MERGED_SCALAR_LISTS:
        return current + [item for item in patch if item not in current]
    if merge_key is None:  # no merge strategy: the patch's list replaces the stored one
        return [_without_directives(item) for item in patch]
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [_without_directives(item) for item in patch if item.get("$patch") != "replace"]
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise _bad_patch(f"an item of {'.'.join(path)} does not contain declared merge key: {merge_key}")
        found = next((i for i, have in enumerate(current) if have.get(merge_key) == item[merge_key]), None)
        if item.get("$patch") == "delete":
            if found is not None:
                del current[found]
            continue
        if found is None:
            current.append(strategic_merge_patch({}, item, kind, (*path, "*")))
        else:
            current[found] = strategic_merge_patch(current[found], item, kind, (*path, "*"))
    return current


def _without_directives(value):
    if isinstance(value, dict):
        return {k: _without_directives(v) for k, v in value.items() if not k.startswith("$")}
    return copy.deepcopy(value)


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, f"the JSON patch path {path!r} does not start with /", "Invalid")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _parent(document, parts: list[str], path: str):
    node = document
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ApiError(422, f"the JSON patch path {path!r} does not exist", "Invalid")
    return node


def json_patch(document, operations: list):
    """RFC 6902 JSON patch: add, remove, replace, move, copy, test; a failing operation is a 422."""
    document = copy.deepcopy(document)

    def get(path):
        parts = _pointer(path)
        if not parts:
            return document
        parent, last = _parent(document, parts, path), parts[-1]
        if isinstance(parent, dict) and last in parent:
            return parent[last]
        if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
            return parent[int(last)]
        raise ApiError(422, f"the JSON patch path {path!r} does not exist", "Invalid")

    def remove(path):
        parts = _pointer(path)
        value = get(path)
        parent = _parent(document, parts, path)
        if isinstance(parent, dict):
            del parent[parts[-1]]
        else:
            del parent[int(parts[-1])]
        return value

    def add(path, value):
        nonlocal document
        parts = _pointer(path)
        if not parts:
            document = value
            return
        parent, last = _parent(document, parts, path), parts[-1]
        if isinstance(parent, dict):
            parent[last] = value
        elif isinstance(parent, list) and (last == "-" or (last.isdigit() and int(last) <= len(parent))):
            parent.insert(len(parent) if last == "-" else int(last), value)
        else:
            raise ApiError(422, f"the JSON patch path {path!r} does not exist", "Invalid")

    for operation in operations:
        if not isinstance(operation, dict) or "path" not in operation:
            raise ApiError(400, f"a JSON patch operation needs op and path: {operation!r}")
        op, path = operation.get("op"), operation["path"]
        if op == "add":
            add(path, copy.deepcopy(operation.get("value")))
        elif op == "remove":
            remove(path)
        elif op == "replace":
            remove(path)
            add(path, copy.deepcopy(operation.get("value")))
        elif op == "move":
            add(path, remove(operation.get("from", "")))
        elif op == "copy":
            add(path, copy.deepcopy(get(operation.get("from", ""))))
        elif op == "test":
            if get(path) != operation.get("value"):
                raise ApiError(422, f"the JSON patch test of {path!r} failed", "Invalid")
        else:
            raise ApiError(400, f"unknown JSON patch operation {op!r}")
    return document


# ----------------------------------------------------------------------------- selectors

def parse_label_selector(text: str | None):
    """Equality-based label selector -> list of (op, key, value).  Set-based syntax is a 400."""
    terms = []
    for raw in (text or "").split(","):
        term = raw.strip()
        if not term:
            continue
        m = re.fullmatch(r"([\w./-]+)\s*(!=|==|=)\s*([\w.-]*)", term)
        if m:
            key, op, value = m.groups()
            terms.append(("!=" if op == "!=" else "=", key, value))
        elif re.fullmatch(r"!\s*[\w./-]+", term):
            terms.append(("!exists", term[1:].strip(), None))
        elif re.fullmatch(r"[\w./-]+", term):
            terms.append(("exists", term, None))
        else:
            raise ApiError(400, f"unable to parse requirement: {term!r} (the stand-in supports "
                                "k=v, k==v, k!=v, k and !k)")
    return terms


def parse_field_selector(text: str | None, resource: str):
    terms = []
    for raw in (text or "").split(","):
        term = raw.strip()
        if not term:
            continue
        m = re.fullmatch(r"([\w.]+)\s*(!=|==|=)\s*(.*)", term)
        if not m:
            raise ApiError(400, f"invalid field selector: {term!r}")
        field, op, value = m.groups()
        if field not in FIELDS[resource]:
            raise ApiError(400, f'field label not supported: {field}')
        terms.append(("!=" if op == "!=" else "=", FIELD_ALIASES.get((resource, field), field), value))
    return terms


def _field_value(obj: dict, dotted: str) -> str:
    # Unset fields compare as "", as in the API server (so "spec.nodeName=" finds unscheduled pods).
    value = obj
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def matches(obj: dict, labels, fields) -> bool:
    obj_labels = (obj.get("metadata") or {}).get("labels") or {}
    for op, key, value in labels:
        if op == "exists" and key not in obj_labels:
            return False
        if op == "!exists" and key in obj_labels:
            return False
        # "!=" also matches objects without the label, as in Kubernetes.
        if op == "=" and obj_labels.get(key) != value:
            return False
        if op == "!=" and obj_labels.get(key) == value:
            return False
    for op, field, value in fields:
        if (_field_value(obj, field) == value) != (op == "="):
            return False
    return True


# ----------------------------------------------------------------------------- state

Event = collections.namedtuple("Event", "rv kind namespace obj prev")
"""One write: obj is None for a deletion; prev is the object before the write (None on create)."""


class _State:
    """Objects, the global resourceVersion and the event history, under one Condition."""

    def __init__(self, history: int, clock=time.monotonic):
        self.cond = threading.Condition()
        self.clock = clock
        self.namespaces: dict[str, str] = {name: "Active" for name in INITIAL_NAMESPACES}  # name -> phase
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.rv = 0
        self.history: collections.deque[Event] = collections.deque(maxlen=history)
        # Every event with rv > floor is still in history; a watch from below floor is expired.
        self.floor = 0
        self.stopping = False
        self.event_ttl = EVENT_TTL_S
        self.expiry: dict[tuple[str, str, str], float] = {}  # an Event's key -> clock() it expires

    def expire(self, everything: bool = False) -> None:
        """Delete the Events whose TTL passed (etcd's lease ran out), as deletions watchers see."""
        now = self.clock()
        for key in [key for key, at in self.expiry.items() if at <= now or everything]:
            del self.expiry[key]
            self.remove(*key)

    def admit(self, method: str, namespace: str, resource: str, name) -> None:
        """NamespaceLifecycle: no write in a namespace that does not exist, no create in one being deleted."""
        phase = self.namespaces.get(namespace)
        if phase is None:
            raise ApiError(404, f'namespaces "{namespace}" not found', name=namespace, resource="namespaces")
        if phase == "Terminating" and method == "POST":
            raise ApiError(403, f'{resource} "{name or ""}" is forbidden: unable to create new content in namespace '
                                f"{namespace} because it is being terminated", name=name or "", resource=resource,
                           causes=[{"reason": NAMESPACE_TERMINATING, "field": "metadata.namespace",
                                    "message": f"namespace {namespace} is being terminated"}])

    def _record(self, kind, namespace, obj, prev) -> None:
        if len(self.history) == self.history.maxlen:
            self.floor = self.history[0].rv  # about to be pushed out of the ring
        self.history.append(Event(self.rv, kind, namespace, obj, prev))
        self.cond.notify_all()

    def write(self, obj: dict, *, create: bool, update: bool) -> dict:
        """Store obj (already carrying kind/metadata.name/namespace); caller holds cond."""
        kind, meta = obj["kind"], obj["metadata"]
        key = (kind, meta.get("namespace", ""), meta["name"])
        prev = self.objects.get(key)
        resource = KINDS[kind]
        if prev is None and not create:
            raise ApiError(404, f'{resource} "{meta["name"]}" not found', name=meta["name"], resource=resource)
        if prev is not None and not update:
            raise ApiError(409, f'{resource} "{meta["name"]}" already exists', "AlreadyExists",
                           name=meta["name"], resource=resource)
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["apiVersion"] = "v1"
        meta = obj["metadata"]
        if prev is None:
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now()
        else:
            # Identity survives updates; a client cannot rewrite it.
            meta["uid"] = prev["metadata"]["uid"]
            meta["creationTimestamp"] = prev["metadata"]["creationTimestamp"]
        meta["resourceVersion"] = str(self.rv)
        self.objects[key] = obj
        if kind == "Event":  # every write renews the lease: the TTL counts from the last one
            self.expiry[key] = self.clock() + self.event_ttl
        self._record(kind, key[1], obj, prev)
        return copy.deepcopy(obj)

    def remove(self, kind: str, namespace: str, name: str) -> dict | None:
        prev = self.objects.pop((kind, namespace, name), None)
        if prev is None:
            return None
        self.expiry.pop((kind, namespace, name), None)
        self.rv += 1
        self._record(kind, namespace, None, prev)
        # The deleted object reports the deletion's resourceVersion, as the API server does.
        gone = copy.deepcopy(prev)
        gone["metadata"]["resourceVersion"] = str(self.rv)
        return gone

    def select(self, kind, namespace, labels=(), fields=()) -> list[dict]:
        found = [o for (k, ns, _), o in self.objects.items()
                 if k == kind and (namespace is None or ns == namespace) and matches(o, labels, fields)]
        found.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        return copy.deepcopy(found)


def watch_event(event: Event, kind, namespace, labels, fields) -> dict | None:
    """What a filtered watcher sees for one write, or None.

    Mirrors the API server's watch cache: an object entering the selector shows up as ADDED,
    one leaving it as DELETED (previous content, the write's resourceVersion).  This matters for
    pods watched by spec.nodeName, which enter the selector when they are scheduled.
    """
    if event.kind != kind or (namespace is not None and event.namespace != namespace):
        return None
    now = event.obj is not None and matches(event.obj, labels, fields)
    before = event.prev is not None and matches(event.prev, labels, fields)
    if now:
        return {"type": "MODIFIED" if before else "ADDED", "object": event.obj}
    if before:
        gone = copy.deepcopy(event.prev)
        gone["metadata"]["resourceVersion"] = str(event.rv)
        return {"type": "DELETED", "object": gone}
    return None


# ----------------------------------------------------------------------------- HTTP

class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, standin: "KubeStandIn"):
        self.standin = standin
        super().__init__(address, _Handler)

    def handle_error(self, request, client_address):
        # A client that hangs up (Watch.stop() shuts its socket down mid-stream) may reset the
        # connection under a kept-alive handler; that is normal, not worth a traceback on stderr.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 so watches can use chunked transfer encoding and connections are kept alive
    # between calls, as urllib3's pool expects.
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format, *args):  # noqa: A002 - keep pytest output clean
        pass

    def setup(self):
        super().setup()
        self.server.standin._track(self.connection, True)

    def finish(self):
        self.server.standin._track(self.connection, False)
        super().finish()

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_PATCH(self):
        self._dispatch("PATCH")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_OPTIONS(self):
        self._dispatch("OPTIONS")

    # -- plumbing

    def _send_json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self) -> bytes:
        # Always drain the body, even for an injected failure, so a kept-alive connection stays in sync.
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _dispatch(self, method: str) -> None:
        standin = self.server.standin
        standin._log(method, self.path)
        raw = self._read_body()
        try:
            injected = standin._take_failure(method, self.path)  # before a hold: a held request's fate is set
            if not standin._hold(method, self.path):  # stopped while held: no answer
                self.close_connection = True
                return
            if injected:
                raise ApiError(injected, f"injected failure ({injected}) for {method} {self.path}")
            caller = standin._authenticate(self.headers.get("Authorization") or "")
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
            body = None
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError as exc:
                    raise ApiError(400, f"invalid JSON body: {exc}") from None
            if url.path in REVIEWS:
                return self._review(method, REVIEWS[url.path], body, caller)
            m = _PATH.match(url.path)
            if not m or m["resource"] not in RESOURCES:
                raise ApiError(404, f"the server could not find the requested resource ({url.path})")
            ns, resource, name, sub = m["ns"], m["resource"], m["name"], m["sub"]
            cluster_scoped = RESOURCES[resource] in CLUSTER_SCOPED
            if (cluster_scoped and ns is not None) or (not cluster_scoped and ns is None and name is not None) or (
                    sub is not None and sub not in SUBRESOURCES.get(resource, ())):
                # /api/v1/configmaps/x is not a thing (items of a namespaced resource live under a
                # namespace), nor is a node under a namespace, nor a subresource the server lacks.
                raise ApiError(404, f"the server could not find the requested resource ({url.path})")
            verb = "list" if method == "GET" and name is None else _VERBS.get(method, method.lower())
            standin._authorize(caller, "watch" if verb == "list" and query.get("watch") in ("true", "1") else verb,
                               f"{resource}/{sub}" if sub else resource, "", ns)
            with standin._state.cond:
                standin._state.expire()
                if ns is not None and method in ("POST", "PUT", "PATCH"):
                    posted = (body.get("metadata") or {}).get("name") if isinstance(body, dict) else None
                    standin._state.admit(method, ns, resource, name or posted)
            if name is None:
                self._collection(method, ns, resource, query, body)
            else:
                self._item(method, ns or "", resource, name, body, sub)
        except ApiError as err:
            self._send_json(err.code, err.body)

    # -- reviews

    def _review(self, method, review, body, caller):
        kind, group, resource = review
        if method != "POST":  # create-only resources
            raise ApiError(405, "the server does not allow this method on the requested resource")
        standin = self.server.standin
        standin._authorize(caller, "create", resource, group, None)
        # Without kind and apiVersion the body is read as the path's type, as the real server does.
        if not isinstance(body, dict) or (body.get("kind", kind), body.get("apiVersion", f"{group}/v1")) != (
                kind, f"{group}/v1"):
            raise ApiError(400, f"the body must be a {group}/v1 {kind}")
        if kind == "SubjectAccessReview" and body.get("metadata") not in (None, {}):
            raise ApiError(422, f'{kind}.{group} "" is invalid: metadata: Invalid value: '
                                f'{json.dumps(body["metadata"])}: must be empty', "Invalid")
        spec = body.get("spec") if isinstance(body.get("spec"), dict) else {}
        status = standin._token_review(spec) if kind == "TokenReview" else standin._access_review(spec)
        # The real server answers with the object it was given (token included) and its status.
        self._send_json(201, {"kind": kind, "apiVersion": f"{group}/v1", "metadata": {"creationTimestamp": None},
                              "spec": spec, "status": status})

    # -- collections

    def _collection(self, method, ns, resource, query, body):
        kind = RESOURCES[resource]
        if method == "GET":
            labels = parse_label_selector(query.get("labelSelector"))
            fields = parse_field_selector(query.get("fieldSelector"), resource)
            if query.get("watch") in ("true", "1"):
                return self._watch(kind, ns, labels, fields, query)
            state = self.server.standin._state
            with state.cond:
                items, rv = state.select(kind, ns, labels, fields), state.rv
            return self._send_json(200, {"kind": f"{kind}List", "apiVersion": "v1",
                                         "metadata": {"resourceVersion": str(rv)}, "items": items})
        if method == "POST" and (ns is not None or kind in CLUSTER_SCOPED):
            if not isinstance(body, dict):
                raise ApiError(400, "request body must be a JSON object")
            meta = body.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
            if not meta.get("name"):
                raise ApiError(400, "metadata.name: Required value: name or generateName is required",
                               "Invalid")
            if kind in CLUSTER_SCOPED:
                meta.pop("namespace", None)
            else:
                meta["namespace"] = ns  # the path wins
            body["kind"] = kind
            if kind == "Event":
                validate_event(body)
            state = self.server.standin._state
            with state.cond:
                stored = state.write(body, create=True, update=False)
            return self._send_json(201, stored)
        raise ApiError(405, f"{method} is not supported on {resource} collections by the stand-in")

    # -- items

    def _item(self, method, ns, resource, name, body, sub=None):
        kind = RESOURCES[resource]
        key = (kind, ns, name)
        state = self.server.standin._state
        not_found = ApiError(404, f'{resource} "{name}" not found', name=name, resource=resource)
        conflict = ApiError(409, f'Operation cannot be fulfilled on {resource} "{name}": the object '
                                 "has been modified; please apply your changes to the latest version "
                                 "and try again", "Conflict", name=name, resource=resource)
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        if method == "PATCH" and ctype not in _PATCH_TYPES:
            # The API server also takes application/apply-patch+yaml (server-side apply); the stand-in does not.
            raise ApiError(415, f"the body of the request was in an unknown format - accepted media types "
                                f"include: {', '.join(_PATCH_TYPES)} (not {ctype!r})")
        if method == "PATCH" and ctype == JSON_PATCH:
            if not isinstance(body, list):
                raise ApiError(400, "a JSON patch must be a list of operations")
        elif method in ("PUT", "PATCH") and not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        if sub is not None and method not in ("GET", "PUT", "PATCH"):
            raise ApiError(405, f"{method} is not supported on {resource}/{sub}")

        with state.cond:
            current = state.objects.get(key)
            if method == "GET":
                if current is None:
                    raise not_found
                stored = copy.deepcopy(current)
            elif method == "DELETE":
                if current is None:
                    raise not_found
                pre = (body or {}).get("preconditions") or {}
                if pre.get("resourceVersion") not in (None, current["metadata"]["resourceVersion"]):
                    raise conflict
                if pre.get("uid") not in (None, current["metadata"]["uid"]):
                    raise conflict
                stored = state.remove(*key)
            elif method in ("PUT", "PATCH"):
                if current is None:
                    raise not_found
                if method == "PUT":
                    new = copy.deepcopy(body)
                elif ctype == JSON_PATCH:
                    new = json_patch(current, body)
                elif ctype == MERGE_PATCH:
                    new = merge_patch(current, body)
                else:
                    new = strategic_merge_patch(current, body, kind)
                if not isinstance(new, dict):
                    raise ApiError(422, f"the patched {resource} is not an object", "Invalid")
                meta = new.get("metadata") if isinstance(new.get("metadata"), dict) else {}
                if meta.get("name") not in (None, name):
                    raise ApiError(400, f"the name of the object ({meta['name']}) does not match the "
                                        f"name on the URL ({name})")
                # A resourceVersion in the body (or left in the patched object by the patch) is an
                # optimistic-concurrency precondition; without one the write is unconditional.
                wanted = meta.get("resourceVersion")
                if wanted is not None and wanted != current["metadata"]["resourceVersion"]:
                    raise conflict
                if sub == "status":  # the status subresource writes the status and nothing else
                    new = {**copy.deepcopy(current), "status": new.get("status") or {}}
                elif kind in CLUSTER_SCOPED:  # a write of the node itself leaves its status as it was
                    if "status" in current:
                        new["status"] = copy.deepcopy(current["status"])
                    else:
                        new.pop("status", None)
                new["kind"] = kind
                new_meta = new.setdefault("metadata", {})
                new_meta.update(name=name)
                if kind in CLUSTER_SCOPED:
                    new_meta.pop("namespace", None)
                else:
                    new_meta["namespace"] = ns
                if new == current:  # a no-op write is not stored: no new resourceVersion, no watch event
                    stored = copy.deepcopy(current)
                else:
                    if kind == "Event":
                        validate_event(new)
                    stored = state.write(new, create=False, update=True)
            else:
                raise ApiError(405, f"{method} is not supported on {resource} by the stand-in")
        self._send_json(200, stored)

    # -- watch

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _watch(self, kind, ns, labels, fields, query):
        state = self.server.standin._state
        timeout = query.get("timeoutSeconds") or ""
        start = query.get("resourceVersion") or "0"
        if not (timeout == "" or timeout.isdigit()) or not start.isdigit():
            raise ApiError(400, f"invalid timeoutSeconds {timeout!r} or resourceVersion {start!r}")
        deadline = time.monotonic() + int(timeout) if timeout else None
        start = int(start)

        pending: list[dict] = []
        with state.cond:
            if start == 0:
                # No resourceVersion: synthetic ADDED for the current state, then changes after it.
                pending = [{"type": "ADDED", "object": o} for o in state.select(kind, ns, labels, fields)]
                cursor = state.rv
            else:
                cursor = start
            expired = cursor < state.floor
            floor = state.floor
            self.server.standin._watchers += 1

        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:
                if expired:
                    # The client's Watch turns this ERROR event into ApiException(410); the
                    # API server sends it inside a 200 stream, not as an HTTP status.
                    pending.append({"type": "ERROR", "object": status_body(
                        410, f"too old resource version: {cursor} ({floor})", "Expired")})
                for event in pending:
                    self._chunk(json.dumps(event).encode() + b"\n")
                if expired:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                with state.cond:
                    state.cond.wait_for(lambda: state.stopping or state.rv > cursor, remaining)
                    if state.stopping:
                        break
                    expired, floor = cursor < state.floor, state.floor
                    events = [e for e in state.history if e.rv > cursor]
                    cursor = max(cursor, state.rv)
                pending = [] if expired else [
                    ev for ev in (watch_event(e, kind, ns, labels, fields) for e in events) if ev]
            self.wfile.write(b"0\r\n\r\n")  # a clean end of the chunked body
            self.wfile.flush()
        except OSError:
            self.close_connection = True  # the client went away (e.g. Watch.stop())
        finally:
            with state.cond:
                self.server.standin._watchers -= 1
                state.cond.notify_all()
        if state.stopping:
            self.close_connection = True


class KubeStandIn:
    """A core/v1 ConfigMap, Pod, Node and Event API server with token and access reviews for tests.
    See the module docstring."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, history: int = 1000, rbac: bool = False,
                 event_ttl: float = EVENT_TTL_S, clock=time.monotonic):
        """`clock`: seconds on any scale, for the Events' TTL only."""
        self._address = (host, port)
        self._state = _State(history, clock)
        self._state.event_ttl = event_ttl
        self._watchers = 0  # open watch streams, guarded by _state.cond
        self._lock = threading.Condition()  # requests log, failure injections, open connections, auth, holds
        self._requests: list[tuple[str, str]] = []
        self._failures: list[list] = []  # [method, compiled regex, status, remaining]
        self._holds: list[list] = []  # [method, compiled regex, remaining]
        self._held = 0  # requests being held now
        self._released = 0  # release() calls: a held request goes on once this moves
        self._stops = 0  # stop() calls: a held request ends unanswered once this moves
        self._connections: set[socket.socket] = set()
        self._tokens: dict[str, dict] = {}  # bearer token -> user (username, uid, groups, extra), audiences, error
        self._rules: list[Rule] = []
        self.rbac = rbac  # False: AlwaysAllow
        self.audiences = list(AUDIENCES)
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle

    def start(self) -> "KubeStandIn":
        """Start serving; after a stop(), on the same port with the same state (like a restarted API server)."""
        with self._state.cond:
            self._state.stopping = False
        self._httpd = _Server(self._address, self)
        self._address = (self._address[0], self._httpd.server_address[1])
        # A short poll interval keeps stop() quick; shutdown() waits for one poll.
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="kube-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        state = self._state
        with state.cond:
            state.stopping = True
            state.cond.notify_all()
            # Let open watches finish their chunked bodies, so clients see a clean end of stream.
            state.cond.wait_for(lambda: self._watchers == 0, timeout=2)
        self._httpd.shutdown()
        # Idle keep-alive connections would otherwise keep their handler threads blocked on read.
        with self._lock:
            self._stops += 1  # held requests end without an answer
            self._lock.notify_all()
            for conn in list(self._connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._httpd.server_close()
        self._thread.join(timeout=5)
        self._httpd = self._thread = None

    def __enter__(self) -> "KubeStandIn":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self._address[0]}:{self.port}"

    def api_client(self, token: str = ""):
        """The official client's ApiClient for this server, as anonymous or with a bearer token
        (imported lazily: the server is stdlib only)."""
        from kubernetes import client as k8s

        config = k8s.Configuration()
        config.host = self.url
        config.proxy = None  # never route loopback through a proxy from the environment
        if token:
            config.api_key = {"authorization": token}
            config.api_key_prefix = {"authorization": "Bearer"}
        return k8s.ApiClient(config)

    def client(self, token: str = "", api: str = "CoreV1Api"):
        """One of the client's API classes (by name) talking to this server."""
        from kubernetes import client as k8s

        return getattr(k8s, api)(self.api_client(token))

    def write_kubeconfig(self, path, token: str = "") -> str:
        """A kubeconfig naming this server (and the caller's bearer token) at `path`; returns the path."""
        user = {"token": token} if token else {}
        Path(path).write_text(json.dumps({  # JSON is YAML
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": user}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
        return str(path)

    # -- who is who (authentication) and who may do what (RBAC)

    def add_token(self, token: str, username: str, groups=(), uid: str = "", extra: dict | None = None,
                  audiences=None) -> None:
        """A bearer token the server knows (a ServiceAccount's, a user's) and the user it stands for;
        valid for `audiences` (default: the server's own)."""
        user = {"username": username, "uid": uid or str(uuid.uuid4()),
                "groups": [*groups, *(["system:authenticated"] if "system:authenticated" not in groups else [])]}
        if extra:
            user["extra"] = {k: list(v) for k, v in extra.items()}
        with self._lock:
            self._tokens[token] = {"user": user, "audiences": list(audiences or self.audiences), "error": ""}

    def add_service_account_token(self, token: str, namespace: str, name: str) -> str:
        """A ServiceAccount's token, named and grouped as the API server names them; returns the user name."""
        username = f"system:serviceaccount:{namespace}:{name}"
        self.add_token(token, username, groups=("system:serviceaccounts", f"system:serviceaccounts:{namespace}"))
        return username

    def expire_token(self, token: str) -> None:
        """The token fails validation from now on (expired): every request with it is a 401, and a
        TokenReview of it says why in `status.error`."""
        with self._lock:
            self._tokens[token]["error"] = "[invalid bearer token, service account token has expired]"

    def allow(self, *, user: str = "", group: str = "", verbs=("get",), paths=(), resources=()) -> None:
        """Grant `verbs` on non-resource `paths` or on `resources` to one user or group (a ClusterRole
        and its ClusterRoleBinding)."""
        assert bool(user) != bool(group), "one user or one group"
        with self._lock:
            name = f"stand-in-{len(self._rules)}"
            self._rules.append(Rule(name, ("User", user) if user else ("Group", group), tuple(verbs),
                                    tuple(paths), tuple(resources)))

    def _user_of(self, token: str) -> dict | None:
        with self._lock:
            known = self._tokens.get(token)
        return None if known is None or known["error"] else known["user"]

    def _authenticate(self, authorization: str) -> dict:
        """The caller; a 401 for a token the server does not accept (anonymous without one)."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return ANONYMOUS
        user = self._user_of(token.strip())
        if user is None:
            raise ApiError(401, "Unauthorized")
        return user

    def _grant(self, user: dict, verb: str, path: str | None = None, resource: str | None = None) -> Rule | None:
        with self._lock:
            return next((rule for rule in self._rules if rule.grants(user, verb, path, resource)), None)

    def _authorize(self, user: dict, verb: str, resource: str, group: str, namespace: str | None) -> None:
        if not self.rbac or self._grant(user, verb, resource=f"{resource}.{group}" if group else resource):
            return
        named = f"{resource}.{group}" if group else resource
        where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        raise ApiError(403, f'{named} is forbidden: User "{user["username"]}" cannot {verb} resource "{resource}" '
                            f'in API group "{group}" {where}')

    def _token_review(self, spec: dict) -> dict:
        token = spec.get("token") or ""
        if not token:
            raise ApiError(400, "token is required for TokenReview in authentication")
        with self._lock:
            known = copy.deepcopy(self._tokens.get(token))
        if known is None:  # not a token any authenticator recognises: no error, only not authenticated
            return {"user": {}}
        if known["error"]:
            return {"user": {}, "error": known["error"]}
        wanted = spec.get("audiences") or self.audiences
        audiences = [audience for audience in known["audiences"] if audience in wanted]
        if not audiences:
            return {"user": {}, "error": f"[invalid bearer token, token audiences {json.dumps(known['audiences'])} is "
                                         f"invalid for the target audiences {json.dumps(wanted)}]"}
        return {"authenticated": True, "user": known["user"], "audiences": audiences}

    def _access_review(self, spec: dict) -> dict:
        resource, non_resource = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
        problems = []
        if (resource is None) == (non_resource is None):
            problems.append("spec.resourceAttributes: Invalid value: exactly one of nonResourceAttributes or "
                            "resourceAttributes must be specified")
        if not spec.get("user") and not spec.get("groups"):
            problems.append('spec.user: Invalid value: "": at least one of user or group must be specified')
        if problems:
            raise ApiError(422, f'SubjectAccessReview.authorization.k8s.io "" is invalid: {", ".join(problems)}',
                           "Invalid")
        user = {"username": spec.get("user") or "", "groups": spec.get("groups") or []}
        if non_resource is not None:
            rule = self._grant(user, non_resource.get("verb") or "", path=non_resource.get("path") or "")
        else:
            group = resource.get("group") or ""
            rule = self._grant(user, resource.get("verb") or "",
                               resource=f"{resource.get('resource')}.{group}" if group else resource.get("resource"))
        if rule is None:
            return {"allowed": False}  # RBAC has no opinion: no reason
        kind, name = rule.subject
        return {"allowed": True, "reason": f'RBAC: allowed by ClusterRoleBinding "{rule.name}" of ClusterRole '
                                           f'"{rule.name}" to {kind} "{name}"'}

    # -- direct state access (same versioning and watch fan-out as the HTTP API)

    def put(self, obj: dict) -> dict:
        """Create or replace a ConfigMap/Pod/Node/Event dict, status included (kind required; the
        namespace defaults to 'default', a Node has none)."""
        obj = copy.deepcopy(obj)
        obj["kind"] = _kind_of(obj.get("kind", ""))
        meta = obj.setdefault("metadata", {})
        if obj["kind"] in CLUSTER_SCOPED:
            meta.pop("namespace", None)
        else:
            meta.setdefault("namespace", "default")
        if not meta.get("name"):
            raise ValueError("metadata.name is required")
        with self._state.cond:
            if meta.get("namespace"):  # the test's setup made the namespace too
                self._state.namespaces.setdefault(meta["namespace"], "Active")
            return self._state.write(obj, create=True, update=True)

    def add_namespace(self, name: str) -> None:
        with self._state.cond:
            self._state.namespaces[name] = "Active"

    def terminate_namespace(self, name: str) -> None:
        """Mark the namespace as being deleted (its finalizers still run): its objects stay and may be
        written, nothing new may be created in it."""
        with self._state.cond:
            self._state.namespaces[name] = "Terminating"

    def delete_namespace(self, name: str) -> None:
        """The namespace and everything in it are gone."""
        with self._state.cond:
            self._state.namespaces.pop(name, None)
            for kind, namespace, item in [key for key in self._state.objects if key[1] == name]:
                self._state.remove(kind, namespace, item)

    def expire_events(self) -> None:
        """Every Event's TTL passes now: the API server deletes them all."""
        with self._state.cond:
            self._state.expire(everything=True)

    def delete(self, kind: str, namespace: str, name: str) -> dict | None:
        with self._state.cond:
            return self._state.remove(_kind_of(kind), namespace, name)

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        """One object; `namespace` "" (or None) for a Node."""
        with self._state.cond:
            self._state.expire()
            obj = self._state.objects.get((_kind_of(kind), namespace or "", name))
            return copy.deepcopy(obj)

    def list(self, kind: str, namespace: str | None = None) -> list[dict]:
        with self._state.cond:
            self._state.expire()
            return self._state.select(_kind_of(kind), namespace)

    @property
    def event_ttl(self) -> float:
        """Seconds an Event lives after its last write (the API server's --event-ttl)."""
        with self._state.cond:
            return self._state.event_ttl

    @event_ttl.setter
    def event_ttl(self, seconds: float) -> None:
        """Applies to Events written from now on."""
        with self._state.cond:
            self._state.event_ttl = seconds

    @property
    def resource_version(self) -> str:
        with self._state.cond:
            return str(self._state.rv)

    def compact(self) -> None:
        """Forget the event history: a watch from any older resourceVersion now gets 410 Expired."""
        with self._state.cond:
            self._state.history.clear()
            self._state.floor = self._state.rv
            self._state.cond.notify_all()  # running watches check whether they fell behind

    # -- fault injection and request log

    def fail_next(self, method: str, path_regex: str, status: int, times: int = 1) -> None:
        """Answer the next `times` requests matching method and path (with query, re.search) with status.

        No Retry-After header is sent: urllib3 would otherwise retry 429/503 GETs transparently.
        """
        with self._lock:
            self._failures.append([method.upper(), re.compile(path_regex), status, times])

    def hang(self, method: str, path_regex: str, times: int = 1) -> None:
        """Hold the next `times` requests matching method and path (with query, re.search) without an
        answer until `release()` (or `stop()`, which closes them unanswered): an API server that hangs."""
        with self._lock:
            self._holds.append([method.upper(), re.compile(path_regex), times])

    @property
    def held(self) -> int:
        """Requests being held now."""
        with self._lock:
            return self._held

    def release(self) -> None:
        """Let every held request go on; further `hang` rules still hold."""
        with self._lock:
            self._holds.clear()
            self._released += 1
            self._lock.notify_all()

    def _hold(self, method: str, path: str) -> bool:
        """Hold a request a `hang` rule matches; False when the server stopped meanwhile."""
        with self._lock:
            rule = next((r for r in self._holds if r[0] == method and r[1].search(path)), None)
            if rule is None:
                return True
            rule[2] -= 1
            if rule[2] <= 0:
                self._holds.remove(rule)
            released, stops, self._held = self._released, self._stops, self._held + 1
            self._lock.wait_for(lambda: self._stops != stops or self._released != released)
            self._held -= 1
            return self._stops == stops

    def _take_failure(self, method: str, path: str) -> int | None:
        with self._lock:
            for rule in self._failures:
                if rule[0] == method and rule[1].search(path):
                    rule[3] -= 1
                    if rule[3] <= 0:
                        self._failures.remove(rule)
                    return rule[2]
        return None

    @property
    def requests(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._requests)

    def _log(self, method: str, path: str) -> None:
        with self._lock:
            self._requests.append((method, path))

    def _track(self, conn: socket.socket, alive: bool) -> None:
        with self._lock:
            (self._connections.add if alive else self._connections.discard)(conn)
