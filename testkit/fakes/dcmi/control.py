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

    def hang(self, function: str, seconds: float) -> None:
        self._command("hang", function, repr(float(seconds)))

    def fail(self, function: str, rc: int) -> None:
        self._command("fail", function, rc)

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


def _hex(code: int) -> str:
    if not 0 <= code <= 0xFFFFFFFF:
        raise ValueError(f"error code {code!r} is not an unsigned 32-bit value")
    return f"{code:X}"


def _via(via: str) -> str:
    if via not in ("event", "silent"):
        raise ValueError(f"via must be 'event' or 'silent', not {via!r}")
    return via
