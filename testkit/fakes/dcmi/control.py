"""Client for the fake libdcmi.so control socket (FAKE_DCMI_CONTROL).

One command per line, one reply per command: ``ok[ <text>]`` or
``err <message>``.  Event commands reply only after the subscribed
callbacks have returned, so a test can assert right after the call.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path


class FakeDcmiControl:
    def __init__(self, socket_path: str | Path, reply_timeout: float = 30.0):
        self.socket_path = str(socket_path)
        self.reply_timeout = reply_timeout
        self._sock: socket.socket | None = None
        self._buf = b""

    # -- connection -------------------------------------------------------

    def connect(self, timeout: float = 10.0) -> "FakeDcmiControl":
        """Connect, retrying until the library (inside the agent) listens."""
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.socket_path)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"fake DCMI control socket {self.socket_path} not accepting "
                        f"after {timeout}s: {exc}"
                    ) from exc
                time.sleep(delay)  # poll interval, not synchronisation
                delay = min(delay * 2, 0.1)
                continue
            sock.settimeout(self.reply_timeout)
            self._sock = sock
            self._buf = b""
            return self

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "FakeDcmiControl":
        if self._sock is None:
            self.connect()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- commands ---------------------------------------------------------

    def occur(self, logic: int, code: int, severity: int = 2, via: str = "event") -> None:
        self._command("occur", logic, _hex(code), severity, _via(via))

    def recover(self, logic: int, code: int, via: str = "event") -> None:
        self._command("recover", logic, _hex(code), _via(via))

    def once(self, logic: int, code: int, severity: int = 1) -> None:
        self._command("once", logic, _hex(code), severity)

    def event(self, logic: int, code: int, assertion: int, severity: int) -> None:
        self._command("event", logic, _hex(code), assertion, severity)

    def drop(self, logic: int) -> None:
        self._command("drop", logic)

    def restore(self, logic: int) -> None:
        self._command("restore", logic)

    def hang(self, function: str, seconds: float, logic: int | None = None) -> None:
        """Calls of `function` block for `seconds` (0 releases waiters) on chip `logic`, or on every chip."""
        self._command("hang", function, repr(float(seconds)), *_chip(logic))

    def fail(self, function: str, rc: int, logic: int | None = None) -> None:
        """Calls of `function` return `rc` (0: work again) on chip `logic`, or on every chip."""
        self._command("fail", function, rc, *_chip(logic))

    # -- telemetry --------------------------------------------------------

    def tele(self, logic: int, field: str, value: int | float) -> None:
        """Set one telemetry reading of one chip; the field names and defaults are in TELEMETRY_FIELDS.

        Any value of the C type's width is accepted (32-bit fields: -2**31 .. 2**32-1), so tests can
        inject out-of-range readings."""
        self._command("tele", logic, field, repr(value) if isinstance(value, float) else int(value))

    def unsupported(self, logic: int, function: str, unsupported: bool = True) -> None:
        """`function` answers -8255 (not supported) for this chip only (False: supported again)."""
        self._command("tele", logic, "unsupported" if unsupported else "supported", function)

    def serial(self, logic: int, serial_number: str) -> None:
        """The serial number of the card holding chip `logic` (dcmi_get_card_elabel_v2 is card-level)."""
        self._command("tele", logic, "serial", serial_number)

    def procs(self, logic: int, processes: list[tuple[int, int]]) -> None:
        """What dcmi_get_device_resource_info reports for the chip: (host pid, bytes) pairs, at most 32."""
        self._command("procs", logic, ",".join(f"{pid}:{size}" for pid, size in processes) or "-")

    def version(self, text: str) -> None:
        """What dcmi_get_dcmi_version answers (default "24.1.rc3")."""
        self._command("version", text)

    def health(self, logic: int, value: int) -> None:
        self._command("health", logic, value)

    def die(self, logic: int, words: tuple[int, int, int, int, int]) -> None:
        """What dcmi_get_device_die_v2 answers from now on (FAKE_DCMI_VDIE sets it before the first call)."""
        self._command("die", logic, "-".join(f"{w:X}" for w in words))

    def pcie(self, logic: int, address: str) -> None:
        """What dcmi_get_device_pcie_info_v2 answers from now on, as DDDD:BB:DD.F (FAKE_DCMI_PCIE before)."""
        self._command("pcie", logic, address)

    def alarm_clock(self, unix_seconds: int) -> None:
        """Alarm times from a broken clock: every event reports this time (0: the real clock again)."""
        self._command("clock", unix_seconds)

    def stats(self) -> dict:
        """``{"subscribers": int, "calls": {function_name: count}}``."""
        result: dict = {"calls": {}}
        for item in self._command("stats").split():
            key, _, value = item.partition("=")
            if key == "calls":
                for pair in filter(None, value.split(",")):
                    name, _, count = pair.rpartition(":")
                    result["calls"][name] = int(count)
            else:
                result[key] = int(value)
        return result

    def _command(self, *parts) -> str:
        """Send one command; return the text after "ok"."""
        if self._sock is None:
            raise RuntimeError("FakeDcmiControl is not connected; call connect() first")
        if any(c.isspace() for p in parts for c in str(p)):
            raise ValueError(f"whitespace inside a command argument: {parts!r}")
        line = " ".join(str(p) for p in parts)
        self._sock.sendall(line.encode() + b"\n")
        while b"\n" not in self._buf:
            chunk = self._sock.recv(4096)
            if not chunk:
                raise RuntimeError(f"fake DCMI closed the control socket during {line!r}")
            self._buf += chunk
        reply, _, self._buf = self._buf.partition(b"\n")
        text = reply.decode()
        if text == "ok" or text.startswith("ok "):
            return text[3:]
        raise RuntimeError(f"fake DCMI {line!r}: {text.removeprefix('err ')}")


# `tele` field -> default value on every chip.  "<name>.<i>" fields are arrays: freq/util by DCMI type
# number (supported: freq 2, 6, 7, 9; util 2, 6, 12, 13, 14; other types answer -8255), hccs* by port
# 0..15, pcie.* by {0 min, 1 max, 2 avg}.
TELEMETRY_FIELDS: dict[str, int | float] = {
    "temperature": 45, "power": 1853, "voltage": 88, "network_health": 0,
    "freq.2": 1900, "freq.6": 1600, "freq.7": 1800, "freq.9": 1800,
    "util.2": 35, "util.6": 20, "util.12": 30, "util.13": 40, "util.14": 50,
    "hbm.total": 65536, "hbm.used": 3200, "hbm.freq": 1600, "hbm.temp": 40, "hbm.bw": 10,
    "ecc.enable_flag": 1, "ecc.single_bit_error_cnt": 0, "ecc.double_bit_error_cnt": 0,
    "ecc.total_single_bit_error_cnt": 0, "ecc.total_double_bit_error_cnt": 0,
    "ecc.single_bit_isolated_pages_cnt": 0, "ecc.double_bit_isolated_pages_cnt": 0,
    **{f"hccs.tx.{p}": 1000 + p for p in range(16)}, **{f"hccs.rx.{p}": 2000 + p for p in range(16)},
    **{f"hccs.crc.{p}": 0 for p in range(16)}, **{f"hccs.retry.{p}": 0 for p in range(16)},
    **{f"hccs_bw.tx.{p}": 1.25 for p in range(16)}, **{f"hccs_bw.rx.{p}": 2.5 for p in range(16)},
    **{f"pcie.{a}.{i}": v for a in ("tx_p_bw", "tx_np_bw", "tx_cpl_bw", "tx_np_lantency", "rx_p_bw", "rx_np_bw",
                                    "rx_cpl_bw") for i, v in enumerate((10, 30, 20))},
    "sio.tx": 0, "sio.rx": 0, "mainboard_id": 0x64,
}
# Aliases the fake also accepts.
TELEMETRY_ALIASES = {"util.aicore": "util.2", "util.hbm": "util.6", "util.vector": "util.12",
                     "util.overall": "util.13", "util.cube": "util.14", "aicore_freq": "freq.7"}


def default_processes(logic: int) -> list[tuple[int, int]]:
    """dcmi_get_device_resource_info's default answer for a chip: (host pid, bytes)."""
    return [(1000 + 10 * logic, 1 << 30), (1001 + 10 * logic, 2 << 30)]


def default_serial(card: int) -> str:
    return f"FAKESN{card:04d}"


def _chip(logic: int | None) -> tuple:
    return () if logic is None else (logic,)


def _hex(code: int) -> str:
    if not 0 <= code <= 0xFFFFFFFF:
        raise ValueError(f"error code {code!r} is not an unsigned 32-bit value")
    return f"{code:X}"


def _via(via: str) -> str:
    if via not in ("event", "silent"):
        raise ValueError(f"via must be 'event' or 'silent', not {via!r}")
    return via
