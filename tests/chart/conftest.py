"""Fixtures for the chart tests: the helm binary, and rendering the chart with a values file."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from testkit import REPO
from tests.chart.helm_binary import HelmUnavailable, helm_path

CHART = REPO / "helm" / "npu-node-agent"
VALUES = Path(__file__).resolve().parent / "values"
VALUE_FILES = sorted(p.stem for p in VALUES.glob("*.yaml"))
RELEASE, NAMESPACE = "npu-node-agent", "npu-system"


@dataclass
class Rendered:
    """The documents `helm template` printed, with lookups by kind and name."""

    docs: list[dict]

    def all(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = [d for d in self.all(kind) if name is None or d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
        return found[0]

    def maybe(self, kind: str, name: str | None = None) -> dict | None:
        found = [d for d in self.all(kind) if name is None or d["metadata"]["name"] == name]
        return found[0] if found else None

    @property
    def pod(self) -> dict:
        return self.one("DaemonSet")["spec"]["template"]

    @property
    def container(self) -> dict:
        return self.pod["spec"]["containers"][0]

    @property
    def agent_config(self) -> dict:
        return yaml.safe_load(self.one("ConfigMap", RELEASE)["data"]["config.yaml"])


def rules(role: dict | None) -> list[dict] | None:
    """A Role's or ClusterRole's resource rules as {apiGroups, resources, verbs}; None: no role."""
    return None if role is None else [{k: r[k] for k in ("apiGroups", "resources", "verbs")} for r in role["rules"]]


class Helm:
    def __init__(self, path: Path):
        self.path = path
        self._cache: dict[tuple, Rendered] = {}

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.path), *args], capture_output=True, text=True, timeout=60)

    def template_args(self, values: str | None, sets: tuple[str, ...], flags: tuple[str, ...] = ()) -> list[str]:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *flags]
        if values:
            args += ["-f", str(VALUES / f"{values}.yaml")]
        for item in sets:
            args += ["--set", item]
        return args

    def render(self, values: str | None = None, *sets: str, flags: tuple[str, ...] = ()) -> Rendered:
        """Render (cached per arguments: the tests only read the result). `flags`: more of helm
        template's options, e.g. ("--api-versions", "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy")."""
        key = (values, sets, flags)
        if key not in self._cache:
            done = self.run(*self.template_args(values, sets, flags))
            assert done.returncode == 0, f"helm template failed:\n{done.stderr}"
            self._cache[key] = Rendered([d for d in yaml.safe_load_all(done.stdout) if d])
        return self._cache[key]

    def render_error(self, values: str | None = None, *sets: str, flags: tuple[str, ...] = ()) -> str:
        """Render that must fail; returns helm's message."""
        done = self.run(*self.template_args(values, sets, flags))
        assert done.returncode != 0, f"helm template unexpectedly succeeded with {values} {sets}"
        return done.stderr


@pytest.fixture(scope="session")
def helm() -> Helm:
    try:
        return Helm(helm_path())
    except HelmUnavailable as exc:
        pytest.fail(f"the chart tests need helm: {exc}")
