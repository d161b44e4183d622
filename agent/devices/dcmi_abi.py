"""The C ABI of libdcmi.so: struct layouts, function signatures and return codes (ctypes)."""

from __future__ import annotations

import ctypes

DCMI_OK = 0
DCMI_ERR_DEVICE_NOT_READY = -8012  # from the health call: the card dropped
DCMI_ERR_SYMBOL_MISSING = -99998  # our own code for a function the library does not export
MAX_ERROR_CODES = 128
MAX_CARDS = 64
MAX_EVENT_NAME = 256
MAX_EVENT_DATA = 32
MAX_EVENT_RESV = 32
DIE_VDIE = 1  # enum dcmi_die_type: NDIE 0, VDIE 1 (the chip's UUID, npu-exporter's vdie_id)
MAX_READING = 2**31 - 1  # a health, voltage or frequency this large is no reading (npu-exporter's validation)


class ChipInfo(ctypes.Structure):
    _fields_ = [
        ("chip_type", ctypes.c_ubyte * 32),
        ("chip_name", ctypes.c_ubyte * 32),
        ("chip_ver", ctypes.c_ubyte * 32),
        ("aicore_cnt", ctypes.c_uint),
    ]


class DieId(ctypes.Structure):
    _fields_ = [("soc_die", ctypes.c_uint * 5)]


class PcieInfoAll(ctypes.Structure):
    _fields_ = [
        ("venderid", ctypes.c_uint),
        ("subvenderid", ctypes.c_uint),
        ("deviceid", ctypes.c_uint),
        ("subdeviceid", ctypes.c_uint),
        ("domain", ctypes.c_int),
        ("bdf_busid", ctypes.c_uint),
        ("bdf_deviceid", ctypes.c_uint),
        ("bdf_funcid", ctypes.c_uint),
        ("reserve", ctypes.c_ubyte * 32),
    ]


class EventFilter(ctypes.Structure):
    _fields_ = [
        ("filter_flag", ctypes.c_ulonglong),
        ("event_id", ctypes.c_uint),
        ("severity", ctypes.c_ubyte),
        ("node_type", ctypes.c_ubyte),
        ("resv", ctypes.c_ubyte * MAX_EVENT_RESV),
    ]


class DmsFaultEvent(ctypes.Structure):
    _fields_ = [
        ("event_id", ctypes.c_uint),
        ("deviceid", ctypes.c_ushort),
        ("node_type", ctypes.c_ubyte),
        ("node_id", ctypes.c_ubyte),
        ("sub_node_type", ctypes.c_ubyte),
        ("sub_node_id", ctypes.c_ubyte),
        ("severity", ctypes.c_ubyte),
        ("assertion", ctypes.c_ubyte),
        ("event_serial_num", ctypes.c_int),
        ("notify_serial_num", ctypes.c_int),
        ("alarm_raised_time", ctypes.c_ulonglong),
        ("event_name", ctypes.c_char * MAX_EVENT_NAME),
        ("additional_info", ctypes.c_char * MAX_EVENT_DATA),
        ("os_id", ctypes.c_ubyte),
        ("resv_1", ctypes.c_ubyte * 1),
        ("node_type_ex", ctypes.c_ushort),
        ("sub_node_type_ex", ctypes.c_ushort),
        ("resv_2", ctypes.c_ubyte * 2),
        ("resv", ctypes.c_ubyte * (MAX_EVENT_RESV - 8)),
    ]


class _EventUnion(ctypes.Union):
    _fields_ = [("dms_event", DmsFaultEvent)]


class Event(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("event_t", _EventUnion)]


EVENT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.POINTER(Event))

INT_P = ctypes.POINTER(ctypes.c_int)
UINT_P = ctypes.POINTER(ctypes.c_uint)

# name -> (restype, argtypes)
SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "dcmi_init": (ctypes.c_int, []),
    "dcmi_get_card_list": (ctypes.c_int, [INT_P, INT_P, ctypes.c_int]),
    "dcmi_get_device_num_in_card": (ctypes.c_int, [ctypes.c_int, INT_P]),
    "dcmi_get_device_logic_id": (ctypes.c_int, [INT_P, ctypes.c_int, ctypes.c_int]),
    "dcmi_get_device_phyid_from_logicid": (ctypes.c_int, [ctypes.c_uint, UINT_P]),
    "dcmi_get_device_chip_info": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ChipInfo)]),
    "dcmi_get_device_die_v2": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(DieId)]),
    "dcmi_get_device_pcie_info_v2": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(PcieInfoAll)]),
    "dcmi_get_device_health": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, UINT_P]),
    "dcmi_get_device_errorcode_v2": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, INT_P, UINT_P, ctypes.c_uint]),
    "dcmi_subscribe_fault_event": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, EventFilter, EVENT_CALLBACK]),
}


def c_text(raw) -> str:
    """A NUL-terminated C char array as text."""
    return bytes(raw).split(b"\0", 1)[0].decode("utf-8", "replace").strip()


def vdie_text(die: DieId) -> str:
    """npu-exporter's vdie_id: each word in upper-case hex, padded to 8 characters, joined by "-"."""
    return "-".join(f"{word:08X}" for word in die.soc_die)


def pcie_text(info: PcieInfoAll) -> str:
    """npu-exporter's pcie_bus_info: domain:bus:device.function."""
    return f"{info.domain:04X}:{info.bdf_busid:02X}:{info.bdf_deviceid:02X}.{info.bdf_funcid:X}"
