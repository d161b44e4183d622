"""Self-test of the Kubernetes API stand-in, driven only through the official `kubernetes` client."""

from __future__ import annotations

import json
import threading
import time

import pytest
import urllib3
from kubernetes import watch
from kubernetes.client import (V1ConfigMap, V1NonResourceAttributes, V1ObjectMeta, V1ResourceAttributes,
                               V1SubjectAccessReview, V1SubjectAccessReviewSpec, V1TokenReview, V1TokenReviewSpec)
from kubernetes.client.rest import ApiException

from testkit.fakes.kube import KubeStandIn
from testkit.fakes.kube.server import AUDIENCES
from testkit.wait import wait_until

NS = "kube-system"


@pytest.fixture
def kube():
    with KubeStandIn() as server:
        yield server


@pytest.fixture
def api(kube):
    return kube.client()


def status_of(exc: ApiException) -> dict:
    return json.loads(exc.body)


def configmap(name, labels=None, **data):
    return V1ConfigMap(metadata=V1ObjectMeta(name=name, labels=labels), data=data)


def pod(name, node=None, namespace="default", phase="Running"):
    spec = {"containers": [{"name": "c", "image": "busybox"}]}
    if node:
        spec["nodeName"] = node
    return {"kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": spec, "status": {"phase": phase}}


class WatchThread:
    """Runs Watch().stream in a thread and collects (type, name) until `stop_after` events."""

    def __init__(self, func, *args, stop_after=None, **kwargs):
        self.watch = watch.Watch()
        self.events: list[tuple[str, str]] = []
        self.error: BaseException | None = None
        self._stop_after = stop_after
        self._thread = threading.Thread(target=self._run, args=(func, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, func, args, kwargs):
        try:
            for event in self.watch.stream(func, *args, **kwargs):
                self.events.append((event["type"], event["object"].metadata.name))
                if self._stop_after and len(self.events) >= self._stop_after:
                    self.watch.stop()
        except BaseException as exc:  # handed to the test thread
            self.error = exc

    def join(self, timeout=5.0):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "watch did not end"
        return self.events


# ----------------------------------------------------------------------------- CRUD


def test_configmap_create_read_replace_patch_delete(api):
    created = api.create_namespaced_config_map(NS, configmap("cm", a="1"))
    assert created.metadata.namespace == NS and created.metadata.uid
    assert created.metadata.creation_timestamp is not None and created.data == {"a": "1"}

    read = api.read_namespaced_config_map("cm", NS)
    assert read.metadata.resource_version == created.metadata.resource_version

    read.data["a"] = "2"
    replaced = api.replace_namespaced_config_map("cm", NS, read)
    assert replaced.data == {"a": "2"} and replaced.metadata.uid == created.metadata.uid
    assert int(replaced.metadata.resource_version) > int(created.metadata.resource_version)

    # The client's default patch content type: strategic merge patch with a JSON body.
    patched = api.patch_namespaced_config_map("cm", NS, {"data": {"b": "3"}})
    assert patched.data == {"a": "2", "b": "3"}
    # A JSON merge patch removes keys with null.
    patched = api.patch_namespaced_config_map("cm", NS, {"data": {"a": None}},
                                              _content_type="application/merge-patch+json")
    assert patched.data == {"b": "3"}

    # Like the API server, DELETE answers with the deleted ConfigMap; the client's declared return
    # type is V1Status, so this client version hands it back as a plain dict.
    deleted = api.delete_namespaced_config_map("cm", NS)
    assert deleted["kind"] == "ConfigMap" and deleted["metadata"]["name"] == "cm"
    with pytest.raises(ApiException) as err:
        api.read_namespaced_config_map("cm", NS)
    assert err.value.status == 404
    assert status_of(err.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'configmaps "cm" not found', "reason": "NotFound",
        "details": {"name": "cm", "kind": "configmaps"}, "code": 404}


def test_missing_objects_are_404_for_every_verb(api):
    for call in (lambda: api.read_namespaced_config_map("nope", NS),
                 lambda: api.replace_namespaced_config_map("nope", NS, configmap("nope")),
                 lambda: api.patch_namespaced_config_map("nope", NS, {"data": {}}),
                 lambda: api.delete_namespaced_config_map("nope", NS),
                 lambda: api.read_namespaced_pod("nope", NS)):
        with pytest.raises(ApiException) as err:
            call()
        assert err.value.status == 404


def test_create_twice_is_409_already_exists(api):
    api.create_namespaced_config_map(NS, configmap("cm"))
    with pytest.raises(ApiException) as err:
        api.create_namespaced_config_map(NS, configmap("cm"))
    assert err.value.status == 409 and status_of(err.value)["reason"] == "AlreadyExists"


def test_replace_with_stale_resource_version_is_409_conflict(api):
    stale = api.create_namespaced_config_map(NS, configmap("cm", a="1"))
    api.patch_namespaced_config_map("cm", NS, {"data": {"a": "2"}})
    stale.data = {"a": "lost update"}
    with pytest.raises(ApiException) as err:
        api.replace_namespaced_config_map("cm", NS, stale)
    assert err.value.status == 409
    assert status_of(err.value)["reason"] == "Conflict"
    assert "the object has been modified" in status_of(err.value)["message"]

    # No resourceVersion in the body: an unconditional update, as in Kubernetes.
    stale.metadata.resource_version = None
    assert api.replace_namespaced_config_map("cm", NS, stale).data == {"a": "lost update"}


def test_namespace_in_path_wins_and_name_is_required(api):
    body = V1ConfigMap(metadata=V1ObjectMeta(name="cm", namespace="elsewhere"))
    assert api.create_namespaced_config_map(NS, body).metadata.namespace == NS
    with pytest.raises(ApiException) as err:
        api.create_namespaced_config_map(NS, V1ConfigMap(metadata=V1ObjectMeta()))
    assert err.value.status == 400


def test_list_with_label_selector_and_across_namespaces(api, kube):
    api.create_namespaced_config_map(NS, configmap("a", {"app": "npu", "tier": "x"}))
    api.create_namespaced_config_map(NS, configmap("b", {"app": "npu"}))
    api.create_namespaced_config_map(NS, configmap("c", {"app": "other"}))
    api.create_namespaced_config_map("default", configmap("d", {"app": "npu"}))

    def names(result):
        return [item.metadata.name for item in result.items]

    assert names(api.list_namespaced_config_map(NS, label_selector="app=npu")) == ["a", "b"]
    assert names(api.list_namespaced_config_map(NS, label_selector="app==npu,tier")) == ["a"]
    assert names(api.list_namespaced_config_map(NS, label_selector="app!=npu")) == ["c"]
    assert names(api.list_namespaced_config_map(NS, label_selector="!tier")) == ["b", "c"]
    assert names(api.list_config_map_for_all_namespaces(label_selector="app=npu")) == ["d", "a", "b"]
    assert names(api.list_namespaced_config_map(NS, field_selector="metadata.name=c")) == ["c"]

    listed = api.list_namespaced_config_map(NS)
    assert listed.metadata.resource_version == kube.resource_version
    assert listed.items[0].kind == "ConfigMap" and listed.items[0].api_version == "v1"


def test_pods_listed_by_node_name(api, kube):
    kube.put(pod("p1", node="node-1"))
    kube.put(pod("p2", node="node-2"))
    kube.put(pod("p3", node="node-1", namespace="training"))
    kube.put(pod("pending"))

    on_node = api.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-1")
    assert [(p.metadata.namespace, p.metadata.name) for p in on_node.items] == [
        ("default", "p1"), ("training", "p3")]
    in_default = api.list_namespaced_pod("default", field_selector="spec.nodeName==node-1")
    assert [p.metadata.name for p in in_default.items] == ["p1"]
    unscheduled = api.list_pod_for_all_namespaces(field_selector="spec.nodeName=")
    assert [p.metadata.name for p in unscheduled.items] == ["pending"]
    assert api.read_namespaced_pod("p1", "default").spec.node_name == "node-1"

    with pytest.raises(ApiException) as err:  # unsupported field label, as in the API server
        api.list_pod_for_all_namespaces(field_selector="spec.bogus=1")
    assert err.value.status == 400


def test_direct_state_access_goes_through_versioning(api, kube):
    stored = kube.put({"kind": "ConfigMap", "metadata": {"name": "cm", "namespace": NS}, "data": {"k": "v"}})
    assert stored["metadata"]["resourceVersion"] == kube.resource_version
    assert api.read_namespaced_config_map("cm", NS).data == {"k": "v"}
    assert kube.get("ConfigMap", NS, "cm")["data"] == {"k": "v"}
    assert [o["metadata"]["name"] for o in kube.list("configmaps")] == ["cm"]
    assert kube.delete("ConfigMap", NS, "cm") is not None
    assert kube.get("ConfigMap", NS, "cm") is None and kube.delete("ConfigMap", NS, "cm") is None


def test_unknown_paths_and_unsupported_methods(api):
    with pytest.raises(ApiException) as err:
        api.list_namespace()  # namespaces are not served
    assert err.value.status == 404 and status_of(err.value)["kind"] == "Status"
    with pytest.raises(ApiException) as err:
        api.delete_collection_namespaced_config_map(NS)
    assert err.value.status == 405
    with pytest.raises(ApiException) as err:  # server-side apply is not served
        api.patch_namespaced_config_map("cm", NS, {"data": {}}, _content_type="application/apply-patch+yaml")
    assert err.value.status == 415


# ----------------------------------------------------------------------------- watch


def test_watch_from_resource_version_sees_changes_in_order(api, kube):
    api.create_namespaced_config_map(NS, configmap("before"))
    rv = api.list_namespaced_config_map(NS).metadata.resource_version
    watcher = WatchThread(api.list_namespaced_config_map, NS, resource_version=rv,
                          timeout_seconds=2, stop_after=3)
    # Writes racing the watch's start are fine: they are replayed from rv.
    api.create_namespaced_config_map(NS, configmap("cm", a="1"))
    api.create_namespaced_config_map("default", configmap("other-namespace"))
    api.patch_namespaced_config_map("cm", NS, {"data": {"a": "2"}})
    api.delete_namespaced_config_map("cm", NS)

    assert watcher.join() == [("ADDED", "cm"), ("MODIFIED", "cm"), ("DELETED", "cm")]
    assert watcher.error is None


def test_watch_without_resource_version_starts_with_current_state(api, kube):
    api.create_namespaced_config_map(NS, configmap("a", {"watched": "yes"}))
    api.create_namespaced_config_map(NS, configmap("b"))
    watcher = WatchThread(api.list_namespaced_config_map, NS, label_selector="watched",
                          timeout_seconds=5, stop_after=2)
    wait_until(lambda: watcher.events, 5, "initial ADDED")
    api.create_namespaced_config_map(NS, configmap("c"))  # filtered out
    api.create_namespaced_config_map(NS, configmap("d", {"watched": "yes"}))
    assert watcher.join() == [("ADDED", "a"), ("ADDED", "d")]


def test_watch_timeout_ends_stream_cleanly(api):
    started = time.monotonic()
    watcher = WatchThread(api.list_namespaced_config_map, NS, timeout_seconds=1)
    assert watcher.join(timeout=5) == [] and watcher.error is None
    assert time.monotonic() - started < 4


def test_pod_watch_by_node_sees_pods_enter_and_leave_the_selector(api, kube):
    kube.put(pod("p", node=None))
    rv = kube.resource_version
    watcher = WatchThread(api.list_pod_for_all_namespaces, field_selector="spec.nodeName=node-1",
                          resource_version=rv, timeout_seconds=5, stop_after=3)
    kube.put(pod("p", node="node-1"))  # scheduled onto the node: ADDED for this watcher
    kube.put(pod("p", node="node-1", phase="Succeeded"))
    kube.put(pod("elsewhere", node="node-2"))
    kube.delete("Pod", "default", "p")
    assert watcher.join() == [("ADDED", "p"), ("MODIFIED", "p"), ("DELETED", "p")]


def test_watch_from_compacted_resource_version_raises_410(api, kube):
    api.create_namespaced_config_map(NS, configmap("cm"))
    old_rv = api.list_namespaced_config_map(NS).metadata.resource_version
    api.patch_namespaced_config_map("cm", NS, {"data": {"x": "1"}})
    kube.compact()

    # With timeout_seconds the client does not retry: the ERROR event becomes ApiException(410).
    watcher = WatchThread(api.list_namespaced_config_map, NS, resource_version=old_rv, timeout_seconds=5)
    watcher.join()
    assert isinstance(watcher.error, ApiException) and watcher.error.status == 410
    assert watcher.error.reason.startswith("Expired: too old resource version")

    # Without it the client retries once from the same resourceVersion, then raises.
    before = len([r for r in kube.requests if "watch=" in r[1]])
    watcher = WatchThread(api.list_namespaced_config_map, NS, resource_version=old_rv)
    watcher.join()
    assert isinstance(watcher.error, ApiException) and watcher.error.status == 410
    assert len([r for r in kube.requests if "watch=" in r[1]]) - before == 2

    # The current resourceVersion still works after compaction.
    current = api.list_namespaced_config_map(NS).metadata.resource_version
    watcher = WatchThread(api.list_namespaced_config_map, NS, resource_version=current,
                          timeout_seconds=5, stop_after=1)
    api.delete_namespaced_config_map("cm", NS)
    assert watcher.join() == [("DELETED", "cm")]


def test_slow_watcher_falls_off_the_history_ring():
    with KubeStandIn(history=3) as kube:
        api = kube.client()
        api.create_namespaced_config_map(NS, configmap("cm"))
        rv = kube.resource_version
        for i in range(5):
            api.patch_namespaced_config_map("cm", NS, {"data": {"i": str(i)}})
        watcher = WatchThread(api.list_namespaced_config_map, NS, resource_version=rv, timeout_seconds=5)
        watcher.join()
        assert isinstance(watcher.error, ApiException) and watcher.error.status == 410


def test_server_stop_ends_an_open_watch():
    kube = KubeStandIn().start()
    api = kube.client()
    api.create_namespaced_config_map(NS, configmap("cm"))
    watcher = WatchThread(api.list_namespaced_config_map, NS, timeout_seconds=60)
    wait_until(lambda: watcher.events, 5, "watch to connect")
    started = time.monotonic()
    kube.stop()
    assert watcher.join(timeout=5) == [("ADDED", "cm")] and watcher.error is None
    assert time.monotonic() - started < 3


# ----------------------------------------------------------------------------- controls


def test_fail_next_injects_statuses_and_requests_are_recorded(api, kube):
    api.create_namespaced_config_map(NS, configmap("cm"))
    kube.fail_next("GET", r"/configmaps/cm$", 500)
    with pytest.raises(ApiException) as err:
        api.read_namespaced_config_map("cm", NS)
    assert err.value.status == 500 and status_of(err.value)["reason"] == "InternalError"
    assert api.read_namespaced_config_map("cm", NS).metadata.name == "cm"  # only once

    kube.fail_next("PUT", r"/configmaps/cm", 409, times=2)
    body = api.read_namespaced_config_map("cm", NS)
    for _ in range(2):
        with pytest.raises(ApiException) as err:
            api.replace_namespaced_config_map("cm", NS, body)
        assert err.value.status == 409
    api.replace_namespaced_config_map("cm", NS, body)

    kube.fail_next("GET", r"watch=true", 429)
    with pytest.raises(ApiException) as err:
        list(watch.Watch().stream(api.list_namespaced_config_map, NS, timeout_seconds=1))
    assert err.value.status == 429

    assert ("GET", f"/api/v1/namespaces/{NS}/configmaps/cm") in kube.requests
    assert any(m == "GET" and "watch=true" in p and "timeoutSeconds=1" in p for m, p in kube.requests)


# ----------------------------------------------------------------------------- authentication and RBAC


def token_review(token: str, audiences=None) -> V1TokenReview:
    return V1TokenReview(spec=V1TokenReviewSpec(token=token, audiences=audiences))


def metrics_review(user: str, groups=None) -> V1SubjectAccessReview:
    return V1SubjectAccessReview(spec=V1SubjectAccessReviewSpec(
        user=user, groups=groups, non_resource_attributes=V1NonResourceAttributes(path="/metrics", verb="get")))


@pytest.fixture
def rbac():
    """An API server with RBAC: a reviewer (the agent), a scraper in the monitoring namespace, nobody else."""
    with KubeStandIn(rbac=True) as server:
        reviewer = server.add_service_account_token("reviewer-token", "npu", "agent")
        server.allow(user=reviewer, verbs=("create",), resources=("tokenreviews.authentication.k8s.io",
                                                                  "subjectaccessreviews.authorization.k8s.io"))
        server.add_service_account_token("scraper-token", "monitoring", "prometheus")
        server.allow(group="system:serviceaccounts:monitoring", verbs=("get",), paths=("/metrics",))
        yield server


def test_a_token_review_names_the_user_its_groups_and_audiences_and_echoes_the_token(rbac):
    authn = rbac.client("reviewer-token", "AuthenticationV1Api")
    review = authn.create_token_review(token_review("scraper-token"))
    assert review.spec.token == "scraper-token"  # as the real API server answers
    assert review.status.authenticated is True and review.status.audiences == list(AUDIENCES)
    assert review.status.user.username == "system:serviceaccount:monitoring:prometheus" and review.status.user.uid
    assert review.status.user.groups == ["system:serviceaccounts", "system:serviceaccounts:monitoring",
                                         "system:authenticated"]
    unknown = authn.create_token_review(token_review("made-up")).status
    assert (unknown.authenticated, unknown.error, unknown.user.username) == (None, None, None)  # omitted, as there
    elsewhere = authn.create_token_review(token_review("scraper-token", audiences=["vault"])).status
    assert not elsewhere.authenticated and "invalid for the target audiences" in elsewhere.error
    rbac.expire_token("scraper-token")
    expired = authn.create_token_review(token_review("scraper-token")).status
    assert not expired.authenticated and "expired" in expired.error
    with pytest.raises(ApiException) as err:
        authn.create_token_review(token_review(""))
    assert err.value.status == 400 and "token is required" in status_of(err.value)["message"]


def test_a_subject_access_review_allows_by_rule_and_otherwise_has_no_opinion(rbac):
    authz = rbac.client("reviewer-token", "AuthorizationV1Api")
    allowed = authz.create_subject_access_review(metrics_review("x", ["system:serviceaccounts:monitoring"])).status
    assert allowed.allowed is True and 'to Group "system:serviceaccounts:monitoring"' in allowed.reason
    nobody = authz.create_subject_access_review(metrics_review("system:serviceaccount:default:nosy")).status
    assert (nobody.allowed, nobody.denied, nobody.reason) == (False, None, None)
    other_path = metrics_review("x", ["system:serviceaccounts:monitoring"])
    other_path.spec.non_resource_attributes.path = "/debug/pprof"
    assert authz.create_subject_access_review(other_path).status.allowed is False
    with pytest.raises(ApiException) as err:  # neither user nor groups
        authz.create_subject_access_review(metrics_review(None))
    assert err.value.status == 422 and "at least one of user or group" in status_of(err.value)["message"]
    both = V1SubjectAccessReview(spec=V1SubjectAccessReviewSpec(user="x", resource_attributes=V1ResourceAttributes(
        verb="get", resource="pods"), non_resource_attributes=V1NonResourceAttributes(path="/metrics", verb="get")))
    with pytest.raises(ApiException) as err:
        authz.create_subject_access_review(both)
    assert err.value.status == 422 and "exactly one of" in status_of(err.value)["message"]


def test_every_caller_is_authenticated_and_with_rbac_authorised(rbac):
    with pytest.raises(ApiException) as err:  # a token the server does not know: 401 on every path
        rbac.client("made-up").list_namespaced_pod(NS)
    assert err.value.status == 401 and status_of(err.value)["reason"] == "Unauthorized"
    with pytest.raises(ApiException) as err:  # anonymous, or known without a rule: 403 naming what is missing
        rbac.client().list_namespaced_pod(NS)
    assert err.value.status == 403
    assert 'User "system:anonymous" cannot list resource "pods"' in status_of(err.value)["message"]
    with pytest.raises(ApiException) as err:  # a scraper may not review tokens
        rbac.client("scraper-token", "AuthenticationV1Api").create_token_review(token_review("scraper-token"))
    assert err.value.status == 403
    assert ('tokenreviews.authentication.k8s.io is forbidden: User "system:serviceaccount:monitoring:prometheus" '
            'cannot create resource "tokenreviews" in API group "authentication.k8s.io" at the cluster scope'
            ) in status_of(err.value)["message"]
    rbac.allow(user="system:serviceaccount:npu:agent", verbs=("list", "watch"), resources=("pods",))
    assert rbac.client("reviewer-token").list_namespaced_pod(NS).items == []
    rbac.expire_token("reviewer-token")
    with pytest.raises(ApiException) as err:
        rbac.client("reviewer-token").list_namespaced_pod(NS)
    assert err.value.status == 401


def test_without_rbac_anyone_may_do_anything(kube):
    authn = kube.client("", "AuthenticationV1Api")
    assert authn.create_token_review(token_review("nobody-knows")).status.authenticated is None


def test_a_hung_request_is_held_until_released_or_stopped(rbac):
    authn = rbac.client("reviewer-token", "AuthenticationV1Api")
    rbac.hang("POST", "tokenreviews")
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):  # the client's own time-out ends the wait
        authn.create_token_review(token_review("scraper-token"), _request_timeout=0.3)
    assert rbac.held == 1
    rbac.release()
    wait_until(lambda: rbac.held == 0, 5, "the held request to go on")
    assert authn.create_token_review(token_review("scraper-token")).status.authenticated  # the rule is gone

    rbac.hang("POST", "tokenreviews")
    answer: list = []
    caller = threading.Thread(target=lambda: answer.append(
        _outcome(lambda: authn.create_token_review(token_review("scraper-token"), _request_timeout=10))))
    caller.start()
    wait_until(lambda: rbac.held == 1, 5, "the request to be held")
    started = time.monotonic()
    rbac.stop()  # a server that dies: the connection closes without an answer
    caller.join(5)
    assert time.monotonic() - started < 5 and isinstance(answer[0], urllib3.exceptions.HTTPError), answer


def _outcome(call):
    try:
        return call()
    except Exception as exc:  # handed to the test thread
        return exc
