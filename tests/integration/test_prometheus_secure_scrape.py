"""A real Prometheus scrapes the agent the way the chart's ServiceMonitor has it with TLS and token
authentication: HTTPS checked against the CA, its service account's token as the bearer, the API
server stand-in reviewing the tokens. A scraper without the grant and one speaking plaintext are
refused, and Prometheus says why."""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request

import pytest
import yaml

from testkit.agent import AgentProcess
from testkit.certs import Authority, SecretVolume
from testkit.fakes.kube import KubeStandIn
from testkit.wait import wait_until

PROMETHEUS = shutil.which("prometheus")
REVIEWS = ("tokenreviews.authentication.k8s.io", "subjectaccessreviews.authorization.k8s.io")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def api(base: str, path: str, **query) -> dict:
    with urllib.request.urlopen(f"{base}{path}?{urllib.parse.urlencode(query)}", timeout=10) as response:
        return json.load(response)["data"]


@pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus server (Debian's prometheus package; .ci/run "
                                               "installs it)")
def test_prometheus_scrapes_over_tls_with_its_token_and_the_others_are_refused(tmp_path):
    ca = Authority()
    served = ca.issue("agent")
    volume = SecretVolume(tmp_path / "tls", {"tls.crt": served.cert, "tls.key": served.key})
    tokens = {name: f"{name}-{secrets.token_urlsafe(16)}" for name in ("agent", "prometheus", "nosy")}
    with KubeStandIn(rbac=True) as standin:
        agent_user = standin.add_service_account_token(tokens["agent"], "npu", "npu-node-agent")
        standin.allow(user=agent_user, verbs=("create",), resources=REVIEWS)
        prometheus_user = standin.add_service_account_token(tokens["prometheus"], "monitoring", "prometheus")
        standin.allow(user=prometheus_user, verbs=("get",), paths=("/metrics",))
        standin.add_service_account_token(tokens["nosy"], "default", "nosy")
        agent = AgentProcess(tmp_path, {
            "devices": {"backend": "simulated", "simulated": {"devices": 2}},
            "kubernetes": {"enabled": True, "pod_resources_socket": ""},
            "http": {"token_auth": True},
            "tls": {"cert_file": volume.path("tls.crt"), "key_file": volume.path("tls.key")},
        }, env={"KUBECONFIG": standin.write_kubeconfig(tmp_path / "kubeconfig", tokens["agent"])}).start()
        prometheus = None
        try:
            (tmp_path / "ca.pem").write_bytes(ca.cert)
            target = {"static_configs": [{"targets": [f"127.0.0.1:{agent.http_port}"]}]}
            jobs = []
            for name in ("prometheus", "nosy"):
                (tmp_path / f"{name}.token").write_text(tokens[name])
                jobs.append({"job_name": name, "scheme": "https", "tls_config": {"ca_file": str(tmp_path / "ca.pem")},
                             "authorization": {"credentials_file": str(tmp_path / f"{name}.token")}, **target})
            jobs.append({"job_name": "plaintext", "scheme": "http", **target})
            (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(
                {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": jobs}))
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            with open(tmp_path / "prometheus.log", "w") as log:
                prometheus = subprocess.Popen(
                    [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--web.listen-address=127.0.0.1:{port}",
                     f"--storage.tsdb.path={tmp_path / 'tsdb'}"], stdout=log, stderr=subprocess.STDOUT)

            def scraped() -> dict | None:
                found = {t["labels"]["job"]: t for t in api(base, "/api/v1/targets")["activeTargets"]}
                return found if len(found) == 3 and all(t["lastScrape"][:4] != "0001" for t in found.values()) \
                    and found["prometheus"]["health"] == "up" else None

            found = wait_until(scraped, 60, lambda: f"three targets scraped, `prometheus` up:\n"
                               f"{(tmp_path / 'prometheus.log').read_text()[-2000:]}")
            assert found["nosy"]["health"] == "down" and "403" in found["nosy"]["lastError"], found["nosy"]
            assert found["plaintext"]["health"] == "down", found["plaintext"]
            series = wait_until(lambda: api(base, "/api/v1/query", query='npu_chip_info_health_status{job="prometheus"}')
                                ["result"], 30, "the agent's series in Prometheus")
            assert len(series) == 2
            assert not [line for line in agent.raw_stderr if tokens["prometheus"] in line or tokens["nosy"] in line]
        finally:
            if prometheus is not None:
                prometheus.terminate()
                prometheus.wait(30)
            agent.stop()
