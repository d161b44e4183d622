"""The status page (agent.status) rendered from the state the agent holds, and served at / by the HTTP
endpoint: faulty NPUs marked with their levels, codes and pods; every value from outside escaped; its
size bounded for 64 NPUs with many codes and pods; the states of sinks, components and the driver;
its headers (a CSP that allows only its own style block), HEAD, and /metrics' token check."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from html.parser import HTMLParser

from prometheus_client import CollectorRegistry

from agent.common.executor import Executor
from agent.faults.hub import FaultHub
from agent.http import HttpEndpoint
from agent.model import ActiveCode, Change, DeviceInfo, DeviceState, Health, Level, PodRef
from agent.status import MAX_CODES, MAX_PODS, StatusPage
from agent.tokenauth import TokenAuth
from tests.support.clock import FakeClock
from tests.unit.test_tokenauth import PROMETHEUS, Reviewer

NOW = 1_800_000_000.0
EVIL = '<script>alert("x")</script>&"\'><img src=x onerror=alert(1)>'


def code(text: str, level: Level, ago_s: float = 60, escalated_by: str = "") -> ActiveCode:
    return ActiveCode(int(text, 16), text, level, int((NOW - ago_s) * 1000), 2, escalated_by)


def state(phy: int, *codes: ActiveCode, health: Health | None = None) -> DeviceState:
    level = max((c.level for c in codes), default=Level.NormalNPU)
    unhealthy = Health.UNHEALTHY if level >= Level.RestartRequest else Health.HEALTHY
    return DeviceState(phy, phy, health if health is not None else unhealthy, level,
                       min((c.since_ms for c in codes), default=0), codes,
                       int((NOW - 30) * 1000) if codes else 0)


def device(phy: int) -> DeviceInfo:
    return DeviceInfo(phy, phy, phy, 0, "910B3", "910B3-Ascend-V1")


@dataclass
class Driver:
    devices: list[DeviceInfo]
    error: str = ""
    events_error: str = ""
    polled_once: bool = True
    counters: dict = field(default_factory=lambda: {"polls": 40, "read_errors": 1, "call_timeouts": 0, "events": 3})


@dataclass
class Write:
    what: str = "cursor"
    failures: int = 0
    problem: str = ""


@dataclass
class Sink:
    name: str
    pending: int = 0
    last_success: float = 0.0
    counters: Counter = field(default_factory=Counter)
    why_not: str = ""
    writes: tuple = ()

    def readiness(self):
        return not self.why_not, self.why_not


def hub_with(*states: DeviceState, current: bool = True) -> FaultHub:
    hub = FaultHub("node-1")
    hub.publish([Change(i + 1, s) for i, s in enumerate(states)])
    hub.current, hub.chip_name = current, "910B3"
    return hub


def page(states=(), devices=None, sinks=(), components=(("devices", True, ""),), pods=None, node="node-1",
         driver=None, current=True, **kwargs) -> tuple[StatusPage, FakeClock]:
    monotonic = FakeClock(100.0)
    devices = devices if devices is not None else [device(s.phy_id) for s in states]
    built = StatusPage(node, hub_with(*states, current=current), driver or Driver(devices), list(sinks),
                       lambda: list(components), pods or (lambda phy: ()), backend="simulated",
                       clock=lambda: NOW, monotonic=monotonic, **kwargs)
    return built, monotonic


class Dom(HTMLParser):
    """Elements by id, rows' classes, every tag and attribute: what the assertions read."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text_by_id: dict[str, str] = {}
        self._open: list[tuple[str, str | None]] = []
        self._text: dict[str, list[str]] = {}
        self.style = ""
        self._in_style = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        self._in_style = tag == "style"
        if tag in ("td", "th", "li", "p", "tr"):  # cells and items read apart
            self.handle_data(" ")
        if tag in ("meta", "br", "img"):
            return
        self._open.append((tag, attrs.get("id")))
        if attrs.get("id"):
            self._text[attrs["id"]] = []

    def handle_endtag(self, tag):
        self._in_style = False
        while self._open:
            name, ident = self._open.pop()
            if ident:
                self.text_by_id[ident] = " ".join("".join(self._text.pop(ident)).split())
            if name == tag:
                break

    def handle_data(self, data):
        if self._in_style:
            self.style += data
        for _, ident in self._open:
            if ident:
                self._text[ident].append(data)


def test_faulty_npus_are_marked_with_their_levels_codes_escalations_and_pods():
    states = [state(0), state(1, code("80E18402", Level.SeparateNPU, 90)),
              state(5, code("80E18005", Level.ManuallySeparateNPU, 200, "FaultFrequency"),
                    code("80E21007", Level.NotHandleFault, 5)),
              state(6, code("81078603", Level.PreSeparateNPU, 3725, "FaultDuration"))]
    pods = {1: (PodRef("demo", "demo-job-worker-0", "ascend"),), 5: (PodRef("demo", "demo-job-worker-1", "ascend"),)}
    built, _ = page(states, devices=[device(p) for p in range(8)], pods=lambda phy: pods.get(phy, ()))
    text = built.render().decode()
    dom = Dom(text)
    rows = {attrs["id"]: attrs for tag, attrs in dom.tags if tag == "tr" and attrs.get("id", "").startswith("npu-")}
    assert sorted(rows) == [f"npu-{p}" for p in range(8)]
    faulty = sorted(ident for ident, attrs in rows.items() if "faulty" in attrs["class"].split())
    assert faulty == ["npu-1", "npu-5", "npu-6"]
    assert rows["npu-5"]["data-level"] == "ManuallySeparateNPU" and rows["npu-0"]["data-level"] == "NormalNPU"
    assert dom.text_by_id["npu-1"] == ("NPU1 unhealthy SeparateNPU 30s ago 80E18402 SeparateNPU 1m 30s ago "
                                       "demo/demo-job-worker-0 (ascend)")
    # The worst code first, each with its own level, what escalated it and since when.
    assert dom.text_by_id["npu-5"] == ("NPU5 unhealthy ManuallySeparateNPU 30s ago 80E18005 ManuallySeparateNPU "
                                       "escalated by FaultFrequency 3m 20s ago 80E21007 NotHandleFault 5s ago "
                                       "demo/demo-job-worker-1 (ascend)")
    assert "escalated by FaultDuration 1h 02m ago" in dom.text_by_id["npu-6"]
    assert rows["npu-2"]["class"] == "npu warn" and dom.text_by_id["npu-2"] == "NPU2 not read yet unknown none free"
    assert dom.text_by_id["npu-summary"] == "8 910B3 NPUs: 3 faulty, 1 healthy, 4 unhealthy or unknown without a code"
    assert "HEALTH" in text and "LEVEL" in text and 'http-equiv="refresh"' in text
    assert {a["href"] for tag, a in dom.tags if tag == "a"} == {"metrics", "healthz", "readyz"}  # relative: proxies


def test_a_device_listed_but_not_read_yet_and_states_from_the_log_are_said_so():
    built, _ = page([state(0, code("80E18402", Level.SeparateNPU))], devices=[device(0), device(1)], current=False)
    dom = Dom(built.render().decode())
    assert dom.text_by_id["npu-1"] == "NPU1 not read yet unknown none free"
    assert "the states shown are the fault log's last" in built.render().decode()


def test_every_value_from_outside_is_escaped():
    states = [state(0, code("80E18402", Level.SeparateNPU, escalated_by=EVIL))]
    sinks = [Sink(EVIL, pending=1, counters=Counter({EVIL: 2}), why_not=EVIL, writes=(Write(problem=EVIL),))]
    built, _ = page(states, sinks=sinks, node=EVIL, components=[(EVIL, False, EVIL)],
                    pods=lambda phy: (PodRef(EVIL, EVIL, EVIL),),
                    driver=Driver([], error=EVIL, events_error=EVIL))
    text = built.render().decode()
    dom = Dom(text)
    assert "<script" not in text and "<img" not in text
    assert not [(tag, name) for tag, attrs in dom.tags for name in attrs if name.startswith("on")]
    assert {tag for tag, _ in dom.tags} <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "span",
                                            "a", "b", "table", "thead", "tbody", "tr", "th", "td", "ul", "li", "code",
                                            "small", "em"}
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&quot;&#x27;&gt;&lt;img" in text
    assert dom.text_by_id["node"] == EVIL  # escaped, and so shown as it is


def test_sixty_four_npus_with_many_codes_and_pods_stay_small():
    many = [code(f"80E{i:05X}", Level(1 + i % 9), i, "FaultFrequency") for i in range(50)]
    states = [state(p, *many) for p in range(64)]
    pods = tuple(PodRef("n" * 63, f"{i}" + "p" * 252, "c" * 63) for i in range(10))
    built, _ = page(states, pods=lambda phy: pods, sinks=[Sink("clusterd"), Sink("configmap")])
    text = built.render().decode()
    assert len(text.encode()) < 192 * 1024, len(text.encode())
    row = Dom(text).text_by_id["npu-7"]
    assert row.count("80E") == MAX_CODES and "+42 more (all on /metrics)" in row
    assert row.count("(ccc") == MAX_PODS and f"+{10 - MAX_PODS} more" in row
    # The worst listed first: the five ManuallySeparateNPU codes (every 9th from 8), then SeparateNPU ones.
    assert row.index("80E0002C") < row.index("80E00008") < row.index("80E0002B") and "80E00031" not in row
    assert "p" * 200 not in row and "…" in row  # names are clipped


def test_sinks_components_and_the_driver_show_their_state():
    sinks = [Sink("clusterd", pending=3, last_success=NOW - 125, counters=Counter(sent=4, unavailable=2)),
             Sink("configmap", last_success=NOW - 5, counters=Counter(written=7)),
             Sink("other", why_not="cursor file not written: disk full"),
             Sink("writes", writes=(Write(problem="state file: read-only file system"),))]
    components = [("devices", False, "dcmi backend unavailable: libdcmi.so not found"), ("faults", True, ""),
                  ("clusterd", True, "")]
    driver = Driver([], error="dcmi backend unavailable: libdcmi.so not found", events_error="", polled_once=False)
    built, _ = page(sinks=sinks, components=components, driver=driver)
    dom = Dom(built.render().decode())
    assert dom.text_by_id["sink-clusterd"] == "clusterd delivering (behind) 3 2m 05s ago sent 4, unavailable 2"
    assert dom.text_by_id["sink-configmap"] == "configmap up to date 0 5s ago written 7"
    assert dom.text_by_id["sink-other"] == "other not ready: cursor file not written: disk full 0 never none yet"
    assert "not ready: state file: read-only file system" in dom.text_by_id["sink-writes"]
    assert dom.text_by_id["stream"] == "Fault stream: 0 subscribers, revision 0."
    assert dom.text_by_id["ready"] == "not ready: devices (reasons below)"
    assert dom.text_by_id["not-ready"] == "not ready why devices dcmi backend unavailable: libdcmi.so not found"
    assert dom.text_by_id["ready-components"] == "ready: faults, clusterd"
    assert dom.text_by_id["no-npus"] == "No NPU listed yet (see Driver below)."
    assert ("devices: no NPU listed: dcmi backend unavailable: libdcmi.so not found fault events: not subscribed yet "
            "first poll of every NPU: not finished") in dom.text_by_id["driver"]


def test_a_working_node_is_ready_and_says_when_events_are_not_delivered():
    driver = Driver([device(0)], events_error="subscribe failed: -8005")
    built, _ = page([state(0)], driver=driver)
    dom = Dom(built.render().decode())
    assert dom.text_by_id["ready"] == "ready: every component works" and "not-ready" not in dom.text_by_id
    assert dom.text_by_id["ready-components"] == "ready: devices"
    assert "fault events: not delivered, polling only: subscribe failed: -8005" in dom.text_by_id["driver"]
    assert "devices: 1 NPU listed" in dom.text_by_id["driver"]
    assert dom.text_by_id["no-sinks"].startswith("No sink is enabled")


def test_a_page_rendered_within_the_last_second_is_served_again():
    built, monotonic = page([state(0)])
    first = built.render()
    monotonic.advance(0.5)
    assert built.render() is first and built.renderings == 1
    monotonic.advance(0.6)
    second = built.render()
    assert built.renderings == 2 and b"up <span id=\"uptime\">1s</span>" in second


def test_the_content_security_policy_allows_exactly_the_pages_style_block():
    built, _ = page([state(0)])
    dom = Dom(built.render().decode())
    csp = dict(built.headers)["Content-Security-Policy"]
    digest = base64.b64encode(hashlib.sha256(dom.style.encode()).digest()).decode()
    assert f"style-src 'sha256-{digest}'" in csp
    assert csp.startswith("default-src 'none';") and "frame-ancestors 'none'" in csp and "script-src" not in csp
    assert not [a for tag, a in dom.tags if "style" in a]  # no style attribute: the hash would not allow it
    assert dict(built.headers)["Cache-Control"] == "no-store"


async def request(port: int, method: str, path: str, token: str = "") -> tuple[str, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    return status, {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}, body


def serve(built: StatusPage | None, *requests: tuple, auth: TokenAuth | None = None) -> list:
    async def main():
        endpoint = HttpEndpoint("127.0.0.1:0", CollectorRegistry(), lambda: (True, []), page=built, auth=auth)
        await endpoint.start()
        try:
            return [await request(endpoint.port, *r) for r in requests]
        finally:
            await endpoint.stop()

    return asyncio.run(main())


def test_the_endpoint_serves_the_page_with_its_headers_and_head_and_names_it_when_not_found():
    built, _ = page([state(1, code("80E18402", Level.SeparateNPU))])
    (status, headers, body), (head_status, head_headers, head_body), (post, _, _), (missing, _, text) = serve(
        built, ("GET", "/"), ("HEAD", "/"), ("POST", "/"), ("GET", "/index.html"))
    assert status == "HTTP/1.1 200 OK" and head_status == status
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert headers["content-security-policy"] == dict(built.headers)["Content-Security-Policy"]
    assert headers["cache-control"] == "no-store" and headers["x-content-type-options"] == "nosniff"
    assert int(headers["content-length"]) == len(body) and b'id="npu-1" class="npu faulty"' in body
    assert head_body == b"" and head_headers["content-length"] == headers["content-length"]
    assert head_headers["content-security-policy"] == headers["content-security-policy"]
    assert post.startswith("HTTP/1.1 405 ")
    assert missing.startswith("HTTP/1.1 404 ") and text == b"not found: try /, /metrics, /healthz or /readyz\n"
    (without, _, text), = serve(None, ("GET", "/"))
    assert without.startswith("HTTP/1.1 404 ") and text == b"not found: try /metrics, /healthz or /readyz\n"


def test_with_token_auth_the_page_is_authorized_as_metrics(caplog):
    caplog.set_level(logging.WARNING, "agent.tokenauth")
    reviewer = Reviewer()
    auth = TokenAuth(reviewer, Executor("test").lane("kube-reviews", 2), clock=FakeClock())
    built, _ = page([state(0)])
    answers = serve(built, ("GET", "/"), ("GET", "/", "prom-token"), ("HEAD", "/", "prom-token"),
                    ("GET", "/metrics", "prom-token"), ("GET", "/", "nosy-token"), ("GET", "/healthz"), auth=auth)
    (none, none_headers, _), (allowed, _, body), (head, _, head_body), (scrape, _, _), (nosy, _, refused), \
        (health, _, _) = answers
    assert none.startswith("HTTP/1.1 401 ") and none_headers["www-authenticate"].startswith("Bearer")
    assert allowed == "HTTP/1.1 200 OK" and b"<h1>npu-node-agent on" in body
    assert head == "HTTP/1.1 200 OK" and head_body == b"" and scrape == "HTTP/1.1 200 OK"
    assert nosy.startswith("HTTP/1.1 403 ")
    assert refused == b"Forbidden (user=system:serviceaccount:default:nosy, verb=get, path=/metrics)\n"
    assert health == "HTTP/1.1 200 OK"
    # One decision for the page and the scrape: the SubjectAccessReview asks for /metrics, never /.
    assert [c for c in reviewer.calls if c[0] == "access"] == [
        ("access", PROMETHEUS.name, "/metrics", "get"), ("access", "system:serviceaccount:default:nosy", "/metrics",
                                                          "get")]
    lines = [(r.getMessage(), r.path, r.reason) for r in caplog.records if r.getMessage().startswith("refused")]
    assert lines == [("refused a request for /", "/", "no_token"), ("refused a request for /", "/", "forbidden")]


def test_every_level_has_a_badge_of_its_own():
    states = [state(p, code(f"80E1800{p}", level)) for p, level in enumerate(Level) if level is not Level.NormalNPU]
    built, _ = page(states)
    text = built.render().decode()
    assert sorted(set(re.findall(r'class="badge (l\d)"', text))) == [f"l{i}" for i in range(1, 10)]
    # Every NPU with a code is faulty; amber while its worst is NotHandleFault or SubHealthFault, else red.
    classes = {int(a["id"][4:]): a["class"] for tag, a in Dom(text).tags if tag == "tr" and "npu" in a.get("class", "")}
    assert classes == {1: "npu faulty minor", 2: "npu faulty minor", **{p: "npu faulty" for p in range(3, 10)}}


def test_the_kubernetes_writers_show_their_queue_drops_and_retries():
    from agent.sinks.events.sink import KubeEventsSink
    from agent.sinks.nodecondition.sink import NodeConditionSink

    executor = Executor(name="test")
    try:
        events = KubeEventsSink("node-1", FaultHub("node-1"), lambda phy: (), kube=executor.lane("kube"), queue_limit=1)
        events.notify([Change(1, state(0, code("80E18402", Level.SeparateNPU)))])  # occurred: queued, not sent
        events.notify([Change(2, state(0))])  # recovered: the queue is full
        events.dropped["rate_limited"] += 4
        condition = NodeConditionSink("node-1", FaultHub("node-1"), lambda phy: (), polled=lambda: True,
                                      driver_problem=lambda: "", kube=executor.lane("kube"))
        condition.failing = "cannot patch nodes/node-1/status: 503 Service Unavailable"
        built, _ = page(sinks=[events, condition])
        dom = Dom(built.render().decode())
    finally:
        executor.close()
    assert dom.text_by_id["sink-kube-events"] == (
        "kube-events sending (queued); dropped queue_full 1, rate_limited 4 1 never none yet")
    assert dom.text_by_id["sink-node-condition"] == (
        "node-condition failing, retrying: cannot patch nodes/node-1/status: 503 Service Unavailable 0 never none yet")
    assert dom.text_by_id["ready"] == "ready: every component works"  # a retried failure is not unreadiness
