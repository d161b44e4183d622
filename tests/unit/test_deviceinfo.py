"""The device-info ConfigMap: Go-compatible JSON and the CheckCode ClusterD verifies."""

from __future__ import annotations

import hashlib
import json

from agent.sinks.configmap.deviceinfo import content_key, device_info_data, device_type
from agent.model import ActiveCode, DeviceState, Health, Level
from agent.common.gojson import check_code, go_map, marshal


# The DeviceInfoCfg value of a node with two faulty NPUs, as the MindCluster documentation publishes
# it: its CheckCode was computed by the Ascend Device Plugin's Go code, so it checks the Go-compatible
# JSON and hash independently.
PUBLISHED_DEVICE_INFO = (
    r'{"DeviceInfo":{"DeviceList":{"huawei.com/Ascend910":"Ascend910-0,Ascend910-1,Ascend910-2,'
    r'Ascend910-3,Ascend910-5,Ascend910-6,Ascend910-7",'
    r'"huawei.com/Ascend910-Fault":"[{\"fault_type\":\"CardNetworkUnhealthy\",'
    r'\"npu_name\":\"Ascend910-0\",\"large_model_fault_level\":\"PreSeparateNPU\",'
    r'\"fault_level\":\"PreSeparateNPU\",\"fault_handling\":\"PreSeparateNPU\",'
    r'\"fault_code\":\"81078603\",'
    r'\"fault_time_and_level_map\":{\"81078603\":{\"fault_time\":1744168468259,'
    r'\"fault_level\":\"PreSeparateNPU\"}}},{\"fault_type\":\"CardUnhealthy\",'
    r'\"npu_name\":\"Ascend910-4\",\"large_model_fault_level\":\"SeparateNPU\",'
    r'\"fault_level\":\"SeparateNPU\",\"fault_handling\":\"SeparateNPU\",\"fault_code\":\"A8028801,'
    r'A4028801,80E18402,80E18401\",'
    r'\"fault_time_and_level_map\":{\"80E18401\":{\"fault_time\":1744167455784,'
    r'\"fault_level\":\"NotHandleFault\"},\"80E18402\":{\"fault_time\":1744167455784,'
    r'\"fault_level\":\"SeparateNPU\"},\"A4028801\":{\"fault_time\":1744167455784,'
    r'\"fault_level\":\"NotHandleFault\"},\"A8028801\":{\"fault_time\":1744167455784,'
    r'\"fault_level\":\"SeparateNPU\"}}}]","huawei.com/Ascend910-NetworkUnhealthy":"Ascend910-0",'
    r'"huawei.com/Ascend910-Recovering":"","huawei.com/Ascend910-Unhealthy":"Ascend910-4"},'
    r'"UpdateTime":1744182144},"SuperPodID":-2,"ServerIndex":-2,'
    r'"CheckCode":"a550811fdfafb5717555526816af2ca4ac6c3e102f5907574048578e0c8fcc73"}'
)


def test_check_code_of_the_published_example_matches_the_device_plugins():
    example = PUBLISHED_DEVICE_INFO
    parsed = json.loads(example)
    inner = parsed["DeviceInfo"]
    rebuilt = {"DeviceList": go_map(inner["DeviceList"]), "UpdateTime": inner["UpdateTime"]}
    assert check_code(rebuilt) == parsed["CheckCode"] == "a550811fdfafb5717555526816af2ca4ac6c3e102f5907574048578e0c8fcc73"
    # and the whole value round-trips byte for byte through the Go-compatible writer
    assert marshal(parsed) == example


def test_go_escaping():
    assert marshal({"a": "<b>&\u2028\u2029é\"\\\n\t\x01"}) == '{"a":"\\u003cb\\u003e\\u0026\\u2028\\u2029é\\"\\\\\\n\\t\\u0001"}'
    assert marshal([1, None, True]) == "[1,null,true]"


def test_device_type():
    assert device_type("910B3") == device_type("910") == "Ascend910"
    assert device_type("310P3") == "Ascend310P"
    assert device_type("Ascend950PR") == "npu"


def code(text: str, level: Level, since: int = 1_780_000_000_000) -> ActiveCode:
    return ActiveCode(int(text, 16), text, level, since, 2, "")


def test_device_info_lists_and_fault_entries():
    states = [
        DeviceState(0, 7),
        DeviceState(1, 6, Health.UNHEALTHY, Level.SeparateNPU, 1_780_000_000_000,
                    (code("80E18401", Level.NotHandleFault), code("80E18402", Level.SeparateNPU))),
        DeviceState(2, 5, Health.HEALTHY, Level.PreSeparateNPU, 1_780_000_000_000,
                    (code("81078603", Level.PreSeparateNPU),)),
        DeviceState(3, 4, Health.UNHEALTHY, Level.ManuallySeparateNPU, 1_780_000_000_000,
                    (ActiveCode(0x80E18005, "80E18005", Level.ManuallySeparateNPU, 1_780_000_000_000, 2, "FaultFrequency"),)),
    ]
    data = device_info_data(states, "910B3", 1_780_000_123)
    config = json.loads(data["DeviceInfoCfg"])
    devices = config["DeviceInfo"]["DeviceList"]
    assert list(devices) == sorted(devices)
    assert devices["huawei.com/Ascend910"] == "Ascend910-0"
    assert devices["huawei.com/Ascend910-Unhealthy"] == "Ascend910-1,Ascend910-3"
    assert devices["huawei.com/Ascend910-NetworkUnhealthy"] == "Ascend910-2"
    faults = json.loads(devices["huawei.com/Ascend910-Fault"])
    assert [(f["npu_name"], f["fault_type"], f["fault_handling"], f["fault_code"]) for f in faults] == [
        ("Ascend910-1", "CardUnhealthy", "SeparateNPU", "80E18401,80E18402"),
        ("Ascend910-2", "CardNetworkUnhealthy", "PreSeparateNPU", "81078603"),
        ("Ascend910-3", "CardUnhealthy", "ManuallySeparateNPU", "80E18005")]
    assert faults[0]["fault_time_and_level_map"]["80E18402"] == {"fault_time": 1_780_000_000_000, "fault_level": "SeparateNPU"}
    assert (config["SuperPodID"], config["ServerIndex"]) == (-2, -2)
    inner = json.dumps(config["DeviceInfo"], separators=(",", ":"), ensure_ascii=False)
    assert config["CheckCode"] == hashlib.sha256(inner.encode()).hexdigest()
    assert data["ManuallySeparateNPU"] == "Ascend910-3"
    assert content_key(data) == content_key(device_info_data(states, "910B3", 1_780_999_999))
    assert content_key(data) != content_key(device_info_data(states[:2], "910B3", 1_780_000_123))
