"""Telemetry for the simulated backend: plausible values that move, in npu-exporter's units, for the demo.

Each chip follows a training-like load (AI core busy most of the time, a dip every five minutes), with
temperature and power following it and counters that grow with traffic. A dropped chip reads nothing
(network health unknown), as a real dropped card.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from agent.model import DeviceInfo
from agent.telemetry.families import FAMILIES, HCCS_LINKS_A2, HCCS_PROFILING_MS, PCIE_BW_TYPES
from agent.telemetry.source import Sample, node_samples

HBM_TOTAL_MB = 65536
READS = ("utilization", "sensors", "network_health", "processes", "hbm", "hccs", "pcie", "network", "roce", "optical")


class SimulatedTelemetry:
    name = "simulated"

    def __init__(self, dropped: Callable[[int], bool] = lambda phy: False, clock: Callable[[], float] = time.time):
        self._dropped = dropped
        self._clock = clock
        self._start = clock()

    def reads(self, device: DeviceInfo) -> tuple[str, ...]:
        return READS

    def read_timeout(self, read: str, call_timeout_s: float) -> float:
        return call_timeout_s

    def unsupported(self) -> list[tuple[int, str]]:
        return []

    def node(self) -> list[Sample]:
        return node_samples("simulated")

    def _load(self, phy: int) -> tuple[float, float]:
        """(seconds since start, AI core utilization 0..100) of a chip now."""
        t = self._clock() - self._start
        dip = (t + 17 * phy) % 300 < 20  # a checkpoint every five minutes: the cores idle briefly
        load = 8.0 if dip else 88.0 + 6.0 * math.sin(t / 7.0 + phy)
        return t, load

    def read(self, device: DeviceInfo, read: str) -> list[Sample]:
        phy = device.phy_id
        if self._dropped(phy):
            return [("npu_chip_info_network_status", (), -1.0)] if read == "network_health" else []
        t, load = self._load(phy)
        if read == "utilization":
            return [("npu_chip_info_utilization", (), round(load)), ("npu_chip_info_cube_utilization", (), round(load * 0.9)),
                    ("npu_chip_info_vector_utilization", (), round(load * 0.4)),
                    ("npu_chip_info_overall_utilization", (), round(load * 0.95))]
        if read == "sensors":
            return [("npu_chip_info_temperature", (), round(38 + load * 0.25 + phy % 3)),
                    ("npu_chip_info_power", (), round(95 + load * 2.6 + phy, 1)),
                    ("npu_chip_info_voltage", (), 0.88), ("npu_chip_info_aicore_current_freq", (), 1800.0),
                    ("npu_chip_info_serial_number", (f"SIM{device.card_id:06d}",), 1.0)]
        if read == "network_health":
            return [("npu_chip_info_network_status", (), 1.0)]
        if read == "processes":
            return [("npu_chip_info_process_info", (str(40000 + phy), ""), 52000.0)] if load > 50 else []
        if read == "hbm":
            used = 52000.0 + 20 * phy if load > 50 else 3000.0
            return [("npu_chip_info_hbm_total_memory", (), HBM_TOTAL_MB), ("npu_chip_info_hbm_used_memory", (), used),
                    ("npu_chip_info_hbm_temperature", (), round(36 + load * 0.2)),
                    ("npu_chip_info_hbm_bandwidth_utilization", (), round(load * 0.6)),
                    ("npu_chip_info_hbm_utilization", (), round(100 * used / HBM_TOTAL_MB)),
                    ("npu_chip_info_hbm_ecc_enable_flag", (), 1.0),
                    *((f"npu_chip_info_hbm_ecc_{name}", (), float(count)) for name, count in (
                        ("single_bit_error_cnt", int(t // 600) if phy == 1 else 0), ("double_bit_error_cnt", 0),
                        ("total_single_bit_error_cnt", 3 + int(t // 600) if phy == 1 else 0),
                        ("total_double_bit_error_cnt", 0), ("single_bit_isolated_pages_cnt", 0),
                        ("double_bit_isolated_pages_cnt", 0)))]
        if read == "hccs":
            per_link = load * 0.3  # GB/s
            return [*((f"npu_chip_info_hccs_statistic_info_{kind}_{x}", (), float(int(t * per_link * 5e7)))
                      for x in HCCS_LINKS_A2 for kind in ("tx_cnt", "rx_cnt")),
                    *((f"npu_chip_info_hccs_statistic_info_crc_err_cnt_{x}", (), 0.0) for x in HCCS_LINKS_A2),
                    *((f"npu_chip_info_hccs_bandwidth_info_{way}_{x}", (), round(per_link, 2))
                      for x in HCCS_LINKS_A2 for way in ("tx", "rx")),
                    ("npu_chip_info_hccs_bandwidth_info_total_tx", (), round(per_link * 7, 2)),
                    ("npu_chip_info_hccs_bandwidth_info_total_rx", (), round(per_link * 7, 2)),
                    ("npu_chip_info_hccs_bandwidth_info_profiling_time", (), float(HCCS_PROFILING_MS))]
        if read == "pcie":
            return [(f"npu_chip_info_pcie_{kind}_bw", (bw,), float(value))
                    for kind in ("rx_p", "rx_np", "rx_cpl", "tx_p", "tx_np", "tx_cpl")
                    for bw, value in zip(PCIE_BW_TYPES, (1, 24, 12))]
        if read == "network":
            rate = round(load * 120, 2)  # MB/s on the RoCE port
            return [("npu_chip_info_link_status", (), 1.0), ("npu_chip_info_bandwidth_tx", (), rate),
                    ("npu_chip_info_bandwidth_rx", (), rate), ("npu_chip_link_speed", (), 200000.0),
                    ("npu_chip_link_up_num", (), 1.0)]
        if read == "roce":
            packets = float(int(t * load * 1000))  # every error and pause counter stays 0
            return [(family.name, (), packets if family.name.endswith("_all_pkt_num") else 0.0)
                    for family in FAMILIES if family.group == "roce"]
        if read == "optical":
            return [("npu_chip_optical_state", (), 1.0), ("npu_chip_optical_temp", (), 45.0),
                    ("npu_chip_optical_vcc", (), 3300.0),
                    *((f"npu_chip_optical_{way}_power_{n}", (), 0.85) for way in ("tx", "rx") for n in range(4))]
        return []
