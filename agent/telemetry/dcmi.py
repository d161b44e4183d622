"""Telemetry from libdcmi: npu-exporter's DCMI calls for A2 and A3 chips, its scaling and its failure values.

Runs in the executor's telemetry lane (blocking ctypes calls). A function the driver does not have or
does not support for a chip (-99998, -8255) is logged once and not called for that chip again.
"""

from __future__ import annotations

import ctypes
import logging
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from agent.devices import dcmi_abi as core
from agent.devices.dcmi import DcmiBackend
from agent.telemetry import dcmi_abi as abi
from agent.model import DeviceInfo
from agent.telemetry.families import NETWORK_HEALTH_TIMEOUT_S, HCCS_LINKS, HCCS_PROFILING_MS, PCIE_BW_TYPES
from agent.telemetry.source import Sample, node_samples

log = logging.getLogger(__name__)

MIB = 1 << 20
UTILIZATION_PERIOD = 1  # what npu-exporter passes to the _period call
MIN_TEMPERATURE = -275
UNSUPPORTED = (abi.DCMI_ERR_NOT_SUPPORTED, core.DCMI_ERR_SYMBOL_MISSING)
CONTAINER_ID = re.compile(r"[0-9a-f]{64}")
A3_CHIP = re.compile(r"^(Ascend)?910_93")  # the 910_93 (A3) chips' name, when the board cannot be read
# npu-exporter tells A3 by the board id (dcmi_get_device_board_info): Atlas 900/9000 A3 SuperPoD bins
# 0xb0-0xb2, Atlas 800I A3 0xb3/0xb4, and the ZQ SuperPoD and server boards 0x81, 0x83, 0xd1, 0xd3.
A3_BOARD_IDS = frozenset({0xB0, 0xB1, 0xB2, 0xB3, 0xB4, 0x81, 0x83, 0xD1, 0xD3})
# An A3 board's first HCCS link, by main-board id (dcmi_get_mainboard_id): Atlas 900 A3 SuperPoD (0x18, 0x19)
# and Atlas 800I A3 (0x14) from link 1, Atlas 9000 A3 SuperPoD (0x1c, 0x1d) from link 2; any other main
# board from link 0, as npu-exporter does (it logs the board as unsupported). A2 boards start at link 1.
A3_FIRST_HCCS_LINK = {0x18: 1, 0x19: 1, 0x14: 1, 0x1C: 2, 0x1D: 2}
COMMON_READS = ("utilization", "sensors", "network_health", "processes", "hbm", "hccs", "pcie", "sio")
# (family, field of struct dcmi_pcie_link_bandwidth_info)
PCIE_FAMILIES = tuple((f"npu_chip_info_pcie_{kind}_bw", f"{kind}_bw") for kind in
                      ("rx_p", "rx_np", "rx_cpl", "tx_p", "tx_np", "tx_cpl"))
ECC_FAMILIES = (("npu_chip_info_hbm_ecc_enable_flag", "enable_flag"),
                *((f"npu_chip_info_hbm_ecc_{name}", name) for name in (
                    "single_bit_error_cnt", "double_bit_error_cnt", "total_single_bit_error_cnt",
                    "total_double_bit_error_cnt", "single_bit_isolated_pages_cnt", "double_bit_isolated_pages_cnt")))
UTILIZATION_FAMILIES = (("npu_chip_info_utilization", "aicore_util", abi.UTIL_AICORE),
                        ("npu_chip_info_vector_utilization", "aiv_util", abi.UTIL_VECTOR),
                        ("npu_chip_info_cube_utilization", "aic_util", abi.UTIL_CUBE),
                        ("npu_chip_info_overall_utilization", "npu_util", abi.UTIL_OVERALL))


@dataclass(frozen=True)
class Board:
    """What npu-exporter decides from the node's first chip: A3 or A2, and the first HCCS link exported."""

    a3: bool
    first_hccs_link: int


def float32(value: float) -> float:
    """`value` as npu-exporter holds it: a Go float32, widened to float64 when exported."""
    return struct.unpack("f", struct.pack("f", value))[0]


def container_of(pid: int, proc: Path) -> str:
    """The container id of a host process, from its cgroup path ("" for a host process or when unknown)."""
    try:
        text = (proc / str(pid) / "cgroup").read_text(errors="replace")
    except OSError:
        return ""
    found = CONTAINER_ID.findall(text)
    return found[-1] if found else ""


class DcmiTelemetry:
    name = "dcmi"

    def __init__(self, backend: DcmiBackend, proc: Path = Path("/proc")):
        self._backend = backend
        self._proc = proc
        self._lock = threading.Lock()  # reads of different chips run on two threads
        self._unsupported: set[tuple[int, str]] = set()
        self._utilization: dict[int, str] = {}  # logic id -> the utilization call that works for it
        self._hccs_sub: dict[int, int] = {}  # logic id -> the HCCS statistic sub-command that works for it
        self._serials: dict[int, str] = {}  # card -> serial number
        self._board: Board | None = None  # read from the first chip that answers
        self._reads: dict[str, Callable[[DeviceInfo], list[Sample]]] = {
            "utilization": self._read_utilization, "sensors": self._read_sensors,
            "network_health": self._read_network_health, "processes": self._read_processes,
            "hbm": self._read_hbm, "hccs": self._read_hccs, "pcie": self._read_pcie, "sio": self._read_sio}

    # ---- TelemetrySource -------------------------------------------------------------------------

    def reads(self, device: DeviceInfo) -> tuple[str, ...]:
        return COMMON_READS  # pcie answers on A2 boards only, sio on A3 ones (board_of, in the lane)

    def read(self, device: DeviceInfo, read: str) -> list[Sample]:
        return self._reads[read](device)

    def read_timeout(self, read: str, call_timeout_s: float) -> float:
        # npu-exporter's bound on the network health call, which blocks for long after a card dropped
        return min(call_timeout_s, NETWORK_HEALTH_TIMEOUT_S) if read == "network_health" else call_timeout_s

    def node(self) -> list[Sample]:
        buffer = ctypes.create_string_buffer(abi.DCMI_VERSION_LEN)
        rc = self._backend.call("dcmi_get_dcmi_version", buffer, abi.DCMI_VERSION_LEN)
        driver = core.c_text(buffer.raw) if rc == core.DCMI_OK else ""
        if rc != core.DCMI_OK:
            log.warning("cannot read the driver version", extra={"rc": rc})
        return node_samples(driver)

    def unsupported(self) -> list[tuple[int, str]]:
        with self._lock:
            return sorted(self._unsupported)

    # ---- calls -----------------------------------------------------------------------------------

    def _call(self, device: DeviceInfo, name: str, *args, what: str = "") -> int:
        """One driver call for one chip; a function (`what`: with the sub-command that matters) the chip does not
        support is not called again."""
        key = (device.phy_id, what or name)
        with self._lock:
            if key in self._unsupported:
                return abi.DCMI_ERR_NOT_SUPPORTED
        rc = self._backend.call(name, *args)
        if rc in UNSUPPORTED:
            with self._lock:
                self._unsupported.add(key)
            if rc == abi.DCMI_ERR_NOT_SUPPORTED:  # a missing symbol the backend has logged already
                log.info("the driver does not support a telemetry call for this chip; not calling it again",
                         extra={"device": device.phy_id, "function": what or name, "rc": rc})
        return rc

    def _get(self, device: DeviceInfo, name: str, *args, ctype=ctypes.c_uint) -> int | None:
        """A call that writes one number (after a type argument, if any); None when it failed."""
        value = ctype(0)
        what = f"{name}(type {args[0]})" if args else ""
        rc = self._call(device, name, device.card_id, device.device_id, *args, ctypes.byref(value), what=what)
        return value.value if rc == core.DCMI_OK else None

    def _struct(self, device: DeviceInfo, name: str, struct, *after):
        """A call that fills a struct, with `after` arguments behind it; None when it failed."""
        value = struct()
        rc = self._call(device, name, device.card_id, device.device_id, ctypes.byref(value), *after)
        return value if rc == core.DCMI_OK else None

    def board_of(self, device: DeviceInfo) -> Board:
        """The node's board, as npu-exporter reads it once: A3 by board id, the first HCCS link by main-board
        id. A driver without the board call falls back to the chip name (npu-exporter would take such an A3
        for an A1 and export no HCCS at all); a failed call is tried again at the next read."""
        with self._lock:
            if self._board is not None:
                return self._board
        info = abi.BoardInfo()
        rc = self._call(device, "dcmi_get_device_board_info", device.card_id, device.device_id, ctypes.byref(info))
        if rc == core.DCMI_OK:
            a3 = info.board_id in A3_BOARD_IDS
        elif rc in UNSUPPORTED:
            a3 = bool(A3_CHIP.match(device.chip_name))
        else:
            return Board(bool(A3_CHIP.match(device.chip_name)), 1)
        first = 1
        if a3:
            mainboard = self._get(device, "dcmi_get_mainboard_id")
            if mainboard is None:
                with self._lock:
                    unsupported = (device.phy_id, "dcmi_get_mainboard_id") in self._unsupported
                if not unsupported:
                    return Board(a3, 1)  # a failed read: asked again at the next one
            first = A3_FIRST_HCCS_LINK.get(mainboard, 0)
            if first == 0:
                log.error("unknown A3 main board: HCCS links 0-7 exported, as npu-exporter does", extra={
                    "mainboard_id": "unsupported" if mainboard is None else f"0x{mainboard:x}", "device": device.phy_id})
        board = Board(a3, first)
        log.info("board read", extra={"a3": a3, "board_id": f"0x{info.board_id:x}" if rc == core.DCMI_OK else None,
                                      "first_hccs_link": first})
        with self._lock:
            self._board = board
        return board

    # ---- reads -----------------------------------------------------------------------------------

    def _read_utilization(self, device: DeviceInfo) -> list[Sample]:
        """npu-exporter's order: the period call, the multi call, then four single calls; the first that works is
        kept for the chip. A reading outside 0..100 is omitted."""
        chosen = self._utilization.get(device.logic_id)
        for how in ([chosen] if chosen else ["period", "multi", "single"]):
            values = self._utilization_by(device, how)
            if values is not None:
                self._utilization[device.logic_id] = how
                return [(family, (), float(v)) for family, v in values if 0 <= v <= 100]
        return []

    def _utilization_by(self, device: DeviceInfo, how: str) -> list[tuple[str, int]] | None:
        if how == "single":
            values = [(family, self._get(device, "dcmi_get_device_utilization_rate", kind))
                      for family, _, kind in UTILIZATION_FAMILIES]
            values = [(family, v) for family, v in values if v is not None]
            return values or None
        if how == "period":
            info = self._struct(device, "dcmi_get_device_multi_utilization_rate_period", abi.MultiUtilizationInfo,
                                UTILIZATION_PERIOD)
        else:
            info = self._struct(device, "dcmi_get_device_multi_utilization_rate", abi.MultiUtilizationInfo)
        return None if info is None else [(family, getattr(info, field)) for family, field, _ in UTILIZATION_FAMILIES]

    def _read_sensors(self, device: DeviceInfo) -> list[Sample]:
        samples: list[Sample] = []
        temperature = self._get(device, "dcmi_get_device_temperature", ctype=ctypes.c_int)
        if temperature is not None and temperature >= MIN_TEMPERATURE:
            samples.append(("npu_chip_info_temperature", (), float(temperature)))
        # 0.1 W and 0.01 V units, scaled in float32 as npu-exporter does: 1853 -> 185.3000030517578
        power = self._get(device, "dcmi_get_device_power_info", ctype=ctypes.c_int)
        if power is not None and power >= 0:
            samples.append(("npu_chip_info_power", (), float32(float32(power) * float32(0.1))))
        voltage = self._get(device, "dcmi_get_device_voltage")
        if voltage is not None and voltage < core.MAX_READING:
            samples.append(("npu_chip_info_voltage", (), float32(float32(voltage) * float32(0.01))))
        frequency = self._get(device, "dcmi_get_device_frequency", abi.FREQ_AICORE_CURRENT)
        if frequency is not None and frequency < core.MAX_READING:
            samples.append(("npu_chip_info_aicore_current_freq", (), float(frequency)))
        samples.append(("npu_chip_info_serial_number", (self._serial(device),), 1.0))
        return samples

    def _serial(self, device: DeviceInfo) -> str:
        serial = self._serials.get(device.card_id)
        if serial is None:
            label = abi.ElabelInfo()
            rc = self._call(device, "dcmi_get_card_elabel_v2", device.card_id, ctypes.byref(label))
            if rc != core.DCMI_OK:
                return "NA"  # npu-exporter's value; asked again next time
            serial = self._serials[device.card_id] = core.c_text(label.serial_number) or "NA"
        return serial

    def _read_network_health(self, device: DeviceInfo) -> list[Sample]:
        result = self._get(device, "dcmi_get_device_network_health", ctype=ctypes.c_int)
        value = -1.0 if result is None else 1.0 if result in (abi.NETWORK_OK, abi.NETWORK_INIT) else 0.0
        return [("npu_chip_info_network_status", (), value)]

    def _read_processes(self, device: DeviceInfo) -> list[Sample]:
        entries = (abi.ProcMemInfo * abi.MAX_PROCESSES)()
        count = ctypes.c_int(0)
        rc = self._call(device, "dcmi_get_device_resource_info", device.card_id, device.device_id, entries,
                        ctypes.byref(count))
        if rc != core.DCMI_OK:
            return []
        listed = entries[: max(0, min(count.value, abi.MAX_PROCESSES))]
        return [*(("npu_chip_info_process_info", (str(entry.proc_id), container_of(entry.proc_id, self._proc)),
                   entry.proc_mem_usage / MIB) for entry in listed),
                ("npu_chip_info_process_info_num", (), float(len(listed)))]

    def _read_hbm(self, device: DeviceInfo) -> list[Sample]:
        samples: list[Sample] = []
        hbm = self._struct(device, "dcmi_get_device_hbm_info", abi.HbmInfo)
        if hbm is not None and hbm.temp >= 0:  # a negative HBM temperature is a failed reading
            samples += [("npu_chip_info_hbm_total_memory", (), float(hbm.memory_size)),
                        ("npu_chip_info_hbm_used_memory", (), float(hbm.memory_usage)),
                        ("npu_chip_info_hbm_temperature", (), float(hbm.temp)),
                        ("npu_chip_info_hbm_bandwidth_utilization", (), float(hbm.bandwith_util_rate))]
        utilization = self._get(device, "dcmi_get_device_utilization_rate", abi.UTIL_HBM)
        if utilization is not None and utilization <= 100:
            samples.append(("npu_chip_info_hbm_utilization", (), float(utilization)))
        ecc = abi.EccInfo()
        rc = self._call(device, "dcmi_get_device_ecc_info", device.card_id, device.device_id, abi.DEVICE_TYPE_HBM,
                        ctypes.byref(ecc))
        if rc == core.DCMI_OK:
            samples += [(family, (), float(getattr(ecc, field))) for family, field in ECC_FAMILIES]
        return samples

    def _read_hccs(self, device: DeviceInfo) -> list[Sample]:
        """Per-link counters (u64 sub-command, else the u32 one) and bandwidths, from the board's first link to 7;
        a part that fails reads -1 (the profiling time keeps its value, as in npu-exporter)."""
        links = HCCS_LINKS[self.board_of(device).first_hccs_link:]
        samples: list[Sample] = []
        statistic = None
        for sub in ([self._hccs_sub[device.logic_id]] if device.logic_id in self._hccs_sub
                    else [abi.HCCS_SUB_STATISTIC_U64, abi.HCCS_SUB_STATISTIC]):
            struct = abi.HccsStatisticInfoU64 if sub == abi.HCCS_SUB_STATISTIC_U64 else abi.HccsStatisticInfo
            value, size = struct(), ctypes.c_uint(ctypes.sizeof(struct))
            rc = self._call(device, "dcmi_get_device_info", device.card_id, device.device_id, abi.MAIN_CMD_HCCS, sub,
                            ctypes.byref(value), ctypes.byref(size), what=f"dcmi_get_device_info(HCCS, {sub})")
            if rc == core.DCMI_OK:
                self._hccs_sub[device.logic_id], statistic = sub, value
                break
        for x in links:
            for kind in ("tx_cnt", "rx_cnt", "crc_err_cnt"):
                samples.append((f"npu_chip_info_hccs_statistic_info_{kind}_{x}", (),
                                float(getattr(statistic, kind)[x]) if statistic is not None else -1.0))
        bandwidth = abi.HccsBandwidthInfo(profiling_time=HCCS_PROFILING_MS)
        rc = self._call(device, "dcmi_get_hccs_link_bandwidth_info", device.card_id, device.device_id,
                        ctypes.byref(bandwidth))
        ok = rc == core.DCMI_OK
        for x in links:
            samples.append((f"npu_chip_info_hccs_bandwidth_info_tx_{x}", (), bandwidth.tx_bandwidth[x] if ok else -1.0))
            samples.append((f"npu_chip_info_hccs_bandwidth_info_rx_{x}", (), bandwidth.rx_bandwidth[x] if ok else -1.0))
        samples += [("npu_chip_info_hccs_bandwidth_info_total_tx", (), bandwidth.total_txbw if ok else -1.0),
                    ("npu_chip_info_hccs_bandwidth_info_total_rx", (), bandwidth.total_rxbw if ok else -1.0),
                    ("npu_chip_info_hccs_bandwidth_info_profiling_time", (), float(HCCS_PROFILING_MS))]
        return samples

    def _read_pcie(self, device: DeviceInfo) -> list[Sample]:
        if self.board_of(device).a3:
            return []  # A2 only
        info = abi.PcieLinkBandwidthInfo(profiling_time=HCCS_PROFILING_MS)
        rc = self._call(device, "dcmi_get_pcie_link_bandwidth_info", device.card_id, device.device_id,
                        ctypes.byref(info))
        if rc != core.DCMI_OK:
            return []
        return [(family, (kind,), float(getattr(info, field)[i]))
                for family, field in PCIE_FAMILIES for i, kind in enumerate(PCIE_BW_TYPES)]

    def _read_sio(self, device: DeviceInfo) -> list[Sample]:
        if not self.board_of(device).a3:
            return []  # A3 only
        info = abi.SioCrcErrStatisticInfo()
        size = ctypes.c_uint(ctypes.sizeof(info))
        rc = self._call(device, "dcmi_get_device_info", device.card_id, device.device_id, abi.MAIN_CMD_SIO,
                        abi.SIO_SUB_CRC, ctypes.byref(info), ctypes.byref(size), what="dcmi_get_device_info(SIO, 0)")
        if rc != core.DCMI_OK:
            return []
        return [("npu_chip_info_sio_crc_tx_err_cnt", (), float(info.tx_error_count)),
                ("npu_chip_info_sio_crc_rx_err_cnt", (), float(info.rx_error_count))]
