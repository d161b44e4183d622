"""The real `npu-node-agent run` against a fake libdcmi.so built from C (same ABI, loaded by dlopen)."""

from __future__ import annotations

import ctypes
import json
import os
import time
from pathlib import Path

import pytest

from agent.devices import dcmi_abi as abi
from testkit.agent import AgentProcess
from testkit.fakes.dcmi import FakeDcmiControl
from testkit.wait import wait_until
from tests.integration.conftest import CARDS, phy

DEADLINE = 2.0  # faults must show in /metrics and `faults --json` within this


def visible(agent: AgentProcess, logic: int, code: str, level: str) -> bool:
    """The fault is in /metrics and in `faults --json` with the expected level."""
    if agent.metric("npu_agent_device_fault", id=phy(logic), fault_code=code, fault_level=level) != 1:
        return False
    fault = agent.fault_of(phy(logic))
    return bool(fault and code in fault["codes"] and fault["level"] == level and fault["logic_id"] == logic)


def cleared(agent: AgentProcess, logic: int) -> bool:
    return agent.fault_of(phy(logic)) is None and agent.metric("npu_agent_device_fault_level", id=phy(logic)) == 0


def test_event_fault_appears_within_2s_and_recovers(start_agent):
    agent, fake = start_agent()  # polling every 30 s: only the event can be this fast
    assert agent.metric("machine_npu_nums") == CARDS
    assert agent.metric("npu_chip_info_health_status", id=phy(2), model_name="910B3-Ascend-V1") == 1

    fake.occur(2, 0x80E18402, severity=3)
    started = time.monotonic()
    wait_until(lambda: visible(agent, 2, "80E18402", "SeparateNPU"), DEADLINE, "event fault on /metrics and faults --json")
    assert time.monotonic() - started < DEADLINE
    fault = agent.fault_of(phy(2))
    assert fault["node"] == "test-node" and fault["since_ms"] > 0 and fault["revision"] > 0
    assert agent.metric("npu_agent_device_fault_level", id=phy(2)) == 8
    assert agent.metric("npu_agent_fault_events_total", assertion="occur") >= 1

    fake.recover(2, 0x80E18402)
    wait_until(lambda: cleared(agent, 2), DEADLINE, "recovery (1 s confirmation poll included)")
    assert agent.metric("npu_chip_info_health_status", id=phy(2), model_name="910B3-Ascend-V1") == 1


def test_fault_without_event_is_found_by_polling(start_agent):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1})
    fake.occur(0, 0x80C98009, via="silent")  # the driver lists the code but sends no event
    wait_until(lambda: visible(agent, 0, "80C98009", "RestartRequest"), DEADLINE, "polled fault")
    fake.recover(0, 0x80C98009, via="silent")
    wait_until(lambda: cleared(agent, 0), DEADLINE, "polled recovery")


def test_dropped_card_reports_the_card_drop_code(start_agent):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1})
    fake.drop(1)
    wait_until(lambda: visible(agent, 1, "40F84E00", "RestartNPU"), DEADLINE, "card drop")
    # The health call fails (-8012): unknown, as npu-exporter shows it.
    assert agent.metric("npu_chip_info_health_status", id=phy(1), model_name="910B3-Ascend-V1") == -1
    fake.restore(1)
    wait_until(lambda: cleared(agent, 1), DEADLINE, "card back")


def test_hung_driver_call_makes_devices_unknown_not_the_agent(start_agent):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1})
    fake.occur(3, 0x80E18005)
    wait_until(lambda: visible(agent, 3, "80E18005", "RestartNPU"), DEADLINE, "fault before the hang")
    fake.hang("dcmi_get_device_health", 60)
    wait_until(lambda: agent.metric("npu_chip_info_health_status", id=phy(0), model_name="910B3-Ascend-V1") == -1,
               DEADLINE + 1, "health -1 while the driver hangs")
    # The agent still answers, without waiting for the hung call (60 s), and keeps the last known faults.
    # Timed: its own answers only (the CLI that `visible` also runs starts a Python process, which
    # on a busy machine takes seconds by itself).
    started = time.monotonic()
    assert agent.http("/healthz")[0] == 200
    assert agent.metric("npu_agent_device_fault", id=phy(3), fault_code="80E18005", fault_level="RestartNPU") == 1
    assert time.monotonic() - started < 5
    assert visible(agent, 3, "80E18005", "RestartNPU")
    assert agent.metric("npu_agent_driver_call_timeouts_total") >= 1
    agent.wait_for_log("device read failed; its last known faults stay", device=phy(0))
    fake.hang("dcmi_get_device_health", 0)
    wait_until(lambda: agent.metric("npu_chip_info_health_status", id=phy(0), model_name="910B3-Ascend-V1") == 1,
               DEADLINE + 1, "health back after the hang")


def test_a_driver_that_answers_late_every_time_is_logged_once_per_device(start_agent):
    """Calls that take longer than call_timeout_seconds fail as "no answer" and then as "the previous
    call has not returned yet", in turn: that is one problem, logged once, not at every poll."""
    agent, fake = start_agent(devices={"poll_interval_seconds": 1})
    fake.hang("dcmi_get_device_health", 1.7)
    wait_until(lambda: agent.metric("npu_agent_driver_call_timeouts_total") >= 8 * 4, 30, "calls timing out")
    failed = [r for r in agent.logs if r.get("msg") == "device read failed; its last known faults stay"]
    assert sorted(r["device"] for r in failed) == sorted(phy(n) for n in range(8)), failed
    fake.hang("dcmi_get_device_health", 0)
    agent.wait_for_log("device read works again", timeout=DEADLINE + 5, device=phy(0))


def test_the_device_plugins_tables_escalate_and_the_escalation_survives_a_restart(start_agent, rule_dir):
    faults = {"fault_code_file": str(rule_dir / "faultCode.json"),
              "customization_file": str(rule_dir / "faultCustomization.json")}
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, faults=faults)
    for _ in range(3):  # 80E18005: 3 times in 24 h -> ManuallySeparateNPU
        fake.occur(4, 0x80E18005)
        wait_until(lambda: agent.fault_of(phy(4)), DEADLINE, "occurrence seen")
        fake.recover(4, 0x80E18005)
        wait_until(lambda: (agent.fault_of(phy(4)) or {}).get("level") in (None, "ManuallySeparateNPU"),
                   DEADLINE + 1, "recovery or escalation")
    wait_until(lambda: visible(agent, 4, "80E18005", "ManuallySeparateNPU"), DEADLINE, "frequency escalation")
    assert agent.fault_of(phy(4))["escalated"] == {"80E18005": "FaultFrequency"}
    assert agent.stop() < 10

    fake.close()
    restarted, _ = start_agent(devices={"poll_interval_seconds": 1}, faults=faults)
    wait_until(lambda: visible(restarted, 4, "80E18005", "ManuallySeparateNPU"), DEADLINE,
               "escalation restored from state_dir after the restart")


def test_polling_alone_works_without_the_subscribe_symbol(start_agent):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, variant="no_subscribe")
    agent.wait_for_log("fault events unavailable; relying on polling")
    assert agent.metric("npu_agent_driver_events_subscribed") == 0
    fake.occur(5, 0x80E18402)
    wait_until(lambda: visible(agent, 5, "80E18402", "SeparateNPU"), DEADLINE, "fault found by polling")


def test_missing_library_keeps_the_agent_up_and_not_ready(start_agent, tmp_path):
    agent, _ = start_agent(library=str(tmp_path / "nowhere" / "libdcmi.so"), wait_ready=False)
    # Until the monitor's first attempt to open the library, the component is only "not started".
    status, body = wait_until(lambda: (lambda r: r if r[0] == 503 and "devices" in r[1] and "not started" not in r[1]
                                       else None)(agent.http("/readyz")), 10, "readyz 503 with the driver's reason")
    assert "no such file" in body
    assert agent.http("/healthz")[0] == 200
    assert agent.metric("npu_agent_component_ready", component="devices") == 0
    agent.wait_for_log("devices unavailable; retrying")


def test_rule_files_reload_at_runtime_and_a_bad_one_keeps_the_old_rules(start_agent, tmp_path):
    table = tmp_path / "faultCode.json"
    table.write_text(json.dumps({"NotHandleFaultCodes": ["12345678"]}))
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, faults={"fault_code_file": str(table)})
    fake.occur(6, 0x12345678, severity=3)
    wait_until(lambda: visible(agent, 6, "12345678", "NotHandleFault"), DEADLINE, "fault with the first table")
    table.write_text(json.dumps({"SeparateNPUCodes": ["12345678"]}))
    wait_until(lambda: visible(agent, 6, "12345678", "SeparateNPU"), 5, "reclassified after the reload")
    table.write_text('{"SeparateNPUCodes": [')
    agent.wait_for_log("fault rule reload failed; the previous rules stay in force", timeout=5)
    assert visible(agent, 6, "12345678", "SeparateNPU")
    status, body = agent.http("/readyz")
    assert status == 503 and "invalid JSON" in body
    assert agent.metric("npu_agent_fault_rule_reloads_total", result="failure") == 1


def test_struct_layouts_match_the_c_compiler(fake_libs):
    lib = ctypes.CDLL(str(fake_libs / "full" / "libdcmi.so"))
    lib.fake_dcmi_layout.restype = ctypes.c_char_p
    layout = json.loads(lib.fake_dcmi_layout())
    # Sizes from the DCMI header, and the compiler's own view of every field.
    expected_sizes = {"dcmi_dms_fault_event": 352, "dcmi_event": 360, "dcmi_event_filter": 48, "dcmi_chip_info": 100,
                      "dcmi_die_id": 20, "dcmi_pcie_info_all": 64}
    for name, cls in {"dcmi_dms_fault_event": abi.DmsFaultEvent, "dcmi_event": abi.Event,
                      "dcmi_event_filter": abi.EventFilter, "dcmi_chip_info": abi.ChipInfo,
                      "dcmi_die_id": abi.DieId, "dcmi_pcie_info_all": abi.PcieInfoAll}.items():
        assert ctypes.sizeof(cls) == layout[name]["size"] == expected_sizes[name], name
        for field, offset in layout[name].items():
            if field != "size":
                assert getattr(cls, field).offset == offset, f"{name}.{field}"


def test_sigterm_while_a_driver_call_hangs_still_stops_within_10s(start_agent):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1})
    fake.hang("dcmi_get_device_errorcode_v2", 600)
    agent.wait_for_log("device read failed; its last known faults stay", timeout=5)
    assert agent.stop() < 10


@pytest.mark.parametrize("content", ["[]", '{"devices": {"3": {"frequency": {"80E18005": {"level": "Bogus"}}}}}',
                                     "[" * 100_000 + "]" * 100_000, "not json",
                                     '{"devices": {"3": {"occurrences": {"80E18005": [1e400]}}}}'])
def test_an_escalation_history_of_the_wrong_shape_is_moved_aside_and_the_agent_starts(start_agent, tmp_path, content):
    state = tmp_path / "state"
    state.mkdir()
    (state / "fault-history.json").write_text(content)
    agent, fake = start_agent(devices={"poll_interval_seconds": 1})  # ready: the first poll finished
    line = agent.wait_for_log("escalation history of the wrong shape; moved aside, starting without it")
    assert Path(line["moved_to"]).read_text() == content
    fake.occur(1, 0x80E18402)
    wait_until(lambda: agent.fault_of(phy(1)), 3, "a fault after the restart")


def replace(path: Path, kind: str, text: str = "") -> None:
    """Put a new file at `path` in one step (as a ConfigMap update does): the agent sees the old one or this."""
    new = path.with_name(f".{path.name}.new")
    if kind == "nested too deeply":
        new.write_text('{"SeparateNPUCodes": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif kind == "a FIFO":
        os.mkfifo(new)  # no writer ever opens it: reading it blocking would wait forever
    else:
        new.write_text(text)
    os.replace(new, path)


@pytest.mark.parametrize("kind", ["nested too deeply", "a FIFO"])
def test_an_unusable_rule_file_at_start_leaves_the_built_in_table_in_force(start_agent, short_dir, tmp_path, kind):
    table = tmp_path / "faultCode.json"
    replace(table, kind)
    agent, _ = start_agent(devices={"poll_interval_seconds": 1}, faults={"fault_code_file": str(table)},
                           wait_ready=False)
    line = agent.wait_for_log("fault rule files are invalid; using the built-in table until they are fixed")
    assert line["problems"] == [f"{table}: invalid JSON: nested too deeply" if kind == "nested too deeply"
                                else f"{table}: cannot read: a FIFO, not a regular file"]
    fake = FakeDcmiControl(short_dir / "ctl.sock").connect()
    fake.occur(2, 0x80E18402, severity=3)
    wait_until(lambda: visible(agent, 2, "80E18402", "SeparateNPU"), DEADLINE, "a fault classified by the built-in table")
    status, body = agent.http("/readyz")
    assert status == 503 and "fault rule files invalid" in body
    assert agent.stop() < 10


@pytest.mark.parametrize("kind", ["nested too deeply", "a FIFO"])
def test_a_rule_file_turned_unusable_at_runtime_keeps_the_rules_and_a_good_one_loads_again(start_agent, tmp_path, kind):
    table = tmp_path / "faultCode.json"
    table.write_text(json.dumps({"NotHandleFaultCodes": ["12345678"]}))
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, faults={"fault_code_file": str(table)})
    fake.occur(6, 0x12345678, severity=3)
    wait_until(lambda: visible(agent, 6, "12345678", "NotHandleFault"), DEADLINE, "fault with the first table")

    replace(table, kind)
    line = agent.wait_for_log("fault rule reload failed; the previous rules stay in force", timeout=10)
    assert len(line["problems"]) == 1 and line["problems"][0].startswith(f"{table}: ")
    assert agent.http("/healthz")[0] == 200  # the loop goes on
    status, body = agent.http("/readyz")
    assert status == 503 and "fault rule files invalid" in body
    assert agent.metric("npu_agent_fault_rule_reloads_total", result="failure") == 1
    assert visible(agent, 6, "12345678", "NotHandleFault")

    replace(table, "good", json.dumps({"SeparateNPUCodes": ["12345678"]}))
    wait_until(lambda: visible(agent, 6, "12345678", "SeparateNPU"), 10, "the next good table in force")
    wait_until(lambda: agent.http("/readyz")[0] == 200, 10, "ready again")
    assert agent.stop() < 10


def test_unknown_assertions_are_logged_once_per_value_and_skipped(start_agent):
    agent, fake = start_agent()
    for i in range(2500):
        fake.event(i % 8, 0x80E18402, 7 if i % 2 else 9, 3)  # assertions DCMI does not have
    fake.occur(3, 0x80E18005)  # handled after every event above: they reach the loop in order
    wait_until(lambda: visible(agent, 3, "80E18005", "RestartNPU"), 10, "a known event after them")
    lines = [r for r in agent.logs if r.get("msg") == "fault event with an unknown assertion skipped"]
    assert sorted(r["assertion"] for r in lines) == [7, 9]
    assert all(f["device"] == phy(3) for f in agent.faults_json())  # none of them was applied
    assert agent.metric("npu_agent_driver_events_total", result="skipped") == 2500
