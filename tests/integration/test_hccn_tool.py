"""HccnTool against the fake hccn_tool: values, npu-exporter's failure values, timeouts, a missing tool."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from agent.model import DeviceInfo
from agent.telemetry.hccn import OPTICAL_FAMILIES, STAT_FAMILIES, HccnTool
from testkit.fakes.hccn import (FakeHccn, bandwidth_text, link_stat_text, link_text, speed_text)
from testkit.wait import wait_until

TIMEOUT_S = 10.0  # generous: a busy machine may be slow to start a run
HANG_TIMEOUT_S = 1.0


def chip(phy: int) -> DeviceInfo:
    return DeviceInfo(logic_id=phy, phy_id=phy, card_id=phy, device_id=0, chip_name="910B3", model_name="910B3")


@pytest.fixture
def fake(tmp_path) -> FakeHccn:
    return FakeHccn(tmp_path / "tool", chips=2)


@pytest.fixture
def tool(fake) -> HccnTool:
    return HccnTool(str(fake.path), TIMEOUT_S)


def values(tool: HccnTool, phy: int, read: str) -> dict[str, float]:
    samples = tool.read(chip(phy), read)
    assert all(extra == () and isinstance(value, float) for _, extra, value in samples)
    return {family: value for family, _, value in samples}


def test_reads_and_node(tool):
    assert tool.name == "hccn_tool"
    assert tool.reads(chip(0)) == ("network", "roce", "optical")
    assert tool.node() == []
    assert tool.unsupported() == []


def test_network_values(fake, tool):
    fake.set(1, "link", link_text(False))
    fake.set(1, "bandwidth", bandwidth_text(1234.5, 0.25))
    fake.set(1, "speed", speed_text(100000))
    fake.set(1, "link_stat", link_stat_text(1, 4, 3))
    assert values(tool, 1, "network") == {
        "npu_chip_info_link_status": 0.0, "npu_chip_info_bandwidth_tx": 1234.5, "npu_chip_info_bandwidth_rx": 0.25,
        "npu_chip_link_speed": 100000.0, "npu_chip_link_up_num": 4.0}
    assert values(tool, 0, "network")["npu_chip_info_link_status"] == 1.0  # chips are told apart by -i


def test_roce_values_missing_key_reads_zero(fake, tool):
    counters = {key: n for n, (_, key) in enumerate(STAT_FAMILIES, start=1)}
    fake.set_stat(0, **counters)
    expected = {family: float(counters[key]) for family, key in STAT_FAMILIES}
    assert values(tool, 0, "roce") == expected

    fake.set(0, "stat", "packet statistics:\nroce_rx_all_pkt_num:9\n")
    got = values(tool, 0, "roce")
    assert got.pop("npu_chip_roce_rx_all_pkt_num") == 9.0
    assert got == dict.fromkeys(got, 0.0) and len(got) == len(STAT_FAMILIES) - 1


def test_roce_garbled_value_is_left_out_and_counted(fake, tool):
    fake.set_stat(0, roce_ecn_db_num="lots")
    got = values(tool, 0, "roce")
    assert "npu_chip_info_rx_ecn_num" not in got and len(got) == len(STAT_FAMILIES) - 1
    assert tool.garbled == 1


def test_optical_values(fake, tool):
    fields = {f"Tx_Power{n}": f"0.{n}1 mW" for n in range(4)} | {f"Rx_Power{n}": f"1.{n}2 mW" for n in range(4)}
    fake.set_optical(0, Vcc="3300.50 mV", temperature="51 C", **fields)
    expected = {f"npu_chip_optical_tx_power_{n}": float(f"0.{n}1") for n in range(4)}
    expected |= {f"npu_chip_optical_rx_power_{n}": float(f"1.{n}2") for n in range(4)}
    expected |= {"npu_chip_optical_state": 1.0, "npu_chip_optical_vcc": 3300.5, "npu_chip_optical_temp": 51.0}
    assert values(tool, 0, "optical") == expected


def test_optical_absent_module_and_na(fake, tool):
    fake.set_optical(0, present="not present", Tx_Power0="NA", Rx_Power1="not supported", temperature="hot")
    got = values(tool, 0, "optical")
    assert got["npu_chip_optical_state"] == 0.0
    # NA and `not supported` are npu-exporter's -1, which it leaves out; a garbled value is left out and counted
    assert {"npu_chip_optical_tx_power_0", "npu_chip_optical_rx_power_1", "npu_chip_optical_temp"}.isdisjoint(got)
    assert len(got) == 1 + len(OPTICAL_FAMILIES) - 3
    assert tool.garbled == 1


def test_failed_runs(fake, tool):
    for command in ("link", "bandwidth", "speed", "link_stat", "stat", "optical"):
        fake.fail(0, command, rc=1)  # with its usual output, which a failed run must not yield
    assert values(tool, 0, "network") == {"npu_chip_info_link_status": -1.0}
    assert values(tool, 0, "roce") == {}
    assert values(tool, 0, "optical") == {}
    assert tool.unsupported() == []
    for command in ("link", "stat"):
        fake.clear(0, command)
    assert values(tool, 0, "network") == {"npu_chip_info_link_status": 1.0}  # failures are not remembered
    assert len(values(tool, 0, "roce")) == len(STAT_FAMILIES)


def test_garbled_link_status_is_a_failure(fake, tool):
    fake.set(0, "link", "link status: ???\n")
    assert values(tool, 0, "network")["npu_chip_info_link_status"] == -1.0
    fake.set(0, "link", "")
    assert values(tool, 0, "network")["npu_chip_info_link_status"] == -1.0


def test_unknown_chip_fails(fake, tool):
    assert values(tool, 7, "network") == {"npu_chip_info_link_status": -1.0}


def test_not_supported_is_remembered(fake, tool):
    fake.fail(1, "optical", rc=255, stdout="the command is not supported on this device\n")
    fake.set(1, "link_stat", "link_stat: not support\n")
    assert values(tool, 1, "optical") == {}
    assert "npu_chip_link_up_num" not in values(tool, 1, "network")
    assert tool.unsupported() == [(1, "hccn_tool -link_stat"), (1, "hccn_tool -optical")]
    fake.defaults(1)  # not run again, so a working tool is not noticed for these commands
    assert values(tool, 1, "optical") == {}
    assert "npu_chip_link_up_num" not in values(tool, 1, "network")
    assert values(tool, 0, "optical")  # another chip is unaffected


def test_timeout_kills_and_reaps_the_run(fake):
    tool = HccnTool(str(fake.path), HANG_TIMEOUT_S)
    fake.hang(0, "link", 60)
    started = time.monotonic()
    got = values(tool, 0, "network")
    took = time.monotonic() - started
    assert got["npu_chip_info_link_status"] == -1.0 and got["npu_chip_link_speed"] == 200000.0
    assert HANG_TIMEOUT_S * 0.9 <= took < HANG_TIMEOUT_S + 3 * HANG_TIMEOUT_S  # the other three runs are quick
    pid = fake.hung_pid(0, "link")
    assert pid is not None
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # already reaped: no zombie left behind
    # its `sleep` child was in the same process group and is killed too
    wait_until(lambda: not alive_in_group(pid), 10, f"no process left in group {pid}")


def test_output_is_capped(fake, tool):
    filler = ("x" * 1023 + "\n") * 2048  # 2 MiB
    fake.set(0, "stat", "mac_tx_mac_pause_num:5\n" + filler + "mac_rx_mac_pause_num:6\n")
    got = values(tool, 0, "roce")
    assert got["npu_chip_mac_tx_pause_num"] == 5.0
    assert got["npu_chip_mac_rx_pause_num"] == 0.0  # past the first MiB: not read, so a missing key


@pytest.mark.parametrize("make", ["missing", "not_executable", "directory"])
def test_unusable_tool_turns_the_groups_off(tmp_path, caplog, make):
    path = tmp_path / "hccn_tool"
    if make == "not_executable":
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o644)
    elif make == "directory":
        path.mkdir()
    with caplog.at_level(logging.INFO, logger="agent.telemetry.hccn"):
        tool = HccnTool(str(path), TIMEOUT_S)
        assert tool.reads(chip(0)) == ()
        assert tool.reads(chip(1)) == ()
    assert len([r for r in caplog.records if r.name == "agent.telemetry.hccn"]) == 1
    assert "hccn_tool" in caplog.records[0].getMessage()


def alive_in_group(pgid: int) -> list[int]:
    """Processes (not zombies) whose process group is pgid."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


def test_the_tool_gets_a_minimal_environment(tmp_path, monkeypatch):
    script = tmp_path / "hccn_tool"
    script.write_text('#!/bin/sh\necho "roce_rx_all_pkt_num:${HCCN_TEST_VAR:-0}"\necho "roce_tx_all_pkt_num:1"\n')
    script.chmod(0o755)
    monkeypatch.setenv("HCCN_TEST_VAR", "5")
    got = values(HccnTool(str(script), TIMEOUT_S), 0, "roce")
    assert got["npu_chip_roce_rx_all_pkt_num"] == 0.0 and got["npu_chip_roce_tx_all_pkt_num"] == 1.0


def test_a_failing_command_is_logged_once_until_it_recovers(fake, tool, caplog):
    fake.fail(0, "speed", rc=3)
    with caplog.at_level(logging.INFO, logger="agent.telemetry.hccn"):
        for _ in range(3):
            assert "npu_chip_link_speed" not in values(tool, 0, "network")
        fake.clear(0, "speed")
        assert values(tool, 0, "network")["npu_chip_link_speed"] == 200000.0
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert messages == ["hccn_tool failed", "hccn_tool works again"]
