"""Telemetry from hccn_tool: npu-exporter's network, RoCE and optical families of a chip's RoCE port.

Each read runs the tool (no shell) once per command: `hccn_tool -i <phy id> -<command> -g`. Unlike a driver
call a run can be cancelled, so every run has a deadline. Each run is its own process group, killed when the tool
exits (whatever it left behind goes too), past the deadline, when its output passes OUTPUT_CAP, on an error, and
for the runs in flight when the source closes or the interpreter exits; its leader is always reaped.
Parsers take the tool's text and tolerate spacing and case; lines they do not know are ignored. They are linear in
the text (partition and split, regexes that cannot backtrack): the text comes from outside, and a regex holds the
GIL, so a super-linear one on a long line would freeze the whole agent.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import selectors
import signal
import subprocess
import threading
import time
import weakref
from typing import NamedTuple

from agent.model import DeviceInfo
from agent.telemetry.source import Sample

log = logging.getLogger(__name__)

OUTPUT_CAP = 1 << 20  # npu-exporter keeps at most 1 MiB of a run's stdout; past it the run is stopped, not drained
LINE_CAP = 1024  # characters; the tool's longest line is under 100: a longer one is not its format and is skipped
EXIT_POLL_S = 0.01  # without pidfd_open (Linux < 5.3, or a seccomp filter): how often a run's exit is looked for
REAP_S = 1.0  # how long killed leftovers orphaned to the agent get to die and be reaped before they are left
LINK_FAILED = -1.0  # npu-exporter's link status when the run failed
NETWORK_COMMANDS = ("link", "bandwidth", "speed", "link_stat")
READS = ("network", "roce", "optical")
NOT_SUPPORTED = re.compile(r"not\s++support", re.IGNORECASE)

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

# Possessive quantifiers: what follows each one cannot match what it took, so giving back would never help; they
# give back nothing and an attempt is linear in the whitespace it crosses (attempts start only at a keyword).
_LINK = re.compile(r"link\s++status\s*+:\s*+(\S++)", re.IGNORECASE)
_BANDWIDTH = re.compile(r"\b([TR]X)\s*+:\s*+(\S++)", re.IGNORECASE)
_SPEED = re.compile(r"speed\s*+:\s*+(\S++)", re.IGNORECASE)
_LINK_UP = re.compile(r"link\s++up\s++count\s*+:\s*+(\S++)", re.IGNORECASE)


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
    for line in text.splitlines():  # partition and split, not a regex: `\s*(.*?)\s*:` backtracked cubically
        key, colon, value = line.partition(":")
        key, value = "_".join(key.split()).lower(), value.strip()
        if colon and key and value:
            pairs[key] = value
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
        except (ValueError, OverflowError):  # OverflowError: more digits than a float holds
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
    words = text.split()
    return _number(words[0] if words else text, "optical")  # blank: Garbled, not IndexError


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
        self._oversized: set[tuple[int, str, str]] = set()  # (phy, command, what) whose cut output was logged
        self.garbled = 0  # values the tool printed that did not parse (their families were left out)
        self.long_lines = 0  # lines longer than LINE_CAP, skipped
        self.cut_outputs = 0  # runs that printed more than OUTPUT_CAP: the rest was not read
        self._runs = Runs()
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

    def close(self) -> None:
        """Kill the runs in flight (their threads reap them) and start no more; it does not block."""
        self._runs.close()

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
        """The stdout of one successful run (its lines within OUTPUT_CAP bytes and LINE_CAP characters); None
        when the command is unsupported for this chip, could not start, exited non-zero or outlived the timeout."""
        if self._is_unsupported(phy, command):
            return None
        argv = [self._path, "-i", str(phy), f"-{command}", "-g"]
        try:
            rc, out, cut = run_capped(argv, self._timeout_s, self._env, self._runs)
        except Closed:
            return None
        except OSError as error:
            return self._failed(phy, command, f"cannot run it: {error}")
        if self._runs.closed:  # killed by close(): not the tool's failure
            return None
        if cut:  # stopped by us, so rc None is no failure: the first OUTPUT_CAP bytes are its output
            self._oversized_output(phy, command)
            out = out[:out.rfind(b"\n") + 1]  # the line the cap cut through would read as another value
        elif rc is None:
            return self._failed(phy, command, f"killed after {self._timeout_s} s")
        text = self._long_lines_skipped(phy, command, out.decode(errors="replace"))
        if rc is not None and rc != 0:
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

    def _oversized_output(self, phy: int, command: str) -> None:
        with self._lock:
            self.cut_outputs += 1
            first = self._first_oversized(phy, command, "output")
        if first:
            log.warning("hccn_tool printed more than the output cap; reading only the lines before it",
                        extra={"device": phy, "command": f"-{command}", "cap_bytes": OUTPUT_CAP})

    def _long_lines_skipped(self, phy: int, command: str, text: str) -> str:
        """text without its lines longer than LINE_CAP, counted and logged once per chip and command."""
        if len(text) <= LINE_CAP:
            return text
        lines = text.splitlines()
        long = [number for number, line in enumerate(lines, start=1) if len(line) > LINE_CAP]
        if not long:
            return text
        with self._lock:
            self.long_lines += len(long)
            first = self._first_oversized(phy, command, "line")
        if first:
            log.warning("hccn_tool printed lines longer than the line cap; skipping them", extra={
                "device": phy, "command": f"-{command}", "lines": len(long), "first_line": long[0],
                "longest": max(len(lines[number - 1]) for number in long), "cap_chars": LINE_CAP})
        skipped = set(long)
        return "\n".join(line for number, line in enumerate(lines, start=1) if number not in skipped)

    def _first_oversized(self, phy: int, command: str, what: str) -> bool:
        """Under the lock: True the first time (phy, command) printed an oversized `what`."""
        first = (phy, command, what) not in self._oversized
        self._oversized.add((phy, command, what))
        return first

    def _failed(self, phy: int, command: str, why: str) -> None:
        """Log a failing command once until it works again: a stuck port fails every minute."""
        with self._lock:
            first = (phy, command) not in self._failing
            self._failing.add((phy, command))
        (log.warning if first else log.debug)("hccn_tool failed", extra={
            "device": phy, "command": f"-{command}", "why": why})


class Closed(Exception):
    """The source is closing (or the interpreter exiting): no run starts."""


class Run(NamedTuple):
    rc: int | None  # the tool's exit code; None when it was stopped before it exited (deadline, OUTPUT_CAP)
    out: bytes  # the first OUTPUT_CAP bytes of its stdout
    cut: bool  # it printed more than OUTPUT_CAP: the rest was not read


class Runs:
    """The process groups of the runs in flight, so that close() can kill them. A group is killed only while its
    leader is unreaped (listed here): a reaped leader's pid, which is the group's id, may belong to another process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._groups: set[int] = set()
        self._closed = False
        _EVERY_RUNS.add(self)

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        if self._closed:
            raise Closed()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env=env, start_new_session=True, close_fds=True)
        with self._lock:
            if not self._closed:
                self._groups.add(proc.pid)
                return proc
        _kill_group(proc.pid)  # closed while it started
        proc.stdout.close()
        proc.wait()
        _reap_orphans(proc.pid)
        raise Closed()

    def kill(self, pgid: int) -> None:
        with self._lock:
            if pgid in self._groups:
                _kill_group(pgid)

    def end(self, pgid: int) -> None:
        """Kill the group and forget it: its leader is reaped next."""
        with self._lock:
            self._groups.discard(pgid)
            _kill_group(pgid)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for pgid in self._groups:
                _kill_group(pgid)


_EVERY_RUNS: weakref.WeakSet[Runs] = weakref.WeakSet()


@atexit.register
def _close_every_runs() -> None:
    """At exit the runs' threads (daemons) are abandoned: their runs, in sessions of their own, would outlive us."""
    for runs in list(_EVERY_RUNS):
        runs.close()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # none left, or none we may signal (a setuid leftover)
        pass


def _has_exited(pid: int) -> bool:
    """Whether the child has exited, leaving it unreaped (WNOWAIT), so that its pid still names its group."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _reap_orphans(pgid: int) -> None:
    """Reap the group's killed leftovers that were orphaned to us: the agent is PID 1 of its container, so it
    inherits them, and each would stay a zombie, counted against the pod's PID limit. Elsewhere they are not
    ours (ECHILD at once). Called after the leader is reaped: the group's id stays taken while it has members."""
    deadline = time.monotonic() + REAP_S
    pause = 0.001
    while True:
        try:
            if os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG) is not None:
                continue
        except ChildProcessError:
            return  # none of ours left in it
        if time.monotonic() >= deadline:
            return  # one that did not die of SIGKILL (stuck in the kernel, or not ours to kill): left as it is
        time.sleep(pause)  # SIGKILL was sent just now: they are dying
        pause = min(2 * pause, 0.05)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux < 5.3 (or a seccomp filter): the caller polls _has_exited instead
        return None


def run_capped(argv: list[str], timeout_s: float, env: dict[str, str], runs: Runs) -> Run:
    """Run argv without a shell, in its own process group: its stdout up to OUTPUT_CAP bytes, and its exit code
    unless it was stopped first (at the deadline, or as soon as it printed more than OUTPUT_CAP: reading on
    would cost a thread for the rest of the deadline). When the tool exits its group is killed at once, so
    nothing it started outlives the run, and a leftover holding stdout open cannot keep the run waiting. On
    every way out the group is killed and the leader reaped (and the rest of the group where it was orphaned to
    us); the leader must die for that (a run stuck in the kernel keeps this thread, as a stuck driver call does)."""
    deadline = time.monotonic() + timeout_s
    proc = runs.start(argv, env)
    pid, fd = proc.pid, proc.stdout.fileno()
    pidfd = _pidfd(pid)
    kept: list[bytes] = []
    size = 0
    exited = cut = eof = False
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            if pidfd is not None:
                selector.register(pidfd, selectors.EVENT_READ)
            while not (eof and exited) and (left := deadline - time.monotonic()) > 0:
                ready = {key.fd for key, _ in selector.select(left if pidfd is not None else min(left, EXIT_POLL_S))}
                if fd in ready:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        eof = True
                        selector.unregister(fd)
                    kept.append(chunk)
                    size += len(chunk)
                    if size > OUTPUT_CAP:
                        cut = True
                        break
                if not exited and (pidfd is None or pidfd in ready) and _has_exited(pid):
                    exited = True
                    if pidfd is not None:
                        selector.unregister(pidfd)
                    runs.kill(pid)  # what it left behind goes now; what it printed is in the pipe
        exited = exited or _has_exited(pid)
    finally:
        runs.end(pid)
        proc.stdout.close()
        if pidfd is not None:
            os.close(pidfd)
        proc.wait()
        _reap_orphans(pid)
    return Run(proc.returncode if exited else None, b"".join(kept)[:OUTPUT_CAP], cut)
