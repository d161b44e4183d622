"""Which training job is at the other end of a TaskNet connection (workers do not say).

The peer address gRPC reports is looked up in the kernel's socket table (this network namespace:
hostNetwork training pods) as the near end of a connection to the proxy's port, the socket's inode in
the processes' descriptor tables (hostPID), and the owning process's environment gives the job:
`MINDX_TASK_ID`, and the manager's host the way TaskD's launcher picks it (`MASTER_ADDR`,
`MS_SCHED_HOST`, `LOCAL_PROXY_ENABLE=on` → loopback). With Kubernetes, the process's pod (the pod
UID in its cgroup path) must be a pod of that job on this node, so a process cannot speak for
another job by setting the variable.
"""

from __future__ import annotations

import os
import re
import socket
import struct
from dataclasses import dataclass

from agent.kube.jobs import JobDirectory

TASK_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}")
ENVIRON_LIMIT = 1 << 20
# The kubelet names a pod's cgroup after its UID: .../pod<uid>/... (cgroupfs) or
# ...-pod<uid with underscores>.slice/... (systemd).
POD_UID_RE = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int
    job: str
    manager_host: str  # where this job's TaskD manager listens (port from the configuration)
    rank: str  # the process's RANK, "" when unset
    command: str


class PeerRefused(Exception):
    """The connection cannot be attributed to a training job; the message says why."""


def parse_peer(text: str) -> tuple[str, int]:
    """gRPC's peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000") as (host, port)."""
    kind, _, rest = text.partition(":")
    host, _, port = rest.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        raise PeerRefused(f"peer {text!r} is not a TCP connection")
    return host.strip("[]"), int(port)


def _socket_keys(host: str, port: int) -> list[tuple[str, str]]:
    """Where /proc/net prints the client's end: 32-bit words in host byte order, hex. An IPv4 client
    of a dual-stack listener is reported as ::ffff:a.b.c.d but its socket is in the IPv4 table."""
    keys = []
    if host.startswith("::ffff:") and "." in host:
        host = host.removeprefix("::ffff:")
    if ":" in host:
        words = struct.unpack("=4I", socket.inet_pton(socket.AF_INET6, host))
        keys.append(("tcp6", "".join(f"{w:08X}" for w in words) + f":{port:04X}"))
    else:
        (word,) = struct.unpack("=I", socket.inet_aton(host))
        keys.append(("tcp", f"{word:08X}:{port:04X}"))
        keys.append(("tcp6", f"0000000000000000FFFF0000{word:08X}:{port:04X}"))
    return keys


def pod_uid(proc: str, pid: int) -> str | None:
    """The UID of the Kubernetes pod the process runs in, None outside pods."""
    try:
        with open(f"{proc}/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            match = POD_UID_RE.search(f.read(65536))
    except OSError:
        return None
    return match.group(1).replace("_", "-") if match else None


class PeerResolver:
    def __init__(self, proc: str = "/proc", jobs: JobDirectory | None = None):
        self._proc = proc
        self._jobs = jobs  # with Kubernetes: the job of each pod on this node
        # (host, port) -> (pid, fd name, socket link, peer): checked with one readlink per call, so a
        # port reused by another process after the first connection closed is resolved afresh.
        self._known: dict[tuple[str, int], tuple[int, str, str, Peer]] = {}
        self._recent_pids: dict[int, None] = {}

    def cached(self, peer: str) -> Peer | None:
        try:
            address = parse_peer(peer)
        except PeerRefused:
            return None
        return self._check(address)

    def _check(self, address: tuple[str, int]) -> Peer | None:
        entry = self._known.get(address)
        if entry is None:
            return None
        pid, fd, link, found = entry
        try:
            if os.readlink(f"{self._proc}/{pid}/fd/{fd}") == link:
                return found
        except OSError:
            pass
        self._known.pop(address, None)
        return None

    def resolve(self, peer: str, server_port: int) -> Peer:
        """The process at the other end of `peer`'s connection to `server_port` (the proxy's).
        Blocking: reads /proc. Raises PeerRefused with the reason."""
        found = self.cached(peer)
        if found is not None:
            return found
        address = parse_peer(peer)
        inode = self._inode(*address, server_port)
        link = f"socket:[{inode}]"
        pid, fd = self._owner(link, address)
        found = self._peer(pid)
        self._known[address] = (pid, fd, link, found)
        self._recent_pids[pid] = None
        if len(self._recent_pids) > 4096:
            self._recent_pids.pop(next(iter(self._recent_pids)))
        if len(self._known) > 65536:
            self._known.pop(next(iter(self._known)))
        return found

    def forget_closed(self) -> None:
        """Drop cached connections whose socket is gone (called now and then)."""
        for address in list(self._known):
            self._check(address)

    def _inode(self, host: str, port: int, server_port: int) -> str:
        # The local address alone does not name the socket: Linux gives one ephemeral port to
        # connections to different destinations, so another process (of another job, on a busy node)
        # may hold a socket from the caller's very address. Only one of them is connected to the proxy.
        remote_port = f":{server_port:04X}"
        for name, key in _socket_keys(host, port):
            try:
                with open(f"{self._proc}/net/{name}", encoding="ascii") as lines:
                    next(lines, None)
                    for line in lines:
                        fields = line.split()
                        if (len(fields) > 9 and fields[1] == key and fields[2].endswith(remote_port)
                                and fields[9] != "0"):
                            return fields[9]
            except FileNotFoundError:
                continue  # no IPv6 on this node
            except OSError as exc:
                raise PeerRefused(f"cannot read {self._proc}/net/{name}: {exc.strerror}") from None
        raise PeerRefused(f"no socket {host}:{port} connected to port {server_port} in this network namespace "
                          "(the training pod must use hostNetwork, like the agent)")

    def _owner(self, link: str, address: tuple[str, int]) -> tuple[int, str]:
        denied = 0
        candidates = list(self._recent_pids)[::-1]
        seen = set(candidates)
        try:
            candidates += [int(n) for n in os.listdir(self._proc) if n.isdigit() and int(n) not in seen]
        except OSError as exc:
            raise PeerRefused(f"cannot list {self._proc}: {exc.strerror}") from None
        for pid in candidates:
            fd_dir = f"{self._proc}/{pid}/fd"
            try:
                names = os.listdir(fd_dir)
            except PermissionError:
                denied += 1
                continue
            except OSError:
                continue  # exited
            for name in names:
                try:
                    if os.readlink(f"{fd_dir}/{name}") == link:
                        return pid, name
                except OSError:
                    continue
        hint = f" ({denied} processes not readable: the agent needs hostPID and root)" if denied else ""
        raise PeerRefused(f"no process holds the socket of {address[0]}:{address[1]}{hint}")

    def _peer(self, pid: int) -> Peer:
        command = _command(self._proc, pid)
        try:
            with open(f"{self._proc}/{pid}/environ", "rb") as f:
                raw = f.read(ENVIRON_LIMIT)
        except OSError as exc:
            raise PeerRefused(f"pid {pid} ({command}): cannot read its environment: {exc.strerror}") from None
        env = dict(item.split("=", 1) for item in raw.decode("utf-8", "replace").split("\0") if "=" in item)
        job = env.get("MINDX_TASK_ID", "")
        if not job:
            raise PeerRefused(f"pid {pid} ({command}) has no MINDX_TASK_ID: not a process of a training job")
        if not TASK_ID_RE.fullmatch(job):
            raise PeerRefused(f"pid {pid} ({command}): MINDX_TASK_ID {job[:80]!r} is not a valid job id")
        if self._jobs is not None:
            self._check_pod(pid, command, job)
        if env.get("LOCAL_PROXY_ENABLE") == "on":
            host = "127.0.0.1"
        else:
            host = env.get("MASTER_ADDR") or env.get("MS_SCHED_HOST") or "127.0.0.1"
        return Peer(pid, job, host, env.get("RANK", ""), command)

    def _check_pod(self, pid: int, command: str, job: str) -> None:
        uid = pod_uid(self._proc, pid)
        if uid is None:
            raise PeerRefused(f"pid {pid} ({command}) is not in a Kubernetes pod (no pod UID in its cgroup)")
        if not self._jobs.synced:
            raise PeerRefused(f"pid {pid} ({command}): this node's pods are not listed yet")
        ref = self._jobs.job_of_pod(uid)
        if ref is None:
            raise PeerRefused(f"pid {pid} ({command}) runs in pod {uid}, which is not a pod of a training job "
                              "on this node")
        if ref.job_id != job:
            raise PeerRefused(f"pid {pid} ({command}) says MINDX_TASK_ID={job} but its pod {uid} belongs to job "
                              f"{ref.job_id} ({ref.namespace}/{ref.job_name})")


def _command(proc: str, pid: int) -> str:
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            words = f.read(4096).split(b"\0")
        return " ".join(w.decode("utf-8", "replace") for w in words if w)[:120] or f"pid {pid}"
    except OSError:
        return f"pid {pid}"
