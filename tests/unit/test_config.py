"""Configuration: defaults, unknown keys with their path, types, environment overrides."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
import yaml

from agent.config import NODE_NAME, Config, config_from_dict, declared_problems, key, load_config, section
from agent.common.errors import MAX_PROBLEMS, ConfigError
from agent.sinks.clusterd import pubfault
from tests.support import genconfig


def test_defaults_follow_the_contract():
    config = config_from_dict({}, environ={"NODE_NAME": "node-7"})
    assert config.node_name == "node-7"
    assert config.http.listen == "0.0.0.0:9410" and config.grpc.listen == "0.0.0.0:9411"
    assert config.devices.backend == "dcmi" and config.devices.poll_interval_seconds == 5
    assert config.clusterd.public_codes["SeparateNPU"] == "020011001"
    assert config.profiling.disk_limit_mb == 5000


def test_unknown_keys_are_rejected_with_their_path():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"devices": {"simulated": {"device": 8}}, "metrics": {}})
    assert "devices.simulated.device: unknown key (known: chip_name, devices, scenario)" in info.value.problems
    assert any(p.startswith("metrics: unknown key") for p in info.value.problems)


@pytest.mark.parametrize("document,message", [
    ({"devices": {"poll_interval_seconds": "5"}}, "devices.poll_interval_seconds: expected a number, got '5'"),
    ({"kubernetes": {"enabled": "yes"}}, "kubernetes.enabled: expected true or false"),
    ({"profiling": {"disk_limit_mb": 1.5}}, "profiling.disk_limit_mb: expected an integer"),
    ({"profiling": {"disk_limit_mb": -1}}, "profiling.disk_limit_mb: must not be negative"),
    ({"devices": {"backend": "nvml"}}, "devices.backend: 'nvml' is not dcmi or simulated"),
    ({"http": {"listen": "9410"}}, "http.listen: '9410' is not HOST:PORT"),
    ({"faults": {"unknown_code_level": "Severe"}}, "faults.unknown_code_level: unknown fault level 'Severe'"),
    ({"clusterd": {"public_codes": {"SeparateNPU": "12345"}}}, "is not a 9-digit public fault code"),
    ({"datatrace": {"enabled": True}}, "datatrace.enabled: needs kubernetes.enabled"),
    ({"log": "debug"}, "log: expected a mapping"),
    ({"telemetry": {"intervals": {"utilization": 0.5}}},
     "telemetry.intervals.utilization: 0.5 is out of range 1..86400 (0 turns the group off)"),
    ({"telemetry": {"intervals": {"ddr": 10}}}, "telemetry.intervals.ddr: unknown key"),
    ({"fault_log": {"retire_unconfigured_cursors_after_seconds": -1}},
     "fault_log.retire_unconfigured_cursors_after_seconds: -1.0 is out of range 0..2592000 (30 days)"),
])
def test_bad_values_name_the_key(document, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict(document)
    assert any(message in p for p in info.value.problems), info.value.problems


def test_environment_overrides():
    config = config_from_dict({"node_name": "from-file", "clusterd": {"enabled": True}},
                              environ={"NODE_NAME": "env", "MINDX_SERVER_IP": "10.0.0.5"})
    assert config.node_name == "from-file"  # NODE_NAME is only the default
    assert config.clusterd.address == "10.0.0.5:8899"  # MINDX_SERVER_IP overrides the host


@pytest.mark.parametrize("server_ip,address", [("fd00::5", "[fd00::5]:8899"), ("[::1]", "[::1]:8899"),
                                               ("clusterd.example", "clusterd.example:8899")])
def test_mindx_server_ip_may_be_ipv6_and_is_a_grpc_target(server_ip, address):
    config = config_from_dict({"clusterd": {"enabled": True}}, environ={"MINDX_SERVER_IP": server_ip})
    assert config.clusterd.address == address


def test_mindx_server_ip_is_only_looked_at_with_clusterd_enabled():
    for server_ip in ("fd00::5", "not an address!"):
        config = config_from_dict({}, environ={"MINDX_SERVER_IP": server_ip})
        assert config.clusterd.address == "clusterd-grpc-svc.mindx-dl.svc.cluster.local:8899"
    with pytest.raises(ConfigError) as info:
        config_from_dict({"clusterd": {"enabled": True}}, environ={"MINDX_SERVER_IP": "not an address!"})
    assert info.value.problems == ["MINDX_SERVER_IP: 'not an address!' is not an IP address or host name"]


@pytest.mark.parametrize("name", ["Node-1", "node_1", "-node", "node.", "n" * 254, "node\n", "node 1", ""])
def test_a_node_name_clusterd_would_refuse_is_a_config_error(name):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"node_name": name}, environ={"NODE_NAME": "from-env"} if name else {"NODE_NAME": "Upper"})
    [problem] = info.value.problems
    assert problem.startswith("node_name: ") and "is not a node name ClusterD and Kubernetes accept" in problem


def test_node_names_clusterd_accepts_pass_and_the_rule_is_clusterds():
    for name in ("node-1", "10.0.0.5", "a", "n" * 253, "gpu-01.rack-7.example"):
        assert config_from_dict({"node_name": name}).node_name == name
    assert NODE_NAME.pattern == pubfault._NODE.pattern  # the agent refuses what ClusterD would drop


@pytest.mark.parametrize("document,message", [
    ({"devices": {"poll_interval_seconds": float("nan")}}, "devices.poll_interval_seconds: expected a finite number, got nan"),
    ({"taskd_proxy": {"hold_seconds": float("inf")}}, "taskd_proxy.hold_seconds: expected a finite number, got inf"),
])
def test_numbers_must_be_finite(document, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict(document)
    assert message in info.value.problems


def test_a_problem_quotes_a_huge_or_deep_value_briefly():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ConfigError) as info:
        config_from_dict({"node_name": deep, "state_dir": ["x" * 10_000_000], "devices": {"backend": {"y" * 10_000_000: 1}}})
    assert len(info.value.problems) == 3 and all(len(p) < 200 for p in info.value.problems), info.value.problems


def test_many_problems_are_summed_up():
    with pytest.raises(ConfigError) as info:
        config_from_dict({f"key{i}": 1 for i in range(1000)})
    assert len(info.value.problems) == MAX_PROBLEMS + 1
    assert info.value.problems[-1] == f"... and {1000 - MAX_PROBLEMS} more problems"


def test_yaml_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text("devices:\n  backend: [dcmi\n")
    with pytest.raises(ConfigError, match=r"agent.yaml: invalid YAML at line"):
        load_config(str(path), environ={})


def test_a_disk_limit_of_zero_is_accepted_as_documented():
    assert config_from_dict({"profiling": {"disk_limit_mb": 0}}).profiling.disk_limit_mb == 0


@dataclasses.dataclass
class Extra:
    burst: int = key(4, "requests sent at once", between=(1, 16))


@dataclasses.dataclass
class Extended(Config):
    extra: Extra = section(Extra)


def test_a_key_is_added_by_declaring_it_once():
    """One `key()` line is the whole change: the agent validates the new key, and the docs' table,
    the chart's values, their schema and the chart README's table all carry it (the generated files
    are then rewritten by `python -m tests.support.gendocs`; tests/unit/test_docs.py fails until they are)."""
    assert declared_problems(Extended(node_name="n", extra=Extra(burst=99)), None) == [
        "extra.burst: 99 is out of range 1..16"]
    assert "| `extra.burst` | integer | `4` | 1..16 | requests sent at once |" in genconfig.configuration_table(Extended)
    assert "| `agent.extra.burst` | `4` | 1..16 | Requests sent at once. |" in genconfig.chart_table(Extended)
    values = yaml.safe_load(genconfig.values_block(Extended))["agent"]
    assert values["extra"] == {"burst": 4}
    schema = genconfig.agent_schema(Extended)
    assert schema["properties"]["extra"]["properties"]["burst"] == {"type": "integer", "minimum": 1, "maximum": 16}
    definitions = json.loads(genconfig.SCHEMA.read_text())["definitions"]
    jsonschema.validate(values, {**schema, "definitions": definitions})  # the defaults pass the schema
    with pytest.raises(jsonschema.ValidationError, match="17 is greater than the maximum of 16"):
        jsonschema.validate({**values, "extra": {"burst": 17}}, {**schema, "definitions": definitions})


@pytest.mark.parametrize("value, address", [("10.0.0.5", "10.0.0.5:9410"), ("fd00::5", "[fd00::5]:9410"),
                                            ("[fd00::5]", "[fd00::5]:9410")])
def test_a_listen_host_may_come_from_the_environment(value, address):
    config = config_from_dict({"http": {"listen": "${POD_IP}:9410"}, "grpc": {"listen": "${POD_IP}:9411"}},
                              environ={"NODE_NAME": "n", "POD_IP": value})
    assert config.http.listen == address and config.grpc.listen == address.replace("9410", "9411")
    with pytest.raises(ConfigError) as info:
        config_from_dict({"http": {"listen": "${POD_IP}:9410"}}, environ={"NODE_NAME": "n"})
    assert info.value.problems == ["http.listen: '${POD_IP}:9410': POD_IP is not set in the environment"]


def test_every_problem_is_listed_at_once_type_and_value_problems_alike():
    """One pass: a key of the wrong type is reported and its value checks skipped (and those that refer
    to it), every other key is still checked."""
    with pytest.raises(ConfigError) as info:
        config_from_dict({"devices": {"poll_interval_seconds": "5", "backend": "nvml"}, "http": {"listen": "9410"},
                          "tls": {"cert_file": 5, "key_file": "/k.pem"},  # key_file needs cert_file: not said again
                          "kubernetes": "yes", "datatrace": {"enabled": True}},  # idem: needs kubernetes.enabled
                         environ={"NODE_NAME": "n"})
    assert sorted(info.value.problems) == sorted([
        "devices.poll_interval_seconds: expected a number, got '5'",
        "devices.backend: 'nvml' is not dcmi or simulated",
        "http.listen: '9410' is not HOST:PORT",
        "tls.cert_file: expected a string, got 5 (quote it)",
        "kubernetes: expected a mapping, got str",
    ])


def test_a_wrong_type_skips_the_floor_check_that_reads_it():
    """taskd_proxy.node_buffer_mb's minimum is job_buffer_mb: with job_buffer_mb unreadable, its default
    (32) would stand in and make 16 look too small."""
    document = {"taskd_proxy": {"job_buffer_mb": "16", "node_buffer_mb": 16}}
    with pytest.raises(ConfigError) as info:
        config_from_dict(document, environ={"NODE_NAME": "n"})
    assert info.value.problems == ["taskd_proxy.job_buffer_mb: expected an integer, got '16'"]
    document["taskd_proxy"]["job_buffer_mb"] = 16
    assert config_from_dict(document, environ={"NODE_NAME": "n"}).taskd_proxy.node_buffer_mb == 16


@pytest.mark.parametrize("document,suggestion", [
    ({"devices": {"pol_interval_seconds": 3}}, "devices.pol_interval_seconds: did you mean devices.poll_interval_seconds?"),
    ({"devices": {"simulated": {"device": 8}}}, "devices.simulated.device: did you mean devices.simulated.devices?"),
    ({"clusterd": {"adress": "x:1"}}, "clusterd.adress: did you mean clusterd.address?"),
    ({"device": {}}, "device: did you mean devices?"),
    ({"poll_interval_seconds": 2}, "poll_interval_seconds: did you mean devices.poll_interval_seconds?"),  # wrong level
    ({"devices": {"simulated": {"poll_interval_seconds": 2}}},
     "devices.simulated.poll_interval_seconds: did you mean devices.poll_interval_seconds?"),
    ({"log_level": "debug"}, "log_level: did you mean log.level?"),
    ({"simulated": {"devices": 3}}, "simulated: did you mean devices.simulated?"),  # a section, for a mapping
    ({"devices.simulated.devices": 3},
     "devices.simulated.devices: a dotted key is not nested: write devices: {simulated: {devices: ...}}"),
])
def test_a_misspelt_or_misplaced_key_gets_a_suggestion(document, suggestion):
    with pytest.raises(ConfigError) as info:
        config_from_dict(document, environ={"NODE_NAME": "n"})
    unknown, hint = info.value.problems  # the unknown-key line as it always was, then the suggestion
    assert unknown.startswith(suggestion.split(":")[0] + ": unknown key (known: ")
    assert hint == suggestion


@pytest.mark.parametrize("document", [{"grpc": {"port": 1}}, {"enabled": True}, {"zzz": {}}, {7: 1}])
def test_nothing_close_or_too_many_alike_gets_no_suggestion(document):
    with pytest.raises(ConfigError) as info:
        config_from_dict(document, environ={"NODE_NAME": "n"})
    assert len(info.value.problems) == 1 and "unknown key" in info.value.problems[0]
