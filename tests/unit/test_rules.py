"""Rule files: tables in the device plugin's formats, and clear errors for bad ones."""

from __future__ import annotations

import json
import os

import pytest

from testkit import REPO

from agent.common.errors import MAX_PROBLEMS, ConfigError
from agent.faults.rules.codes import load_fault_code_table, parse_fault_code_table
from agent.faults.rules.customization import NEVER_RELEASE_S, load_customization, parse_customization
from agent.model import Level


def test_the_device_plugins_fault_code_table_loads(rule_dir):
    table = load_fault_code_table(str(rule_dir / "faultCode.json"))
    assert len(table) == 16  # 17 entries, 16 distinct codes
    assert table.lookup(0xA2301001) is Level.SeparateNPU  # in RestartBusiness and Separate
    assert table.lookup(0x80E18005) is Level.RestartNPU
    assert table.lookup(0x80E18402) is Level.SeparateNPU
    assert table.lookup(0x40F84E00) is Level.RestartNPU
    assert table.lookup(0x81078603) is Level.NotHandleFault
    assert table.spell(0x020001002) == "020001002"
    assert any("A2301001" in w for w in table.warnings)


# The device plugin's shipped faultCode.json: 804 entries, 802 distinct codes (A2301001 is under
# RestartBusiness and SeparateNPU, B4060011 twice under RestartBusiness). Its rule: a code takes the
# first bucket that holds it, in the order SeparateNPU, PreSeparateNPU, RestartNPU, FreeRestartNPU,
# RestartBusiness, RestartRequest, SubHealthFault, NotHandleFault. The digest is of every code with
# that level, one "<CODE> <Level>" line each, sorted - computed from the plugin's file by that rule.
DEVICE_PLUGIN_LEVELS_SHA256 = "2e6a797a425501834d70db09f1d3a2651e2c21047461a9a188654209c85f8a33"
DEVICE_PLUGIN_LEVEL_COUNTS = {"SeparateNPU": 215, "PreSeparateNPU": 200, "RestartNPU": 162, "FreeRestartNPU": 23,
                              "RestartBusiness": 24, "RestartRequest": 33, "SubHealthFault": 13, "NotHandleFault": 132}


def test_the_built_in_table_classifies_every_code_as_the_device_plugin_does():
    import hashlib
    from agent.faults.rules.engine import EngineSettings, FaultEngine
    from agent.model import Assertion, Health

    table = load_fault_code_table("")
    assert table.warnings == ()  # each code once, under the level it takes
    spelled = sorted(table.spell(c) for c in [*table.chip, *table.network])
    engine = FaultEngine(table, load_customization(""), EngineSettings())
    levels = {}
    for phy, text in enumerate(spelled):  # one device per code, each seen as the driver reports it
        engine.add_device(phy, phy, 1_780_000_000_000)
        engine.on_reading(phy, frozenset(), Health.HEALTHY, 1_780_000_000_000)
        [change] = engine.on_event(phy, int(text, 16), Assertion.OCCUR, 2, None, 1_780_000_000_000)
        levels[text] = change.level.name
    assert len(levels) == 802
    assert {name: list(levels.values()).count(name) for name in DEVICE_PLUGIN_LEVEL_COUNTS} == DEVICE_PLUGIN_LEVEL_COUNTS
    lines = "".join(f"{text} {levels[text]}\n" for text in spelled)
    assert hashlib.sha256(lines.encode()).hexdigest() == DEVICE_PLUGIN_LEVELS_SHA256
    # The parameter-plane codes are network faults, at the levels the plugin's buckets give them.
    assert [levels[c] for c in ("81078603", "81078607", "110000002", "110001024")] == \
        ["NotHandleFault", "NotHandleFault", "SubHealthFault", "PreSeparateNPU"]


def test_the_built_in_customization_is_the_device_plugins():
    rules = load_customization("")
    assert rules.source == "built-in fault customization" and rules.warnings == ()
    twice = {0x80C98000, 0x80E01801, 0x80E18008, 0x81978008}  # 4 of the 41 codes of its first rule
    assert len([c for c, r in rules.frequency.items() if r.times == 2 and r.window_s == 86400]) == 41
    assert all(rules.frequency[c].level is Level.ManuallySeparateNPU for c in twice)
    assert (rules.frequency[0x80E18005].times, rules.frequency[0x80E18005].release_s) == (3, NEVER_RELEASE_S)
    assert (rules.frequency[0x81078603].times, rules.frequency[0x81078603].release_s) == (5, 172800)
    duration = rules.duration[0x81078603]
    assert (duration.fault_timeout_s, duration.recover_timeout_s, duration.level) == (20, 60, Level.PreSeparateNPU)
    assert rules.grace_tolerance == {"WaitProcessReadCMTime": 30, "WaitDeviceResetTime": 150, "WaitFaultSelfHealingTime": 15}


def test_the_device_plugins_customization_loads(rule_dir):
    rules = load_customization(str(rule_dir / "faultCustomization.json"))
    assert rules.frequency[0x80E18005].times == 3
    assert rules.frequency[0x80E18005].level is Level.ManuallySeparateNPU
    assert rules.frequency[0x80E18005].release_s == NEVER_RELEASE_S
    assert rules.frequency[0x81078603].release_s == 172800
    assert rules.frequency[0x80E18008].times == 2
    assert len(rules.frequency) == 5
    assert rules.duration[0x81078603].fault_timeout_s == 20
    assert rules.grace_tolerance["WaitDeviceResetTime"] == 150


def test_the_built_in_table_loads():
    table = load_fault_code_table("")
    assert table.lookup(0x80E18402) is Level.SeparateNPU
    assert table.warnings == ()


@pytest.mark.parametrize("document,message", [
    ([], "expected a JSON object"),
    ({"SeperateNPUCodes": ["80E18402"]}, "SeperateNPUCodes: unknown key"),
    ({"SeparateNPUCodes": "80E18402"}, "SeparateNPUCodes: expected a list"),
    ({"SeparateNPUCodes": ["80E1840G"]}, "SeparateNPUCodes[0]: '80E1840G' is not a hexadecimal fault code"),
    ({"SeparateNPUCodes": [12]}, "SeparateNPUCodes[0]: 12 is not a string"),
])
def test_bad_fault_code_tables_name_the_file_and_the_problem(document, message):
    with pytest.raises(ConfigError) as info:
        parse_fault_code_table(document, "/etc/faultCode.json")
    assert any(p.startswith("/etc/faultCode.json: ") and message in p for p in info.value.problems), info.value.problems


def test_unreadable_and_malformed_files(tmp_path):
    broken = tmp_path / "faultCode.json"
    broken.write_text('{"SeparateNPUCodes": [')
    with pytest.raises(ConfigError, match=r"faultCode.json: invalid JSON at line 1"):
        load_fault_code_table(str(broken))
    with pytest.raises(ConfigError, match="cannot read"):
        load_customization(str(tmp_path / "missing.json"))


def rule(**fields):
    base = {"EventId": ["80E18005"], "TimeWindow": 3600, "Times": 3, "FaultHandling": "ManuallySeparateNPU"}
    base.update(fields)
    return {"FaultFrequency": [base]}


@pytest.mark.parametrize("document,message", [
    (rule(TimeWindow=59), "FaultFrequency[0].TimeWindow: 59 is out of range (allowed range 60..864000)"),
    (rule(TimeWindow=864001), "allowed range 60..864000"),
    (rule(Times=0), "FaultFrequency[0].Times: 0 is out of range (allowed range 1..100)"),
    (rule(Times=101), "allowed range 1..100"),
    (rule(ReleaseTimeWindow=59), "ReleaseTimeWindow: 59 is out of range (allowed range 60..4294967296)"),
    (rule(FaultHandling="SeparateNPU"), "ReleaseTimeWindow: required when FaultHandling is SeparateNPU"),
    (rule(FaultHandling="Broken"), "FaultHandling: 'Broken' is not allowed here"),
    (rule(Times="3"), "Times: '3' is not an integer"),
    (rule(EventId=[]), "EventId: expected a non-empty list"),
    (rule(Extra=1), "FaultFrequency[0].Extra: unknown key"),
    ({"FaultDuration": [{"EventId": ["81078603"], "FaultTimeout": 601, "RecoverTimeout": 60,
                         "FaultHandling": "PreSeparateNPU"}]}, "FaultTimeout: 601 is out of range (allowed range 0..600)"),
    ({"FaultDuration": [{"EventId": ["81078603"], "FaultTimeout": 20, "RecoverTimeout": 86401,
                         "FaultHandling": "PreSeparateNPU"}]}, "allowed range 0..86400"),
    ({"FaultDuration": [{"EventId": ["81078603"], "FaultTimeout": 20, "RecoverTimeout": 60,
                         "FaultHandling": "ManuallySeparateNPU"}]}, "'ManuallySeparateNPU' is not allowed here"),
    ({"GraceTolerance": {"WaitDeviceResetTime": 200}}, "GraceTolerance.WaitDeviceResetTime: 200 is out of range (allowed range 60..180)"),
    ({"Unknown": []}, "Unknown: unknown key"),
])
def test_out_of_range_customization_is_rejected_with_the_allowed_range(document, message):
    with pytest.raises(ConfigError) as info:
        parse_customization(document, "custom.json")
    assert any(message in p for p in info.value.problems), info.value.problems


def test_the_first_rule_for_a_code_wins():
    rules = parse_customization({"FaultFrequency": [
        rule()["FaultFrequency"][0],
        {"EventId": ["80E18005"], "TimeWindow": 60, "Times": 1, "FaultHandling": "SubHealthFault",
         "ReleaseTimeWindow": 60}]}, "c")
    assert rules.frequency[0x80E18005].times == 3
    assert any("repeats 80E18005" in w for w in rules.warnings)


# ClusterD's shipped public-fault configuration (publicFaultConfiguration.json): the codes it accepts
# per level and the resources allowed to send them.
CLUSTERD_DEFAULT_CODES = {
    "NotHandleFaultCodes": {"200001006", "200001010", "200001011", "200001012", "100001011"},
    "SubHealthFaultCodes": {"010001001", "010001002", "010001004", "110001010", "110001020", "110001021",
                            "210001007", "210001008", "210001009", "310001005"},
    "SeparateNPUCodes": {"020001001", "020001003", "020001004", "120001001", "120001002", "120001003",
                         "220001001", "220001002", "220001003", "220001004", "220001005", "220001006",
                         "220001007"},
    "PreSeparateNPUCodes": {"110001022", "110001023"},
}
CLUSTERD_DEFAULT_RESOURCES = {"CCAE", "fd-online", "pingmesh", "Netmind", "dpcStorage", "dtfsStorage"}


def test_the_shipped_clusterd_customization_keeps_the_defaults_and_adds_the_agents_codes():
    from agent.config import config_from_dict

    shipped = json.loads((REPO / "helm/npu-node-agent/files/clusterd/publicCustomization.json").read_text())
    # ClusterD replaces its whole configuration with this file: every shipped entry must stay.
    for key, codes in CLUSTERD_DEFAULT_CODES.items():
        assert codes <= set(shipped["publicFaultCode"][key]), key
    assert CLUSTERD_DEFAULT_RESOURCES <= set(shipped["publicFaultResource"])
    config = config_from_dict({})
    assert config.clusterd.resource in shipped["publicFaultResource"]
    listed = {code: key for key, codes in shipped["publicFaultCode"].items() for code in codes}
    expected = {"SubHealthFault": "SubHealthFaultCodes", "PreSeparateNPU": "PreSeparateNPUCodes"}
    for level, code in config.clusterd.public_codes.items():
        assert listed[code] == expected.get(level, "SeparateNPUCodes"), (level, code)


@pytest.mark.parametrize("content,message", [
    (b'{"SeparateNPUCodes": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid JSON: nested too deeply"),
    (b'{"SeparateNPUCodes": [' + b"1" * 5000 + b"]}", "invalid JSON: Exceeds the limit (4300 digits)"),
    (b'{"SeparateNPUCodes": ["80E18402\xff"]}', "not UTF-8 text (invalid start byte at byte 31)"),
    (b" " * (5 << 20), "larger than 4 MiB; not read"),
])
def test_a_rule_file_that_cannot_be_parsed_is_one_line(tmp_path, content, message):
    path = tmp_path / "faultCode.json"
    path.write_bytes(content)
    for load in (load_fault_code_table, load_customization):
        with pytest.raises(ConfigError) as info:
            load(str(path))
        assert info.value.problems[0].startswith(f"{path}: {message}")
        assert len(info.value.problems) == 1 and len(info.value.problems[0]) < 300


def test_a_rule_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # no writer: opening it to read in the usual way would wait forever
    with pytest.raises(ConfigError, match=r"fifo.json: cannot read: a FIFO, not a regular file"):
        load_fault_code_table(str(fifo))
    with pytest.raises(ConfigError, match=r"cannot read: a directory, not a regular file"):
        load_customization(str(tmp_path))


def test_bad_values_are_quoted_briefly_and_many_problems_are_summed_up():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ConfigError) as info:
        parse_fault_code_table({"SeparateNPUCodes": ["Z" * 1_000_000, deep, *[7] * 1000]}, "faultCode.json")
    problems = info.value.problems
    assert len(problems) == MAX_PROBLEMS + 1 and problems[-1] == f"... and {1002 - MAX_PROBLEMS} more problems"
    assert problems[0].startswith("faultCode.json: SeparateNPUCodes[0]: 'ZZZ") and len(problems[0]) < 150
    assert problems[1] == "faultCode.json: SeparateNPUCodes[1]: [[[[...]]]] is not a string"
    with pytest.raises(ConfigError) as info:
        parse_customization({"FaultDuration": [{"EventId": ["80E18005"], "FaultTimeout": "9" * 1_000_000,
                                                "RecoverTimeout": 60, "FaultHandling": deep}]}, "custom.json")
    assert len(info.value.problems) == 2 and all(len(p) < 300 for p in info.value.problems), info.value.problems
