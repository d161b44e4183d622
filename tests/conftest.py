"""Shared fixtures: the device plugin's rule files, and real file systems and cgroups a test can break."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.tables import write_rule_files


@pytest.fixture(scope="session")
def rule_dir(tmp_path_factory) -> Path:
    """A directory holding faultCode.json and faultCustomization.json in the device plugin's formats."""
    return write_rule_files(tmp_path_factory.mktemp("rules"))


class SmallFs:
    """A tmpfs of its own: a real file system a test can fill up or remount read-only under a process."""

    def __init__(self, path: Path):
        self.path = path

    def fill(self) -> None:
        """Use up every free byte: the next write that needs a new block fails with ENOSPC."""
        with open(self.path / ".filler", "ab", buffering=0) as handle:
            try:
                while True:
                    handle.write(b"\0" * 4096)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise

    def free(self) -> None:
        (self.path / ".filler").unlink(missing_ok=True)

    def read_only(self, on: bool = True, timeout: float = 10.0) -> None:
        """Remount; a file open for writing at that moment makes the kernel refuse (EBUSY): try again."""
        deadline = time.monotonic() + timeout
        while True:
            done = subprocess.run(["mount", "-o", f"remount,{'ro' if on else 'rw'}", str(self.path)],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"cannot remount {self.path}: {done.stderr.strip()}")
            time.sleep(0.01)


@pytest.fixture
def small_fs():
    path = Path(tempfile.mkdtemp(prefix="npa-fs-", dir="/tmp"))
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        shutil.rmtree(path, ignore_errors=True)
        detail = exc.stderr.decode().strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        pytest.skip(f"a full or read-only disk needs a tmpfs of its own, and this machine cannot mount one "
                    f"(needs root with CAP_SYS_ADMIN): {detail}")
    yield SmallFs(path)
    subprocess.run(["umount", "-l", str(path)], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


PIDS_ROOT = Path("/sys/fs/cgroup/pids")


class PidsLimit:
    """A process in a pids cgroup of its own: the kernel refuses it new threads, as in a pod whose PID
    limit is reached (Python raises RuntimeError: can't start new thread)."""

    def __init__(self, path: Path):
        self.path = path

    def hold(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def freeze(self) -> None:
        """No thread more than the process has now."""
        (self.path / "pids.max").write_text((self.path / "pids.current").read_text().strip())

    def lift(self) -> None:
        (self.path / "pids.max").write_text("max")

    @property
    def refused(self) -> int:
        """Times the limit refused a new thread or process."""
        return int((self.path / "pids.events").read_text().split()[1])


@pytest.fixture
def pids_limit():
    if not (PIDS_ROOT / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 pids hierarchy at /sys/fs/cgroup/pids: a PID limit cannot be put on a process here")
    path = PIDS_ROOT / f"npu-agent-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a pids cgroup (needs root and a writable /sys/fs/cgroup/pids): {exc}")
    yield PidsLimit(path)
    for pid in (path / "cgroup.procs").read_text().split():
        try:
            (PIDS_ROOT / "cgroup.procs").write_text(pid)
        except OSError:  # the process is gone
            pass
    path.rmdir()
