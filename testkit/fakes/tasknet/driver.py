"""Test-side driver for the TaskNet peers: start one as a subprocess, send commands, wait for events."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid as uuidlib
from pathlib import Path
from typing import Callable, Iterable, Union

from testkit import REPO

Predicate = Union[str, Callable[[dict], bool]]


def pos(role: str, server_rank: str | int, process_rank: str | int = "-1") -> dict:
    """A position as the peers spell it in JSON."""
    return {"role": role, "server_rank": str(server_rank), "process_rank": str(process_rank)}


MGR = pos("Mgr", "0", "-1")


def ephemeral_ports() -> range:
    """The ports the kernel hands out for outgoing connections (and for binds to port 0)."""
    try:
        low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port(hosts: Iterable[str] = ("127.0.0.1",), attempts: int = 200) -> int:
    """A TCP port that is bindable right now on every one of `hosts` (e.g. 127.0.0.2 and 127.0.0.3), and
    stays free until bound: it is outside the ephemeral range, so no process's outgoing connection takes it
    meanwhile (on a busy machine one would, if the port came from a bind to port 0)."""
    hosts = list(hosts)
    ephemeral = ephemeral_ports()
    candidates = [p for p in range(10_000, 65_536) if p not in ephemeral]
    for port in random.sample(candidates, min(attempts, len(candidates))):
        taken = []
        try:
            for host in hosts:
                s = socket.socket()
                taken.append(s)
                s.bind((host, port))
            return port
        except OSError:
            continue
        finally:
            for s in taken:
                s.close()
    raise RuntimeError(f"no port outside the ephemeral range {ephemeral.start}-{ephemeral.stop - 1} free on all of "
                       f"{hosts}")


class PeerProcess:
    """One peer (`python -m testkit.fakes.tasknet.peer ...`) and the events it has printed so far.

    Other stand-ins driven the same way (JSON commands in, one JSON event per stdout line) pass their
    own `module`; `inherit_env=False` runs them with exactly `env`; `stderr_lines=None` keeps all of
    stderr."""

    def __init__(self, args: list[str], env: dict | None = None, name: str | None = None, cgroup: Path | None = None,
                 *, module: str = "testkit.fakes.tasknet.peer", inherit_env: bool = True,
                 stderr_lines: int | None = 200):
        self.args = list(args)
        self.name = name or " ".join(self.args[:1] + self.args[-4:])
        self.env = {**(os.environ if inherit_env else {}), **(env or {})}
        self._events: list[dict] = []
        self._stderr: collections.deque[str] = collections.deque(maxlen=stderr_lines)
        self._cond = threading.Condition()
        self._eof = False
        self.port: int | None = None  # a manager's bound port (from its ready event)
        self.address: str | None = None  # a manager's "host:port" to dial
        self.pos: dict | None = None  # a worker's own position
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *self.args], cwd=REPO, env=self.env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            preexec_fn=(lambda: (cgroup / "cgroup.procs").write_text("0")) if cgroup else None)  # e.g. a pod's
        threading.Thread(target=self._read_stdout, name=f"peer-out {self.name}", daemon=True).start()
        threading.Thread(target=self._read_stderr, name=f"peer-err {self.name}", daemon=True).start()

    # ---- reading --------------------------------------------------------------------------------

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "garbage", "line": line.rstrip("\n")}
            with self._cond:
                self._events.append(event)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _read_stderr(self) -> None:
        for line in self.process.stderr:
            self._stderr.append(line)

    # ---- commands -------------------------------------------------------------------------------

    def send(self, **cmd) -> None:
        """Write one command line, e.g. ``send(op="routes")``."""
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()

    def mark(self) -> int:
        """How many events so far; pass as ``since=`` to wait only for later ones."""
        with self._cond:
            return len(self._events)

    def wait_event(self, predicate: Predicate, timeout: float = 10.0, since: int = 0) -> dict:
        """The first event (at index >= `since`) matching `predicate` (an event kind or a callable).

        Raises AssertionError listing the events seen (and the stderr tail) after `timeout` seconds,
        or as soon as the peer's stdout closes without a match.
        """
        match = (lambda e: e.get("event") == predicate) if isinstance(predicate, str) else predicate
        deadline = time.monotonic() + timeout
        with self._cond:
            scanned = since
            while True:
                for event in self._events[scanned:]:
                    if match(event):
                        return event
                scanned = max(scanned, len(self._events))
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._eof:
                    break
                self._cond.wait(remaining)
            seen = list(self._events[since:])
        why = "peer exited" if self._eof else f"timed out after {timeout}s"
        raise AssertionError(f"{self.name}: {why} waiting for {predicate!r}; events since {since}:\n"
                             + "\n".join(json.dumps(e) for e in seen[-50:])
                             + "\n--- stderr tail ---\n" + self.stderr_tail())

    def stderr_tail(self, lines: int | None = 30) -> str:
        """The last `lines` lines of stderr (None: all that is kept)."""
        kept = list(self._stderr)
        return "".join(kept[-lines:] if lines else kept)

    def events(self, kind: str | None = None) -> list[dict]:
        with self._cond:
            return [e for e in self._events if kind is None or e.get("event") == kind]

    def transfer(self, dst: dict, body: str = "", sync: bool = False, uuid: str | None = None,
                 mtype: str = "DEFAULT", rpc_timeout: float | None = None, wait: float = 10.0,
                 body_size: int | None = None) -> dict:
        """Send one message and return its "sent" event (waiting up to `wait` s for it).

        `rpc_timeout` becomes the command's "timeout": a worker's gRPC deadline for TransferMessage.
        `body_size` replaces `body` with that many "x" made by the peer (big bodies stay off stdin).
        """
        uuid = uuid or str(uuidlib.uuid4())
        extra = {} if rpc_timeout is None else {"timeout": rpc_timeout}
        if body_size is not None:
            extra["body_size"] = int(body_size)
        self.send(op="send", uuid=uuid, dst=dst, body=body, sync=sync, mtype=mtype, **extra)
        return self.wait_event(lambda e: e.get("event") == "sent" and e.get("uuid") == uuid, wait)

    def request(self, op: str, reply: str, timeout: float = 10.0, **fields) -> dict:
        """Send a command that answers with one event of kind `reply` (routes, entries, config)."""
        since = self.mark()
        self.send(op=op, **fields)
        return self.wait_event(reply, timeout, since=since)

    def routes(self) -> list:
        return self.request("routes", "routes")["routes"]

    def config(self, **knobs) -> dict:
        """Set knobs (worker: auto_ack, ack_code, ack_delay; manager: transfer_code, transfer_delay,
        register_delay, path_delay, stream_delay, register_reply, register_reply_tries); returns the
        "configured" event."""
        return self.request("config", "configured", **knobs)

    def drop(self, timeout: float = 10.0) -> dict:
        """A worker's simulated network blip; returns its "dropping" event (then come stream_lost, rejoined)."""
        return self.request("drop", "dropping", timeout)

    def workers(self) -> dict:
        """A manager's worker registry: {name: {"pos", "status"}}."""
        return self.request("workers", "workers")["workers"]

    def action(self, code: int, tries: int = 1, retry_interval: float = 3.0, wait: float | None = None) -> dict:
        """A manager's profiling ACTION to every registered worker; returns "action_done" (the per-worker
        "action_sent" events come before it).  `wait` defaults to what `tries` sync sends can take."""
        if wait is None:
            wait = 10.0 + tries * (3.0 + retry_interval)
        since = self.mark()
        self.send(op="action", code=code, tries=tries, retry_interval=retry_interval)
        return self.wait_event(lambda e: e.get("event") == "action_done" and e.get("code") == code, wait, since)

    # ---- lifetime -------------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL: the peer dies mid-stream without closing anything."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self, timeout: float = 10.0) -> int | None:
        """Ask it to quit and return its exit code; SIGKILL (and return None) if it does not go in time."""
        if self.process.poll() is None:
            try:
                self.send(op="quit")
            except (BrokenPipeError, ValueError, OSError):
                pass
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        for pipe in (self.process.stdin,):
            try:
                pipe.close()
            except OSError:
                pass
        return self.process.returncode

    def __enter__(self) -> "PeerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def manager(listen: str, env: dict | None = None, ready_timeout: float = 30.0,
            config: dict | None = None) -> PeerProcess:
    """A manager peer, once it listens; ``port`` is the bound port and ``address`` the host:port to dial.
    `config`: knobs (as ``PeerProcess.config`` takes them) in force before anyone can connect."""
    args = ["manager", "--listen", listen] + (["--config", json.dumps(config)] if config else [])
    peer = PeerProcess(args, env, name=f"manager@{listen}")
    try:
        peer.port = peer.wait_event("ready", ready_timeout)["port"]
        peer.address = f"{listen.rsplit(':', 1)[0]}:{peer.port}"
    except BaseException:
        peer.stop()
        raise
    return peer


def worker(proxy: str, server_rank: str | int, process_rank: str | int = "-1", role: str = "Worker",
           env: dict | None = None, wait_ready: bool = True, retry_interval: float = 0.2,
           ready_timeout: float = 30.0, extra_args: Iterable[str] = (), cgroup: Path | None = None) -> PeerProcess:
    """A worker (or agent) peer joined through `proxy`; with `wait_ready`, after its "ready" event."""
    args = ["worker", "--proxy", proxy, "--server-rank", str(server_rank), "--role", role,
            "--retry-interval", str(retry_interval), *extra_args]
    if role == "Worker":
        args += ["--process-rank", str(process_rank)]
    peer = PeerProcess(args, env, name=f"{role}/{server_rank}/{process_rank if role == 'Worker' else -1}",
                       cgroup=cgroup)
    peer.pos = pos(role, server_rank, process_rank if role == "Worker" else "-1")
    if wait_ready:
        try:
            peer.wait_event("ready", ready_timeout)
        except BaseException:
            peer.stop()
            raise
    return peer
