"""The `dcmi` backend: libdcmi.so through ctypes, the way the Ascend Device Plugin uses it."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Mapping

from agent.devices import dcmi_abi as abi
from agent.devices.base import BackendError
from agent.model import CARD_DROP_CODE, DeviceInfo, DriverEvent, Health, Reading

log = logging.getLogger(__name__)

DEFAULT_LIBRARY = "/usr/local/Ascend/driver/lib64/driver/libdcmi.so"
LIBRARY_NAME = "libdcmi.so"


def find_library(configured: str, environ=os.environ) -> str:
    """The configured path, else LD_LIBRARY_PATH, the ld cache, then the driver's default place."""
    if configured:
        if not Path(configured).is_file():
            raise BackendError(f"devices.dcmi_library {configured!r}: no such file")
        return configured
    for directory in filter(None, environ.get("LD_LIBRARY_PATH", "").split(":")):
        candidate = Path(directory) / LIBRARY_NAME
        if candidate.is_file():
            return str(candidate)
    cached = ctypes.util.find_library("dcmi")
    if cached:
        return cached
    if Path(DEFAULT_LIBRARY).is_file():
        return DEFAULT_LIBRARY
    raise BackendError(
        f"{LIBRARY_NAME} not found in LD_LIBRARY_PATH, the ld cache or {DEFAULT_LIBRARY}; "
        "mount the Ascend driver or set devices.dcmi_library")


class DcmiBackend:
    name = "dcmi"

    def __init__(self, library_path: str = "", signatures: Mapping[str, tuple] = abi.SIGNATURES):
        """`signatures`: name -> (restype, argtypes) of every function `call` may be asked for (the
        fault monitor's, and telemetry's when enabled: agent.telemetry.dcmi_abi)."""
        self._configured = library_path
        self._signatures = signatures
        self._lib: ctypes.CDLL | None = None
        self._functions: dict[str, Callable] = {}
        self._missing: set[str] = set()
        self._callback = None  # kept referenced: the driver calls it for as long as the process lives
        self._lock = threading.Lock()
        self.path = ""

    # ---- driver calls ---------------------------------------------------------------------------

    def _fn(self, name: str) -> Callable | None:
        """The function, resolved lazily like the device plugin does; None when not exported."""
        with self._lock:
            if name in self._functions:
                return self._functions[name]
            if name in self._missing or self._lib is None:
                return None
            try:
                fn = getattr(self._lib, name)
            except AttributeError:
                self._missing.add(name)
                log.warning("driver library lacks a function", extra={"library": self.path, "function": name})
                return None
            fn.restype, fn.argtypes = self._signatures[name]
            self._functions[name] = fn
            return fn

    def call(self, name: str, *args) -> int:
        """`name(*args)`; DCMI_ERR_SYMBOL_MISSING when the library does not export it."""
        fn = self._fn(name)
        return abi.DCMI_ERR_SYMBOL_MISSING if fn is None else fn(*args)


    # ---- DeviceBackend --------------------------------------------------------------------------

    def open(self) -> list[DeviceInfo]:
        self.path = find_library(self._configured)
        try:
            self._lib = ctypes.CDLL(self.path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        except OSError as exc:
            raise BackendError(f"cannot load {self.path}: {exc}") from None
        rc = self.call("dcmi_init")
        if rc != abi.DCMI_OK:
            raise BackendError(f"dcmi_init failed with {rc}")
        count = ctypes.c_int(0)
        cards = (ctypes.c_int * abi.MAX_CARDS)()
        rc = self.call("dcmi_get_card_list", ctypes.byref(count), cards, abi.MAX_CARDS)
        if rc != abi.DCMI_OK:
            raise BackendError(f"dcmi_get_card_list failed with {rc}")
        devices = []
        for card in cards[: max(0, min(count.value, abi.MAX_CARDS))]:
            chips = ctypes.c_int(0)
            rc = self.call("dcmi_get_device_num_in_card", card, ctypes.byref(chips))
            if rc != abi.DCMI_OK:
                log.error("cannot count the chips of a card", extra={"card": card, "rc": rc})
                continue
            for chip in range(chips.value):
                device = self._describe(card, chip)
                if device is not None:
                    devices.append(device)
        if not devices:
            raise BackendError(f"the driver at {self.path} lists no NPU")
        return sorted(devices, key=lambda d: d.logic_id)

    def _describe(self, card: int, chip: int) -> DeviceInfo | None:
        logic = ctypes.c_int(-1)
        rc = self.call("dcmi_get_device_logic_id", ctypes.byref(logic), card, chip)
        if rc != abi.DCMI_OK:
            log.error("cannot read a logic id", extra={"card": card, "chip": chip, "rc": rc})
            return None
        phy = ctypes.c_uint(0)
        rc = self.call("dcmi_get_device_phyid_from_logicid", logic.value, ctypes.byref(phy))
        if rc != abi.DCMI_OK:
            log.error("cannot read a physical id", extra={"logic_id": logic.value, "rc": rc})
            return None
        info = abi.ChipInfo()
        rc = self.call("dcmi_get_device_chip_info", card, chip, ctypes.byref(info))
        chip_type = chip_name = chip_ver = ""
        if rc == abi.DCMI_OK:
            chip_type, chip_name, chip_ver = abi.c_text(info.chip_type), abi.c_text(info.chip_name), abi.c_text(info.chip_ver)
        else:
            log.warning("cannot read chip info", extra={"logic_id": logic.value, "rc": rc})
        model = "-".join(part for part in (chip_name, chip_type, chip_ver) if part)
        return DeviceInfo(logic.value, phy.value, card, chip, chip_name, model,
                          self._identity(card, chip, "dcmi_get_device_die_v2", abi.DieId, abi.vdie_text, abi.DIE_VDIE),
                          self._identity(card, chip, "dcmi_get_device_pcie_info_v2", abi.PcieInfoAll, abi.pcie_text))

    def _identity(self, card: int, chip: int, name: str, struct, text, *args) -> str:
        """A label read once at inventory (the chip's UUID, its PCIe address); "" when the driver cannot say,
        as npu-exporter exports it."""
        value = struct()
        rc = self.call(name, card, chip, *args, ctypes.byref(value))
        if rc != abi.DCMI_OK:
            log.warning("cannot read a chip label", extra={"card": card, "chip": chip, "function": name, "rc": rc})
            return ""
        return text(value)

    def read(self, device: DeviceInfo) -> Reading:
        health = ctypes.c_uint(0)
        rc = self.call("dcmi_get_device_health", device.card_id, device.device_id, ctypes.byref(health))
        dropped = rc == abi.DCMI_ERR_DEVICE_NOT_READY
        # npu-exporter's reading: 0 healthy, any alarm (even a minor one) unhealthy; a failed call, a dropped card
        # (-8012) included, or an out-of-range value is unknown.
        if rc != abi.DCMI_OK or health.value >= abi.MAX_READING:
            status = Health.UNKNOWN
        else:
            status = Health.HEALTHY if health.value == 0 else Health.UNHEALTHY
        count = ctypes.c_int(0)
        codes = (ctypes.c_uint * abi.MAX_ERROR_CODES)()
        code_rc = self.call("dcmi_get_device_errorcode_v2", device.card_id, device.device_id,
                             ctypes.byref(count), codes, abi.MAX_ERROR_CODES)
        order: tuple[int, ...] = ()
        if code_rc == abi.DCMI_OK:
            order = tuple(dict.fromkeys(codes[: max(0, min(count.value, abi.MAX_ERROR_CODES))]))
            found = frozenset(order)
        elif dropped:
            found = frozenset()  # a dropped card answers nothing but "not ready"
        else:
            found = None
        if dropped:
            found = found | {CARD_DROP_CODE}
            order = (*order, CARD_DROP_CODE)
        errors = []
        if rc not in (abi.DCMI_OK, abi.DCMI_ERR_DEVICE_NOT_READY):
            errors.append(f"dcmi_get_device_health returned {rc}")
        if found is None:
            errors.append(f"dcmi_get_device_errorcode_v2 returned {code_rc}")
        return Reading(status, found, "; ".join(errors), order)

    def subscribe(self, on_event: Callable[[DriverEvent], None]) -> str:
        if self._fn("dcmi_subscribe_fault_event") is None:
            return "the driver library has no dcmi_subscribe_fault_event"

        def deliver(pointer):
            # Runs on the driver's thread: copy the fields out at once, the struct is not ours.
            try:
                event = pointer.contents
                if event.type != 0:
                    return
                fault = event.event_t.dms_event
                on_event(DriverEvent(fault.deviceid, fault.event_id, fault.assertion, fault.severity,
                                     int(fault.alarm_raised_time)))
            except Exception:  # an exception must never unwind into the driver
                log.exception("fault event callback failed")

        self._callback = abi.EVENT_CALLBACK(deliver)
        rc = self.call("dcmi_subscribe_fault_event", -1, -1, abi.EventFilter(), self._callback)
        if rc != abi.DCMI_OK:
            self._callback = None
            return f"dcmi_subscribe_fault_event returned {rc}"
        return ""

    def close(self) -> None:
        # libdcmi has no unsubscribe or shutdown call; the library stays loaded with the process.
        pass
