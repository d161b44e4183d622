"""Runs the real `npu-node-agent` in a subprocess and observes it only from outside (HTTP, gRPC, logs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from testkit import REPO
from testkit.wait import wait_until


class AgentProcess:
    def __init__(self, workdir: Path, config: dict, env: dict | None = None):
        self.workdir = workdir
        self.config_path = workdir / "agent.yaml"
        base = {"node_name": "test-node", "state_dir": str(workdir / "state"),
                "profiling": {"root": str(workdir / "profiling")},
                "log": {"level": "debug", "format": "json"},
                "http": {"listen": "127.0.0.1:0"}, "grpc": {"listen": "127.0.0.1:0"}}
        for key, value in config.items():
            base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
        self.config_path.write_text(yaml.safe_dump(base))
        self.env = {**os.environ, **(env or {})}
        self.logs: list[dict] = []
        self.raw_stderr: list[str] = []
        self.process: subprocess.Popen | None = None
        self.launcher: list[str] = []  # a command the agent's command line is handed to (it must exec it)
        self.program: list[str] = [sys.executable, "-m", "agent"]  # or the `npu-node-agent` console script
        self.http_port = self.grpc_port = 0
        self.token = ""  # the bearer token http() sends (http.token_auth)

    def start(self, ready_timeout: float = 20.0) -> "AgentProcess":
        self.logs.clear()
        self.process = subprocess.Popen(
            [*self.launcher, *self.program, "run", "--config", str(self.config_path)],
            cwd=REPO, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read_stderr, daemon=True).start()
        http = self.wait_for_log("http endpoint listening", ready_timeout)
        grpc = self.wait_for_log("grpc server listening", ready_timeout)
        self.http_port = int(http["address"].rsplit(":", 1)[1])
        self.grpc_port = int(grpc["address"].rsplit(":", 1)[1])
        return self

    def _read_stderr(self) -> None:
        for line in self.process.stderr:
            self.raw_stderr.append(line)
            try:
                self.logs.append(json.loads(line))
            except ValueError:
                pass

    def wait_for_log(self, message: str, timeout: float = 10.0, **fields) -> dict:
        def find():
            return next((r for r in list(self.logs) if r.get("msg") == message
                         and all(r.get(k) == v for k, v in fields.items())), None)
        return wait_until(find, timeout,
                          lambda: f"log line {message!r} {fields or ''}\n{''.join(self.raw_stderr[-20:])}")

    def stop(self, timeout: float = 10.0) -> float:
        """SIGTERM, and how long the agent took to exit (it must exit 0 within `timeout`)."""
        if self.process is None or self.process.poll() is not None:
            return 0.0
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"agent did not stop within {timeout}s of SIGTERM")
        assert code == 0, f"agent exited {code}:\n{''.join(self.raw_stderr[-30:])}"
        return time.monotonic() - started

    # ---- views from outside ---------------------------------------------------------------------

    def http(self, path: str, token: str | None = None) -> tuple[int, str]:
        """(status, body) of a GET, with `token` (default: self.token) as its bearer token when there is one."""
        token = self.token if token is None else token
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}{path}",
                                         headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metrics(self) -> dict[tuple, float]:
        """{(name, frozenset(labels without node)): value} of the agent's scrape; every sample must carry node
        and none `job`."""
        status, text = self.http("/metrics")
        assert status == 200
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = dict(sample.labels)
                assert labels.pop("node", None) == "test-node", f"{sample.name} lacks the node label"
                assert "job" not in labels, f"{sample.name}: `job` is the scrape's own label"
                if "pod_name" in labels and labels["pod_name"] == "":  # a free NPU: match without its pod labels
                    for key in ("namespace", "pod_name", "container_name"):
                        labels.pop(key, None)
                labels.pop("vdie_id", None)  # a chip's fixed identity: tests match chips by id (series() has all)
                labels.pop("pcie_bus_info", None)
                samples[(sample.name, frozenset(labels.items()))] = sample.value
        return samples

    def series(self, name: str) -> dict[str, tuple[dict[str, str], float]]:
        """{id: (every label, value)} of one per-chip family, exactly as scraped."""
        status, text = self.http("/metrics")
        assert status == 200
        found = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    assert sample.labels["id"] not in found, f"two {name} series for chip {sample.labels['id']}"
                    found[sample.labels["id"]] = (dict(sample.labels), sample.value)
        return found

    def metric(self, name: str, **labels) -> float | None:
        return self.metrics().get((name, frozenset((k, str(v)) for k, v in labels.items())))

    def faults_json(self) -> list[dict]:
        result = subprocess.run([sys.executable, "-m", "agent", "faults", "--json", "--target",
                                 f"127.0.0.1:{self.grpc_port}"], cwd=REPO, capture_output=True, text=True, timeout=30)
        # 3: the agent said it cannot see all of its devices (e.g. a driver call hangs); the list is its last known
        assert result.returncode in (0, 3), result.stderr
        return [json.loads(line) for line in result.stdout.splitlines()]

    def fault_of(self, device: int) -> dict | None:
        return next((f for f in self.faults_json() if f["device"] == device), None)
