"""Who may scrape /metrics (`http.token_auth`): bearer tokens checked the Kubernetes way, as the
kubelet and kube-rbac-proxy check their scrapers.

A request for /metrics must carry `Authorization: Bearer <token>`. The API server says whose token it
is (a TokenReview, authentication.k8s.io/v1), then whether that user (name, uid, groups, extra) may
`get` the non-resource URL /metrics (a SubjectAccessReview, authorization.k8s.io/v1). The status page
`/` shows the same facts and is asked for as `get /metrics` too (agent.http.AUTHORIZED_AS), so one grant
covers both and one cached decision serves both. /healthz and /readyz are not checked: the kubelet's
probes carry no token.

Answers, as the kubelet's (its server's auth filter) and kube-rbac-proxy's:
- no bearer token: 401 `no_token`; a token the API server does not accept: 401 `token_rejected`;
  both with `WWW-Authenticate: Bearer`;
- a user the API server does not allow: 403 `forbidden`;
- a review without an answer (connection refused, no answer within `http.token_auth_timeout_seconds`,
  5xx, 429, or the API server refusing the agent itself, e.g. without RBAC for reviews):
  `review_failed`, and the request is refused: 401 when the TokenReview failed, 500 when the
  SubjectAccessReview did. That is fail closed, and what the kubelet answers: its delegating webhook
  authenticator returns the error, which its filter answers with 401 Unauthorized, and its webhook
  authorizer returns the error with "no opinion", which its filter answers with 500 "Authorization
  error" (kube-rbac-proxy does the same). A 503 would change nothing for Prometheus (any non-2xx is
  a failed scrape, `up` 0), and answering as the kubelet does keeps one set of alerts and runbooks
  for both; the counter's reason and the log line tell an outage from a bad token.

Caching, with the kubelet's webhook defaults (authentication-token-webhook-cache-ttl 2m,
authorization-webhook-cache-authorized-ttl 5m, -unauthorized-ttl 30s): a TokenReview's answer is
kept 120 s, accepted or not (k8s.io/apiserver's cached token authenticator keeps both for the TTL),
a SubjectAccessReview's 300 s when allowed and 30 s when not. An error is never cached (the kubelet's
token cache is built with cacheErrs=false, and its webhook authorizer caches answers only), nor is a
rejection the API server gives a reason for (`status.error`, e.g. an expired token: the webhook
authenticator turns it into an error). So while the API server is down a scraper served in the
last two minutes is still served (its TokenReview answer lasts 2 min, its allowed decision 5), and
a new token is refused. Each cache holds at most 1024 entries, the oldest making room, and expires
by the injected clock. Tokens are keyed by an HMAC-SHA256 under a key drawn at start (as the API
server's token cache keys them): the agent keeps no token, and none is ever logged. Decisions are
keyed by the user and the request's attributes (as the webhook authorizer keys its cache by the
review's spec), so a user's rotated tokens share one decision.

Reviews never block the event loop: the Kubernetes client's calls run in the executor's lane for
them (`kube-reviews`, apart from the kube lane's watches and ConfigMap writes), which runs at most
its limit (2) at once. A request waits for its review at most the time-out; a call that the API
server leaves hanging keeps its slot until the client's own time-out (0.5 s later) ends it, and a
call still waiting for a slot then is dropped unrun, so a hung API server costs two threads and
no more. Requests that need a review already in flight share it: a storm of scrapes with one new
token costs one TokenReview.

Every refusal is counted (npu_agent_http_refusals_total{reason}) and logged at most once per reason
and client address a minute, with the path, the user when known and the API server's reason.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Protocol

from prometheus_client.core import Metric

from agent.common.executor import CallTimeout, Lane
from agent.common.families import counter, described

log = logging.getLogger(__name__)

NO_TOKEN, TOKEN_REJECTED, FORBIDDEN, REVIEW_FAILED = REASONS = ("no_token", "token_rejected", "forbidden",
                                                                "review_failed")
AUTHENTICATED_TTL_S = 120.0  # a TokenReview's answer, accepted or not
ALLOWED_TTL_S = 300.0
DENIED_TTL_S = 30.0
CACHE_ENTRIES = 1024  # per cache; the oldest entry makes room
TIMEOUT_S = 3.0
CLIENT_SLACK_S = 0.5  # the client's own time-out is this much longer: the request's is the one that answers
LOG_INTERVAL_S = 60.0
LOGGED_PAIRS = 1024  # (reason, client) pairs remembered for the log's interval; past that, only counted

UNAUTHORIZED = "401 Unauthorized"
REFUSALS = counter("npu_agent_http_refusals_total", "Requests for /metrics and the status page / refused by "
                   "http.token_auth, by reason: no_token (no bearer token), token_rejected (the API server does not "
                   "accept it), forbidden (its user may not get /metrics), review_failed (no answer to a review: the "
                   "API server refused the connection, timed out, failed, throttled or refused the agent)", "reason")


class ReviewFailed(Exception):
    """No answer to a review. Its message never holds the token."""


@dataclass(frozen=True)
class User:
    name: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()  # sorted by key: hashable, one key per user


@dataclass(frozen=True)
class TokenReview:
    user: User | None  # None: not authenticated
    error: str = ""  # why not, when the API server said (then not cached)


@dataclass(frozen=True)
class AccessReview:
    allowed: bool
    reason: str = ""


class Reviewer(Protocol):
    """The API server's reviews (agent.kube.reviews). Blocking: they run in the kube-reviews lane,
    each within `timeout_s`; ReviewFailed when there is no answer."""

    def review_token(self, token: str, timeout_s: float) -> TokenReview: ...

    def review_access(self, user: User, path: str, verb: str, timeout_s: float) -> AccessReview: ...


@dataclass(frozen=True)
class Refusal:
    status: str  # the status line's code and phrase
    reason: str  # one of REASONS
    body: str


class TtlCache:
    """At most `limit` entries, each kept until its own expiry by `clock`; the oldest makes room."""

    def __init__(self, clock: Callable[[], float], limit: int = CACHE_ENTRIES):
        self._clock = clock
        self._limit = max(1, limit)
        self._entries: OrderedDict[Hashable, tuple[float, object]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> object | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self._clock() >= entry[0]:
            del self._entries[key]
            return None
        return entry[1]

    def put(self, key: Hashable, value: object, ttl_s: float) -> None:
        self._entries.pop(key, None)
        self._entries[key] = (self._clock() + ttl_s, value)
        while len(self._entries) > self._limit:
            self._entries.popitem(last=False)


def token_ttl(review: TokenReview) -> float:
    return 0.0 if review.error else AUTHENTICATED_TTL_S


def access_ttl(review: AccessReview) -> float:
    return ALLOWED_TTL_S if review.allowed else DENIED_TTL_S


def redact(text: str, token: str) -> str:
    return text.replace(token, "<token>") if token else text


class TokenAuth:
    def __init__(self, reviewer: Reviewer, lane: Lane, *, timeout_s: float = TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic, log_interval_s: float = LOG_INTERVAL_S,
                 cache_entries: int = CACHE_ENTRIES):
        self._reviewer = reviewer
        self._lane = lane  # its limit is how many reviews run at once
        self._timeout_s = timeout_s
        self._clock = clock
        self._log_interval_s = log_interval_s
        self._hash_key = secrets.token_bytes(32)
        self._tokens = TtlCache(clock, cache_entries)  # HMAC of a token -> TokenReview
        self._decisions = TtlCache(clock, cache_entries)  # (user, path, verb) -> AccessReview
        self._reviews: dict[Hashable, asyncio.Future] = {}  # in flight, by cache key: shared
        self._logged: dict[tuple[str, str], float] = {}  # (reason, client) -> when last logged
        self._unlogged: Counter[tuple[str, str]] = Counter()  # refusals since that line
        self.refusals: Counter[str] = Counter()
        self.reviews: Counter[str] = Counter()  # reviews asked of the API server: token, access

    async def check(self, authorization: str, path: str, client: str = "", verb: str = "get",
                    requested: str = "") -> Refusal | None:
        """None when the request may be answered, else how to refuse it (counted and logged).
        `authorization` is the request's Authorization header, `path` the non-resource URL the
        SubjectAccessReview asks for, `requested` the request's own path when it differs (for the log),
        `client` its peer's address."""
        requested = requested or path
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return self._refuse(NO_TOKEN, UNAUTHORIZED, "Unauthorized\n", requested, client)
        key = hmac.new(self._hash_key, token.encode(), hashlib.sha256).digest()
        try:
            review = await self._cached(self._tokens, key, token_ttl, "token", self._reviewer.review_token, token)
        except ReviewFailed as exc:
            return self._refuse(REVIEW_FAILED, UNAUTHORIZED, "Unauthorized\n", requested, client,
                                detail=f"TokenReview: {redact(str(exc), token)}")
        if review.user is None:
            return self._refuse(TOKEN_REJECTED, UNAUTHORIZED, "Unauthorized\n", requested, client,
                                detail=redact(review.error, token))
        user, said = review.user, f"(user={review.user.name}, verb={verb}, path={path})"
        try:
            decision = await self._cached(self._decisions, (user, path, verb), access_ttl, "access",
                                          self._reviewer.review_access, user, path, verb)
        except ReviewFailed as exc:
            return self._refuse(REVIEW_FAILED, "500 Internal Server Error", f"Authorization error {said}\n",
                                requested, client, user.name, f"SubjectAccessReview: {redact(str(exc), token)}")
        if not decision.allowed:
            return self._refuse(FORBIDDEN, "403 Forbidden", f"Forbidden {said}\n", requested, client, user.name,
                                decision.reason)
        return None

    # ---- reviews -------------------------------------------------------------------------------

    async def _cached(self, cache: TtlCache, key: Hashable, ttl: Callable, kind: str, review: Callable, *args):
        """The cached answer, else the review in flight for `key`, else a new one (a request that goes
        away cancels no other's)."""
        answer = cache.get(key)
        if answer is not None:
            return answer
        pending = self._reviews.get(key)
        if pending is None:
            pending = self._reviews[key] = asyncio.ensure_future(self._review(cache, key, ttl, kind, review, *args))
            pending.add_done_callback(functools.partial(self._reviewed, key))
        return await asyncio.shield(pending)

    def _reviewed(self, key: Hashable, pending: asyncio.Future) -> None:
        if self._reviews.get(key) is pending:
            del self._reviews[key]
        if not pending.cancelled():
            pending.exception()  # each waiter has it; none left is no unretrieved error

    async def _review(self, cache: TtlCache, key: Hashable, ttl: Callable, kind: str, review: Callable, *args):
        self.reviews[kind] += 1
        try:
            async with asyncio.timeout(self._timeout_s):  # the wait for the lane's turn included
                answer = await self._lane.run(review, *args, self._timeout_s + CLIENT_SLACK_S,
                                              timeout=self._timeout_s)
        except (TimeoutError, CallTimeout):
            raise ReviewFailed(f"no answer within {self._timeout_s:g} s") from None
        except RuntimeError as exc:  # the executor closed: the agent is stopping
            raise ReviewFailed(str(exc)) from None
        if seconds := ttl(answer):
            cache.put(key, answer, seconds)
        return answer

    # ---- refusals ------------------------------------------------------------------------------

    def _refuse(self, reason: str, status: str, body: str, path: str, client: str, user: str = "",
                detail: str = "") -> Refusal:
        self.refusals[reason] += 1
        self._log(reason, path, client, user, detail)
        return Refusal(status, reason, body)

    def _log(self, reason: str, path: str, client: str, user: str, detail: str) -> None:
        """At most once per reason and client a log interval, with how many went unlogged before."""
        now, pair = self._clock(), (reason, client)
        last = self._logged.get(pair)
        if last is not None and now - last < self._log_interval_s:
            self._unlogged[pair] += 1
            return
        if pair not in self._logged and len(self._logged) >= LOGGED_PAIRS:
            self._logged = {p: t for p, t in self._logged.items() if now - t < self._log_interval_s}
            self._unlogged = Counter({p: n for p, n in self._unlogged.items() if p in self._logged})
            if len(self._logged) >= LOGGED_PAIRS:  # a flood from many addresses: counted, not logged
                return
        self._logged[pair] = now
        log.warning(f"refused a request for {path}", extra={  # /metrics or /: the two paths it guards
            "reason": reason, "path": path, "client": client, "user": user, "detail": detail[:300],
            "refused_unlogged": self._unlogged.pop(pair, 0)})


class TokenAuthCollector:
    """The refusals of http.token_auth."""

    def __init__(self, node: str, auth: TokenAuth):
        self._node = node
        self._auth = auth

    def describe(self) -> list[Metric]:
        return described((REFUSALS,))

    def collect(self) -> Iterable[Metric]:
        yield REFUSALS.series(self._node, ((reason, self._auth.refusals[reason]) for reason in REASONS))
