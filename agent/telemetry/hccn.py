"""Telemetry from hccn_tool: npu-exporter's network, RoCE and optical families of a chip's RoCE port.

Each read runs the tool (no shell) once per command: `hccn_tool -i <phy id> -<command> -g`. Unlike a driver
call a run can be cancelled, so every run has a deadline: past it the run's process group is killed and reaped.
Parsers take the tool's text and tolerate spacing and case; lines they do not know are ignored.
"""

from __future__ import annotations

import logging
import os
import re
import selectors
import signal
import subprocess
import threading
import time

from agent.model import DeviceInfo
from agent.telemetry.source import Sample

log = logging.getLogger(__name__)

OUTPUT_CAP = 1 << 20  # npu-exporter keeps at most 1 MiB of a run's stdout
LINK_FAILED = -1.0  # npu-exporter's link status when the run failed
NETWORK_COMMANDS = ("link", "bandwidth", "speed", "link_stat")
READS = ("network", "roce", "optical")
NOT_SUPPORTED = re.compile(r"not\s+support", re.IGNORECASE)

# (family, -stat key); a key the tool does not print reads 0, as in npu-exporter
STAT_FAMILIES = (
    *((f"npu_chip_mac_{way}_pause_num", f"mac_{way}_mac_pause_num") for way in ("rx", "tx")),
    *((f"npu_chip_mac_{way}_{kind}_num", f"mac_{way}_{kind}_num")
      for kind in ("pfc_pkt", "bad_pkt", "bad_oct") for way in ("rx", "tx")),
    ("npu_chip_info_rx_fcs_num", "mac_rx_fcs_err_pkt_num"),
    *((f"npu_chip_roce_{key}", f"roce_{key}") for key in (
        "rx_all_pkt_num", "tx_all_pkt_num", "rx_err_pkt_num", "tx_err_pkt_num", "rx_cnp_pkt_num", "tx_cnp_pkt_num",
        "new_pkt_rty_num", "unexpected_ack_num", "out_of_order_num", "verification_err_num", "qp_status_err_num")),
    ("npu_chip_info_rx_ecn_num", "roce_ecn_db_num"),
)
# (family, -optical key, lower case with spaces as underscores)
OPTICAL_FAMILIES = (
    *((f"npu_chip_optical_{way}_power_{n}", f"{way}_power{n}") for way in ("tx", "rx") for n in range(4)),
    ("npu_chip_optical_vcc", "vcc"),
    ("npu_chip_optical_temp", "temperature"),
)

_LINK = re.compile(r"link\s+status\s*:\s*(\S+)", re.IGNORECASE)
_BANDWIDTH = re.compile(r"\b([TR]X)\s*:\s*(\S+)", re.IGNORECASE)
_SPEED = re.compile(r"speed\s*:\s*(\S+)", re.IGNORECASE)
_LINK_UP = re.compile(r"link\s+up\s+count\s*:\s*(\S+)", re.IGNORECASE)
_KEY_VALUE = re.compile(r"^\s*([^:]*?)\s*:\s*(.*?)\s*$")


class Garbled(ValueError):
    """A value the tool printed that does not parse; its family is left out."""


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise Garbled(f"{what}: {text!r}") from None


def _key_values(text: str) -> dict[str, str]:
    """`key : value` lines, keys lower case with inner spaces as underscores; lines without a value are skipped."""
    pairs = {}
    for line in text.splitlines():
        found = _KEY_VALUE.match(line)
        if found and found[1] and found[2]:
            pairs[re.sub(r"\s+", "_", found[1]).lower()] = found[2]
    return pairs


def parse_link(text: str) -> float | None:
    """`link status: UP` → 1, DOWN → 0; None when there is no status line."""
    found = _LINK.search(text)
    if not found:
        return None
    status = found[1].upper()
    if status not in ("UP", "DOWN"):
        raise Garbled(f"link status: {found[1]!r}")
    return 1.0 if status == "UP" else 0.0


def parse_bandwidth(text: str) -> dict[str, float]:
    """`Bandwidth TX: 0.00 MB/sec` and the RX line → {"tx": MB/s, "rx": MB/s}, each only when it parses."""
    found = {}
    for line in text.splitlines():
        match = _BANDWIDTH.search(line)
        if match:
            try:
                found[match[1].lower()] = _number(match[2], "bandwidth")
            except Garbled:
                continue
    return found


def parse_speed(text: str) -> float | None:
    """`Speed: 100000 Mb/s` → Mb/s; None when there is no speed line (or it says `Unknown!`)."""
    found = _SPEED.search(text)
    if not found or found[1].lower().startswith("unknown"):
        return None
    return _number(found[1], "speed")


def parse_link_up(text: str) -> float | None:
    """`[device 0]link up count : 3` → 3; None when there is no such line."""
    found = _LINK_UP.search(text)
    return _number(found[1], "link up count") if found else None


def parse_stat(text: str) -> dict[str, float | None]:
    """`-stat` counters (`mac_tx_mac_pause_num:0` lines) → key → value, None where the value did not parse."""
    counters: dict[str, float | None] = {}
    for key, value in _key_values(text).items():
        try:
            counters[key] = float(int(value))
        except ValueError:
            counters[key] = None
    return counters


def parse_optical(text: str) -> dict[str, str]:
    """`-optical` fields (`Tx Power0 : 0.81 mW`) → lower-case key → value text."""
    return _key_values(text)


def optical_value(text: str) -> float | None:
    """A reading with its unit (`0.81 mW`, `3300 mV`, `45 C`); None for `NA` / `not supported`, which
    npu-exporter turns into -1 and then leaves out."""
    if text.upper().startswith("NA") or NOT_SUPPORTED.search(text):
        return None
    return _number(text.split()[0], "optical")


class HccnTool:
    """TelemetrySource for the `network`, `roce` and `optical` reads. Reads of different chips may run on
    different threads at once."""

    name = "hccn_tool"

    def __init__(self, path: str, timeout_s: float):
        self._path = path
        self._timeout_s = timeout_s
        self._env = {name: os.environ[name] for name in ("PATH", "LD_LIBRARY_PATH") if name in os.environ}
        self._lock = threading.Lock()
        self._unsupported: set[tuple[int, str]] = set()
        self._logged: set[tuple[int, str]] = set()  # (phy, command) whose garbled output was logged
        self._failing: set[tuple[int, str]] = set()  # (phy, command) whose last run failed: logged once
        self.garbled = 0  # values the tool printed that did not parse (their families were left out)
        self._available = os.path.isfile(path) and os.access(path, os.X_OK)
        if not self._available:
            log.warning("hccn_tool is missing or not executable; the network, roce and optical groups are off",
                        extra={"path": path})

    # ---- TelemetrySource -------------------------------------------------------------------------

    def reads(self, device: DeviceInfo) -> tuple[str, ...]:
        return READS if self._available else ()

    def read_timeout(self, read: str, call_timeout_s: float) -> float:
        """Every run has its own deadline (and is killed past it): the read may take them all, one by one."""
        runs = len(NETWORK_COMMANDS) if read == "network" else 1
        return runs * self._timeout_s + call_timeout_s

    def read(self, device: DeviceInfo, read: str) -> list[Sample]:
        phy = device.phy_id
        if read == "network":
            return [sample for command in NETWORK_COMMANDS for sample in self._network(phy, command)]
        if read == "roce":
            return self._roce(phy)
        if read == "optical":
            return self._optical(phy)
        raise KeyError(read)

    def node(self) -> list[Sample]:
        return []

    def unsupported(self) -> list[tuple[int, str]]:
        with self._lock:
            return sorted((phy, f"hccn_tool -{command}") for phy, command in self._unsupported)

    # ---- reads -----------------------------------------------------------------------------------

    def _network(self, phy: int, command: str) -> list[Sample]:
        text = self._output(phy, command)
        if command == "link":
            status = self._parsed(phy, command, parse_link, text)
            if status is None and self._is_unsupported(phy, command):
                return []  # not applicable, not a failure
            return [("npu_chip_info_link_status", (), LINK_FAILED if status is None else status)]
        if command == "bandwidth":
            found = self._parsed(phy, command, parse_bandwidth, text) or {}
            return [(f"npu_chip_info_bandwidth_{way}", (), found[way]) for way in ("tx", "rx") if way in found]
        parse, family = ((parse_speed, "npu_chip_link_speed") if command == "speed"
                         else (parse_link_up, "npu_chip_link_up_num"))
        value = self._parsed(phy, command, parse, text)
        return [] if value is None else [(family, (), value)]

    def _roce(self, phy: int) -> list[Sample]:
        counters = self._parsed(phy, "stat", parse_stat, self._output(phy, "stat"))
        if counters is None:
            return []
        samples = [(family, (), counters.get(key, 0.0)) for family, key in STAT_FAMILIES]
        self._count_garbled(phy, "stat", [key for family, key in STAT_FAMILIES if key in counters
                                          and counters[key] is None])
        return [sample for sample in samples if sample[2] is not None]

    def _optical(self, phy: int) -> list[Sample]:
        fields = self._parsed(phy, "optical", parse_optical, self._output(phy, "optical"))
        if fields is None:
            return []
        samples: list[Sample] = []
        state = {"present": 1.0, "not present": 0.0}.get(fields.get("present", "").lower())
        if state is not None:
            samples.append(("npu_chip_optical_state", (), state))
        garbled = []
        for family, key in OPTICAL_FAMILIES:
            try:
                value = optical_value(fields[key]) if key in fields else None
            except Garbled:
                garbled.append(key)
                continue
            if value is not None:
                samples.append((family, (), value))
        self._count_garbled(phy, "optical", garbled)
        return samples

    def _parsed(self, phy: int, command: str, parse, text: str | None):
        """parse(text); None when the run failed, its value did not parse or the tool said it does not support
        the command for this chip."""
        if text is None:
            return None
        try:
            value = parse(text)
        except Garbled as error:
            self._count_garbled(phy, command, [str(error)])
            return None
        if not value and NOT_SUPPORTED.search(text):
            self._set_unsupported(phy, command)
            return None
        return value

    def _set_unsupported(self, phy: int, command: str) -> None:
        with self._lock:
            self._unsupported.add((phy, command))
        log.info("hccn_tool does not support a command for this chip; not running it again",
                 extra={"device": phy, "command": f"-{command}"})

    def _is_unsupported(self, phy: int, command: str) -> bool:
        with self._lock:
            return (phy, command) in self._unsupported

    def _count_garbled(self, phy: int, command: str, what: list[str]) -> None:
        if not what:
            return
        with self._lock:
            self.garbled += len(what)
            first = (phy, command) not in self._logged
            self._logged.add((phy, command))
        if first:
            log.warning("hccn_tool printed values that do not parse; leaving them out",
                        extra={"device": phy, "command": f"-{command}", "values": what})

    # ---- runs ------------------------------------------------------------------------------------

    def _output(self, phy: int, command: str) -> str | None:
        """The stdout of one successful run (at most OUTPUT_CAP bytes); None when the command is unsupported
        for this chip, could not start, exited non-zero or outlived the timeout."""
        if self._is_unsupported(phy, command):
            return None
        argv = [self._path, "-i", str(phy), f"-{command}", "-g"]
        try:
            rc, out = run_capped(argv, self._timeout_s, self._env)
        except OSError as error:
            return self._failed(phy, command, f"cannot run it: {error}")
        if rc is None:
            return self._failed(phy, command, f"killed after {self._timeout_s} s")
        text = out.decode(errors="replace")
        if rc != 0:
            if NOT_SUPPORTED.search(text):
                self._set_unsupported(phy, command)
                return None
            return self._failed(phy, command, f"exit code {rc}")
        with self._lock:
            recovered = (phy, command) in self._failing
            self._failing.discard((phy, command))
        if recovered:
            log.info("hccn_tool works again", extra={"device": phy, "command": f"-{command}"})
        return text

    def _failed(self, phy: int, command: str, why: str) -> None:
        """Log a failing command once until it works again: a stuck port fails every minute."""
        with self._lock:
            first = (phy, command) not in self._failing
            self._failing.add((phy, command))
        (log.warning if first else log.debug)("hccn_tool failed", extra={
            "device": phy, "command": f"-{command}", "why": why})


def run_capped(argv: list[str], timeout_s: float, env: dict[str, str]) -> tuple[int | None, bytes]:
    """Run argv without a shell; (exit code, first OUTPUT_CAP bytes of stdout), exit code None when it did not
    finish within timeout_s. The child runs in its own process group so that a timeout kills whatever it
    started as well (a grandchild holding stdout open would otherwise keep the pipe alive); it is always
    reaped."""
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True, close_fds=True)
    kept: list[bytes] = []
    size = 0
    finished = False
    with proc, selectors.DefaultSelector() as selector:
        fd = proc.stdout.fileno()
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0 and selector.select(left):
            chunk = os.read(fd, 65536)
            if not chunk:
                finished = True
                break
            if size < OUTPUT_CAP:  # past the cap the output is drained and dropped
                kept.append(chunk[:OUTPUT_CAP - size])
                size += len(kept[-1])
        if finished:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                finished = False
        if not finished:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            return None, b"".join(kept)
    return proc.returncode, b"".join(kept)
