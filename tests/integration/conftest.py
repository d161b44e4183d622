"""Fixtures for running the real agent against the fake driver (and other stand-ins)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from testkit.agent import AgentProcess
from testkit.fakes.dcmi import FakeDcmiControl, build_fake_dcmi, physical_id
from testkit.fakes.kube import KubeStandIn
from testkit.fakes.mspti import build_fake_mspti
from testkit.wait import wait_until

CARDS = 8


def phy(logic: int) -> int:
    return physical_id(logic, CARDS)


@pytest.fixture(scope="session")
def fake_libs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fake-dcmi")
    build_fake_dcmi(out, "full")
    build_fake_dcmi(out, "no_subscribe")
    build_fake_dcmi(out, "no_period")
    return out


@pytest.fixture(scope="session")
def fake_mspti_path(tmp_path_factory) -> Path:
    """One fake libmspti.so per test run: it is loaded RTLD_GLOBAL, and a second copy's own calls
    would bind to the first copy's symbols, so every test module must share this one."""
    return build_fake_mspti(tmp_path_factory.mktemp("fake-mspti"))


@pytest.fixture
def short_dir():
    # Unix socket paths must stay under 108 bytes, so keep the control socket out of pytest's long paths.
    path = Path(tempfile.mkdtemp(prefix="npa-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_agent(fake_libs, short_dir, tmp_path):
    agents: list[AgentProcess] = []

    def start(devices: dict | None = None, faults: dict | None = None, variant: str = "full",
              library: str | None = None, wait_ready: bool = True, env: dict | None = None,
              **sections) -> tuple[AgentProcess, FakeDcmiControl]:
        lib = library if library is not None else str(fake_libs / variant / "libdcmi.so")
        config = {"devices": {"backend": "dcmi", "dcmi_library": lib, "poll_interval_seconds": 30,
                              "call_timeout_seconds": 0.5, **(devices or {})},
                  "faults": faults or {}, **sections}
        env = {"FAKE_DCMI_CONTROL": str(short_dir / "ctl.sock"), "FAKE_DCMI_CARDS": str(CARDS), **(env or {})}
        agent = AgentProcess(tmp_path, config, env).start()
        agents.append(agent)
        control = None
        if wait_ready:
            wait_until(lambda: agent.http("/readyz")[0] == 200, 10, "/readyz 200")
            control = FakeDcmiControl(short_dir / "ctl.sock").connect()
        return agent, control

    yield start
    for agent in agents:
        agent.stop()




@pytest.fixture
def kube(tmp_path):
    """A Kubernetes API stand-in and a kubeconfig pointing at it."""
    with KubeStandIn() as standin:
        yield standin, standin.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
def pod_cgroup():
    """make(uid): a real cgroup whose path names the pod UID the way the kubelet names it."""
    made: list[Path] = []

    def make(uid: str) -> Path:
        for hierarchy in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
            path = Path(hierarchy) / "npu-agent-test-kubepods" / f"pod{uid}"
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError:
                continue
            if (path / "cgroup.procs").exists():
                made.append(path)
                return path
        pytest.skip("no cgroup hierarchy can be written here (needs root and a writable /sys/fs/cgroup), "
                    "so no process can be put into a pod's cgroup")

    yield make
    for path in made:
        for directory in (path, path.parent):
            try:
                directory.rmdir()
            except OSError:
                pass
