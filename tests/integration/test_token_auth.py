"""`http.token_auth` end to end: the real agent in a subprocess checks scrapers' bearer tokens with
an API server stand-in that runs RBAC, over real sockets, through an outage; and the reviewer's
calls against the stand-in's failures. No token ever reaches a log line."""

from __future__ import annotations

import http.client
import secrets

import pytest

from agent.kube.reviews import KubeReviewer
from agent.tokenauth import ReviewFailed, User
from testkit.agent import AgentProcess
from testkit.fakes.kube import KubeStandIn
from testkit.wait import wait_until

REFUSED = "refused a request for /metrics"
REVIEWS = ("tokenreviews.authentication.k8s.io", "subjectaccessreviews.authorization.k8s.io")


class Cluster:
    """The stand-in with RBAC as the chart sets it up: the agent's service account may create reviews
    (and watch its node's pods); Prometheus's service account may get /metrics; a nosy one may not."""

    def __init__(self, standin: KubeStandIn):
        self.standin = standin
        self.tokens = {name: f"{name}-{secrets.token_urlsafe(16)}" for name in ("agent", "prometheus", "nosy")}
        self.agent = standin.add_service_account_token(self.tokens["agent"], "npu", "npu-node-agent")
        standin.allow(user=self.agent, verbs=("create",), resources=REVIEWS)
        standin.allow(user=self.agent, verbs=("list", "watch"), resources=("pods",))
        self.prometheus = standin.add_service_account_token(self.tokens["prometheus"], "monitoring", "prometheus")
        standin.allow(user=self.prometheus, verbs=("get",), paths=("/metrics",))
        self.nosy = standin.add_service_account_token(self.tokens["nosy"], "default", "nosy")

    def token(self, name: str, username: str = "") -> str:
        """A new token (default: another of Prometheus's service account, a rotated one)."""
        self.tokens[name] = f"{name}-{secrets.token_urlsafe(16)}"
        self.standin.add_token(self.tokens[name], username or self.prometheus)
        return self.tokens[name]


@pytest.fixture
def cluster():
    with KubeStandIn(rbac=True) as standin:
        yield Cluster(standin)


def scrape(agent: AgentProcess, token: str = "", path: str = "/metrics",
           source: str = "127.0.0.1") -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of a GET from the `source` address (127/8 is all loopback)."""
    connection = http.client.HTTPConnection("127.0.0.1", agent.http_port, timeout=10, source_address=(source, 0))
    try:
        connection.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode()
    finally:
        connection.close()


def refusals(agent: AgentProcess) -> dict[str, float]:
    return {reason: agent.metric("npu_agent_http_refusals_total", reason=reason)
            for reason in ("no_token", "token_rejected", "forbidden", "review_failed")}


def refusal_lines(agent: AgentProcess) -> list[tuple[str, str, str]]:
    return [(line["reason"], line["client"], line["user"]) for line in list(agent.logs) if line.get("msg") == REFUSED]


def test_scrapers_are_checked_the_kubernetes_way_through_an_outage(cluster, tmp_path):
    standin, tokens = cluster.standin, cluster.tokens
    agent = AgentProcess(tmp_path, {
        "devices": {"backend": "simulated", "simulated": {"devices": 2}},
        "kubernetes": {"enabled": True, "pod_resources_socket": ""},
        "http": {"token_auth": True, "token_auth_timeout_seconds": 1},
    }, env={"KUBECONFIG": standin.write_kubeconfig(tmp_path / "kubeconfig", tokens["agent"])}).start()
    try:
        # The kubelet's probes carry no token.
        wait_until(lambda: agent.http("/readyz")[0] == 200, 20, "/readyz 200 without a token")
        assert agent.http("/healthz")[0] == 200

        status, headers, body = scrape(agent)
        assert (status, body) == (401, "Unauthorized\n") and headers["WWW-Authenticate"].startswith("Bearer")
        status, headers, _ = scrape(agent, "made-up-token")
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        status, _, body = scrape(agent, tokens["nosy"])
        assert (status, body) == (403, "Forbidden (user=system:serviceaccount:default:nosy, verb=get, path=/metrics)\n")
        status, _, body = scrape(agent, tokens["prometheus"])
        assert status == 200 and "npu_chip_info_health_status" in body
        assert [scrape(agent)[0] for _ in range(2)] == [401, 401]

        agent.token = tokens["prometheus"]
        assert refusals(agent) == {"no_token": 3, "token_rejected": 1, "forbidden": 1, "review_failed": 0}
        # Logged once per reason and client, with the user when known.
        assert refusal_lines(agent) == [("no_token", "127.0.0.1", ""), ("token_rejected", "127.0.0.1", ""),
                                        ("forbidden", "127.0.0.1", cluster.nosy)]

        # The API server goes away: a new token is refused, a scraper served before is served from the cache.
        standin.stop()
        rotated = cluster.token("rotated")
        assert scrape(agent, rotated)[0] == 401
        assert scrape(agent, tokens["prometheus"])[0] == 200
        assert refusals(agent)["review_failed"] == 1
        line = next(line for line in agent.logs if line.get("msg") == REFUSED and line["reason"] == "review_failed")
        assert line["detail"].startswith("TokenReview: ") and line["user"] == ""

        # Back: the failure was not cached.
        standin.start()
        assert scrape(agent, rotated)[0] == 200

        # It hangs: the review gives up within its time-out, and nothing else waits for it.
        standin.hang("POST", "tokenreviews")
        status, _, _ = scrape(agent, cluster.token("hung"), source="127.0.0.2")
        assert status == 401 and standin.held == 1 and agent.http("/healthz")[0] == 200
        standin.release()
        # It fails: a TokenReview answered 429 is a 401, a SubjectAccessReview answered 500 a 500 (as the kubelet).
        standin.fail_next("POST", "tokenreviews", 429)
        assert scrape(agent, cluster.token("throttled"))[0] == 401
        standin.fail_next("POST", "subjectaccessreviews", 500)
        grafana = cluster.token("grafana", "system:serviceaccount:monitoring:grafana")
        status, _, body = scrape(agent, grafana, source="127.0.0.3")
        assert (status, body) == (500, "Authorization error (user=system:serviceaccount:monitoring:grafana, "
                                       "verb=get, path=/metrics)\n")
        assert refusals(agent)["review_failed"] == 4
        # Once per reason and client: the 429 from 127.0.0.1 within the minute is counted, not logged.
        details = {line["client"]: line["detail"] for line in list(agent.logs)
                   if line.get("msg") == REFUSED and line["reason"] == "review_failed"}
        assert sorted(details) == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
        assert details["127.0.0.2"] == "TokenReview: no answer within 1 s"
        assert details["127.0.0.3"].startswith("SubjectAccessReview: 500 Internal Server Error: injected failure")
    finally:
        agent.stop()
    stderr = "".join(agent.raw_stderr)
    assert [name for name, token in tokens.items() if token in stderr] == []


def test_the_reviewer_says_what_the_api_server_said_and_never_the_token(cluster):
    standin, tokens = cluster.standin, cluster.tokens
    reviewer = KubeReviewer(lambda: standin.api_client(tokens["agent"]))
    review = reviewer.review_token(tokens["prometheus"], 2)
    assert review.user.name == cluster.prometheus and "system:authenticated" in review.user.groups
    assert reviewer.review_access(review.user, "/metrics", "get", 2).allowed
    assert not reviewer.review_access(User("system:serviceaccount:default:nosy"), "/metrics", "get", 2).allowed

    standin.expire_token(tokens["nosy"])
    assert reviewer.review_token(tokens["nosy"], 2).error.endswith("service account token has expired]")
    for fail, said in ((lambda: standin.fail_next("POST", "tokenreviews", 503), "503 Service Unavailable: injected"),
                       (lambda: standin.hang("POST", "tokenreviews"), "ReadTimeoutError: "),
                       (standin.stop, "MaxRetryError: ")):
        fail()
        with pytest.raises(ReviewFailed) as err:
            reviewer.review_token(tokens["prometheus"], 0.5)
        assert str(err.value).startswith(said) and tokens["prometheus"] not in str(err.value)
        standin.release()
    standin.start()
    # Without RBAC for reviews the API server refuses the agent: the operator reads why.
    unprivileged = KubeReviewer(lambda: standin.api_client(tokens["nosy"].replace("nosy", "other")))
    standin.add_service_account_token(tokens["nosy"].replace("nosy", "other"), "npu", "other")
    with pytest.raises(ReviewFailed) as err:
        unprivileged.review_token(tokens["prometheus"], 2)
    assert str(err.value).startswith('403 Forbidden: tokenreviews.authentication.k8s.io is forbidden: User '
                                     '"system:serviceaccount:npu:other" cannot create resource "tokenreviews"')
