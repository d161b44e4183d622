"""The image's build steps (.ci/build-image), run here as the Dockerfile runs them, minus Docker.

The installed package goes into a fresh virtualenv created without pip; a .pth file puts the CI
virtualenv's site-packages after the fresh one's own, so the agent's dependencies (and pip) are
found there and only the wheel is installed (`--no-deps`): the same install step as in the image,
without downloading grpcio & co. again. The CI virtualenv's editable install is not seen: it is
hooked up by a .pth file, and .pth files are only read in site directories, which a .pth-added
path is not.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from testkit import REPO

SCRIPT = REPO / ".ci" / "build-image"


def _run(*args: str, python: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": python}, cwd=cwd)
    assert done.returncode == 0, f"build-image {' '.join(args)} failed:\n{done.stdout}{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    had_build_dir = (REPO / "build").exists()
    # From another directory: the script finds the sources next to itself.
    _run("wheel", str(out), python=sys.executable, cwd=out)
    # It builds from a copy of the sources: no build/ (nor egg-info) appears in the work tree.
    assert (REPO / "build").exists() == had_build_dir
    [built] = out.glob("npu_node_agent-*.whl")
    return built


def test_wheel_carries_the_native_extension_and_no_tests(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.fullmatch(r"agent/_native\.cpython-311-.*\.so", n) for n in names), names
    assert "agent/faults/rules/builtin_fault_codes.json" in names
    assert not [n for n in names if n.startswith(("tests/", "bench/", "testkit/"))]


def test_install_into_a_fresh_environment_loads_the_native_extension(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "ci-venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    done = _run("install", str(wheel), "--no-deps", python=str(python))
    assert "native extension: loaded" in done.stdout
    # The agent that runs is the installed one, not the work tree's.
    where = subprocess.run([str(python), "-c", "import agent; print(agent.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert where.startswith(str(site)), where
    # And the layout step's default configuration passes the installed agent's own check.
    _run("layout", str(tmp_path / "root"), python=str(python))
    check = subprocess.run([str(env_dir / "bin" / "npu-node-agent"), "check-config",
                            str(tmp_path / "root/etc/npu-node-agent/config.yaml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_layout(tmp_path):
    root = tmp_path / "root"
    for _ in range(2):  # idempotent: one passwd entry however often it runs
        _run("layout", str(root), python=sys.executable)
    assert (root / "etc/passwd").read_text() == \
        "npu-node-agent:x:65532:65532:npu-node-agent:/nonexistent:/usr/sbin/nologin\n"
    assert (root / "etc/group").read_text() == "npu-node-agent:x:65532:\n"
    state = (root / "var/lib/npu-node-agent").stat()
    if os.getuid() == 0:
        assert (state.st_uid, state.st_gid) == (65532, 65532)


def test_dockerfile_uses_the_script_and_declares_the_runtime():
    dockerfile = (REPO / "Dockerfile").read_text()
    steps = re.findall(r"build-image (\w+)", dockerfile)
    assert steps == ["wheel", "install", "layout"]
    subcommands = re.search(r"^\s*(\w+(?: \| \w+)*)\) cmd=", SCRIPT.read_text(), re.M).group(1).split(" | ")
    assert set(steps) <= set(subcommands)
    assert re.search(r"^FROM python:\$\{PYTHON_VERSION\}-slim-\$\{DEBIAN\}$", dockerfile, re.M)
    assert 'ARG PYTHON_VERSION=3.11' in dockerfile
    for line in ("USER 65532:65532", "EXPOSE 9410 9411", 'ENTRYPOINT ["npu-node-agent"]',
                 'CMD ["run", "--config", "/etc/npu-node-agent/config.yaml"]'):
        assert re.search(rf"^{re.escape(line)}$", dockerfile, re.M), line
    assert "PYTHONDONTWRITEBYTECODE=1" in dockerfile
    healthcheck = re.search(r"HEALTHCHECK .*\n.*\n.*", dockerfile)[0]  # plaintext, else HTTPS (tls.cert_file)
    assert "urlopen('http://127.0.0.1:9410/healthz'" in healthcheck and "urlopen('https://127.0.0.1:9410/healthz'" in healthcheck


def test_docker_context_holds_what_the_dockerfile_copies():
    """.dockerignore admits only the build inputs; every one the Dockerfile copies must be in it."""
    allowed = {line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    dockerfile = (REPO / "Dockerfile").read_text()
    copied = {src for line in re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile, re.M) for src in line.split()}
    copied |= set(re.findall(r"source=(\.ci/[\w-]+)", dockerfile))
    assert copied and copied <= allowed, copied - allowed
    assert all((REPO / path).exists() for path in copied)


def test_the_agent_needs_no_asyncio_kubernetes_client():
    """`build-image install` removes kubernetes/aio from the image; nothing in the agent may use it."""
    import ast
    for path in (REPO / "agent").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            assert not [n for n in names if n.startswith("kubernetes.aio")], f"{path}:{node.lineno} imports {names}"
