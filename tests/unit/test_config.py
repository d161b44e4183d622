"""Configuration: defaults, unknown keys with their path, types, environment overrides."""

from __future__ import annotations

import pytest

from agent.config import config_from_dict, load_config
from agent.errors import ConfigError


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
])
def test_bad_values_name_the_key(document, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict(document)
    assert any(message in p for p in info.value.problems), info.value.problems


def test_environment_overrides():
    config = config_from_dict({"node_name": "from-file"}, environ={"NODE_NAME": "env", "MINDX_SERVER_IP": "10.0.0.5"})
    assert config.node_name == "from-file"  # NODE_NAME is only the default
    assert config.clusterd.address == "10.0.0.5:8899"  # MINDX_SERVER_IP overrides the host


def test_yaml_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text("devices:\n  backend: [dcmi\n")
    with pytest.raises(ConfigError, match=r"agent.yaml: invalid YAML at line"):
        load_config(str(path), environ={})


def test_a_disk_limit_of_zero_is_accepted_as_documented():
    assert config_from_dict({"profiling": {"disk_limit_mb": 0}}).profiling.disk_limit_mb == 0
