"""hccn_tool's output and processes are bounded: hostile output costs milliseconds and leaves the agent answering,
output past the caps is cut, counted and logged once, and nothing a run starts outlives the run or the agent."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from agent.model import DeviceInfo
from agent.telemetry import hccn as hccn_module
from agent.telemetry.families import GROUPS
from agent.telemetry.hccn import OUTPUT_CAP, STAT_FAMILIES, HccnTool
from testkit import REPO
from testkit.agent import AgentProcess
from testkit.fakes.hccn import OPTICAL_DEFAULTS, STAT_KEYS, FakeHccn, optical_text, stat_text
from testkit.wait import wait_until
from tests.integration.conftest import CARDS, phy

TIMEOUT_S = 10.0  # generous: a busy machine may be slow to start a run
CPU_LIMIT_S = 2.0  # the fixed reads take milliseconds; the old parser took minutes on a few thousand spaces
WALL_LIMIT_S = 30.0
HEALTHZ_LIMIT_S = 2.0
HOSTILE = " " * 100_000 + "\n" + "k" + " " * 50_000 + "x" + " " * 50_000 + ":1\n" + "x" * 500_000 + "\n"
LONG_LINES = "hccn_tool printed lines longer than the line cap; skipping them"
CUT_OUTPUT = "hccn_tool printed more than the output cap; reading only the lines before it"
HCCN_ONLY = {group.name: 1 if group.name in ("network", "roce", "optical") else 0 for group in GROUPS}


def chip(phy_id: int) -> DeviceInfo:
    return DeviceInfo(logic_id=phy_id, phy_id=phy_id, card_id=phy_id, device_id=0, chip_name="910B3",
                      model_name="910B3")


def values(tool: HccnTool, phy_id: int, read: str) -> dict[str, float]:
    return {family: value for family, _, value in tool.read(chip(phy_id), read)}


def left_in_groups(groups, reaper: int | None = None) -> list[psutil.Process]:
    """Processes in any of these process groups: live ones, and zombies `reaper` should have reaped."""
    groups, found = set(groups), []
    for process in psutil.process_iter(["status", "ppid"]):
        try:
            zombie = process.info["status"] == psutil.STATUS_ZOMBIE
            if os.getpgid(process.pid) in groups and (not zombie or process.info["ppid"] == reaper):
                found.append(process)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


def kill_groups(groups) -> None:
    """Cleanup when a test failed: what it left behind must not outlive it."""
    for group in set(groups):
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture
def fake(tmp_path) -> FakeHccn:
    return FakeHccn(tmp_path / "tool", chips=2)


def hostile_fake(fake: FakeHccn, phy_id: int) -> None:
    """Hostile lines first, then the usual ones, whose values must still be read."""
    fake.set(phy_id, "stat", HOSTILE + stat_text({**dict.fromkeys(STAT_KEYS, 0), "roce_rx_all_pkt_num": 7}))
    fake.set(phy_id, "optical", HOSTILE + optical_text({**OPTICAL_DEFAULTS, "temperature": "51 C"}))


# ---- output: CPU time, caps ----------------------------------------------------------------------------------

READ_IN_A_CHILD = """
import json, sys, time
from agent.model import DeviceInfo
from agent.telemetry.hccn import HccnTool
tool = HccnTool(sys.argv[1], 10.0)
device = DeviceInfo(logic_id=0, phy_id=0, card_id=0, device_id=0, chip_name="910B3", model_name="910B3")
started = time.thread_time()  # this thread's CPU: reading the pipe and parsing, not the tool's own
got = {read: {family: value for family, _, value in tool.read(device, read)} for read in ("roce", "optical")}
print(json.dumps({"cpu": time.thread_time() - started, "got": got, "long_lines": tool.long_lines}))
"""


def test_hostile_output_is_read_in_bounded_cpu_time(fake):
    hostile_fake(fake, 0)
    try:  # in a child: a parser that backtracks would hold this process for hours
        done = subprocess.run([sys.executable, "-c", READ_IN_A_CHILD, str(fake.path)], cwd=REPO, capture_output=True,
                              text=True, timeout=WALL_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the reads of hostile output still ran after {WALL_LIMIT_S} s")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["cpu"] < CPU_LIMIT_S, result["cpu"]
    assert result["got"]["roce"]["npu_chip_roce_rx_all_pkt_num"] == 7.0
    assert result["got"]["optical"]["npu_chip_optical_temp"] == 51.0
    assert result["long_lines"] == 2 * 3  # the three hostile lines of each output


def test_long_lines_are_skipped_counted_and_logged_once(fake, caplog):
    tool = HccnTool(str(fake.path), TIMEOUT_S)
    padded = "roce_tx_all_pkt_num:" + " " * hccn_module.LINE_CAP + "5"  # not the tool's format: skipped, not read as 5
    fake.set(0, "stat", "x" * 5000 + "\n" + padded + "\n" + stat_text({"roce_rx_all_pkt_num": 7}))
    with caplog.at_level(logging.INFO, logger="agent.telemetry.hccn"):
        for _ in range(3):
            got = values(tool, 0, "roce")
            assert got["npu_chip_roce_rx_all_pkt_num"] == 7.0 and got["npu_chip_roce_tx_all_pkt_num"] == 0.0
    assert tool.long_lines == 3 * 2
    logged = [r for r in caplog.records if r.getMessage() == LONG_LINES]
    assert len(logged) == 1
    assert (logged[0].device, logged[0].command, logged[0].lines, logged[0].first_line, logged[0].longest,
            logged[0].cap_chars) == (0, "-stat", 2, 1, 5000, hccn_module.LINE_CAP)


def test_a_tool_that_prints_without_end_is_stopped_at_the_output_cap(tmp_path, caplog):
    script = tmp_path / "hccn_tool"
    script.write_text("#!/bin/sh\nprintf 'roce_rx_all_pkt_num:3\\n'\nexec yes filler\n")
    script.chmod(0o755)
    tool = HccnTool(str(script), TIMEOUT_S)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="agent.telemetry.hccn"):
        got = values(tool, 0, "roce")
        values(tool, 0, "roce")
    took = time.monotonic() - started
    assert got["npu_chip_roce_rx_all_pkt_num"] == 3.0
    assert took < TIMEOUT_S / 2  # stopped at the cap, not drained until the deadline
    assert tool.cut_outputs == 2
    logged = [r for r in caplog.records if r.getMessage() == CUT_OUTPUT]
    assert len(logged) == 1 and (logged[0].device, logged[0].command, logged[0].cap_bytes) == (0, "-stat", OUTPUT_CAP)


def test_the_line_the_output_cap_cuts_through_is_not_read(fake):
    tool = HccnTool(str(fake.path), TIMEOUT_S)
    head = "mac_tx_mac_pause_num:5\n" + ("x" * 999 + "\n") * (OUTPUT_CAP // 1000 - 1)
    value_line = "mac_rx_mac_pause_num:123456789\n"
    pad = "y" * (OUTPUT_CAP - len(head) - len("mac_rx_mac_pause_num:1234") - 1) + "\n"
    text = head + pad + value_line + "z\n" * 1000
    assert len(head + pad) + len("mac_rx_mac_pause_num:1234") == OUTPUT_CAP  # the cap falls inside the value
    fake.set(0, "stat", text)
    got = values(tool, 0, "roce")
    assert got["npu_chip_mac_tx_pause_num"] == 5.0
    assert got["npu_chip_mac_rx_pause_num"] == 0.0  # not 1234: a missing key, as past the cap


# ---- processes: nothing outlives its run ----------------------------------------------------------------------

def test_nothing_a_run_leaves_behind_outlives_it(fake):
    tool = HccnTool(str(fake.path), TIMEOUT_S)
    fake.leave_behind(0, "stat", 1000)
    fake.leave_behind(1, "optical", 1000)
    reads = 5
    try:
        for _ in range(reads):
            assert len(values(tool, 0, "roce")) == len(STAT_FAMILIES)
            assert values(tool, 1, "optical")["npu_chip_optical_temp"] == 45.0
        runs = fake.left_behind(0, "stat") + fake.left_behind(1, "optical")
        assert len(runs) == 2 * reads
        groups = {group for group, _ in runs}
        wait_until(lambda: not left_in_groups(groups), 5,
                   lambda: f"no process left in the runs' groups: {left_in_groups(groups)}")
    finally:
        kill_groups(group for group, _ in fake.left_behind(0, "stat") + fake.left_behind(1, "optical"))


def test_a_leftover_holding_stdout_does_not_hold_the_run(fake):
    tool = HccnTool(str(fake.path), TIMEOUT_S)
    fake.leave_behind(0, "stat", 1000, holds_stdout=True)
    try:
        started = time.monotonic()
        got = values(tool, 0, "roce")
        took = time.monotonic() - started
        assert len(got) == len(STAT_FAMILIES)  # the tool exited 0: its run is done, whoever holds the pipe
        assert took < TIMEOUT_S / 2
        groups = {group for group, _ in fake.left_behind(0, "stat")}
        wait_until(lambda: not left_in_groups(groups), 5, lambda: f"no process left: {left_in_groups(groups)}")
    finally:
        kill_groups(group for group, _ in fake.left_behind(0, "stat"))


def test_close_kills_the_runs_in_flight_and_starts_no_more(fake):
    tool = HccnTool(str(fake.path), 60.0)
    fake.hang(0, "optical", 1000)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(values(tool, 0, "optical")), daemon=True)
    reader.start()
    group = wait_until(lambda: fake.hung_pid(0, "optical"), TIMEOUT_S, "the run in flight")
    try:
        tool.close()
        reader.join(TIMEOUT_S)
        assert not reader.is_alive() and got == [{}]  # it returned at once, with nothing read
        wait_until(lambda: not left_in_groups({group}), 5, lambda: f"no process left: {left_in_groups({group})}")
        assert values(tool, 1, "roce") == {}  # no run starts after close()
        assert fake.left_behind(1, "stat") == []
    finally:
        kill_groups({group})


# ---- through the agent ----------------------------------------------------------------------------------------

# Runs the agent as a child subreaper, as PID 1 of its container is: what a run leaves behind is orphaned to it.
AS_PID_1 = ("import ctypes, os, sys\n"
            "if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER\n"
            "    sys.exit('prctl failed')\n"
            "os.execv(sys.argv[1], sys.argv[1:])\n")


@pytest.fixture
def hccn_agent(fake_libs, short_dir, tmp_path):
    """The real agent on the fake libdcmi.so (only its hccn_tool groups on) and the fake hccn_tool."""
    hccn = FakeHccn(tmp_path / "hccn", chips=CARDS)
    agents: list[AgentProcess] = []

    def start(call_timeout_s: float = 5.0, as_pid_1: bool = False) -> AgentProcess:
        config = {"devices": {"backend": "dcmi", "dcmi_library": str(fake_libs / "full" / "libdcmi.so"),
                              "poll_interval_seconds": 1, "call_timeout_seconds": call_timeout_s},
                  "telemetry": {"enabled": True, "hccn_tool": str(hccn.path), "intervals": HCCN_ONLY}}
        agent = AgentProcess(tmp_path, config, {"FAKE_DCMI_CONTROL": str(short_dir / "ctl.sock"),
                                                "FAKE_DCMI_CARDS": str(CARDS)})
        if as_pid_1:
            agent.launcher = [sys.executable, "-c", AS_PID_1]
        agents.append(agent)
        agent.start()
        wait_until(lambda: agent.http("/readyz")[0] == 200, 10, "/readyz 200")
        return agent

    yield hccn, start
    for agent in agents:
        agent.stop()


def chip_value(agent, name: str, logic: int) -> float | None:
    return next((value for (family, labels), value in agent.metrics().items()
                 if family == name and ("id", str(phy(logic))) in labels), None)


def test_the_agent_keeps_answering_while_telemetry_reads_hostile_output(hccn_agent):
    hccn, start = hccn_agent
    hostile_fake(hccn, phy(0))
    agent = start()
    slowest = [0.0]

    def healthz_answers() -> None:
        started = time.monotonic()
        assert agent.http("/healthz")[0] == 200
        slowest[0] = max(slowest[0], time.monotonic() - started)

    def read_hostile_output():
        healthz_answers()
        return (chip_value(agent, "npu_chip_roce_rx_all_pkt_num", 0) == 7
                and chip_value(agent, "npu_chip_optical_temp", 0) == 51)

    wait_until(read_hostile_output, 20, lambda: f"the values after the hostile lines\n{''.join(agent.raw_stderr[-5:])}")
    ok = agent.metric("npu_agent_telemetry_reads_total", group="roce", result="ok")
    # three more rounds of it (one a second), /healthz asked all along
    wait_until(lambda: healthz_answers() or agent.metric("npu_agent_telemetry_reads_total", group="roce",
                                                         result="ok") >= ok + 3 * CARDS, 20, "three more rounds")
    assert slowest[0] < HEALTHZ_LIMIT_S, slowest[0]
    logged = [r for r in agent.logs if r.get("msg") == LONG_LINES]
    assert sorted((r["device"], r["command"], r["lines"], r["first_line"], r["longest"]) for r in logged) == [
        (phy(0), "-optical", 3, 1, 500_000), (phy(0), "-stat", 3, 1, 500_000)]  # once each, though read every second


def test_nothing_a_run_leaves_behind_outlives_the_agent(hccn_agent):
    hccn, start = hccn_agent
    for logic in (0, 1):
        hccn.leave_behind(phy(logic), "stat", 1000)
    hccn.hang(phy(2), "optical", 1000)  # in flight when the agent stops: its deadline is 30 s away
    agent = start(call_timeout_s=30, as_pid_1=True)
    reaper = agent.process.pid

    def left_behind() -> list[tuple[int, int]]:
        return [run for logic in (0, 1) for run in hccn.left_behind(phy(logic), "stat")]

    in_flight = None
    try:
        wait_until(lambda: len(left_behind()) >= 10, 30, "ten runs that left a process behind")
        for logic in (0, 1):
            hccn.clear(phy(logic), "stat")
        groups = {group for group, _ in left_behind()}
        wait_until(lambda: not left_in_groups(groups, reaper), 5,
                   lambda: f"no process left, nor a zombie: {left_in_groups(groups, reaper)}")

        in_flight = wait_until(lambda: hccn.hung_pid(phy(2), "optical"), 30, "an optical run in flight")
        assert left_in_groups({in_flight})
        agent.stop()
        wait_until(lambda: not left_in_groups({in_flight}), 5,
                   lambda: f"no process of the run in flight left: {left_in_groups({in_flight})}")
    finally:
        in_flight = in_flight or hccn.hung_pid(phy(2), "optical")
        kill_groups({group for group, _ in left_behind()} | ({in_flight} if in_flight else set()))
