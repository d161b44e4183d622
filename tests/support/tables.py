"""Rule files in the formats the Ascend Device Plugin ships, written by the tests.

The device plugin's faultCode.json maps about 800 codes to levels and its faultCustomization.json
escalates a few dozen by frequency or duration. These are the same files cut down to a few codes of
each kind, with the levels and rules the shipped files give those codes; what the tests check holds
for the shipped files too.
"""

from __future__ import annotations

import json
from pathlib import Path

# faultCode.json: a list of hexadecimal codes per level.
FAULT_CODES = {
    # 81078603 is a parameter-plane link down: a network code, listed at NotHandleFault.
    "NotHandleFaultCodes": ["80E21007", "81078603", "8C2FA009"],
    "RestartRequestCodes": ["80C98008", "80C98009"],
    "RestartBusinessCodes": ["8C204E00", "A2301001"],  # A2301001 is under SeparateNPUCodes too
    "FreeRestartNPUCodes": ["8C0E4E00"],
    "RestartNPUCodes": ["40F84E00", "80E18005"],  # 40F84E00: the card dropped
    "SeparateNPUCodes": ["80E18402", "A2301001", "020001002"],  # a 9-digit code keeps its leading zero
    "PreSeparateNPUCodes": ["110001024", "8118043C"],
    "SubHealthFaultCodes": ["81A3880C", "110000002"],
}

# faultCustomization.json: escalation by how often a code occurs and by how long it lasts.
CUSTOMIZATION = {
    "GraceTolerance": {"WaitProcessReadCMTime": 30, "WaitDeviceResetTime": 150, "WaitFaultSelfHealingTime": 15},
    "FaultFrequency": [
        {"EventId": ["80C98008", "80E18008", "80E38008"], "TimeWindow": 86400, "Times": 2,
         "FaultHandling": "ManuallySeparateNPU"},
        {"EventId": ["80E18005"], "TimeWindow": 86400, "Times": 3, "FaultHandling": "ManuallySeparateNPU"},
        {"EventId": ["81078603"], "TimeWindow": 86400, "Times": 5, "FaultHandling": "ManuallySeparateNPU",
         "ReleaseTimeWindow": 172800},
    ],
    "FaultDuration": [
        {"EventId": ["81078603"], "FaultTimeout": 20, "RecoverTimeout": 60, "FaultHandling": "PreSeparateNPU"},
    ],
}


def write_rule_files(directory: Path) -> Path:
    """faultCode.json and faultCustomization.json in `directory`, as the device plugin's ConfigMap mounts them."""
    (directory / "faultCode.json").write_text(json.dumps(FAULT_CODES, indent=2))
    (directory / "faultCustomization.json").write_text(json.dumps(CUSTOMIZATION, indent=2))
    return directory
