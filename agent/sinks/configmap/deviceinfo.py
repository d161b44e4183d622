"""The device-info ConfigMap (`kube-system/mindx-dl-deviceinfo-<node>`) as the Ascend Device Plugin writes it.

Pure: device states in, the ConfigMap's data out. ClusterD recomputes `CheckCode` over the Go JSON
of `DeviceInfo` and ignores the ConfigMap when it differs, so every byte goes through `gojson`.
"""

from __future__ import annotations

import re

from agent.faults.rules.codes import NETWORK_FAULT_CODES
from agent.model import DeviceState, Level
from agent.common.gojson import check_code, go_map, marshal

NAMESPACE = "kube-system"
LABELS = {"mx-consumer-cim": "true"}
NAME_PREFIX = "mindx-dl-deviceinfo-"
UNSUPPORTED = -2  # SuperPodID / ServerIndex when the agent cannot query them, as the device plugin writes
CHIP_HEALTHY = frozenset({Level.NormalNPU, Level.NotHandleFault, Level.SubHealthFault})
NETWORK_HEALTHY = frozenset({Level.NormalNPU, Level.NotHandleFault})
DESCRIPTION = ("Written by npu-node-agent in the Ascend Device Plugin's format; the available-device "
               "list is deprecated, Volcano tracks availability itself.")


def device_type(chip_name: str) -> str:
    """The resource family of a chip name, as the device plugin derives it."""
    name = chip_name.removeprefix("Ascend")
    if chip_name.startswith("Ascend950") or name.startswith("950"):
        return "npu"
    if re.match(r"^(310P\d?|I2\d?)", name):
        return "Ascend310P"
    if "310" in name:
        return "Ascend310B" if "310B" in name else "Ascend310"
    return "Ascend910"


def _entry(kind: str, npu: str, codes) -> dict:
    level = max(c.level for c in codes).name
    return {"fault_type": kind, "npu_name": npu, "large_model_fault_level": level, "fault_level": level,
            "fault_handling": level, "fault_code": ",".join(c.text for c in codes),
            "fault_time_and_level_map": go_map({c.text: {"fault_time": c.since_ms, "fault_level": c.level.name}
                                                for c in codes})}


def device_info_data(states: list[DeviceState], chip_name: str, update_time_s: int) -> dict[str, str]:
    kind = device_type(chip_name)
    prefix = f"huawei.com/{kind}"
    label = "Ascend910" if kind == "npu" else kind  # device names keep the chip family
    available, unhealthy, network_unhealthy, faults, manual = [], [], [], [], []
    for state in sorted(states, key=lambda s: s.phy_id):
        name = f"{label}-{state.phy_id}"
        chip = [c for c in state.codes if c.code not in NETWORK_FAULT_CODES]
        network = [c for c in state.codes if c.code in NETWORK_FAULT_CODES]
        chip_level = max((c.level for c in chip), default=Level.NormalNPU)
        network_level = max((c.level for c in network), default=Level.NormalNPU)
        if chip:
            faults.append(_entry("CardUnhealthy", name, chip))
        if network:
            faults.append(_entry("CardNetworkUnhealthy", name, network))
        if chip_level not in CHIP_HEALTHY:
            unhealthy.append(name)
        if network_level not in NETWORK_HEALTHY:
            network_unhealthy.append(name)
        if chip_level in CHIP_HEALTHY and network_level in NETWORK_HEALTHY:
            available.append(name)
        if state.level is Level.ManuallySeparateNPU:
            manual.append(name)
    device_list = go_map({
        prefix: ",".join(available),
        f"{prefix}-Fault": marshal(faults),
        f"{prefix}-NetworkUnhealthy": ",".join(network_unhealthy),
        f"{prefix}-Recovering": "",
        f"{prefix}-Unhealthy": ",".join(unhealthy),
    })
    inner = {"DeviceList": device_list, "UpdateTime": update_time_s}
    config = {"DeviceInfo": inner, "SuperPodID": UNSUPPORTED, "ServerIndex": UNSUPPORTED, "CheckCode": check_code(inner)}
    return {"DeviceInfoCfg": marshal(config), "ManuallySeparateNPU": ",".join(manual), "Description": DESCRIPTION}


def content_key(data: dict[str, str]) -> str:
    """What must be written again when it changes: everything but the update time."""
    return re.sub(r'"UpdateTime":\d+|"CheckCode":"[0-9a-f]+"', "", data["DeviceInfoCfg"]) + data["ManuallySeparateNPU"]
