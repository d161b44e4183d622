"""Self-test of the fake libdcmi.so, loaded with plain ctypes in this process."""

from __future__ import annotations

import ctypes
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from testkit.fakes.dcmi import FakeDcmiControl, build_fake_dcmi
from testkit.wait import wait_until

OK, INVALID_PARAM, NOT_READY, NOT_INIT = 0, -8001, -8012, -8020
CODE_A, CODE_B, CODE_C = 0x80E01801, 0x8C2FA009, 0xA8028802


# The product's ctypes definitions; their layout is checked against the C compiler in test_dcmi_agent.py.
from agent.devices.dcmi_abi import EVENT_CALLBACK as CALLBACK  # noqa: E402
from agent.devices.dcmi_abi import ChipInfo, DieId, DmsFaultEvent, EventFilter, PcieInfoAll  # noqa: E402
from agent.devices import dcmi_abi as abi  # noqa: E402
from agent.telemetry import dcmi_abi as tabi  # noqa: E402
from testkit.fakes.dcmi.control import (TELEMETRY_ALIASES, TELEMETRY_FIELDS, default_processes,  # noqa: E402
                                        default_serial)
_KEEPALIVE: list = []  # the library keeps callback pointers until process exit

P = ctypes.POINTER
_INT, _UINT = ctypes.c_int, ctypes.c_uint
_SIGNATURES = {
    "dcmi_init": [],
    "dcmi_get_card_list": [P(_INT), P(_INT), _INT],
    "dcmi_get_device_num_in_card": [_INT, P(_INT)],
    "dcmi_get_device_logic_id": [P(_INT), _INT, _INT],
    "dcmi_get_device_phyid_from_logicid": [_UINT, P(_UINT)],
    "dcmi_get_device_logicid_from_phyid": [_UINT, P(_UINT)],
    "dcmi_get_card_id_device_id_from_logicid": [P(_INT), P(_INT), _UINT],
    "dcmi_get_device_chip_info": [_INT, _INT, P(ChipInfo)],
    "dcmi_get_device_die_v2": [_INT, _INT, _INT, P(DieId)],
    "dcmi_get_device_pcie_info_v2": [_INT, _INT, P(PcieInfoAll)],
    "dcmi_get_device_health": [_INT, _INT, P(_UINT)],
    "dcmi_get_device_errorcode_v2": [_INT, _INT, P(_INT), P(_UINT), _UINT],
    "dcmi_subscribe_fault_event": [_INT, _INT, EventFilter, CALLBACK],
}


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    telemetry = {name: argtypes for name, (_, argtypes) in tabi.SIGNATURES.items() if name not in _SIGNATURES}
    for name, argtypes in {**_SIGNATURES, **telemetry, "dcmi_get_mainboard_id": [_INT, _INT, P(_UINT)]}.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.fake_dcmi_layout.restype = ctypes.c_char_p
    return lib


# -- fixtures --------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fake_dcmi")


@pytest.fixture
def make_fake(built, tmp_path, monkeypatch):
    """Load a private instance of the library; returns (lib, ctl, trace)."""
    controls: list[FakeDcmiControl] = []
    # sun_path holds only 107 bytes, so keep the socket out of the deep tmp_path.
    sock_dir = Path(tempfile.mkdtemp(prefix="fdcmi-"))

    def make(variant: str = "full", init: bool = True, **env: str) -> SimpleNamespace:
        # glibc shares one instance per file, and dcmi_init state is per
        # instance: a fresh copy gives every test a freshly booted "driver".
        copy = tmp_path / f"{variant}-{len(controls)}" / "libdcmi.so"
        copy.parent.mkdir()
        shutil.copyfile(build_fake_dcmi(built, variant), copy)
        sock = sock_dir / f"ctl{len(controls)}"
        trace = tmp_path / f"trace{len(controls)}"
        monkeypatch.setenv("FAKE_DCMI_CONTROL", str(sock))
        monkeypatch.setenv("FAKE_DCMI_TRACE", str(trace))
        for key in ("CARDS", "CHIPS_PER_CARD", "CHIP_NAME", "PHY_IDS", "VDIE", "PCIE", "FAIL"):
            monkeypatch.delenv(f"FAKE_DCMI_{key}", raising=False)
        for key, value in env.items():
            monkeypatch.setenv(f"FAKE_DCMI_{key.upper()}", value)
        lib = load(copy)
        ctl = FakeDcmiControl(sock)
        controls.append(ctl)
        if init:
            assert lib.dcmi_init() == OK
            ctl.connect()
        return SimpleNamespace(lib=lib, ctl=ctl, trace=trace)

    yield make
    for ctl in controls:
        ctl.close()
    shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.fixture
def fake(make_fake) -> SimpleNamespace:
    return make_fake()


def health(lib, card: int, device: int = 0) -> tuple[int, int]:
    value = ctypes.c_uint(0xDEAD)
    rc = lib.dcmi_get_device_health(card, device, ctypes.byref(value))
    return rc, value.value


def error_codes(lib, card: int, device: int = 0, list_len: int = 128) -> tuple[int, list[int]]:
    count = ctypes.c_int(-1)
    codes = (ctypes.c_uint * max(list_len, 1))()
    rc = lib.dcmi_get_device_errorcode_v2(card, device, ctypes.byref(count), codes, list_len)
    return rc, list(codes[: max(count.value, 0)])


def subscribe(lib, card=-1, device=-1, event_id=None) -> list[dict]:
    """Register a recording callback; returns the list it appends to."""
    events: list[dict] = []

    def on_event(ptr):
        ev = ptr.contents
        f = ev.event_t.dms_event
        record = {name: getattr(f, name) for name, _ in DmsFaultEvent._fields_}
        record["type"] = ev.type
        # Calling back into DCMI from the callback must not deadlock.
        record["health_rc"] = health(lib, f.deviceid)[0]
        events.append(record)

    flt = EventFilter()
    if event_id is not None:
        flt.filter_flag, flt.event_id = 1, event_id
    cb = CALLBACK(on_event)
    _KEEPALIVE.append(cb)
    assert lib.dcmi_subscribe_fault_event(card, device, flt, cb) == OK
    return events


# -- tests -----------------------------------------------------------------


def test_default_topology(fake):
    lib = fake.lib
    num, cards = ctypes.c_int(), (ctypes.c_int * 64)()
    assert lib.dcmi_get_card_list(ctypes.byref(num), cards, 64) == OK
    assert list(cards[: num.value]) == list(range(8))
    phy = ctypes.c_uint()
    for logic in range(8):
        assert lib.dcmi_get_device_phyid_from_logicid(logic, ctypes.byref(phy)) == OK
        assert phy.value == 7 - logic
    info = ChipInfo()
    assert lib.dcmi_get_device_chip_info(3, 0, ctypes.byref(info)) == OK
    assert bytes(info.chip_type).rstrip(b"\0") == b"Ascend"
    assert bytes(info.chip_name).rstrip(b"\0") == b"910B3"
    assert bytes(info.chip_ver).rstrip(b"\0") == b"V1"
    assert info.aicore_cnt == 24
    assert health(lib, 7) == (OK, 0)
    assert error_codes(lib, 7) == (OK, [])


def test_inventory_with_several_chips_per_card(make_fake):
    lib = make_fake(cards="2", chips_per_card="2", chip_name="910B4", phy_ids="10,11,12,13").lib
    num, cards = ctypes.c_int(), (ctypes.c_int * 4)()
    assert lib.dcmi_get_card_list(ctypes.byref(num), cards, 4) == OK
    assert list(cards[: num.value]) == [0, 1]
    n = ctypes.c_int()
    assert lib.dcmi_get_device_num_in_card(1, ctypes.byref(n)) == OK and n.value == 2
    logic = ctypes.c_int()
    assert lib.dcmi_get_device_logic_id(ctypes.byref(logic), 1, 1) == OK and logic.value == 3
    phy, back = ctypes.c_uint(), ctypes.c_uint()
    assert lib.dcmi_get_device_phyid_from_logicid(2, ctypes.byref(phy)) == OK and phy.value == 12
    assert lib.dcmi_get_device_logicid_from_phyid(12, ctypes.byref(back)) == OK
    assert back.value == 2
    card, dev = ctypes.c_int(), ctypes.c_int()
    assert lib.dcmi_get_card_id_device_id_from_logicid(ctypes.byref(card), ctypes.byref(dev), 2) == OK
    assert (card.value, dev.value) == (1, 0)
    info = ChipInfo()
    assert lib.dcmi_get_device_chip_info(1, 1, ctypes.byref(info)) == OK
    assert bytes(info.chip_name).rstrip(b"\0") == b"910B4"


def test_invalid_parameters(fake):
    lib = fake.lib
    num, cards, out = ctypes.c_int(), (ctypes.c_int * 8)(), ctypes.c_uint()
    assert lib.dcmi_get_card_list(ctypes.byref(num), cards, 4) == INVALID_PARAM
    assert lib.dcmi_get_card_list(None, cards, 8) == INVALID_PARAM
    assert lib.dcmi_get_device_num_in_card(8, ctypes.byref(num)) == INVALID_PARAM
    assert lib.dcmi_get_device_logic_id(ctypes.byref(num), 0, 1) == INVALID_PARAM
    assert lib.dcmi_get_device_phyid_from_logicid(8, ctypes.byref(out)) == INVALID_PARAM
    assert lib.dcmi_get_device_logicid_from_phyid(99, ctypes.byref(out)) == INVALID_PARAM
    assert lib.dcmi_get_device_health(0, 0, None) == INVALID_PARAM
    assert health(lib, -1) == (INVALID_PARAM, 0xDEAD)
    assert lib.dcmi_get_device_errorcode_v2(0, 0, None, None, 0) == INVALID_PARAM


def test_calls_before_init_and_repeated_init(make_fake):
    fake = make_fake(init=False, cards="2")
    assert health(fake.lib, 0)[0] == NOT_INIT
    assert fake.lib.dcmi_init() == OK
    fake.ctl.connect()
    assert fake.lib.dcmi_init() == OK  # idempotent: the socket and topology stay
    num, cards = ctypes.c_int(), (ctypes.c_int * 8)()
    assert fake.lib.dcmi_get_card_list(ctypes.byref(num), cards, 8) == OK
    assert num.value == 2
    stats = fake.ctl.stats()
    assert stats["calls"]["dcmi_init"] == 2
    assert stats["calls"]["dcmi_get_device_health"] == 0  # the pre-init call is not counted
    assert stats["calls"]["dcmi_get_card_list"] == 1


def test_occur_and_recover_change_error_codes_and_health(fake):
    lib, ctl = fake.lib, fake.ctl
    ctl.occur(2, CODE_A)
    ctl.occur(2, CODE_B, via="silent")
    ctl.occur(2, CODE_A)  # no duplicates
    assert error_codes(lib, 2) == (OK, [CODE_A, CODE_B])
    assert error_codes(lib, 2, list_len=1) == (OK, [CODE_A])
    assert error_codes(lib, 3) == (OK, [])
    assert health(lib, 2) == (OK, 1)  # alarms make a healthy device report 1
    ctl.health(2, 3)
    assert health(lib, 2) == (OK, 3)
    ctl.health(2, 0)
    ctl.recover(2, CODE_A, via="silent")
    assert error_codes(lib, 2) == (OK, [CODE_B])
    ctl.recover(2, CODE_B)
    assert error_codes(lib, 2) == (OK, [])
    assert health(lib, 2) == (OK, 0)


def test_drop_makes_device_not_ready(fake):
    lib, ctl = fake.lib, fake.ctl
    ctl.occur(5, CODE_A, via="silent")
    ctl.drop(5)
    assert health(lib, 5)[0] == NOT_READY
    assert error_codes(lib, 5)[0] == NOT_READY
    assert health(lib, 4) == (OK, 0)
    ctl.restore(5)
    assert health(lib, 5) == (OK, 1)
    assert error_codes(lib, 5) == (OK, [CODE_A])


def test_callback_receives_events(fake):
    lib, ctl = fake.lib, fake.ctl
    events = subscribe(lib)
    before = int(time.time())
    ctl.occur(1, CODE_A, severity=3)
    ctl.occur(1, CODE_B, via="silent")
    ctl.recover(1, CODE_A)
    ctl.once(6, CODE_C)
    ctl.event(0, 0x1234ABCD, assertion=1, severity=0)
    after = int(time.time())

    # The reply comes after the callbacks, so no waiting is needed here.
    assert [(e["deviceid"], e["event_id"], e["assertion"], e["severity"]) for e in events] == [
        (1, CODE_A, 1, 3),
        (1, CODE_A, 0, 3),
        (6, CODE_C, 2, 1),
        (0, 0x1234ABCD, 1, 0),
    ]
    occur, recovery = events[0], events[1]
    assert occur["type"] == 0
    assert occur["event_name"] == b"fake dcmi event %X" % CODE_A
    assert before <= occur["alarm_raised_time"] <= after
    assert recovery["alarm_raised_time"] == occur["alarm_raised_time"]
    serials = [e["event_serial_num"] for e in events]
    assert serials == sorted(set(serials)) and serials[0] >= 1
    assert all(e["notify_serial_num"] == e["event_serial_num"] for e in events)
    assert all(e["health_rc"] == OK for e in events)
    for field in ("node_type", "node_id", "sub_node_type", "os_id", "node_type_ex"):
        assert all(e[field] == 0 for e in events)
    assert ctl.stats()["subscribers"] == 1

    lines = fake.trace.read_text().splitlines()
    assert [line.split()[2:] for line in lines] == [
        ["1", "%X" % CODE_A, "1"],
        ["1", "%X" % CODE_A, "0"],
        ["6", "%X" % CODE_C, "2"],
        ["0", "1234ABCD", "1"],
    ]
    stamps = [int(line.split()[1]) for line in lines]
    assert all(line.startswith("cb ") for line in lines)
    assert stamps == sorted(stamps) and abs(stamps[0] / 1e9 - before) < 5


def test_device_subscription_and_event_id_filter(fake):
    lib, ctl = fake.lib, fake.ctl
    only_b_on_3 = subscribe(lib, card=3, device=0, event_id=CODE_B)
    on_3 = subscribe(lib, card=3, device=0)
    ctl.occur(3, CODE_A)
    ctl.occur(3, CODE_B)
    ctl.occur(4, CODE_B)
    assert [e["event_id"] for e in only_b_on_3] == [CODE_B]
    assert [e["event_id"] for e in on_3] == [CODE_A, CODE_B]
    flt = EventFilter()
    cb = CALLBACK(lambda ptr: None)
    _KEEPALIVE.append(cb)
    assert lib.dcmi_subscribe_fault_event(8, 0, flt, cb) == INVALID_PARAM
    assert lib.dcmi_subscribe_fault_event(-1, -1, flt, CALLBACK()) == INVALID_PARAM


def test_hang_blocks_until_released(fake):
    lib, ctl = fake.lib, fake.ctl
    ctl.hang("dcmi_get_device_health", 300)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=health(lib, 0)), daemon=True)
    worker.start()
    # Calls are counted before they hang, under the same lock as the wait.
    wait_until(lambda: ctl.stats()["calls"]["dcmi_get_device_health"] == 1, 5, "hung call")
    assert worker.is_alive() and not result
    assert error_codes(lib, 0) == (OK, [])  # other functions are unaffected
    ctl.hang("dcmi_get_device_health", 0)
    worker.join(timeout=5)
    assert not worker.is_alive()
    assert result["out"] == (OK, 0)
    assert health(lib, 0) == (OK, 0)  # cleared: no longer hangs


def test_hang_expires_on_its_own(fake):
    fake.ctl.hang("dcmi_get_device_errorcode_v2", 0.2)
    start = time.monotonic()
    assert error_codes(fake.lib, 0) == (OK, [])
    assert time.monotonic() - start >= 0.19


def test_fail_injects_return_code(fake):
    lib, ctl = fake.lib, fake.ctl
    ctl.occur(0, CODE_A, via="silent")
    ctl.fail("dcmi_get_device_errorcode_v2", -8005)
    assert error_codes(lib, 0)[0] == -8005
    assert health(lib, 0) == (OK, 1)
    ctl.fail("dcmi_get_device_errorcode_v2", 0)
    assert error_codes(lib, 0) == (OK, [CODE_A])


def die(lib, card: int, kind: int = 1) -> tuple[int, list[int]]:
    value = DieId()
    rc = lib.dcmi_get_device_die_v2(card, 0, kind, ctypes.byref(value))
    return rc, list(value.soc_die)


def pcie(lib, card: int) -> tuple[int, tuple[int, int, int, int]]:
    info = PcieInfoAll()
    rc = lib.dcmi_get_device_pcie_info_v2(card, 0, ctypes.byref(info))
    return rc, (info.domain, info.bdf_busid, info.bdf_deviceid, info.bdf_funcid)


def test_chip_identities_from_the_environment_and_the_control_socket(make_fake):
    fake = make_fake(vdie="1-2-3-4-5,,ABCDEF01-0-0-0-FFFFFFFF", pcie="0002:3b:1f.7")
    lib, ctl = fake.lib, fake.ctl
    assert die(fake.lib, 0) == (OK, [1, 2, 3, 4, 5])
    assert die(lib, 2) == (OK, [0xABCDEF01, 0, 0, 0, 0xFFFFFFFF])
    defaults = die(lib, 1)[1]
    assert defaults != die(lib, 3)[1] and defaults[3] < 0x10000000  # distinct per chip; a word that needs padding
    assert pcie(lib, 0) == (OK, (2, 0x3B, 0x1F, 7))
    assert pcie(lib, 1)[1] != pcie(lib, 2)[1]
    ctl.die(1, (0xA, 0xB, 0xC, 0xD, 0xE))
    ctl.pcie(1, "0000:c1:00.0")
    assert die(lib, 1) == (OK, [0xA, 0xB, 0xC, 0xD, 0xE]) and pcie(lib, 1) == (OK, (0, 0xC1, 0, 0))
    assert die(lib, 1, kind=7)[0] == -8001
    with pytest.raises(RuntimeError, match="bad value"):
        ctl.pcie(1, "0000:c1:00")
    ctl.fail("dcmi_get_device_pcie_info_v2", -8255)
    assert pcie(lib, 1)[0] == -8255


def test_failures_from_the_start(make_fake):
    lib = make_fake(fail="dcmi_get_device_die_v2=-8255").lib
    assert die(lib, 0)[0] == -8255
    assert pcie(lib, 0)[0] == OK


def test_control_errors(fake):
    ctl = fake.ctl
    with pytest.raises(RuntimeError, match="unknown function"):
        ctl.hang("dcmi_nope", 1)
    with pytest.raises(RuntimeError, match="bad logic id"):
        ctl.drop(8)
    with pytest.raises(RuntimeError, match="unknown command"):
        ctl._command("frobnicate")
    with pytest.raises(RuntimeError, match="bad hex code"):
        ctl._command("occur", 0, "XYZ")
    ctl._command("occur", 0, "80e01801", "silent")  # hex in any case, severity optional
    assert error_codes(fake.lib, 0) == (OK, [CODE_A])


def test_no_subscribe_variant_lacks_symbol(make_fake):
    fake = make_fake(variant="no_subscribe")
    assert not hasattr(fake.lib, "dcmi_subscribe_fault_event")
    assert "dcmi_subscribe_fault_event" not in fake.ctl.stats()["calls"]
    fake.ctl.occur(0, CODE_A)  # events with no subscribers are fine
    assert error_codes(fake.lib, 0) == (OK, [CODE_A])


# -- telemetry ---------------------------------------------------------------

NOT_SUPPORTED = -8255


def test_telemetry_struct_layouts_match_the_c_compiler(fake):
    layout = json.loads(fake.lib.fake_dcmi_layout())
    c_names = {tabi.HbmInfo: "dcmi_hbm_info", tabi.EccInfo: "dcmi_ecc_info",
               tabi.MultiUtilizationInfo: "dcmi_multi_utilization_info",
               tabi.PcieLinkBandwidthInfo: "dcmi_pcie_link_bandwidth_info",
               tabi.HccsStatisticInfo: "dcmi_hccs_statistic_info",
               tabi.HccsStatisticInfoU64: "dcmi_hccs_statistic_info_u64",
               tabi.HccsBandwidthInfo: "dcmi_hccs_bandwidth_info",
               tabi.SioCrcErrStatisticInfo: "dcmi_sio_crc_err_statistic_info",
               abi.PcieInfoAll: "dcmi_pcie_info_all", abi.DieId: "dcmi_die_id", tabi.ProcMemInfo: "dcmi_proc_mem_info",
               tabi.ElabelInfo: "dcmi_elabel_info", tabi.BoardInfo: "dcmi_board_info"}
    assert set(c_names) == set(tabi.TELEMETRY_SIZES)
    for cls, size in tabi.TELEMETRY_SIZES.items():
        c = layout[c_names[cls]]
        assert ctypes.sizeof(cls) == c["size"] == size, cls.__name__
        assert {name: getattr(cls, name).offset for name, _ in cls._fields_} == {
            k: v for k, v in c.items() if k != "size"}, cls.__name__


def scalar(lib, function: str, ctype, logic: int, *extra) -> tuple[int, int]:
    value = ctype(0x5A5A)
    rc = getattr(lib, function)(logic, 0, *extra, ctypes.byref(value))
    return rc, value.value


def fill(lib, function: str, cls, logic: int, *extra, **preset):
    out = cls(**preset)
    rc = getattr(lib, function)(logic, 0, *extra, ctypes.byref(out))
    return rc, out


def device_info(lib, logic: int, main: int, sub: int, cls, size: int | None = None):
    out, n = cls(), ctypes.c_uint(ctypes.sizeof(cls) if size is None else size)
    rc = lib.dcmi_get_device_info(logic, 0, main, sub, ctypes.byref(out), ctypes.byref(n))
    return rc, out


def hccs_bw(lib, logic: int, ms: int = 1, out=None):
    out = out or tabi.HccsBandwidthInfo()
    out.profiling_time = ms
    return lib.dcmi_get_hccs_link_bandwidth_info(logic, 0, ctypes.byref(out)), out


def pcie_bw(lib, logic: int, ms: int = 0):
    out = tabi.PcieLinkBandwidthInfo(profiling_time=ms)
    return lib.dcmi_get_pcie_link_bandwidth_info(logic, 0, ctypes.byref(out)), out


def procs(lib, logic: int) -> tuple[int, list[tuple[int, int]]]:
    table, n = (tabi.ProcMemInfo * tabi.MAX_PROCESSES)(), ctypes.c_int(-1)
    rc = lib.dcmi_get_device_resource_info(logic, 0, table, ctypes.byref(n))
    return rc, [(p.proc_id, p.proc_mem_usage) for p in table[: max(n.value, 0)]]


def version(lib, size: int = tabi.DCMI_VERSION_LEN) -> tuple[int, bytes]:
    buf = ctypes.create_string_buffer(b"\xff" * size, size)
    return lib.dcmi_get_dcmi_version(buf, size), buf.raw


def elabel(lib, card: int):
    out = tabi.ElabelInfo()
    return lib.dcmi_get_card_elabel_v2(card, ctypes.byref(out)), out


def read_field(lib, logic: int, field: str):
    """One telemetry field, read through the DCMI call that reports it."""
    field = TELEMETRY_ALIASES.get(field, field)
    group, _, rest = field.partition(".")
    simple = {"temperature": ("dcmi_get_device_temperature", ctypes.c_int),
              "power": ("dcmi_get_device_power_info", ctypes.c_int),
              "voltage": ("dcmi_get_device_voltage", ctypes.c_uint),
              "network_health": ("dcmi_get_device_network_health", ctypes.c_int),
              "mainboard_id": ("dcmi_get_mainboard_id", ctypes.c_uint)}
    if field in simple:
        rc, value = scalar(lib, *simple[field], logic)
    elif group in ("freq", "util"):
        fn = "dcmi_get_device_frequency" if group == "freq" else "dcmi_get_device_utilization_rate"
        rc, value = scalar(lib, fn, ctypes.c_uint, logic, int(rest))
    elif group == "hbm":
        rc, out = fill(lib, "dcmi_get_device_hbm_info", tabi.HbmInfo, logic)
        value = getattr(out, {"total": "memory_size", "used": "memory_usage", "freq": "freq", "temp": "temp",
                              "bw": "bandwith_util_rate"}[rest])
    elif group == "ecc":
        rc, out = fill(lib, "dcmi_get_device_ecc_info", tabi.EccInfo, logic, tabi.DEVICE_TYPE_HBM)
        value = getattr(out, rest)
    elif group == "hccs":
        kind, port = rest.split(".")
        rc, out = device_info(lib, logic, tabi.MAIN_CMD_HCCS, tabi.HCCS_SUB_STATISTIC_U64, tabi.HccsStatisticInfoU64)
        member = {"tx": "tx_cnt", "rx": "rx_cnt", "crc": "crc_err_cnt", "retry": "retry_cnt"}[kind]
        value = getattr(out, member)[int(port)]
    elif group == "hccs_bw":
        kind, port = rest.split(".")
        rc, out = hccs_bw(lib, logic)
        value = getattr(out, f"{kind}_bandwidth")[int(port)]
    elif group == "pcie":
        member, index = rest.split(".")
        rc, out = pcie_bw(lib, logic)
        value = getattr(out, member)[int(index)]
    else:
        rc, out = device_info(lib, logic, tabi.MAIN_CMD_SIO, tabi.SIO_SUB_CRC, tabi.SioCrcErrStatisticInfo)
        value = getattr(out, f"{rest}_error_count")
    return rc, value


def test_every_telemetry_field_has_its_default_and_can_be_set_per_chip(make_fake):
    fake = make_fake(cards="2")
    lib, ctl = fake.lib, fake.ctl
    for field, default in TELEMETRY_FIELDS.items():
        assert read_field(lib, 1, field) == (OK, default), field
        new = default + 7 if isinstance(default, int) else default * 3
        ctl.tele(1, field, new)
        assert read_field(lib, 1, field) == (OK, new), field
        assert read_field(lib, 0, field) == (OK, default), f"{field} leaked to another chip"
    for alias, field in TELEMETRY_ALIASES.items():
        ctl.tele(0, alias, 77)
        assert read_field(lib, 0, field) == (OK, 77), alias


@pytest.mark.parametrize("field, sent, read", [
    ("temperature", -300, -300), ("temperature", 4294967295, -1), ("power", -1, -1),
    ("voltage", 2147483647, 2147483647), ("voltage", 4294967295, 4294967295), ("util.aicore", 101, 101),
    ("hbm.temp", -5, -5), ("hbm.used", 2**64 - 1, 2**64 - 1), ("sio.rx", 65535, 65535),
    ("network_health", 5, 5), ("freq.7", 4294967295, 4294967295)])
def test_out_of_range_readings_can_be_injected(fake, field, sent, read):
    fake.ctl.tele(0, field, sent)
    assert read_field(fake.lib, 0, field) == (OK, read)


def test_tele_rejects_unknown_fields_and_bad_values(fake):
    ctl = fake.ctl
    for field, value in [("nope", 1), ("util.16", 1), ("hccs.tx.16", 1), ("pcie.tx_p_bw.3", 1), ("temperature", 2**32),
                         ("sio.tx", 65536), ("ecc.single_bit_next_isolated_pages_cnt", 1)]:
        with pytest.raises(RuntimeError, match="unknown field|bad value"):
            ctl.tele(0, field, value)
    with pytest.raises(RuntimeError, match="bad logic id"):
        ctl.tele(8, "power", 1)
    with pytest.raises(RuntimeError, match="unknown function"):
        ctl.unsupported(0, "dcmi_nope")


def test_unsupported_types_and_commands(fake):
    lib = fake.lib
    for kind in (0, 1, 3, 8, 12, 15, 16, -1):
        assert scalar(lib, "dcmi_get_device_frequency", ctypes.c_uint, 0, kind)[0] == NOT_SUPPORTED, kind
    for kind in (0, 1, 3, 7, 15, 16, -1):
        assert scalar(lib, "dcmi_get_device_utilization_rate", ctypes.c_uint, 0, kind)[0] == NOT_SUPPORTED, kind
    for kind in (0, 1, 3, 0xFF):
        assert fill(lib, "dcmi_get_device_ecc_info", tabi.EccInfo, 0, kind)[0] == NOT_SUPPORTED
    assert device_info(lib, 0, tabi.MAIN_CMD_HCCS, 4, tabi.HccsStatisticInfoU64)[0] == NOT_SUPPORTED
    assert device_info(lib, 0, tabi.MAIN_CMD_SIO, 1, tabi.HccsStatisticInfoU64)[0] == NOT_SUPPORTED
    assert device_info(lib, 0, 17, 3, tabi.HccsStatisticInfoU64)[0] == NOT_SUPPORTED


def test_a_function_unsupported_on_one_chip_only(fake):
    lib, ctl = fake.lib, fake.ctl
    ctl.unsupported(2, "dcmi_get_device_hbm_info")
    assert fill(lib, "dcmi_get_device_hbm_info", tabi.HbmInfo, 2)[0] == NOT_SUPPORTED
    assert fill(lib, "dcmi_get_device_hbm_info", tabi.HbmInfo, 1)[0] == OK
    ctl.unsupported(2, "dcmi_get_device_hbm_info", False)
    assert fill(lib, "dcmi_get_device_hbm_info", tabi.HbmInfo, 2)[0] == OK


def test_ecc_writes_only_the_first_seven_members(fake):
    fake.ctl.tele(0, "ecc.double_bit_isolated_pages_cnt", 9)
    rc, out = fill(fake.lib, "dcmi_get_device_ecc_info", tabi.EccInfo, 0, tabi.DEVICE_TYPE_HBM,
                   single_bit_error_cnt=0xEEEE, single_bit_next_isolated_pages_cnt=0xABCD,
                   double_bit_next_isolated_pages_cnt=0xDCBA)
    assert rc == OK and (out.enable_flag, out.single_bit_error_cnt, out.double_bit_isolated_pages_cnt) == (1, 0, 9)
    assert (out.single_bit_next_isolated_pages_cnt, out.double_bit_next_isolated_pages_cnt) == (0xABCD, 0xDCBA)


def test_multi_utilization_with_and_without_period(make_fake):
    fake = make_fake()
    fake.ctl.tele(3, "util.cube", 61)
    expected = (61, 30, 35, 40)  # aic (cube), aiv (vector), aicore, npu (overall)
    rc, out = fill(fake.lib, "dcmi_get_device_multi_utilization_rate", tabi.MultiUtilizationInfo, 3)
    assert rc == OK and (out.aic_util, out.aiv_util, out.aicore_util, out.npu_util) == expected
    out = tabi.MultiUtilizationInfo()
    rc = fake.lib.dcmi_get_device_multi_utilization_rate_period(3, 0, ctypes.byref(out), 1)
    assert rc == OK and (out.aic_util, out.aiv_util, out.aicore_util, out.npu_util) == expected
    old = make_fake(variant="no_period")
    assert not hasattr(old.lib, "dcmi_get_device_multi_utilization_rate_period")
    assert "dcmi_get_device_multi_utilization_rate_period" not in old.ctl.stats()["calls"]
    assert fill(old.lib, "dcmi_get_device_multi_utilization_rate", tabi.MultiUtilizationInfo, 0)[0] == OK


def test_hccs_and_sio_statistics_check_the_size_and_wrap_the_32_bit_view(fake):
    lib, ctl = fake.lib, fake.ctl
    ctl.tele(0, "hccs.crc.3", 2**32 + 5)
    rc, out = device_info(lib, 0, tabi.MAIN_CMD_HCCS, tabi.HCCS_SUB_STATISTIC, tabi.HccsStatisticInfo)
    assert rc == OK and out.crc_err_cnt[3] == 5 and list(out.tx_cnt) == [1000 + p for p in range(16)]
    rc, out = device_info(lib, 0, tabi.MAIN_CMD_HCCS, tabi.HCCS_SUB_STATISTIC_U64, tabi.HccsStatisticInfoU64)
    assert rc == OK and out.crc_err_cnt[3] == 2**32 + 5
    for sub, cls in ((tabi.HCCS_SUB_STATISTIC, tabi.HccsStatisticInfo),
                     (tabi.HCCS_SUB_STATISTIC_U64, tabi.HccsStatisticInfoU64)):
        assert device_info(lib, 0, tabi.MAIN_CMD_HCCS, sub, cls, ctypes.sizeof(cls) - 1)[0] == INVALID_PARAM
    sio = tabi.SioCrcErrStatisticInfo
    assert device_info(lib, 0, tabi.MAIN_CMD_SIO, tabi.SIO_SUB_CRC, sio, ctypes.sizeof(sio) - 1)[0] == INVALID_PARAM


def test_hccs_bandwidth_adds_into_totals_it_does_not_clear(fake):
    lib = fake.lib
    rc, out = hccs_bw(lib, 0)
    assert rc == OK and (out.total_txbw, out.total_rxbw) == (20.0, 40.0)
    rc, out = hccs_bw(lib, 0, out=out)  # the same struct again, not zeroed
    assert rc == OK and (out.total_txbw, out.total_rxbw) == (40.0, 80.0)
    assert list(out.tx_bandwidth) == [1.25] * 16


def test_bandwidth_calls_block_for_the_profiling_time_and_check_it(fake):
    lib = fake.lib
    for call, ms in ((hccs_bw, 200), (pcie_bw, 200)):
        start = time.monotonic()
        assert call(lib, 0, ms)[0] == OK
        assert time.monotonic() - start >= 0.19
    assert hccs_bw(lib, 0, 0)[0] == INVALID_PARAM and hccs_bw(lib, 0, 1001)[0] == INVALID_PARAM
    assert pcie_bw(lib, 0, -1)[0] == INVALID_PARAM and pcie_bw(lib, 0, 2001)[0] == INVALID_PARAM


def test_a_sampling_call_does_not_block_other_chips(fake):
    lib = fake.lib
    worker = threading.Thread(target=hccs_bw, args=(lib, 0, 1000), daemon=True)
    worker.start()
    wait_until(lambda: fake.ctl.stats()["calls"]["dcmi_get_hccs_link_bandwidth_info"] == 1, 5, "sampling call")
    start = time.monotonic()
    assert hccs_bw(lib, 1)[0] == OK and read_field(lib, 0, "temperature")[0] == OK
    assert time.monotonic() - start < 0.9 and worker.is_alive()
    worker.join(timeout=10)


def test_processes_serials_and_version(make_fake):
    fake = make_fake(cards="2", chips_per_card="2")
    lib, ctl = fake.lib, fake.ctl
    # The helpers address (card, chip 0): card 1 is logic 2 here.
    assert procs(lib, 1) == (OK, default_processes(2))
    ctl.procs(2, [(4242, 123), (7, 2**40)])
    assert procs(lib, 1) == (OK, [(4242, 123), (7, 2**40)])
    ctl.procs(2, [])
    assert procs(lib, 1) == (OK, [])
    ctl.procs(2, [(p, p) for p in range(32)])
    assert procs(lib, 1)[1][31] == (31, 31)
    with pytest.raises(RuntimeError, match="at most 32"):
        ctl.procs(2, [(p, p) for p in range(33)])
    rc, label = elabel(lib, 1)
    assert rc == OK and label.serial_number == default_serial(1).encode() and label.manufacturer == b"Huawei"
    ctl.serial(3, "2102314JXT10P5000123")  # logic 3 is card 1, chip 1
    assert elabel(lib, 1)[1].serial_number == b"2102314JXT10P5000123"
    assert elabel(lib, 0)[1].serial_number == default_serial(0).encode()
    assert elabel(lib, 2)[0] == INVALID_PARAM
    assert version(lib) == (OK, b"24.1.rc3\0" + b"\xff" * 24)
    ctl.version("25.0.rc1.b030")
    assert version(lib)[1].split(b"\0")[0] == b"25.0.rc1.b030"
    assert version(lib, 13)[0] == INVALID_PARAM and version(lib, 14)[0] == OK


def test_per_chip_failure_and_a_failure_everywhere(fake):
    lib, ctl = fake.lib, fake.ctl
    ctl.fail("dcmi_get_device_temperature", -8005, logic=1)
    assert [read_field(lib, n, "temperature")[0] for n in range(3)] == [OK, -8005, OK]
    ctl.fail("dcmi_get_device_temperature", -8006)
    assert [read_field(lib, n, "temperature")[0] for n in range(3)] == [-8006] * 3
    ctl.fail("dcmi_get_device_temperature", 0)  # everywhere clears the per-chip one too
    assert [read_field(lib, n, "temperature")[0] for n in range(3)] == [OK] * 3
    ctl.fail("dcmi_get_device_health", -8012, 2)  # the fault calls take a chip too
    assert health(lib, 2)[0] == -8012 and health(lib, 1) == (OK, 0)


def test_per_chip_hang_blocks_only_that_chip(fake):
    lib, ctl = fake.lib, fake.ctl
    ctl.hang("dcmi_get_device_network_health", 300, logic=4)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=read_field(lib, 4, "network_health")), daemon=True)
    worker.start()
    wait_until(lambda: ctl.stats()["calls"]["dcmi_get_device_network_health"] == 1, 5, "hung call")
    assert read_field(lib, 5, "network_health") == (OK, 0)  # another chip, same function
    assert read_field(lib, 4, "power") == (OK, 1853)  # same chip, another function
    assert worker.is_alive() and not result
    ctl.hang("dcmi_get_device_network_health", 0, logic=4)
    worker.join(timeout=5)
    assert result["out"] == (OK, 0)


def test_telemetry_of_a_dropped_chip_is_not_ready(fake):
    fake.ctl.drop(1)
    assert read_field(fake.lib, 1, "temperature")[0] == NOT_READY
    assert read_field(fake.lib, 1, "hbm.used")[0] == NOT_READY
    assert read_field(fake.lib, 0, "temperature")[0] == OK
