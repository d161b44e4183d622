"""The C ABI of libdcmi.so's telemetry functions (npu-exporter's default families): struct layouts,
function signatures and constants. Apart from agent.devices.dcmi_abi because ctypes types cost
memory (~0.5 MiB for these): an agent with telemetry off never loads them."""

from __future__ import annotations

import ctypes

from agent.devices.dcmi_abi import DieId, PcieInfoAll, INT_P, UINT_P

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


class BoardInfo(ctypes.Structure):
    _fields_ = [
        ("board_id", ctypes.c_uint),  # tells the A3 (910_93) boards from the A2 ones
        ("pcb_id", ctypes.c_uint),
        ("bom_id", ctypes.c_uint),
        ("slot_id", ctypes.c_uint),
    ]


# sizeof / alignment on x86_64, as the real header compiles (checked by a test against the fake's C compiler).
TELEMETRY_SIZES = {HbmInfo: 32, EccInfo: 36, MultiUtilizationInfo: 48, PcieLinkBandwidthInfo: 88,
                   HccsStatisticInfo: 512, HccsStatisticInfoU64: 1024, HccsBandwidthInfo: 280,
                   SioCrcErrStatisticInfo: 12, PcieInfoAll: 64, DieId: 20, ProcMemInfo: 16, ElabelInfo: 1280,
                   BoardInfo: 16}


# name -> (restype, argtypes), added to the core ones when telemetry is enabled
SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "dcmi_get_device_temperature": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, INT_P]),
    "dcmi_get_device_power_info": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, INT_P]),
    "dcmi_get_device_voltage": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, UINT_P]),
    "dcmi_get_device_frequency": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, UINT_P]),
    "dcmi_get_device_network_health": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, INT_P]),
    "dcmi_get_device_utilization_rate": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, UINT_P]),
    "dcmi_get_device_multi_utilization_rate": (
        ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(MultiUtilizationInfo)]),
    "dcmi_get_device_multi_utilization_rate_period": (
        ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(MultiUtilizationInfo), ctypes.c_int]),
    "dcmi_get_device_hbm_info": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(HbmInfo)]),
    "dcmi_get_device_ecc_info": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(EccInfo)]),
    "dcmi_get_device_info": (
        ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, UINT_P]),
    "dcmi_get_hccs_link_bandwidth_info": (
        ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(HccsBandwidthInfo)]),
    "dcmi_get_pcie_link_bandwidth_info": (
        ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(PcieLinkBandwidthInfo)]),
    "dcmi_get_device_resource_info": (
        ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ProcMemInfo), INT_P]),
    "dcmi_get_card_elabel_v2": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ElabelInfo)]),
    "dcmi_get_dcmi_version": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]),
    "dcmi_get_device_board_info": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(BoardInfo)]),
    "dcmi_get_mainboard_id": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, UINT_P]),
}
