"""The pure-Python MSPTI collector (ctypes), used when the native extension `agent._native` is absent.

Same API and the same output, byte for byte, as `agent._native.Collector`:

* `__init__` loads the library, resolves every symbol TaskD uses (OSError naming the one missing)
  and registers the buffer callbacks;
* the request callback hands out one of `buffers` preallocated buffers of `buffer_bytes`, or
  declines with NULL (counted) when all are out: it never blocks mspti and never allocates;
* the completion callback walks the buffer with `msptiActivityGetNextRecord`, serialises marker,
  API and kernel records (`jsonlines`), counts and skips any other kind, and returns the buffer to
  the pool; the lines wait in a queue bounded by `ring_bytes` (past it records are dropped, counted);
  the time spent in it is counted (`complete_ns`, `complete_max_ns`);
* `drain()` hands over the complete lines gathered since the last drain (the native collector can
  also write them to a file itself, `drain_to`; this one cannot, and `agent.worker` writes the bytes);
* `set_switch(default_on, comm_on)` makes TaskD's MSPTI calls and returns each domain's result
  (0 off, 1 on, 2 exception: one of that domain's calls failed), as TaskD reports them to its manager;
* in a forked child (`os.register_at_fork`) it forgets the lines queued in the parent and goes inert,
  as the native one does: the callbacks decline, nothing is drained, flushed or closed, no MSPTI call.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref

from agent.worker import jsonlines

MSPTI_SUCCESS = 0
MSPTI_ERROR_MAX_LIMIT_REACHED = 3
SWITCH_OFF, SWITCH_ON, SWITCH_EXCEPTION = 0, 1, 2  # a domain's result, as TaskD's STATUS reports it
KIND_MARKER, KIND_KERNEL, KIND_API = 1, 2, 3
COMM_DOMAIN = b"communication"

SYMBOLS = ("msptiActivityRegisterCallbacks", "msptiActivityGetNextRecord", "msptiActivityEnable",
           "msptiActivityDisable", "msptiActivityEnableMarkerDomain", "msptiActivityDisableMarkerDomain",
           "msptiActivityFlushAll", "msptiSubscribe", "msptiUnsubscribe")


class _Pair(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("a", ctypes.c_uint32), ("b", ctypes.c_uint32)]


class ActivityMarker(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("kind", ctypes.c_int32), ("flag", ctypes.c_int32), ("sourceKind", ctypes.c_int32),
                ("timestamp", ctypes.c_uint64), ("id", ctypes.c_uint64), ("objectId", _Pair),
                ("name", ctypes.c_void_p), ("domain", ctypes.c_void_p), ("_tail", ctypes.c_uint32)]


class ActivityApi(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("kind", ctypes.c_int32), ("start", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("pt", _Pair), ("correlationId", ctypes.c_uint64), ("name", ctypes.c_void_p),
                ("_tail", ctypes.c_uint32)]


class ActivityKernel(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("kind", ctypes.c_int32), ("start", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("ds", _Pair), ("correlationId", ctypes.c_uint64), ("type", ctypes.c_void_p),
                ("name", ctypes.c_void_p), ("_tail", ctypes.c_uint32)]


# The header declares the structs packed and 8-byte aligned, so 64-bit fields sit at unaligned
# offsets and each size is rounded up to 8 (the `_tail` fields); checked against the MSPTI headers' layout.
assert [getattr(ActivityMarker, f).offset for f in ("kind", "flag", "sourceKind", "timestamp", "id", "objectId",
                                                      "name", "domain")] == [0, 4, 8, 12, 20, 28, 36, 44]
assert ctypes.sizeof(ActivityMarker) == 56
assert ctypes.sizeof(ActivityApi) == 48
assert ctypes.sizeof(ActivityKernel) == 56
assert [getattr(ActivityApi, f).offset for f in ("kind", "start", "end", "pt", "correlationId", "name")] \
    == [0, 4, 12, 20, 28, 36]
assert [getattr(ActivityKernel, f).offset for f in ("kind", "start", "end", "ds", "correlationId", "type",
                                                      "name")] == [0, 4, 12, 20, 28, 36, 44]

REQUEST_FN = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
                              ctypes.POINTER(ctypes.c_size_t))
COMPLETE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)

# mspti may call a registered callback at any time until the process ends: the ctypes thunks must
# outlive their collector, so they are kept here for good.
_KEEP_ALIVE: list = []


def _cstr(ptr: int | None) -> bytes | None:
    return None if not ptr else ctypes.string_at(ptr)


def serialise(address: int) -> bytes | None:
    """The JSON line of the activity record at `address`, or None for a kind that is not written."""
    kind = ctypes.c_int32.from_address(address).value
    if kind == KIND_MARKER:
        m = ActivityMarker.from_address(address)
        return jsonlines.marker_line(m.flag, m.sourceKind, m.timestamp, m.id, m.objectId.a, m.objectId.b,
                                     _cstr(m.name), _cstr(m.domain))
    if kind == KIND_API:
        r = ActivityApi.from_address(address)
        return jsonlines.api_line(r.start, r.end, r.pt.a, r.pt.b, r.correlationId, _cstr(r.name))
    if kind == KIND_KERNEL:
        k = ActivityKernel.from_address(address)
        return jsonlines.kernel_line(k.start, k.end, k.ds.a, k.ds.b, k.correlationId, _cstr(k.type), _cstr(k.name))
    return None


# The open collectors, for the fork hook below.
_LIVE: "weakref.WeakSet[Collector]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for collector in list(_LIVE):
        collector._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Collector:
    def __init__(self, lib_path: str, *, buffers: int = 32, buffer_bytes: int = 1 << 20,
                 ring_bytes: int = 64 << 20) -> None:
        if buffers < 1 or buffer_bytes < 64 or ring_bytes < 1:
            raise ValueError("buffers >= 1, buffer_bytes >= 64 and ring_bytes >= 1 are required")
        try:
            lib = ctypes.CDLL(lib_path)
        except OSError as exc:
            raise OSError(f"cannot load {lib_path}: {exc}") from None
        for symbol in SYMBOLS:
            if not hasattr(lib, symbol):
                raise OSError(f"{lib_path} has no symbol {symbol}")
        self._lib = lib
        lib.msptiActivityRegisterCallbacks.argtypes = [REQUEST_FN, COMPLETE_FN]
        lib.msptiActivityGetNextRecord.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                                   ctypes.POINTER(ctypes.c_void_p)]
        for name in ("msptiActivityEnable", "msptiActivityDisable", "msptiActivityFlushAll"):
            getattr(lib, name).argtypes = [ctypes.c_int]
        lib.msptiActivityEnableMarkerDomain.argtypes = [ctypes.c_char_p]
        lib.msptiActivityDisableMarkerDomain.argtypes = [ctypes.c_char_p]
        lib.msptiSubscribe.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_void_p]
        lib.msptiUnsubscribe.argtypes = [ctypes.c_void_p]
        for symbol in SYMBOLS:
            getattr(lib, symbol).restype = ctypes.c_int

        self.buffer_bytes = buffer_bytes
        self.ring_bytes = ring_bytes
        self._pool = [ctypes.create_string_buffer(buffer_bytes) for _ in range(buffers)]
        self._free = [ctypes.addressof(b) for b in self._pool]
        self._owned = frozenset(self._free)
        self._lock = threading.Lock()  # pool, queue and counters
        self._lines: list[bytes] = []
        self._queued = 0
        self._subscriber = ctypes.c_void_p()
        self._subscribed = False
        self._closed = False
        self._closing = False
        self._switch_lock = threading.Lock()
        self._pid = os.getpid()
        self._counters = dict.fromkeys(("records", "bytes", "buffers_requested", "buffers_declined",
                                        "buffers_completed", "records_dropped", "records_skipped",
                                        "complete_ns", "complete_max_ns"), 0)
        self._request_fn = REQUEST_FN(self._on_request)
        self._complete_fn = COMPLETE_FN(self._on_complete)
        _KEEP_ALIVE.append((self._request_fn, self._complete_fn, self._pool))
        result = lib.msptiActivityRegisterCallbacks(self._request_fn, self._complete_fn)
        if result != MSPTI_SUCCESS:
            raise OSError(f"msptiActivityRegisterCallbacks failed with {result}")
        _LIVE.add(self)

    def _forget(self) -> None:
        """In a forked child: the queued lines are the parent's to write. Dropped, the callbacks
        turned away, close and flush made no-ops; the locks are new (a thread of the parent may
        have held one at the fork, and it is not in the child to release it)."""
        self._lock = threading.Lock()
        self._switch_lock = threading.Lock()
        self._lines, self._queued = [], 0
        self._closed = self._closing = True

    def _foreign(self) -> bool:
        return self._pid != os.getpid()

    # -- callbacks (mspti's threads) ---------------------------------------------------------------

    def _on_request(self, buffer, size, max_records) -> None:
        try:
            buffer[0] = None
            size[0] = 0
            max_records[0] = 0  # "as many as fit"
            if self._closed:
                return
            with self._lock:
                self._counters["buffers_requested"] += 1
                address = self._free.pop() if self._free else None
                if address is None:
                    self._counters["buffers_declined"] += 1
                    return
            buffer[0] = address
            size[0] = self.buffer_bytes
        except BaseException:  # never let an exception cross into C
            pass

    def _on_complete(self, buffer, size, valid_size) -> None:
        start = time.monotonic_ns()
        if not buffer or self._closed:
            return
        if buffer not in self._owned:
            return  # not one of ours (a buffer of an earlier collector): ignored, as the native one does
        lines = []
        skipped = 0
        try:
            valid_size = min(valid_size, self.buffer_bytes)
            record = ctypes.c_void_p()
            next_record = self._lib.msptiActivityGetNextRecord
            while next_record(buffer, valid_size, ctypes.byref(record)) == MSPTI_SUCCESS and record.value:
                line = serialise(record.value)
                if line is None:
                    skipped += 1
                else:
                    lines.append(line)
        except BaseException:
            pass
        finally:
            with self._lock:
                c = self._counters
                c["records_skipped"] += skipped
                for line in lines:
                    if self._queued + len(line) > self.ring_bytes:
                        c["records_dropped"] += 1
                        continue
                    self._lines.append(line)
                    self._queued += len(line)
                    c["records"] += 1
                    c["bytes"] += len(line)
                self._free.append(buffer)
                c["buffers_completed"] += 1
                spent = time.monotonic_ns() - start
                c["complete_ns"] += spent
                c["complete_max_ns"] = max(c["complete_max_ns"], spent)

    # -- API ---------------------------------------------------------------------------------------

    def set_switch(self, default_on: bool, comm_on: bool) -> tuple[int, int]:
        """As TaskD enables them: the default domain (MARKER kind, subscriber slot), then the comm domain.

        Returns `(default_result, comm_result)`, each SWITCH_OFF, SWITCH_ON or SWITCH_EXCEPTION (an
        MSPTI call of that domain did not return success), the per-domain results TaskD reports."""
        if self._foreign():
            raise ValueError(f"Collector belongs to process {self._pid}, not to this fork of it")
        with self._switch_lock:
            if self._closing:
                raise ValueError("Collector is closed")
            return self._apply(bool(default_on), bool(comm_on))

    def _apply(self, default_on: bool, comm_on: bool) -> tuple[int, int]:
        """The switch sequence (self._switch_lock held); the calls made never depend on the results."""
        lib = self._lib
        ok = True
        if default_on:
            if not self._subscribed:
                # NULL callback: only the subscriber slot is claimed, as TaskD does
                if lib.msptiSubscribe(ctypes.byref(self._subscriber), None, None) == MSPTI_SUCCESS:
                    self._subscribed = True
                else:
                    ok = False  # e.g. another profiler holds MSPTI's only subscriber slot
            if lib.msptiActivityEnable(KIND_MARKER) != MSPTI_SUCCESS:
                ok = False
        else:
            for kind in (KIND_MARKER, KIND_KERNEL, KIND_API):
                if lib.msptiActivityDisable(kind) != MSPTI_SUCCESS:
                    ok = False
            if self._subscribed:
                if lib.msptiUnsubscribe(self._subscriber) != MSPTI_SUCCESS:
                    ok = False
                self._subscribed = False
        if comm_on:
            comm_ok = lib.msptiActivityEnableMarkerDomain(COMM_DOMAIN) == MSPTI_SUCCESS
        else:
            comm_ok = lib.msptiActivityDisableMarkerDomain(COMM_DOMAIN) == MSPTI_SUCCESS
        return (int(default_on) if ok else SWITCH_EXCEPTION,
                int(comm_on) if comm_ok else SWITCH_EXCEPTION)

    def drain(self) -> bytes:
        if self._foreign():
            return b""
        with self._lock:
            lines, self._lines, self._queued = self._lines, [], 0
        return b"".join(lines)

    def flush(self) -> None:
        if not self._closed and not self._foreign():
            self._lib.msptiActivityFlushAll(1)

    def close(self) -> None:
        """Switch everything off (MARKER, KERNEL, API disabled, the subscriber released, the comm
        domain disabled), flush, and stop taking buffers; the lines still queued are returned by the
        next `drain()`. Idempotent. The callbacks stay registered and alive: mspti offers no way to
        unregister them, so they ignore everything from now on."""
        if self._foreign():
            return
        with self._switch_lock:
            if self._closing:
                return
            self._closing = True
            try:
                self._apply(False, False)
            except Exception:
                pass
        try:
            self._lib.msptiActivityFlushAll(1)
        except Exception:
            pass
        self._closed = True

    def counters(self) -> dict:
        with self._lock:
            return dict(self._counters)
