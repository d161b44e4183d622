"""The status page of the real agent, loaded by a real browser: a simulated 8-NPU node with scripted
faults (the demo's codes: a SeparateNPU event, a RestartRequest code only polling sees, a code that
escalates to ManuallySeparateNPU by frequency, a link down escalated by duration, a dropped card),
a kubelet saying which pods hold the NPUs, ClusterD and the device-info ConfigMap as sinks. Headless
chromium renders `/` under the page's Content-Security-Policy; its DOM must show the faulty NPUs with
their levels, codes and pods and the sinks, and its screenshot must be a real picture of the styled
page. Without chromium the browser test is skipped; the page's headers, HEAD and its token check run
regardless."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

import pytest
import yaml

from testkit.agent import AgentProcess
from testkit.fakes.clusterd import ClusterdStandIn
from testkit.fakes.kube import KubeStandIn
from testkit.fakes.kubelet.podresources import PodResourcesStandIn
from testkit.wait import wait_until
from tests.unit.test_status_page import Dom

CHROMIUM = next((found for found in map(shutil.which, ("chromium", "chromium-browser")) if found), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed: install Debian's `chromium` package "
                             "(apt-get install --no-install-recommends chromium); CI does (.ci/run)")
BROWSER_TIMEOUT_S = 60  # a cold start on a busy 2-core machine takes a few seconds; a hang is cut here
RESOURCE = "huawei.com/Ascend910"

SCENARIO = {"steps": [
    {"at": 0.5, "device": 1, "action": "occur", "code": "80E18402", "severity": 3},  # SeparateNPU
    {"at": 0.5, "device": 3, "action": "occur", "code": "80C98009", "via": "poll"},  # RestartRequest, no event
    {"at": 0.5, "device": 6, "action": "occur", "code": "81078603", "severity": 1},  # link down: duration rule
    *({"at": at, "device": 5, "action": action, "code": "80E18005"}  # 3rd occurrence: ManuallySeparateNPU
      for at, action in ((0.5, "occur"), (1.0, "recover"), (1.5, "occur"), (2.0, "recover"), (2.5, "occur"))),
    {"at": 0.5, "device": 7, "action": "drop"},  # the card answers -8012: 40F84E00, RestartNPU
]}
CUSTOMIZATION = {
    "FaultFrequency": [{"EventId": ["80E18005"], "TimeWindow": 3600, "Times": 3,
                        "FaultHandling": "ManuallySeparateNPU", "ReleaseTimeWindow": 3600}],
    "FaultDuration": [{"EventId": ["81078603"], "FaultTimeout": 1, "RecoverTimeout": 10,
                       "FaultHandling": "PreSeparateNPU"}],
}
EXPECTED = {  # NPU -> (level, codes, pod)
    1: ("SeparateNPU", ["80E18402"], "team-a/train-worker-0"),
    3: ("RestartRequest", ["80C98009"], "team-a/train-worker-0"),
    5: ("ManuallySeparateNPU", ["80E18005"], "team-a/train-worker-1"),
    6: ("PreSeparateNPU", ["81078603"], "team-a/train-worker-1"),
    7: ("RestartNPU", ["40F84E00"], "team-a/train-worker-1"),
}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """The agent on its simulated node with a kubelet, ClusterD and an API server, once for the module."""
    workdir = tmp_path_factory.mktemp("status-page")
    (workdir / "scenario.yaml").write_text(yaml.safe_dump(SCENARIO))
    (workdir / "customization.json").write_text(json.dumps(CUSTOMIZATION))
    sockets = Path(tempfile.mkdtemp(prefix="npa-", dir="/tmp"))  # a unix socket path must stay short
    kubelet = PodResourcesStandIn(sockets / "kubelet.sock")
    kubelet.set_pods(("team-a", "train-worker-0", "main", RESOURCE, [f"Ascend910-{i}" for i in range(4)]),
                     ("team-a", "train-worker-1", "main", RESOURCE, [f"Ascend910-{i}" for i in range(4, 8)]))
    with kubelet, ClusterdStandIn() as clusterd, KubeStandIn() as kube:
        agent = AgentProcess(workdir, {
            "devices": {"backend": "simulated", "poll_interval_seconds": 1,
                        "simulated": {"devices": 8, "scenario": str(workdir / "scenario.yaml")}},
            "faults": {"customization_file": str(workdir / "customization.json")},
            "clusterd": {"enabled": True, "address": f"127.0.0.1:{clusterd.port}"},
            "kubernetes": {"enabled": True, "device_info_configmap": True,
                           "pod_resources_socket": str(kubelet.socket_path), "pod_resources_refresh_seconds": 0.5},
        }, env={"KUBECONFIG": kube.write_kubeconfig(workdir / "kubeconfig")}).start()
        try:
            wait_until(lambda: settled(agent), 30, lambda: f"the scenario's faults delivered:\n{agent.http('/')[1]}")
            yield agent
        finally:
            agent.stop()
    shutil.rmtree(sockets, ignore_errors=True)


def npu_rows(dom: Dom) -> dict[int, tuple[str, str, str]]:
    """NPU -> (row class, level, text) of every NPU row."""
    return {int(attrs["id"].split("-")[1]): (attrs["class"], attrs["data-level"], dom.text_by_id[attrs["id"]])
            for tag, attrs in dom.tags if tag == "tr" and attrs.get("id", "").startswith("npu-")}


def settled(agent: AgentProcess) -> bool:
    """Every scripted fault at its level and both sinks up to date with them."""
    status, text = agent.http("/")
    dom = Dom(text)
    rows = npu_rows(dom)
    return (status == 200 and all(rows.get(npu, ("", ""))[1] == level for npu, (level, _, _) in EXPECTED.items())
            and all("up to date" in dom.text_by_id.get(f"sink-{name}", "") for name in ("clusterd", "configmap")))


def check_page(dom: Dom) -> None:
    rows = npu_rows(dom)
    assert sorted(rows) == list(range(8))
    for npu, (row_class, level, text) in rows.items():
        if npu in EXPECTED:
            want_level, codes, pod = EXPECTED[npu]
            assert "faulty" in row_class.split() and level == want_level, (npu, row_class, level)
            assert all(code in text for code in codes) and f"{pod} (main)" in text, (npu, text)
        else:
            assert row_class.split() == ["npu"] and level == "NormalNPU" and "healthy" in text, (npu, text)
    assert "escalated by FaultFrequency" in rows[5][2] and "escalated by FaultDuration" in rows[6][2]
    assert dom.text_by_id["npu-summary"].startswith("8 910B3 NPUs: 5 faulty, 3 healthy")
    assert "sent" in dom.text_by_id["sink-clusterd"] and "written" in dom.text_by_id["sink-configmap"]
    assert dom.text_by_id["node"] == "test-node" and dom.text_by_id["ready"] == "ready: every component works"
    assert "devices: 8 NPUs listed" in dom.text_by_id["driver"]


def browser(url: str, profile: Path, *args: str) -> str:
    """Headless chromium's stdout for `url`; a browser that hangs is killed with its children and the
    test fails saying so."""
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
               "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
               f"--user-data-dir={profile}", *args, url]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # its zygote and renderers share its group: killed together
    try:
        out, err = process.communicate(timeout=BROWSER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"chromium did not finish within {BROWSER_TIMEOUT_S} s: {' '.join(command)}")
    assert process.returncode == 0, f"chromium exited {process.returncode}: {err[-2000:]}"
    return out


def png_rows(data: bytes):
    """(width, height), then each row's bytes, of an 8-bit RGB or RGBA PNG, decoded here (no imaging
    library): a generator, so that a test can stop at the row it was looking for."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    offset, chunks = 8, {}
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset:offset + 8])
        chunks.setdefault(kind, []).append(data[offset + 8:offset + 8 + length])
        offset += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][0][:10])
    assert depth == 8 and colour in (2, 6), (depth, colour)
    yield width, height
    channels = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(b"".join(chunks[b"IDAT"])), width * channels
    previous = bytes(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if kind == 2:  # up: no dependency along the row
            line = bytearray((a + b) & 0xFF for a, b in zip(line, previous))
        elif kind in (1, 3, 4):  # sub, average, paeth: each byte needs the one decoded left of it
            for x in range(stride):
                left = line[x - channels] if x >= channels else 0
                up, corner = previous[x], previous[x - channels] if x >= channels else 0
                if kind == 1:
                    line[x] = (line[x] + left) & 0xFF
                elif kind == 3:
                    line[x] = (line[x] + (left + up) // 2) & 0xFF
                else:
                    p = left + up - corner
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                    line[x] = (line[x] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 0xFF
        previous = bytes(line)
        yield [tuple(previous[x:x + 3]) for x in range(0, stride, channels)]


@needs_chromium
def test_a_browser_shows_the_faulty_npus_their_pods_and_the_sinks(node, tmp_path):
    url = f"http://127.0.0.1:{node.http_port}/"
    started = time.monotonic()
    dom = Dom(browser(url, tmp_path / "profile", "--dump-dom"))
    check_page(dom)
    shot = tmp_path / "page.png"
    browser(url, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1000,1100", "--hide-scrollbars")
    print(f"browser: DOM and screenshot in {time.monotonic() - started:.1f} s")
    rows = png_rows(shot.read_bytes())
    assert next(rows) == (1000, 1100)
    # The page's own style applied (the CSP allows its block by hash): the faulty rows' background and
    # the SeparateNPU badge are painted, beside white and text's anti-aliased shades; read down to them.
    wanted, colours = {(255, 241, 240), (198, 40, 40)}, set()
    for row in rows:
        colours.update(row)
        if wanted <= colours and len(colours) > 50:
            break
    assert wanted <= colours and len(colours) > 50, (wanted - colours, len(colours))


def test_the_real_agent_serves_the_page_with_its_headers_and_head(node):
    connection = http.client.HTTPConnection("127.0.0.1", node.http_port, timeout=10)
    try:
        connection.request("GET", "/")
        response = connection.getresponse()
        body, headers = response.read(), dict(response.getheaders())
        connection.close()
        connection = http.client.HTTPConnection("127.0.0.1", node.http_port, timeout=10)
        connection.request("HEAD", "/")
        head = connection.getresponse()
        head_body, head_headers = head.read(), dict(head.getheaders())
    finally:
        connection.close()
    assert response.status == 200 and head.status == 200 and head_body == b""
    assert headers["Content-Type"] == "text/html; charset=utf-8" and headers["Cache-Control"] == "no-store"
    assert headers["Content-Security-Policy"].startswith("default-src 'none'; style-src 'sha256-")
    assert head_headers["Content-Security-Policy"] == headers["Content-Security-Policy"]
    assert int(headers["Content-Length"]) == len(body) < 64 * 1024
    check_page(Dom(body.decode()))
    assert node.http("/nothing") == (404, "not found: try /, /metrics, /healthz or /readyz\n")


def test_with_token_auth_the_page_needs_a_token_allowed_to_get_metrics(tmp_path):
    with KubeStandIn(rbac=True) as kube:
        tokens = {name: f"{name}-{secrets.token_urlsafe(16)}" for name in ("agent", "prometheus", "nosy")}
        user = kube.add_service_account_token(tokens["agent"], "npu", "npu-node-agent")
        kube.allow(user=user, verbs=("create",),
                   resources=("tokenreviews.authentication.k8s.io", "subjectaccessreviews.authorization.k8s.io"))
        kube.allow(user=user, verbs=("list", "watch"), resources=("pods",))
        prometheus = kube.add_service_account_token(tokens["prometheus"], "monitoring", "prometheus")
        kube.allow(user=prometheus, verbs=("get",), paths=("/metrics",))  # the chart's metrics-reader, no more
        kube.add_service_account_token(tokens["nosy"], "default", "nosy")
        agent = AgentProcess(tmp_path, {
            "devices": {"backend": "simulated", "simulated": {"devices": 2}},
            "kubernetes": {"enabled": True, "pod_resources_socket": ""},
            "http": {"token_auth": True},
        }, env={"KUBECONFIG": kube.write_kubeconfig(tmp_path / "kubeconfig", tokens["agent"])}).start()
        try:
            wait_until(lambda: agent.http("/readyz")[0] == 200, 20, "/readyz 200 without a token")
            assert agent.http("/", token="")[0] == 401
            status, text = agent.http("/", token=tokens["prometheus"])
            assert status == 200 and "<h1>npu-node-agent on" in text
            assert agent.http("/", token=tokens["nosy"]) == (
                403, "Forbidden (user=system:serviceaccount:default:nosy, verb=get, path=/metrics)\n")
            line = agent.wait_for_log("refused a request for /", reason="forbidden")
            assert line["path"] == "/" and line["user"] == "system:serviceaccount:default:nosy"
        finally:
            agent.stop()
