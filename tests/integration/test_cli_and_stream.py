"""The command line and the fault stream, end to end on the simulated backend."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent._proto import npu_agent_faults_pb2 as pb
from agent._proto import npu_agent_faults_pb2_grpc as pb_grpc
from testkit import REPO
from testkit.agent import AgentProcess
from testkit.wait import wait_until


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def simulated_agent(tmp_path, steps: list[dict]) -> AgentProcess:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({"steps": steps}))
    return AgentProcess(tmp_path, {"devices": {"backend": "simulated", "poll_interval_seconds": 1,
                                               "simulated": {"devices": 4, "scenario": str(scenario)}}}).start()


class BackgroundDemo:
    """`npu-node-agent demo <args>` started now in a process of its own; `result` waits for its end."""

    def __init__(self, base: Path, *args: str):
        self.workdir = base / "demo"
        self.stdout, self.stderr = base / "stdout", base / "stderr"  # files: nobody reads a pipe meanwhile
        self.started = time.monotonic()
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "agent", "demo", *args, "--workdir", str(self.workdir)],
                cwd=REPO, stdout=out, stderr=err, text=True)
        self.took: float | None = None
        self._waiter = threading.Thread(target=self._wait, name="demo", daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        self.process.wait()
        self.took = time.monotonic() - self.started

    def result(self, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
        """What it printed, and how long it ran; killed once `timeout` s have passed since its start."""
        self._waiter.join(max(0.0, self.started + timeout - time.monotonic()))
        if self._waiter.is_alive():
            self.stop()
            raise AssertionError(f"the demo ran over {timeout} s:\n{self.stdout.read_text()[-4000:]}")
        done = subprocess.CompletedProcess(self.process.args, self.process.returncode, self.stdout.read_text(),
                                           self.stderr.read_text())
        return done, self.took

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


DEMO_TEST = "test_demo_shows_faults_appearing_escalating_and_clearing"


@pytest.fixture(scope="module", autouse=True)
def demo(request, tmp_path_factory):
    """The demo plays 27 s of scripted faults and mostly waits on them (2 s of CPU), so it runs from the
    module's start beside the other tests; its test, the module's last, reads what it printed. Started
    only when that test is to run."""
    if not any(item.name == DEMO_TEST for item in request.session.items):
        yield None
        return
    running = BackgroundDemo(tmp_path_factory.mktemp("demo"), "--duration", "27", "--slow-after", "18")
    yield running
    running.stop()  # its test failed or never waited


def test_stream_snapshot_changes_resume_and_health(tmp_path):
    agent = simulated_agent(tmp_path, [
        {"at": 0.5, "device": 2, "action": "occur", "code": "80E18402", "severity": 3},
        {"at": 1.5, "device": 1, "action": "occur", "code": "80C98009"},
        {"at": 2.5, "device": 1, "action": "recover", "code": "80C98009"},
    ])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.NodeFaultsStub(channel)
            stream = stub.Watch(pb.WatchRequest(keepalive_seconds=1), timeout=30)
            first = next(stream)
            assert first.WhichOneof("kind") == "snapshot" and first.snapshot.node == "test-node"
            epoch, seen = first.snapshot.epoch, first.snapshot.revision
            levels = {}
            for message in stream:  # follow until device 1 has come and gone
                if message.WhichOneof("kind") == "change":
                    assert message.change.revision == seen + 1  # no gaps, no repeats
                    seen = message.change.revision
                    levels.setdefault(message.change.device.device, []).append(message.change.device.level)
                    if levels.get(1, [])[-1:] == ["NormalNPU"] and "RestartRequest" in levels.get(1, []):
                        break
            stream.cancel()
            assert "SeparateNPU" in levels[2]
            # Resume from an earlier revision: exactly the changes after it, then keepalives.
            resumed = stub.Watch(pb.WatchRequest(epoch=epoch, since_revision=seen - 2, keepalive_seconds=1), timeout=30)
            kinds = [next(resumed) for _ in range(3)]
            resumed.cancel()
            assert [m.change.revision for m in kinds[:2]] == [seen - 1, seen]
            assert kinds[2].WhichOneof("kind") == "keepalive"
            state = stub.GetFaults(pb.GetFaultsRequest(), timeout=5)
            assert [d.level for d in state.devices] == ["NormalNPU", "NormalNPU", "SeparateNPU", "NormalNPU"]
            assert state.view.state == pb.DeviceView.COMPLETE  # every device listed and read: nothing to warn of

        text = cli("faults", "--target", f"127.0.0.1:{agent.grpc_port}")
        assert text.returncode == 0 and text.stderr == "", text.stderr
        assert "1 of 4 devices with faults" in text.stdout and "80E18402 SeparateNPU" in text.stdout
        listed = [json.loads(line) for line in cli("faults", "--json", "--target", f"127.0.0.1:{agent.grpc_port}").stdout.splitlines()]
        assert [(f["device"], f["codes"], f["level"]) for f in listed] == [(2, ["80E18402"], "SeparateNPU")]
        assert set(listed[0]) >= {"node", "device", "logic_id", "codes", "level", "since_ms", "revision"}
    finally:
        assert agent.stop() < 10


def test_faults_follow_prints_changes(tmp_path):
    agent = simulated_agent(tmp_path, [{"at": 2, "device": 3, "action": "occur", "code": "80E18005"}])
    try:
        follower = subprocess.Popen([sys.executable, "-m", "agent", "faults", "--json", "--follow", "--target",
                                     f"127.0.0.1:{agent.grpc_port}"], cwd=REPO, stdout=subprocess.PIPE, text=True)
        line = json.loads(follower.stdout.readline())
        assert (line["device"], line["level"], line["codes"]) == (3, "RestartNPU", ["80E18005"])
        follower.terminate()
        follower.wait(5)
    finally:
        agent.stop()


def test_faults_reports_an_unreachable_agent_in_one_line():
    result = cli("faults", "--target", "127.0.0.1:1", "--timeout", "0.5")
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "cannot reach" in result.stderr
    assert "Connection refused" in result.stderr  # why, as gRPC said it


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1:99999", "127.0.0.1:0", "::1:9411", "host:", ":9411",
                                     "[::1]"])
def test_faults_refuses_an_address_that_is_not_host_port_at_once(address):
    started = time.monotonic()
    result = cli("faults", "--target", address, "--timeout", "20")
    assert result.returncode == 2 and time.monotonic() - started < 15, result.stderr
    assert f"argument --target: expected HOST:PORT with a port 1-65535 (an IPv6 address in brackets: [::1]:9411), " \
           f"got {address!r}" in result.stderr


def test_faults_says_at_once_when_the_host_does_not_resolve():
    """gRPC reports a failed name lookup as UNAVAILABLE "errors resolving ...": no need to wait the time-out.
    (.invalid never resolves: RFC 2606.)"""
    started = time.monotonic()
    result = cli("faults", "--target", "no-such-agent.invalid:9411", "--timeout", "30")
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("npu-node-agent: cannot resolve the host of no-such-agent.invalid:9411: "), line
    assert took < 25, took


def test_version_flag_help_and_no_command():
    version = cli("version")
    flag = cli("--version")
    assert flag.returncode == 0 and flag.stdout == version.stdout.splitlines()[0] + "\n"
    bare = cli()
    assert bare.returncode == 2 and bare.stdout == ""
    assert bare.stderr.startswith("usage: npu-node-agent") and "npu-node-agent demo" in bare.stderr
    assert "exit codes:" in bare.stderr and "3  faults: the agent cannot see all of its devices" in bare.stderr
    helped = cli("faults", "--help")
    assert helped.returncode == 0 and "--target HOST:PORT" in helped.stdout
    assert "HEALTH   what the driver last said of the chip" in helped.stdout and "exit codes:" in helped.stdout


@pytest.mark.parametrize("where", ["before the command", "after the command"])
def test_log_level_overrides_the_configuration_before_or_after_the_command(tmp_path, where):
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "node_name": "test-node", "state_dir": str(tmp_path / "state"), "profiling": {"root": str(tmp_path / "p")},
        "log": {"level": "error"}, "http": {"listen": "127.0.0.1:0"}, "grpc": {"listen": "127.0.0.1:0"},
        "devices": {"backend": "simulated", "simulated": {"devices": 2}}}))
    command = ["run", "--config", str(config)]
    command = ["--log-level", "debug", *command] if where == "before the command" else [*command, "--log-level", "debug"]
    agent = subprocess.Popen([sys.executable, "-m", "agent", *command], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    levels: set[str] = set()
    threading.Thread(target=lambda: levels.update(json.loads(line)["level"] for line in agent.stderr
                                                  if line.startswith("{")), daemon=True).start()
    try:  # the agent logs at debug from its start (at "error" it would say nothing at all)
        wait_until(lambda: {"debug", "info"} <= levels, 20, lambda: f"debug and info lines; got {levels}")
    finally:
        agent.terminate()
        assert agent.wait(15) == 0


def test_log_level_is_checked():
    result = cli("run", "--log-level", "verbose")
    assert result.returncode == 2
    assert "argument --log-level: invalid choice: 'verbose'" in result.stderr


def test_check_config_lists_type_and_value_problems_at_once_with_suggestions(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"devices": {"pol_interval_seconds": 1, "backend": "nvml",
                                                "call_timeout_seconds": "2"}, "grpc": {"listen": "nowhere"}}))
    result = cli("check-config", str(path))
    assert result.returncode == 2
    assert sorted(result.stderr.splitlines()) == sorted([
        "devices.pol_interval_seconds: unknown key (known: backend, call_timeout_seconds, dcmi_library, "
        "poll_interval_seconds, simulated)",
        "devices.pol_interval_seconds: did you mean devices.poll_interval_seconds?",
        "devices.call_timeout_seconds: expected a number, got '2'",
        "devices.backend: 'nvml' is not dcmi or simulated",
        "grpc.listen: 'nowhere' is not HOST:PORT"])


def test_check_config(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("devices: {backend: simulated}\n")
    assert cli("check-config", str(good)).returncode == 0
    bad = tmp_path / "bad.yaml"
    (tmp_path / "custom.json").write_text(json.dumps({"FaultFrequency": [
        {"EventId": ["80E18005"], "TimeWindow": 10, "Times": 3, "FaultHandling": "ManuallySeparateNPU"}]}))
    bad.write_text(yaml.safe_dump({"devices": {"poll_interval": 5},
                                   "faults": {"customization_file": str(tmp_path / "custom.json")}}))
    result = cli("check-config", str(bad))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert any(line.startswith("devices.poll_interval: unknown key") for line in lines)
    assert "Traceback" not in result.stderr
    bad.write_text(yaml.safe_dump({"faults": {"customization_file": str(tmp_path / "custom.json")}}))
    result = cli("check-config", str(bad))
    assert result.returncode == 2
    assert "custom.json: FaultFrequency[0].TimeWindow: 10 is out of range (allowed range 60..864000)" in result.stderr


def test_run_with_a_bad_config_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpc: {listen: nowhere}\n")
    result = cli("run", "--config", str(bad))
    assert result.returncode == 2
    assert result.stderr.strip() == "npu-node-agent: grpc.listen: 'nowhere' is not HOST:PORT"


def test_version():
    result = cli("version")
    assert result.returncode == 0 and result.stdout.startswith("npu-node-agent 0.1.0")
    assert "native extension: loaded" in result.stdout  # built by pip install (CI has a C compiler)


def test_generated_stubs_are_up_to_date():
    result = subprocess.run([sys.executable, "proto/generate.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_subscriber_resumes_across_an_agent_restart(tmp_path, start_agent):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1})
    with grpc.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as channel:
        stream = pb_grpc.NodeFaultsStub(channel).Watch(pb.WatchRequest(), timeout=30)
        snapshot = next(stream).snapshot
        stream.cancel()
    epoch, seen = snapshot.epoch, snapshot.revision
    fake.occur(0, 0x80E18402)  # changes the subscriber misses while it is away
    fake.occur(1, 0x80E18005)
    wait_until(lambda: agent.fault_of(7) and agent.fault_of(6), 3, "both faults")
    missed = {(f["device"], f["revision"]) for f in agent.faults_json()}
    assert agent.stop() < 10
    fake.close()
    restarted, _ = start_agent(devices={"poll_interval_seconds": 1})
    with grpc.insecure_channel(f"127.0.0.1:{restarted.grpc_port}") as channel:
        stream = pb_grpc.NodeFaultsStub(channel).Watch(
            pb.WatchRequest(epoch=epoch, since_revision=seen, keepalive_seconds=1), timeout=30)
        changes = []
        for message in stream:
            if message.WhichOneof("kind") != "change":
                break
            changes.append(message.change)
        stream.cancel()
    assert all(c.epoch == epoch for c in changes)  # revisions continue: the fault log is durable
    revisions = [c.revision for c in changes]
    assert revisions == list(range(seen + 1, seen + 1 + len(revisions)))
    assert missed <= {(c.device.device, c.revision) for c in changes}


def test_a_listening_port_is_exclusive_and_a_taken_one_is_one_line_naming_the_key(tmp_path):
    (tmp_path / "first").mkdir()
    first = AgentProcess(tmp_path / "first", {"devices": {"backend": "simulated"}}).start()
    try:
        for key, section in (("grpc.listen", "grpc"), ("http.listen", "http")):
            port = first.grpc_port if section == "grpc" else first.http_port
            config = tmp_path / f"second-{section}.yaml"
            config.write_text(yaml.safe_dump({
                "node_name": "second", "state_dir": str(tmp_path / f"state-{section}"), "devices": {"backend": "simulated"},
                "http": {"listen": "127.0.0.1:0"}, "grpc": {"listen": "127.0.0.1:0"},
                section: {"listen": f"127.0.0.1:{port}"}}))
            result = cli("run", "--config", str(config), timeout=30)
            assert result.returncode == 1, result.stderr[-2000:]
            lines = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
            [failure] = [line for line in lines if line["msg"] == "cannot start"]
            assert failure["error"].startswith(f"{key} 127.0.0.1:{port}: cannot listen there"), failure
            assert "Traceback" not in result.stderr
    finally:
        first.stop()


def alias_bomb(levels: int) -> str:
    """A YAML "billion laughs": `levels` lines of nine aliases each stand for 9**levels strings."""
    names = [f"l{i}" for i in range(levels)]
    lines = [f"{names[0]}: &{names[0]} [{', '.join(['lol'] * 9)}]"]
    lines += [f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]" for prev, name in zip(names, names[1:])]
    return "\n".join([*lines, f"node_name: *{names[-1]}", ""])


def unusable_file(path: Path, kind: str) -> None:
    if kind == "not UTF-8":
        path.write_bytes(b"node_name: caf\xe9\n")
    elif kind == "a directory":
        path.mkdir()
    elif kind == "a FIFO":
        os.mkfifo(path)
    elif kind == "an alias bomb":
        path.write_text(alias_bomb(6))  # 531,441 strings: a 3 MB error message once
    elif kind == "nested too deeply":
        path.write_text("[" * 100_000)
    elif kind == "too large":
        path.write_text("# " + "x" * (5 << 20) + "\n")


@pytest.mark.parametrize("command", ["run", "check-config"])
@pytest.mark.parametrize("kind", ["not UTF-8", "a directory", "a FIFO", "an alias bomb", "nested too deeply",
                                  "too large"])
def test_an_unusable_config_file_is_one_short_line_naming_it_and_exit_2(tmp_path, command, kind):
    path = tmp_path / "agent.yaml"
    unusable_file(path, kind)
    result = cli(*(["run", "--config"] if command == "run" else ["check-config"]), str(path), timeout=30)
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = result.stderr.splitlines()
    assert str(path) in line and len(line) < 300, line


def test_a_yaml_alias_used_sparingly_still_works(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text("devices: &d {backend: simulated}\nlog: {level: &l info}\n")
    assert cli("check-config", str(path)).returncode == 0


def test_a_node_name_clusterd_would_refuse_is_refused_by_check_config_and_run(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"node_name": "GPU_Node1", "state_dir": str(tmp_path / "state"),
                                    "devices": {"backend": "simulated"},
                                    "http": {"listen": "127.0.0.1:0"}, "grpc": {"listen": "127.0.0.1:0"}}))
    for command in (["check-config"], ["run", "--config"]):
        result = cli(*command, str(path), timeout=30)
        assert result.returncode == 2, result.stderr[-2000:]
        [line] = result.stderr.splitlines()
        assert "node_name: 'GPU_Node1' is not a node name ClusterD and Kubernetes accept" in line


@pytest.mark.parametrize("scenario,message", [
    ({"steps": [{"at": 1, "device": 0, "action": "drop"}, {"at": float("nan"), "device": 1, "action": "drop"}]},
     "scenario.yaml: steps[1].at: expected seconds 0..31536000, got nan"),
    ({"repeat_every": float("nan"), "steps": [{"at": 0, "device": 0, "action": "drop"}]},
     "scenario.yaml: repeat_every: expected 0 (play once) or seconds 1..31536000, got nan"),
    ({"repeat_every": 0.000001, "steps": [{"at": 0, "device": 0, "action": "drop"}]},
     "scenario.yaml: repeat_every: expected 0 (play once) or seconds 1..31536000, got 1e-06"),
    ({"steps": [{"at": float("inf"), "device": 0, "action": "drop"}]},
     "scenario.yaml: steps[0].at: expected seconds 0..31536000, got inf"),
])
def test_a_scenario_whose_times_are_not_seconds_is_refused_naming_the_entry(tmp_path, scenario, message):
    (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(scenario))
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({
        "node_name": "test-node", "state_dir": str(tmp_path / "state"), "profiling": {"root": str(tmp_path / "p")},
        "http": {"listen": "127.0.0.1:0"}, "grpc": {"listen": "127.0.0.1:0"},
        "devices": {"backend": "simulated", "simulated": {"scenario": str(tmp_path / "scenario.yaml")}}}))
    for command in (["check-config"], ["run", "--config"]):
        result = cli(*command, str(path), timeout=30)  # a NaN once made `run` spin a core, never exit
        assert result.returncode == 2, result.stderr[-2000:]
        [line] = [line for line in result.stderr.splitlines() if not line.startswith("{")]  # (run logs first)
        assert line.endswith(message), line


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1", "1e400", "soon"])
def test_faults_timeout_must_be_a_finite_positive_number(value):
    result = cli("faults", "--target", "127.0.0.1:1", "--timeout", value, timeout=30)  # nan once waited forever
    assert result.returncode == 2
    assert f"argument --timeout: expected seconds > 0 and <= 2592000, got '{value}'" in result.stderr


# Last in the module: the demo has been running since the module started (see `demo`).
def test_demo_shows_faults_appearing_escalating_and_clearing(demo):
    result, took = demo.result(timeout=90)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "http://127.0.0.1:" in out and "/metrics" in out and "npu-node-agent faults --target" in out
    assert "LEVEL   the agent's verdict" in out and "HEALTH  the driver's own reading of the chip" in out  # the legend
    assert re.search(r"rev 1-8 NPU0-7 +NormalNPU +healthy +first reading of 8 NPU\(s\): no fault", out), out
    # Appearing, with the pod holding the NPU; the driver's health follows at the next poll (or in the same line).
    assert re.search(r"NPU1 +SeparateNPU +(un)?healthy +80E18402 occurred: SeparateNPU(; driver health healthy -> "
                     r"unhealthy)?  \[pod demo/demo-job-worker-0\]", out), out
    assert "80E18005 occurred: ManuallySeparateNPU by FaultFrequency" in out  # escalating by frequency
    assert "81078603 NotHandleFault -> PreSeparateNPU by FaultDuration  [pod demo/demo-job-worker-1]" in out
    # Held by its rule on a chip the driver calls healthy again: one line that says so, not a contradiction.
    assert "driver health unhealthy -> healthy; 80E18005 stays ManuallySeparateNPU (held by FaultFrequency)" in out
    assert re.search(r"NPU3 +NormalNPU +healthy +80C98009 cleared", out), out  # found and cleared by polling
    assert "ClusterD <- occur   020011001 NPU1 SeparateNPU pod demo/demo-job-worker-0" in out  # with its pod
    # Every revision printed once, none twice, none left out: `rev 1-8` (the first readings), `rev 9,10` (a fault
    # and the health polled within 0.5 s of it: tests/unit/test_demo_changes.py), `rev 11`.
    revisions = []
    for said in re.findall(r"\] rev ([\d,-]+) ", out):
        for part in said.split(","):
            first, _, last = part.partition("-")
            revisions += range(int(first), int(last or first) + 1)
    assert sorted(revisions) == list(range(1, len(revisions) + 1)) and len(revisions) > 20, revisions
    assert "ClusterD <- recover 020011001 NPU1 SeparateNPU" in out
    assert "DROPPED" not in out
    assert "disk guard: over 1 MiB -> aged " in out  # the simulated job's records
    # rank 5, 15 % slower from 18 s. Evidence is step-indexed: the first verdict may come while the slow steps are
    # half of the last 8 (+8 %, the median of the window) or after (+15 %), as the records happen to be read.
    excess = re.search(r"slow worker 5 \(rank\(s\) 5, stage 1\) of job demo-job: computes \+(\d+)% over", out)
    assert excess and 5 <= int(excess.group(1)) <= 16, out
    assert "slow rank(s) 0-15 of job demo-job: reason=temporal" in out  # every rank waits for it
    assert took < 40  # from its start to its exit: it stops on time
    assert (demo.workdir / "config.yaml").is_file()
    assert cli("check-config", str(demo.workdir / "config.yaml")).returncode == 0
