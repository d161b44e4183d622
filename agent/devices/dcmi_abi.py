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


# ---- telemetry (npu-exporter's default families) ----------------------------------------------------------

DCMI_ERR_NOT_SUPPORTED = -8255
FREQ_AICORE_CURRENT = 7  # enum dcmi_freq_type
UTIL_AICORE, UTIL_HBM, UTIL_VECTOR, UTIL_OVERALL, UTIL_CUBE = 2, 6, 12, 13, 14  # dcmi_get_device_utilization_rate types
DEVICE_TYPE_HBM = 2  # enum dcmi_device_type, for the ECC call
MAIN_CMD_HCCS, HCCS_SUB_STATISTIC, HCCS_SUB_STATISTIC_U64 = 16, 3, 5  # dcmi_get_device_info
MAIN_CMD_SIO, SIO_SUB_CRC = 56, 0
MAX_PROCESSES = 32  # dcmi_get_device_resource_info has no length argument: the driver fills up to this many
DCMI_VERSION_LEN = 33  # what npu-exporter passes to dcmi_get_dcmi_version
HCCS_PORTS = 16
NETWORK_OK, NETWORK_INIT = 0, 6  # enum dcmi_rdfx_detect_result values npu-exporter counts as healthy


class HbmInfo(ctypes.Structure):
    _fields_ = [
        ("memory_size", ctypes.c_ulonglong),  # MB
        ("freq", ctypes.c_uint),  # MHz
        ("memory_usage", ctypes.c_ulonglong),  # MB
        ("temp", ctypes.c_int),  # degrees C
        ("bandwith_util_rate", ctypes.c_uint),  # %, the header's spelling
    ]


class EccInfo(ctypes.Structure):
    # npu-exporter's header declares nine members (36 bytes); the driver writes the first seven. Allocate nine.
    _fields_ = [
        ("enable_flag", ctypes.c_int),
        ("single_bit_error_cnt", ctypes.c_uint),
        ("double_bit_error_cnt", ctypes.c_uint),
        ("total_single_bit_error_cnt", ctypes.c_uint),
        ("total_double_bit_error_cnt", ctypes.c_uint),
        ("single_bit_isolated_pages_cnt", ctypes.c_uint),
        ("double_bit_isolated_pages_cnt", ctypes.c_uint),
        ("single_bit_next_isolated_pages_cnt", ctypes.c_uint),
        ("double_bit_next_isolated_pages_cnt", ctypes.c_uint),
    ]


class MultiUtilizationInfo(ctypes.Structure):
    _fields_ = [
        ("aic_util", ctypes.c_uint),  # cube
        ("aiv_util", ctypes.c_uint),  # vector
        ("aicore_util", ctypes.c_uint),
        ("npu_util", ctypes.c_uint),  # overall
        ("reserved", ctypes.c_uint * 8),
    ]


class PcieLinkBandwidthInfo(ctypes.Structure):
    _fields_ = [
        ("profiling_time", ctypes.c_int),  # input, ms
        ("tx_p_bw", ctypes.c_uint * 3),  # {min, max, avg}, MB/ms
        ("tx_np_bw", ctypes.c_uint * 3),
        ("tx_cpl_bw", ctypes.c_uint * 3),
        ("tx_np_lantency", ctypes.c_uint * 3),
        ("rx_p_bw", ctypes.c_uint * 3),
        ("rx_np_bw", ctypes.c_uint * 3),
        ("rx_cpl_bw", ctypes.c_uint * 3),
    ]


class HccsStatisticInfo(ctypes.Structure):
    _fields_ = [
        ("tx_cnt", ctypes.c_uint * HCCS_PORTS),
        ("rx_cnt", ctypes.c_uint * HCCS_PORTS),
        ("crc_err_cnt", ctypes.c_uint * HCCS_PORTS),
        ("retry_cnt", ctypes.c_uint * HCCS_PORTS),
        ("reserved_field_cnt", ctypes.c_uint * 64),
    ]


class HccsStatisticInfoU64(ctypes.Structure):
    _fields_ = [
        ("tx_cnt", ctypes.c_ulonglong * HCCS_PORTS),
        ("rx_cnt", ctypes.c_ulonglong * HCCS_PORTS),
        ("crc_err_cnt", ctypes.c_ulonglong * HCCS_PORTS),
        ("retry_cnt", ctypes.c_ulonglong * HCCS_PORTS),
        ("reserved", ctypes.c_ulonglong * 64),
    ]


class HccsBandwidthInfo(ctypes.Structure):
    _fields_ = [
        ("profiling_time", ctypes.c_int),  # input, ms
        ("total_txbw", ctypes.c_double),  # GB/s
        ("total_rxbw", ctypes.c_double),
        ("tx_bandwidth", ctypes.c_double * HCCS_PORTS),
        ("rx_bandwidth", ctypes.c_double * HCCS_PORTS),
    ]


class SioCrcErrStatisticInfo(ctypes.Structure):
    _fields_ = [
        ("tx_error_count", ctypes.c_ushort),
        ("rx_error_count", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 8),
    ]


class ProcMemInfo(ctypes.Structure):
    _fields_ = [
        ("proc_id", ctypes.c_int),  # host PID
        ("proc_mem_usage", ctypes.c_ulong),  # bytes
    ]


class ElabelInfo(ctypes.Structure):
    _fields_ = [
        ("product_name", ctypes.c_char * 256),
        ("model", ctypes.c_char * 256),
        ("manufacturer", ctypes.c_char * 256),
        ("manufacturer_date", ctypes.c_char * 256),
        ("serial_number", ctypes.c_char * 256),
    ]


# sizeof / alignment on x86_64, as the real header compiles (checked by a test against the fake's C compiler).
TELEMETRY_SIZES = {HbmInfo: 32, EccInfo: 36, MultiUtilizationInfo: 48, PcieLinkBandwidthInfo: 88,
                   HccsStatisticInfo: 512, HccsStatisticInfoU64: 1024, HccsBandwidthInfo: 280,
                   SioCrcErrStatisticInfo: 12, PcieInfoAll: 64, DieId: 20, ProcMemInfo: 16, ElabelInfo: 1280}


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

_int_p = ctypes.POINTER(ctypes.c_int)
_uint_p = ctypes.POINTER(ctypes.c_uint)

# name -> (restype, argtypes)
SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "dcmi_init": (ctypes.c_int, []),
    "dcmi_get_card_list": (ctypes.c_int, [_int_p, _int_p, ctypes.c_int]),
    "dcmi_get_device_num_in_card": (ctypes.c_int, [ctypes.c_int, _int_p]),
    "dcmi_get_device_logic_id": (ctypes.c_int, [_int_p, ctypes.c_int, ctypes.c_int]),
    "dcmi_get_device_phyid_from_logicid": (ctypes.c_int, [ctypes.c_uint, _uint_p]),
    "dcmi_get_device_chip_info": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ChipInfo)]),
    "dcmi_get_device_die_v2": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(DieId)]),
    "dcmi_get_device_pcie_info_v2": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(PcieInfoAll)]),
    "dcmi_get_device_health": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, _uint_p]),
    "dcmi_get_device_errorcode_v2": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, _int_p, _uint_p, ctypes.c_uint]),
    "dcmi_subscribe_fault_event": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, EventFilter, EVENT_CALLBACK]),
    # telemetry
    "dcmi_get_device_temperature": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, _int_p]),
    "dcmi_get_device_power_info": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, _int_p]),
    "dcmi_get_device_voltage": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, _uint_p]),
    "dcmi_get_device_frequency": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, _uint_p]),
    "dcmi_get_device_network_health": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, _int_p]),
    "dcmi_get_device_utilization_rate": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, _uint_p]),
    "dcmi_get_device_multi_utilization_rate": (
        ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(MultiUtilizationInfo)]),
    "dcmi_get_device_multi_utilization_rate_period": (
        ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(MultiUtilizationInfo), ctypes.c_int]),
    "dcmi_get_device_hbm_info": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(HbmInfo)]),
    "dcmi_get_device_ecc_info": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(EccInfo)]),
    "dcmi_get_device_info": (
        ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, _uint_p]),
    "dcmi_get_hccs_link_bandwidth_info": (
        ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(HccsBandwidthInfo)]),
    "dcmi_get_pcie_link_bandwidth_info": (
        ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(PcieLinkBandwidthInfo)]),
    "dcmi_get_device_resource_info": (
        ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ProcMemInfo), _int_p]),
    "dcmi_get_card_elabel_v2": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ElabelInfo)]),
    "dcmi_get_dcmi_version": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]),
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
