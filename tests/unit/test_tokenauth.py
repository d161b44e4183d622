"""The token checks of /metrics (agent.tokenauth) against a reviewer the test scripts: the kubelet's
answers and cache lifetimes (by a fake clock, no sleeping), failures that are never cached, one
review for concurrent requests with one token, a bound on reviews in flight, refusals counted and
logged once per reason and client, and never a token in a log line."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from agent.common.executor import Executor
from agent.http import HttpEndpoint
from agent.metrics import make_registry
from agent.tokenauth import (ALLOWED_TTL_S, AUTHENTICATED_TTL_S, DENIED_TTL_S, AccessReview, ReviewFailed, TokenAuth,
                             TokenAuthCollector, TokenReview, TtlCache, User)
from testkit.wait import until
from tests.support.clock import FakeClock

PROMETHEUS = User("system:serviceaccount:monitoring:prometheus", "u-1",
                  ("system:serviceaccounts", "system:authenticated"), (("scopes", ("a", "b")),))
NOSY = User("system:serviceaccount:default:nosy")
BEARER = "Bearer {}".format


class Reviewer:
    """Tokens -> users, users allowed; `fail` makes every review fail; `gate` holds reviews until set."""

    def __init__(self):
        self.users = {"prom-token": PROMETHEUS, "nosy-token": NOSY}
        self.errors = {"expired-token": "[invalid bearer token, service account token has expired]"}
        self.allowed = {PROMETHEUS.name}
        self.fail = ""
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[tuple] = []
        self.running = self.most_running = 0
        self._lock = threading.Lock()

    def _enter(self, call: tuple) -> None:
        with self._lock:
            self.calls.append(call)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            self.gate.wait(10)
            if self.fail:
                raise ReviewFailed(self.fail)
        finally:
            with self._lock:
                self.running -= 1

    def review_token(self, token: str, timeout_s: float) -> TokenReview:
        self._enter(("token", token))
        return TokenReview(self.users.get(token), self.errors.get(token, ""))

    def review_access(self, user: User, path: str, verb: str, timeout_s: float) -> AccessReview:
        self._enter(("access", user.name, path, verb))
        allowed = user.name in self.allowed
        return AccessReview(allowed, "RBAC: allowed" if allowed else "")


def made(reviewer: Reviewer | None = None, lane_limit: int = 2, **settings) -> tuple[TokenAuth, Reviewer, FakeClock]:
    reviewer = reviewer or Reviewer()
    clock = FakeClock()
    lane = Executor("test").lane("kube-reviews", lane_limit)
    return TokenAuth(reviewer, lane, clock=clock, **settings), reviewer, clock


def check(auth: TokenAuth, authorization: str, client: str = "10.0.0.1"):
    return asyncio.run(auth.check(authorization, "/metrics", client))


def test_the_kubelets_answers_no_token_rejected_forbidden_allowed():
    auth, reviewer, _ = made()
    for header in ("", "Basic dXNlcjpwYXNz", "Bearer ", "Bearer    "):
        assert (check(auth, header).status, check(auth, header).reason) == ("401 Unauthorized", "no_token")
    refused = check(auth, BEARER("wrong-token"))
    assert (refused.status, refused.reason, refused.body) == ("401 Unauthorized", "token_rejected", "Unauthorized\n")
    refused = check(auth, BEARER("nosy-token"))
    assert (refused.status, refused.reason) == ("403 Forbidden", "forbidden")
    assert refused.body == f"Forbidden (user={NOSY.name}, verb=get, path=/metrics)\n"
    assert check(auth, BEARER("prom-token")) is None
    assert check(auth, "bearer  prom-token ") is None  # the scheme in any case, spaces around the token
    # The user as the TokenReview gave it (uid, groups, extra) is what the SubjectAccessReview asks about.
    assert ("access", PROMETHEUS.name, "/metrics", "get") in reviewer.calls
    assert auth.refusals == {"no_token": 8, "token_rejected": 1, "forbidden": 1}


def test_answers_are_cached_as_the_kubelet_caches_them():
    auth, reviewer, clock = made()
    assert check(auth, BEARER("prom-token")) is None
    assert check(auth, BEARER("wrong-token")).reason == "token_rejected"
    assert check(auth, BEARER("nosy-token")).reason == "forbidden"
    asked = len(reviewer.calls)
    assert [check(auth, BEARER(t)) and check(auth, BEARER(t)).reason for t in ("prom-token", "wrong-token",
                                                                              "nosy-token")] == [
        None, "token_rejected", "forbidden"]
    assert len(reviewer.calls) == asked  # all from the caches

    clock.advance(DENIED_TTL_S)  # the denial expires; the TokenReview answers still hold
    assert check(auth, BEARER("nosy-token")).reason == "forbidden"
    assert reviewer.calls[asked:] == [("access", NOSY.name, "/metrics", "get")]
    clock.at(AUTHENTICATED_TTL_S)  # every TokenReview answer expires, rejections included; the allowed decision holds
    asked = len(reviewer.calls)
    assert check(auth, BEARER("prom-token")) is None and check(auth, BEARER("wrong-token")).reason == "token_rejected"
    assert reviewer.calls[asked:] == [("token", "prom-token"), ("token", "wrong-token")]
    clock.at(ALLOWED_TTL_S)  # the allowed decision expires (and the TokenReview answer of 120 s)
    asked = len(reviewer.calls)
    assert check(auth, BEARER("prom-token")) is None
    assert reviewer.calls[asked:] == [("token", "prom-token"), ("access", PROMETHEUS.name, "/metrics", "get")]


def test_a_rejection_with_the_api_servers_reason_is_not_cached_and_the_reason_is_logged(caplog):
    auth, reviewer, _ = made()
    caplog.set_level(logging.WARNING, "agent.tokenauth")
    assert check(auth, BEARER("expired-token")).reason == "token_rejected"
    assert check(auth, BEARER("expired-token")).reason == "token_rejected"
    assert reviewer.calls == [("token", "expired-token")] * 2  # an error, as the webhook authenticator says
    [line] = [r for r in caplog.records if r.reason == "token_rejected"]
    assert "has expired" in line.detail and "expired-token" not in line.detail


def test_a_failed_review_is_refused_never_cached_and_a_cached_allowed_user_is_still_served():
    auth, reviewer, clock = made()
    assert check(auth, BEARER("prom-token")) is None
    reviewer.fail = "HTTPError: connection refused"
    assert check(auth, BEARER("prom-token")) is None  # from the caches while they last
    refused = check(auth, BEARER("nosy-token"))  # a TokenReview that fails: 401, as the kubelet answers
    assert (refused.status, refused.reason, refused.body) == ("401 Unauthorized", "review_failed", "Unauthorized\n")
    assert check(auth, BEARER("nosy-token")).reason == "review_failed"
    assert reviewer.calls[-2:] == [("token", "nosy-token")] * 2  # failures are not cached

    clock.at(DENIED_TTL_S)  # nosy's TokenReview answered now, its SubjectAccessReview fails: 500, as the kubelet
    reviewer.fail = ""
    assert check(auth, BEARER("nosy-token")).reason == "forbidden"
    clock.at(2 * DENIED_TTL_S)
    reviewer.fail = "503 Service Unavailable: the server is currently unable to handle the request"
    refused = check(auth, BEARER("nosy-token"))
    assert (refused.status, refused.reason) == ("500 Internal Server Error", "review_failed")
    assert refused.body == f"Authorization error (user={NOSY.name}, verb=get, path=/metrics)\n"

    clock.at(AUTHENTICATED_TTL_S)  # the cached TokenReview answer is gone: the outage refuses prometheus too
    assert check(auth, BEARER("prom-token")).reason == "review_failed"
    reviewer.fail = ""
    assert check(auth, BEARER("prom-token")) is None
    assert auth.refusals["review_failed"] == 4


def test_concurrent_requests_with_one_token_share_one_review():
    async def main():
        auth, reviewer, _ = made()
        reviewer.gate.clear()
        checks = [asyncio.ensure_future(auth.check(BEARER("prom-token"), "/metrics", "10.0.0.1")) for _ in range(8)]
        await until(lambda: reviewer.running == 1, 5, "the TokenReview under way")
        reviewer.gate.set()
        return await asyncio.gather(*checks), reviewer.calls

    answers, calls = asyncio.run(main())
    assert answers == [None] * 8
    assert calls == [("token", "prom-token"), ("access", PROMETHEUS.name, "/metrics", "get")]


def test_reviews_in_flight_are_bounded_by_the_lane_and_a_review_without_an_answer_times_out():
    async def main():
        reviewer = Reviewer()
        reviewer.users = {f"token-{n}": PROMETHEUS for n in range(6)}
        reviewer.gate.clear()  # the API server hangs
        auth, _, _ = made(reviewer, lane_limit=2, timeout_s=0.3)
        first = [auth.check(BEARER(f"token-{n}"), "/metrics", "10.0.0.1") for n in range(3)]
        answers = await asyncio.wait_for(asyncio.gather(*first), 5)
        # The two hung calls still hold the lane: later reviews wait for a turn, and are dropped unrun.
        later = [auth.check(BEARER(f"token-{n}"), "/metrics", "10.0.0.1") for n in range(3, 6)]
        answers += await asyncio.wait_for(asyncio.gather(*later), 5)
        started = len(reviewer.calls)
        reviewer.gate.set()
        return answers, reviewer.most_running, started

    answers, most_running, started = asyncio.run(main())
    assert [a.reason for a in answers] == ["review_failed"] * 6  # each within its time-out
    assert most_running == 2 and started == 2


def test_refusals_are_logged_once_per_reason_and_client_a_minute_never_with_the_token(caplog):
    auth, reviewer, clock = made(log_interval_s=60)
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        check(auth, "", "10.0.0.1")
        check(auth, BEARER("wrong-token"), "10.0.0.1")
        check(auth, BEARER("nosy-token"), "10.0.0.1")
    check(auth, "", "10.0.0.2")  # another client: its own line
    lines = [r for r in caplog.records if r.getMessage() == "refused a request for /metrics"]
    assert [(r.reason, r.client) for r in lines] == [("no_token", "10.0.0.1"), ("token_rejected", "10.0.0.1"),
                                                     ("forbidden", "10.0.0.1"), ("no_token", "10.0.0.2")]
    assert lines[2].user == NOSY.name and lines[2].path == "/metrics"
    clock.advance(60)
    check(auth, "", "10.0.0.1")
    last = [r for r in caplog.records if r.getMessage() == "refused a request for /metrics"][-1]
    assert (last.reason, last.refused_unlogged) == ("no_token", 2)  # the two refusals in between
    text = "\n".join(f"{r.getMessage()} {vars(r)}" for r in caplog.records)
    assert "wrong-token" not in text and "nosy-token" not in text


def test_the_cache_is_bounded_oldest_first_and_expires_by_its_clock():
    clock = FakeClock()
    cache = TtlCache(clock, limit=3)
    for n in range(4):
        cache.put(n, f"v{n}", 10)
    assert len(cache) == 3 and cache.get(0) is None and cache.get(1) == "v1"
    cache.put(1, "again", 30)  # a new answer moves it to the young end
    cache.put(4, "v4", 10)
    assert cache.get(2) is None and cache.get(1) == "again"
    clock.advance(10)
    assert cache.get(3) is None and cache.get(1) == "again"
    clock.advance(20)
    assert cache.get(1) is None and cache.get(4) is None and len(cache) == 0


def test_the_collector_exports_every_reason_from_the_start():
    auth, _, _ = made()
    check(auth, "")
    [family] = TokenAuthCollector("n", auth).collect()
    assert {s.labels["reason"]: s.value for s in family.samples} == {
        "no_token": 1, "token_rejected": 0, "forbidden": 0, "review_failed": 0}


async def get(port: int, path: str, token: str = "") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    authorization = f"Authorization: Bearer {token}\r\n" if token else ""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{authorization}\r\n".encode())
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


@pytest.mark.parametrize("path, token, status", [
    ("/metrics", "", b"401 "), ("/metrics", "wrong-token", b"401 "), ("/metrics", "nosy-token", b"403 "),
    ("/metrics", "prom-token", b"200 "), ("/healthz", "", b"200 "), ("/readyz", "", b"200 "),
])
def test_the_endpoint_asks_for_a_token_on_metrics_only(path, token, status):
    async def main():
        auth, _, _ = made()
        endpoint = HttpEndpoint("127.0.0.1:0", make_registry(TokenAuthCollector("n", auth)), lambda: (True, []),
                                auth=auth)
        await endpoint.start()
        try:
            return await get(endpoint.port, path, token)
        finally:
            await endpoint.stop()

    answer = asyncio.run(main())
    assert answer.startswith(b"HTTP/1.1 " + status), answer
    assert (b'WWW-Authenticate: Bearer realm="npu-node-agent"' in answer) == (status == b"401 ")
    if status == b"200 " and path == "/metrics":
        assert b'npu_agent_http_refusals_total{node="n",reason="no_token"} 0.0' in answer
