"""npu-exporter's default telemetry families for Atlas A2 (910B) and A3 (910_93) chips: names, HELP texts, label
names, the group that collects each and the groups' default intervals. Pure data: sources fill the families,
the collector renders them.

A *read* is one blocking unit of work for one chip (one or a few driver calls, or one hccn_tool run); a
*group* is npu-exporter's scheduling unit, collected every `interval` seconds, made of one or more reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.telemetry.labels import CARD_LABELS, POD_LABELS

NAME_LABELS = ("id", "name", "vdie_id", "pcie_bus_info", *POD_LABELS)  # npu_chip_info_name says `name`
CONTAINER_INFO_LABELS = ("npuID", "model_name", "vdie_id", "pcie_bus_info", *POD_LABELS, "containerID", "containerName")

HCCS_LINKS = range(0, 8)  # the HCCS ports any board exports (npu-exporter: from the board's first link to 7)
HCCS_LINKS_A2 = range(1, 8)  # on A2, Atlas 900 A3 SuperPoD and Atlas 800I A3 boards
HCCS_PROFILING_MS = 200  # npu-exporter's default -hccsBWProfilingTime and -profilingTime (PCIe)
PCIE_BW_TYPES = ("minPcieBw", "maxPcieBw", "avgPcieBw")  # index 0, 1, 2 of each PCIe bandwidth array


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    help: str
    group: str
    extra: tuple[str, ...] = ()  # labels after the card labels
    card: tuple[str, ...] = CARD_LABELS  # () for node-level families


@dataclass(frozen=True, slots=True)
class Group:
    name: str
    interval_s: float  # npu-exporter's default; 0 = once at start
    reads: tuple[str, ...]


# npu-exporter's defaults (its metricConfiguration.json). `npu` also holds health and error codes, which the
# agent reads in its fault pipeline (agent.metrics), so here it is the sensors, network health and processes.
GROUPS = (
    Group("utilization", 1.0, ("utilization",)),
    Group("npu", 5.0, ("sensors", "network_health", "processes")),
    Group("hbm", 60.0, ("hbm",)),
    Group("hccs", 60.0, ("hccs",)),
    Group("pcie", 60.0, ("pcie",)),  # A2 only
    Group("sio", 60.0, ("sio",)),  # A3 only
    Group("network", 60.0, ("network",)),  # hccn_tool from here on
    Group("roce", 60.0, ("roce",)),
    Group("optical", 60.0, ("optical",)),
)
# Reads whose driver calls block for their sampling window (HCCS and PCIe bandwidth, 200 ms a chip): one at a
# time, so that they never hold both of the telemetry lane's threads and the quick reads always find one.
SAMPLING_READS = frozenset({"hccs", "pcie"})
GROUP_OF_READ = {read: group.name for group in GROUPS for read in group.reads}
NETWORK_HEALTH_TIMEOUT_S = 1.0  # npu-exporter's bound on dcmi_get_device_network_health, which hangs on a dropped card


def _f(name: str, help: str, group: str, *extra: str) -> Family:
    return Family(name, help, group, tuple(extra))


def _node(name: str, help: str, group: str, *labels: str) -> Family:
    return Family(name, help, group, tuple(labels), ())


_MAC = (("rx_pause_num", "mac-rx-pause-num"), ("tx_pause_num", "mac-tx-pause-num"),
        ("rx_pfc_pkt_num", "mac-rx-pfc-pkt-num"), ("tx_pfc_pkt_num", "mac-tx-pfc-pkt-num"),
        ("rx_bad_pkt_num", "mac-rx-bad-pkt-num"), ("tx_bad_pkt_num", "mac-tx-bad-pkt-num"),
        ("rx_bad_oct_num", "mac-rx-bad-oct-num"), ("tx_bad_oct_num", "mac-tx-bad-oct-num"))
_ROCE = ("rx_all_pkt_num", "tx_all_pkt_num", "rx_err_pkt_num", "tx_err_pkt_num", "rx_cnp_pkt_num", "tx_cnp_pkt_num",
         "new_pkt_rty_num", "unexpected_ack_num", "out_of_order_num", "verification_err_num", "qp_status_err_num")
# npu-exporter's HELP texts byte for byte, its typos and the U+2018 in rx_p's included: a tool that compares the
# two exporters' metadata sees no difference.
_PCIE = (("rx_p", "the npu write bw to remote\u2018s speed"), ("rx_np", "the npu read bw's speed from remote"),
         ("rx_cpl", "the npu reply remote read operate cpl's speed"),
         ("tx_p", "the npu receive remote write operate's speed"),
         ("tx_np", "the npu receive remote read operate's speed"),
         ("tx_cpl", "the npu read cpl's responese bw speed from remote"))
# RoCE counters whose HELP npu-exporter starts with "the "
_ROCE_THE = frozenset({"unexpected_ack_num", "out_of_order_num", "verification_err_num", "qp_status_err_num"})

FAMILIES: tuple[Family, ...] = (
    # npu (5 s): sensors, network health, identity, processes
    _f("npu_chip_info_temperature", "the npu temperature", "npu"),
    _f("npu_chip_info_power", "the npu power", "npu"),
    _f("npu_chip_info_voltage", "the npu voltage", "npu"),
    _f("npu_chip_info_aicore_current_freq", "the npu ai core current frequency, unit is 'MHz'", "npu"),
    _f("npu_chip_info_network_status", "the npu network health status", "npu"),
    Family("npu_chip_info_name", "the Ascend npu name with value '1'", "npu", (), NAME_LABELS),
    _f("npu_chip_info_serial_number", "the npu serial number information", "npu", "serial_number"),
    _f("npu_chip_info_process_info", "the npu process info, unit is 'MB'. if process run on host, container_id and "
       "container_name will be empty", "npu", "process_id", "container_id"),
    _f("npu_chip_info_process_info_num", "the npu process num", "npu"),
    # utilization (1 s)
    _f("npu_chip_info_utilization", "the ai core utilization", "utilization"),
    _f("npu_chip_info_vector_utilization", "the vector utilization", "utilization"),
    _f("npu_chip_info_cube_utilization", "the cube utilization", "utilization"),
    _f("npu_chip_info_overall_utilization", "the overall utilization of npu", "utilization"),
    _f("container_npu_utilization", "npu ai core utilization in container, unit is '%'", "utilization"),
    # hbm (60 s): memory and ECC
    _f("npu_chip_info_hbm_total_memory", "the npu hbm total memory", "hbm"),
    _f("npu_chip_info_hbm_used_memory", "the npu hbm used memory", "hbm"),
    _f("npu_chip_info_hbm_temperature", "the npu hbm temperature", "hbm"),
    _f("npu_chip_info_hbm_bandwidth_utilization", "the npu hbm bandwidth util rate", "hbm"),
    _f("npu_chip_info_hbm_utilization", "the npu hbm utilization", "hbm"),
    _f("container_npu_total_memory", "npu total memory in container, unit is 'MB'", "hbm"),
    _f("container_npu_used_memory", "the npu used memory in container, unit is 'MB'", "hbm"),
    _f("npu_chip_info_hbm_ecc_enable_flag", "whether HBM ecc detection is enabled", "hbm"),
    _f("npu_chip_info_hbm_ecc_single_bit_error_cnt", "HBM Single Bit Error Count", "hbm"),
    _f("npu_chip_info_hbm_ecc_double_bit_error_cnt", "HBM Double Bit Error Count", "hbm"),
    _f("npu_chip_info_hbm_ecc_total_single_bit_error_cnt", "HBM Single Bit Aggregate Total Err Cnt", "hbm"),
    _f("npu_chip_info_hbm_ecc_total_double_bit_error_cnt", "HBM Double Bit Aggregate Total Err Cnt", "hbm"),
    _f("npu_chip_info_hbm_ecc_single_bit_isolated_pages_cnt", "HBM Single Bit Isolated Pages Count", "hbm"),
    _f("npu_chip_info_hbm_ecc_double_bit_isolated_pages_cnt", "HBM Double Bit Isolated Pages Count", "hbm"),
    # hccs (60 s): per-link counters (flits) and bandwidth (GB/s)
    *(_f(f"npu_chip_info_hccs_statistic_info_{kind}_{x}", f"{what} for hccs {x}", "hccs")
      for x in HCCS_LINKS
      for kind, what in (("tx_cnt", "transmitted message count"), ("rx_cnt", "received message count"),
                         ("crc_err_cnt", "crc error count"))),
    *(_f(f"npu_chip_info_hccs_bandwidth_info_{kind}_{x}", f"{what} for hccs {x}", "hccs")
      for x in HCCS_LINKS
      for kind, what in (("tx", "single-link transmission data bandwidth"),
                         ("rx", "single-link receive data bandwidth"))),
    _f("npu_chip_info_hccs_bandwidth_info_total_tx", "total sent data bandwidth", "hccs"),
    _f("npu_chip_info_hccs_bandwidth_info_total_rx", "total received data bandwidth", "hccs"),
    _f("npu_chip_info_hccs_bandwidth_info_profiling_time", "sampling interval for hccs bandwidth", "hccs"),
    # pcie (60 s, A2): {min, max, avg} of each bandwidth, MB/ms
    *(_f(f"npu_chip_info_pcie_{kind}_bw", f"{what}, unit is 'MB/ms'", "pcie", "pcie_bw_type") for kind, what in _PCIE),
    # sio (60 s, A3)
    _f("npu_chip_info_sio_crc_tx_err_cnt", "sio transmitted error count between die", "sio"),
    _f("npu_chip_info_sio_crc_rx_err_cnt", "sio received error count between die", "sio"),
    # network (60 s, hccn_tool)
    _f("npu_chip_info_link_status", "the npu link status", "network"),
    _f("npu_chip_info_bandwidth_tx", "the npu interface transport speed, unit is 'MB/s'", "network"),
    _f("npu_chip_info_bandwidth_rx", "the npu interface receive speed, unit is 'MB/s'", "network"),
    _f("npu_chip_link_speed", "the npu interface receive link speed, unit is 'Mb/s'", "network"),
    _f("npu_chip_link_up_num", "the npu interface receive link-up num", "network"),
    # roce (60 s, hccn_tool -stat): MAC and RoCE counters
    *(_f(f"npu_chip_mac_{key}", f"npu interface receive {what}", "roce") for key, what in _MAC),
    _f("npu_chip_info_rx_fcs_num", "the npu network fcs receive number", "roce"),
    *(_f(f"npu_chip_roce_{key}", f"{'the ' if key in _ROCE_THE else ''}npu interface receive roce-{key.replace('_', '-')}",
         "roce") for key in _ROCE),
    _f("npu_chip_info_rx_ecn_num", "the npu network ecn receive number", "roce"),
    # optical (60 s, hccn_tool)
    _f("npu_chip_optical_state", "the npu interface receive optical-state", "optical"),
    *(_f(f"npu_chip_optical_{way}_power_{n}", f"npu interface receive optical-{way}-power-{n}", "optical")
      for way in ("tx", "rx") for n in range(4)),
    _f("npu_chip_optical_vcc", "the npu interface receive optical-vcc", "optical"),
    _f("npu_chip_optical_temp", "the npu interface receive optical-temperature", "optical"),
    # node level (no card labels)
    _node("machine_card_nums", "Amount of card installed on the machine.", "node"),
    _node("npu_exporter_version_info", "exporter version with value '1'", "node", "exporterVersion"),
    _node("node_base_info", "the common information of this node", "node", "exporterVersion", "driverVersion"),
    Family("npu_container_info", "the container name and deviceID relationship", "npu", (), CONTAINER_INFO_LABELS),
)
BY_NAME = {family.name: family for family in FAMILIES}

# What a read renders when it could not run at all (no answer in time, refused while stuck): npu-exporter's
# failure values where it exports one (-1), nothing where it omits the sample.
FAILED_AS_MINUS_ONE = {
    "network_health": ("npu_chip_info_network_status",),
    "hccs": tuple(f.name for f in FAMILIES if f.group == "hccs"),
    "network": ("npu_chip_info_link_status",),
}
