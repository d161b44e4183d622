"""The status page at `/`: the node's NPUs, the sinks' delivery, the components' readiness and the
driver, on one HTML page an operator reads through `kubectl port-forward`.

It shows what /metrics and /readyz already say (with `http.token_auth` it is authorized as /metrics,
agent.http), read on the event loop from the state the agent holds: the hub's published states (what
the stream and the sinks see), the device monitor, the sinks, the readiness checks, the pod lookup.
Nothing on it is fetched for it, so it answers while a peer hangs.

Plain HTML with one constant style block: no script, no external resource, a Content-Security-Policy
that allows that style block by its hash and nothing else, every value from outside (pod names, codes,
reasons, sink names) HTML-escaped and clipped. Its size is bounded: at most MAX_CODES codes and
MAX_PODS pods listed per NPU (the rest counted; /metrics has them all), text clipped to MAX_TEXT
characters. 64 NPUs of which 16 are faulty (3 codes, a pod each) make a 31 KB page rendered in about
1 ms; all 64 faulty with 12 codes and 2 pods each 106 KB in about 6 ms; the bound, 64 NPUs with 50
codes and 10 pods of the longest names each, 188 KB in about 7-9 ms. A page rendered less than a second
ago is served again, so a flood of requests costs the loop one rendering a second.
"""

from __future__ import annotations

import base64
import hashlib
import html
import time
from typing import Callable, Iterable, Mapping, Protocol, Sequence

from agent import __version__
from agent.model import DeviceInfo, DeviceState, Health, Level, PodsOf, Sink, Snapshot, no_pods

MAX_CODES = 8  # codes listed per NPU, the worst first; the rest counted
MAX_PODS = 4  # containers listed per NPU
MAX_TEXT = 120  # a pod name, sink name or code text is cut here
MAX_REASON = 600  # a readiness reason (a rule file's problems can be long; /readyz has it whole)
MAX_AGE_S = 1.0  # a page rendered this recently is served again
REFRESH_S = 10

HEALTH_MEANS = ("the driver's own verdict on the chip: healthy or unhealthy, unknown when it could not be read "
                "(a failing or hung driver call, a card not read yet)")
LEVEL_MEANS = ("the worst fault level of the NPU's active codes, as the Ascend device plugin ranks them (NormalNPU 0 "
               "… ManuallySeparateNPU 9) after the frequency and duration rules; what ClusterD and the scheduler "
               "act on")

STYLE = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;padding:12px 20px;max-width:1200px;
color:#1d1f21;background:#fff}
h1{font-size:20px;margin:4px 0}h2{font-size:16px;margin:18px 0 6px;border-bottom:1px solid #ddd}
.meta{color:#555;margin:0 0 6px}.meta a{margin-right:10px}
table{border-collapse:collapse;width:100%}th,td{text-align:left;vertical-align:top;padding:4px 8px;
border-bottom:1px solid #eee}th{background:#f4f5f7;font-weight:600}
tr.faulty td{background:#fff1f0}tr.faulty td:first-child{border-left:4px solid #c62828}
tr.warn td,tr.faulty.minor td{background:#fffbe6}
tr.warn td:first-child,tr.faulty.minor td:first-child{border-left:4px solid #e0a800}
.badge{display:inline-block;padding:0 6px;border-radius:3px;font-size:12px;font-weight:600;white-space:nowrap}
.l0{background:#e8f5e9;color:#1b5e20}.l1{background:#eceff1;color:#37474f}.l2{background:#fff8e1;color:#8d6e00}
.l3{background:#ffe0b2;color:#8a3c00}.l4{background:#ffcc80;color:#7a2e00}.l5{background:#ffcc80;color:#7a2e00}
.l6{background:#ffab91;color:#6d1b00}.l7{background:#ef9a9a;color:#5d0000}.l8{background:#c62828;color:#fff}
.l9{background:#7f0000;color:#fff}
.ok{color:#1b5e20;font-weight:600}.bad{color:#c62828;font-weight:600}.unk{color:#8d6e00;font-weight:600}
ul{margin:0;padding:0;list-style:none}td.pods{min-width:16em;overflow-wrap:anywhere}
small,em{color:#777;font-style:normal;font-size:12px;white-space:nowrap}
ul.driver{padding-left:18px;list-style:disc}
code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px}
.muted{color:#777}.legend{color:#444;margin:2px 0}.banner{padding:6px 10px;border-radius:4px;margin:8px 0}
.banner.ok{background:#e8f5e9}.banner.bad{background:#fdecea}
"""
STYLE_HASH = base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()
# Only the style block above may apply; nothing loads, runs, frames the page or is posted from it.
CSP = (f"default-src 'none'; style-src 'sha256-{STYLE_HASH}'; img-src 'none'; base-uri 'none'; "
       "form-action 'none'; frame-ancestors 'none'")
HEADERS = (("Content-Security-Policy", CSP), ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
           ("Referrer-Policy", "no-referrer"))
CONTENT_TYPE = "text/html; charset=utf-8"

HEALTH_TEXT = {Health.HEALTHY: ("healthy", "ok"), Health.UNHEALTHY: ("unhealthy", "bad"),
               Health.UNKNOWN: ("unknown", "unk")}


class Hub(Protocol):
    """What the page reads of the fault hub: the published state of every device."""

    chip_name: str
    current: bool  # every device was polled since the start (else the states are the fault log's last)
    revision: int
    subscribers: int

    def snapshot(self) -> Snapshot: ...


class Driver(Protocol):
    """What the page reads of the device monitor (agent.devices.monitor.DeviceMonitor)."""

    devices: list[DeviceInfo]
    error: str  # why no device is listed
    events_error: str  # why the driver's fault events are not delivered ("" when they are)
    polled_once: bool
    counters: Mapping[str, int]


def esc(value: object, limit: int = MAX_TEXT) -> str:
    """`value` as text, clipped to `limit` characters, escaped for HTML text and attribute values."""
    text = str(value)
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return html.escape(text, quote=True)


def age(seconds: float) -> str:
    """A duration as people read it: 45s, 3m 12s, 2h 05m, 3d 04h."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def since(ms: int, now: float) -> str:
    """How long ago, with the UTC time as its title (shown on hover); "" for no time."""
    if ms <= 0:
        return ""
    return f'<small title="{utc(ms / 1000)}">{age(now - ms / 1000)} ago</small>'


def level_badge(level: Level) -> str:
    return f'<span class="badge l{int(level)}">{level.name}</span>'


class StatusPage:
    content_type = CONTENT_TYPE
    headers = HEADERS

    def __init__(self, node: str, hub: Hub, driver: Driver, sinks: Sequence[Sink],
                 readiness: Callable[[], list[tuple[str, bool, str]]], pods_of: PodsOf = no_pods, *,
                 backend: str = "", clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, max_age_s: float = MAX_AGE_S):
        self._node = node
        self._hub = hub
        self._driver = driver
        self._sinks = tuple(sinks)
        self._readiness = readiness  # agent.lifecycle.Readiness.states: (component, ready, why not)
        self._pods_of = pods_of
        self._backend = backend
        self._clock = clock
        self._monotonic = monotonic
        self._started = monotonic()
        self._max_age_s = max_age_s
        self._last: tuple[float, bytes] | None = None
        self.renderings = 0

    def render(self) -> bytes:
        """The page, rendered on the loop from in-memory state, or the one rendered within max_age_s."""
        now = self._monotonic()
        if self._last is not None and now - self._last[0] < self._max_age_s:
            return self._last[1]
        body = self._page().encode("utf-8")
        self.renderings += 1
        self._last = (now, body)
        return body

    # ---- sections -------------------------------------------------------------------------------

    def _page(self) -> str:
        now = self._clock()
        states = self._readiness()
        not_ready = [(name, why) for name, ok, why in states if not ok]
        node = esc(self._node)
        parts = ['<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
                 f'<meta http-equiv="refresh" content="{REFRESH_S}">',
                 '<meta name="viewport" content="width=device-width,initial-scale=1">',
                 f"<title>npu-node-agent · {node}</title><style>{STYLE}</style></head><body>",
                 f'<h1>npu-node-agent on <span id="node">{node}</span></h1>',
                 f'<p class="meta">version <span id="version">{esc(__version__)}</span> · up '
                 f'<span id="uptime">{age(self._monotonic() - self._started)}</span> · {utc(now)} · refreshes every '
                 # Relative links: they work through the API server's pod proxy too (.../pods/<pod>:9410/proxy/).
                 f'{REFRESH_S}s · <a href="metrics">/metrics</a><a href="healthz">/healthz</a>'
                 f'<a href="readyz">/readyz</a></p>']
        if not_ready:
            parts.append(f'<p class="banner bad" id="ready">not ready: {esc(", ".join(n for n, _ in not_ready))} '
                         f"(reasons below)</p>")
        else:
            parts.append('<p class="banner ok" id="ready">ready: every component works</p>')
        parts += self._npus(now)
        parts += self._delivery(now)
        parts += self._components(states)
        parts += self._driver_section()
        parts.append("</body></html>\n")
        return "".join(parts)

    def _npus(self, now: float) -> list[str]:
        hub, driver = self._hub, self._driver
        listed = {d.phy_id: d for d in driver.devices}
        states = {change.state.phy_id: change.state for change in hub.snapshot().devices}
        phy_ids = sorted(listed.keys() | states.keys())
        faulty = {p for p in phy_ids if p in states and states[p].faulty}
        # Without a code but not healthy either: unhealthy, unknown, or not read yet.
        doubtful = {p for p in phy_ids if p not in states or states[p].health is not Health.HEALTHY} - faulty
        chip = f" {esc(hub.chip_name)}" if hub.chip_name else ""
        out = [f'<h2>NPUs</h2><p id="npu-summary">{len(phy_ids)}{chip} NPU{"s" if len(phy_ids) != 1 else ""}: '
               f'<span class="{"bad" if faulty else "ok"}">{len(faulty)} faulty</span>, '
               f"{len(phy_ids) - len(faulty) - len(doubtful)} healthy"
               + (f", {len(doubtful)} unhealthy or unknown without a code" if doubtful else "") + "</p>",
               f'<p class="legend"><b>HEALTH</b>: {esc(HEALTH_MEANS, 400)}.</p>',
               f'<p class="legend"><b>LEVEL</b>: {esc(LEVEL_MEANS, 400)}.</p>']
        if not hub.current and states:
            out.append('<p class="legend bad">Not every NPU was polled since the start: the states shown are the '
                       "fault log's last.</p>")
        if not phy_ids:
            out.append('<p class="muted" id="no-npus">No NPU listed yet (see Driver below).</p>')
            return out
        out.append('<table id="npus"><thead><tr><th>NPU</th><th>health</th><th>level</th><th>level since</th>'
                   "<th>active codes (level, escalated by, since)</th><th>pods</th></tr></thead><tbody>")
        for phy in phy_ids:
            out.append(self._npu_row(phy, states.get(phy), now))
        out.append("</tbody></table>")
        return out

    def _npu_row(self, phy: int, state: DeviceState | None, now: float) -> str:
        if state is None:
            health, level, codes, started = Health.UNKNOWN, Level.NormalNPU, (), 0
        else:
            health, level, codes, started = state.health, state.level, state.codes, state.level_since_ms
        # Faulty: any active code (red; amber while the worst is NotHandleFault or SubHealthFault).
        row_class = ("faulty minor" if level <= Level.SubHealthFault else "faulty") if codes else (
            "warn" if health is not Health.HEALTHY else "")
        health_text, health_class = HEALTH_TEXT.get(health, ("unknown", "unk"))
        if state is None:
            health_text = "not read yet"
        listed = sorted(codes, key=lambda c: (-int(c.level), c.since_ms, c.code))
        items = []
        for code in listed[:MAX_CODES]:
            escalated = f" <em>escalated by {esc(code.escalated_by)}</em>" if code.escalated_by else ""
            items.append(f"<li><code>{esc(code.text)}</code> {level_badge(code.level)}{escalated} "
                         f"{since(code.since_ms, now)}</li>")
        if len(listed) > MAX_CODES:
            items.append(f'<li class="more"><small>+{len(listed) - MAX_CODES} more (all on /metrics)</small></li>')
        pods = self._pods_of(phy)
        pod_items = [f"<li>{esc(p.namespace)}/{esc(p.pod)} <small>({esc(p.container)})</small></li>"
                     for p in pods[:MAX_PODS]]
        if len(pods) > MAX_PODS:
            pod_items.append(f'<li class="more"><small>+{len(pods) - MAX_PODS} more</small></li>')
        return (f'<tr id="npu-{phy}" class="npu {row_class}" data-level="{level.name if state else "unknown"}">'
                f'<td><b>NPU{phy}</b></td><td class="{health_class}">{health_text}</td>'
                f'<td>{level_badge(level) if state else "<small>unknown</small>"}</td>'
                f"<td>{since(started, now) if codes else ''}</td>"
                f'<td>{"<ul class=codes>" + "".join(items) + "</ul>" if items else "<small>none</small>"}</td>'
                f'<td class="pods">{"<ul>" + "".join(pod_items) + "</ul>" if pod_items else "<small>free</small>"}'
                "</td></tr>")

    def _delivery(self, now: float) -> list[str]:
        hub = self._hub
        out = ["<h2>Delivery</h2>",
               f'<p id="stream">Fault stream: {hub.subscribers} subscriber{"s" if hub.subscribers != 1 else ""}, '
               f"revision {hub.revision}.</p>"]
        if not self._sinks:
            out.append('<p class="muted" id="no-sinks">No sink is enabled (clusterd.enabled, '
                       "kubernetes.device_info_configmap, kubernetes.node_condition, kubernetes.events).</p>")
            return out
        out.append('<table id="sinks"><thead><tr><th>sink</th><th>state</th><th>pending</th><th>last success</th>'
                   "<th>requests by result</th></tr></thead><tbody>")
        for sink in self._sinks:
            ok, why = sink.readiness()
            problems = [w.problem for w in sink.writes if w.problem]
            pending, last = sink.pending, sink.last_success
            # Optional: a best-effort sink (the Events) queues and drops rather than owes; a sink may be
            # failing and retrying without being unready (the node condition after a 5xx).
            queued, dropped = getattr(sink, "queued", None), getattr(sink, "dropped", None) or {}
            failing = getattr(sink, "failing", "")
            if queued is not None:
                pending = queued
            lost = {cause: count for cause, count in sorted(dropped.items()) if count}
            if not ok or problems:
                state, css = f"not ready: {'; '.join(p for p in (why, *problems) if p)}", "bad"
            elif failing:
                state, css = f"failing, retrying: {failing}", "unk"
            elif pending:
                state, css = ("sending (queued)" if queued is not None else "delivering (behind)"), "unk"
            else:
                state, css = "up to date", "ok"
            if lost:  # best-effort: what was not sent, by cause (rate_limited is by design)
                state += f"; dropped {', '.join(f'{cause} {count}' for cause, count in lost.items())}"
                if css == "ok" and set(lost) - {"rate_limited", "namespace_gone"}:
                    css = "unk"
            counters = ", ".join(f"{esc(result)} {count}" for result, count in sorted(sink.counters.items()))
            last_text = (f'<span title="{utc(last)}">{age(now - last)} ago</span>' if last > 0
                         else '<span class="muted">never</span>')
            out.append(f'<tr class="sink" id="sink-{esc(sink.name)}"><td><b>{esc(sink.name)}</b></td>'
                       f'<td class="{css}">{esc(state, MAX_REASON)}</td><td>{int(pending)}</td><td>{last_text}</td>'
                       f'<td>{counters or "<span class=muted>none yet</span>"}</td></tr>')
        out.append("</tbody></table>")
        return out

    def _components(self, states: Iterable[tuple[str, bool, str]]) -> list[str]:
        """Those not ready with their reasons (as /readyz says them), then the names of the ready ones."""
        states = list(states)
        ready = [name for name, ok, _ in states if ok]
        out = ["<h2>Components</h2>"]
        failing = [(name, why) for name, ok, why in states if not ok]
        if failing:
            out.append('<table id="not-ready"><thead><tr><th>not ready</th><th>why</th></tr></thead><tbody>')
            out += [f'<tr class="faulty"><td class="bad">{esc(name)}</td><td>{esc(why, MAX_REASON)}</td></tr>'
                    for name, why in failing]
            out.append("</tbody></table>")
        out.append(f'<p id="ready-components"><span class="ok">ready</span>: '
                   f'{esc(", ".join(ready), MAX_REASON) if ready else "none"}</p>')
        return out

    def _driver_section(self) -> list[str]:
        driver = self._driver
        counters = driver.counters
        backend = f" ({esc(self._backend)})" if self._backend else ""
        if driver.devices:
            count = len(driver.devices)
            listed = f'<span class="ok">{count} NPU{"s" if count != 1 else ""} listed</span>'
        else:
            listed = f'<span class="bad">no NPU listed: {esc(driver.error or "not started", MAX_REASON)}</span>'
        if driver.events_error:
            events = f'<span class="unk">not delivered, polling only: {esc(driver.events_error, MAX_REASON)}</span>'
        else:
            events = '<span class="ok">delivered</span>' if driver.devices else "not subscribed yet"
        polled = "done" if driver.polled_once else '<span class="unk">not finished</span>'
        return [f'<h2>Driver{backend}</h2><ul id="driver" class="driver">',
                f"<li>devices: {listed}</li><li>fault events: {events}</li><li>first poll of every NPU: {polled}</li>",
                f"<li>polls {counters.get('polls', 0)}, read errors {counters.get('read_errors', 0)}, calls timed out "
                f"{counters.get('call_timeouts', 0)}, events {counters.get('events', 0)} (rate-limited "
                f"{counters.get('events_dropped', 0)}, skipped {counters.get('events_skipped', 0)})</li></ul>"]
