"""The durable fault log: every device state change, with its revision, on disk before any sink sees it.

`<state_dir>/faultlog/log` holds one record per line, `<crc32 hex> <json>`: an optional base record
(the state of every device at some revision, written by compaction) and then one record per change.
A torn tail (a crash in the middle of a write, never handed to anyone) is cut off at open.

Revisions are comparable only within one epoch (`meta.json`). A log that lost records somebody may
have seen (deleted, cut short, a corrupt record in it, or behind what `cursors.json` says it held)
starts a new epoch: stream clients then take a snapshot and a sink whose cursor is from another
epoch resynchronises its peer from the current state instead of trusting revisions.

Each sink keeps a cursor, and a small state of its own, in `cursors.json`, advanced only after its
peer acknowledged; compaction folds only what every sink has passed (and what the stream no longer
needs for resuming) into the base record. A write that fails raises OSError and changes nothing.

A sink the configuration no longer runs would hold compaction back for good, so its cursor is
retired: kept for `retire_after_s` from the first start without it (a sink switched off by mistake
and back on within that while resumes where it was), then dropped. Its own state stays (small, and
still true of its peer): switched on later, the sink resynchronises its peer from it.

Writes go through the `*_async` methods, on the event loop: the state is computed on the loop, the
bytes go to disk in the fault log's lane of the executor (`lane`), one write at a time and in order.
A write is never abandoned (one whose outcome is unknown cannot be retried: it may still land), so a
slow disk is waited for, and `stalled` says so meanwhile. Only `open` blocks: it runs at the start,
before anything else does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from agent.model import ActiveCode, Change, DeviceState, Health, Level
from agent.common.executor import Lane
from agent.common.fsutil import atomic_write, keep_aside, read_state, strict_json

log = logging.getLogger(__name__)

SLOW_WRITE_S = 5.0  # a write that has not returned by then makes the fault log "stalled" until it does
RETIRE_AFTER_S = 86400.0  # config.FaultLogConfig's default


def state_to_dict(state: DeviceState) -> dict:
    return {"phy": state.phy_id, "logic": state.logic_id, "health": int(state.health), "level": state.level.name,
            "since": state.since_ms, "level_since": state.level_since_ms,
            "codes": [[c.code, c.text, c.level.name, c.since_ms, c.severity, c.escalated_by] for c in state.codes]}


def state_from_dict(item: dict) -> DeviceState:
    codes = tuple(ActiveCode(int(code), text, Level[level], int(since), severity, escalated_by)
                  for code, text, level, since, severity, escalated_by in item["codes"])
    return DeviceState(int(item["phy"]), int(item["logic"]), Health(int(item["health"])), Level[item["level"]],
                       int(item["since"]), codes, int(item.get("level_since", 0)))


def _line(record: dict) -> bytes:
    body = json.dumps(record, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse(line: bytes) -> dict:
    if not line.endswith(b"\n") or len(line) < 10 or line[8:9] != b" ":
        raise ValueError("incomplete record")
    body = line[9:-1]
    if int(line[:8], 16) != zlib.crc32(body):
        raise ValueError("checksum mismatch")
    try:
        record = strict_json(body)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    return record


def _object(value) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"a JSON object was expected, not {type(value).__name__}")
    return value


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _time(value) -> float | None:
    """A saved wall-clock time, or None when it is not a finite number (the while then starts again)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


@dataclass
class SinkEntry:
    revision: int | None  # everything up to here is acknowledged by the sink's peer; None: retired
    epoch: str  # the log epoch `revision` belongs to
    state: dict | None = None  # the sink's own record of its peer, saved with the cursor
    unconfigured_since: float | None = None  # wall clock: the first start whose configuration lacked the sink


class FaultLog:
    def __init__(self, directory: Path, keep_recent: int = 4096, fsync: bool = True, lane: Lane | None = None,
                 slow_write_s: float = SLOW_WRITE_S, sinks: Iterable[str] | None = None,
                 retire_after_s: float = RETIRE_AFTER_S, clock: Callable[[], float] = time.time):
        self._dir = Path(directory)
        # The sinks this configuration runs (None: every sink with a cursor); the others' cursors retire.
        self._configured = None if sinks is None else frozenset(sinks)
        self._retire_after_s = retire_after_s
        self._clock = clock  # wall clock: the start of a retirement is saved, and must mean the same after a restart
        self._lane = lane  # where the *_async methods write
        self._slow_write_s = slow_write_s
        self._busy = asyncio.Lock()  # one *_async operation at a time: revisions are assigned in order
        self.stalled = ""  # why the fault log is not writing, while a write is slow
        self._path = self._dir / "log"
        self._cursors_path = self._dir / "cursors.json"
        self._keep_recent = keep_recent
        self._fsync = fsync
        self.epoch = ""
        self.revision = 0
        self._base_revision = 0
        self._base: dict[int, DeviceState] = {}  # state of every device at _base_revision
        self._records: deque[Change] = deque()  # every change after _base_revision
        self._latest: dict[int, Change] = {}
        self._sinks: dict[str, SinkEntry] = {}
        self._size = 0  # bytes of whole records in the file: a failed append is cut back to it
        self._torn = False
        self.truncated_bytes = 0
        self.resets: list[str] = []  # why this open started a new epoch (empty: it did not)
        # The previous run ended with close_async() (a clean stop): nothing it sent can still be in flight.
        self.previous_clean = False

    # ---- opening ------------------------------------------------------------------------------

    def open(self) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        epoch = self._read_json(self._dir / "meta.json", "fault log metadata").get("epoch")
        saved = self._read_json(self._cursors_path, "fault log cursors")
        self._sinks = self._read_sinks(saved, epoch)
        self.previous_clean = saved.get("clean") is True
        existed = self._path.exists()
        corrupt = self._load()
        self.epoch = epoch if isinstance(epoch, str) and epoch else ""
        reasons = []
        if not self.epoch and existed:
            reasons.append("meta.json is missing or unreadable")
        if self.epoch:
            held = max([_int(saved.get("revision")),
                        *(e.revision for e in self._sinks.values() if e.epoch == epoch and e.revision is not None)])
            if not existed and held:
                reasons.append("the log file is missing")
            elif self.revision < held:
                reasons.append(f"the log ends at revision {self.revision}, {held} was written before")
            if corrupt:
                reasons.append(f"a corrupt record at revision {self.revision + 1}")
            if saved.get("epoch") not in (None, epoch):
                reasons.append("cursors.json belongs to another epoch")
        if reasons or not self.epoch:
            self.epoch = os.urandom(8).hex()
            atomic_write(self._dir / "meta.json", json.dumps({"epoch": self.epoch}).encode())
            if reasons:
                self.resets = reasons
                log.warning("fault log lost records it had; starting a new epoch (sinks resynchronise from the "
                            "current state, stream clients get a snapshot)",
                            extra={"path": str(self._path), "reasons": reasons, "revision": self.revision})
        self._retire()
        # Until close_async() says otherwise, this run did not end cleanly (and the retirements are saved).
        atomic_write(self._cursors_path, self._cursors_data())

    def _read_json(self, path: Path, what: str) -> dict:
        return read_state(path, what, _object) or {}

    def _read_sinks(self, saved: dict, epoch) -> dict[str, SinkEntry]:
        if "sinks" not in saved:  # the first format: {sink: revision} in the log's epoch
            saved = {"sinks": {k: {"revision": v, "epoch": epoch} for k, v in saved.items()}}
        sinks = {}
        items = saved.get("sinks")
        if not isinstance(items, dict):
            log.error("the sinks' cursors are malformed; every sink resynchronises its peer",
                      extra={"path": str(self._cursors_path)})
            items = {}
        for name, item in items.items():
            try:
                state = item.get("state")
                revision = item["revision"]
                sinks[name] = SinkEntry(None if revision is None else int(revision), str(item["epoch"]),
                                        state if isinstance(state, dict) else None,
                                        _time(item.get("unconfigured_since")))
            except (AttributeError, KeyError, TypeError, ValueError):
                log.error("a sink's cursor is malformed; that sink resynchronises its peer",
                          extra={"path": str(self._cursors_path), "sink": name})
        return sinks

    def _load(self) -> bool:
        """Read the file; True when a corrupt record (not just an unfinished last one) was cut off."""
        good = 0
        corrupt = False
        try:
            with open(self._path, "rb") as handle:
                for line in handle:
                    try:
                        record = _parse(line)
                        self._apply(record)
                    except (ValueError, KeyError, TypeError, AttributeError, ArithmeticError) as exc:
                        size = self._path.stat().st_size
                        self.truncated_bytes = size - good
                        corrupt = line.endswith(b"\n")  # an unfinished write never reached anyone
                        log.warning("fault log has a torn or corrupt tail; cut off", extra={
                            "path": str(self._path), "offset": good, "bytes_dropped": self.truncated_bytes,
                            "reason": str(exc), "revision": self.revision})
                        break
                    good += len(line)
        except FileNotFoundError:
            return False
        if self.truncated_bytes:
            with open(self._path, "r+b") as handle:
                if corrupt:  # not merely a write a crash left unfinished: keep it for inspection
                    handle.seek(good)
                    keep_aside(self._path, handle.read())
                handle.truncate(good)
                os.fsync(handle.fileno())
        self._size = good
        return corrupt

    def _apply(self, record: dict) -> None:
        if record.get("base"):
            if self.revision:
                raise ValueError("base record after changes")
            self._base_revision = self.revision = int(record["rev"])
            self._base = {s.phy_id: s for s in map(state_from_dict, record["devices"])}
            self._latest = {phy: Change(self.revision, s) for phy, s in self._base.items()}
            return
        revision = int(record["rev"])
        if revision != self.revision + 1:
            raise ValueError(f"revision {revision} after {self.revision}")
        change = Change(revision, state_from_dict(record["state"]))
        self.revision = revision
        self._records.append(change)
        self._latest[change.state.phy_id] = change

    # ---- writing ------------------------------------------------------------------------------

    async def append_async(self, states: list[DeviceState]) -> list[Change]:
        """Write the changes and sync them to disk; only then are they handed to anyone.

        OSError (disk full, read-only, EIO) leaves the log as it was: the file is cut back to its
        last whole record and no revision is used up, so the caller can simply try again.
        Cancelling the caller does not cancel the write: it completes (and is accounted for) before
        the next operation starts."""
        return await asyncio.shield(self._append_in_order(states))

    async def _append_in_order(self, states: list[DeviceState]) -> list[Change]:
        async with self._busy:
            changes, data = self._encode(states)
            if changes:
                await self._io(self._write_records, data)
                self._added(changes, data)
                await self._compact()
            return changes

    def _encode(self, states: list[DeviceState]) -> tuple[list[Change], bytes]:
        changes = [Change(self.revision + i, state) for i, state in enumerate(states, 1)]
        return changes, b"".join(_line({"rev": c.revision, "state": state_to_dict(c.state)}) for c in changes)

    def _write_records(self, data: bytes) -> None:
        """Blocking: append whole records to the file, or leave it as it was."""
        try:
            if self._torn:  # what a failed append left could not be cut off then
                os.truncate(self._path, self._size)
                self._torn = False
            # Opened for each append (they are rare): nothing holds the file between writes, so a file
            # replaced or removed meanwhile is noticed at the next open, and the disk can be remounted.
            with open(self._path, "ab") as handle:
                handle.write(data)
                handle.flush()
                if self._fsync:
                    os.fsync(handle.fileno())
        except OSError:
            self._cut_back()
            raise

    def _added(self, changes: list[Change], data: bytes) -> None:
        self._size += len(data)
        self.revision = changes[-1].revision
        for change in changes:
            self._records.append(change)
            self._latest[change.state.phy_id] = change

    async def save_file(self, path: Path, data: bytes) -> None:
        """Replace another file of the agent's state (atomic_write), off the loop and in order with the log's writes."""
        async with self._busy:
            await self._io(atomic_write, path, data)

    async def _io(self, fn, *args):
        """`fn(*args)` in the fault log's lane, waited for however long it takes (see the module's doc)."""
        future = asyncio.wrap_future(self._lane.submit(fn, *args))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self._slow_write_s)
        except TimeoutError:
            self.stalled = f"a write under {self._dir} has not returned for {self._slow_write_s:g} s (disk hung?)"
            log.error("fault log write is not returning; waiting for it", extra={"path": str(self._dir)})
        try:
            return await future
        finally:
            if self.stalled:
                log.info("fault log write returned", extra={"path": str(self._dir)})
            self.stalled = ""

    def _cut_back(self) -> None:
        """Drop whatever part of a failed append reached the file (a later append must not follow half a line)."""
        try:
            if self._path.stat().st_size > self._size:
                os.truncate(self._path, self._size)
        except OSError as exc:  # the next append (or open) cuts it
            self._torn = True
            log.warning("cannot cut a failed append off the fault log yet", extra={"error": str(exc)})

    async def close_async(self) -> None:
        """At a clean stop: note the last revision (a log cut short before the next start is noticed)
        and that nothing this run sent can still be in flight."""
        if not self.epoch:
            return
        async with self._busy:
            try:
                await self._save_cursors(clean=True)
            except OSError as exc:
                log.warning("cannot note the fault log's last revision at shutdown", extra={"error": str(exc)})

    # ---- reading ------------------------------------------------------------------------------

    def latest(self) -> dict[int, Change]:
        return dict(self._latest)

    def changes_after(self, revision: int) -> list[Change] | None:
        """The changes after `revision`, or None when some of them were compacted away."""
        if revision < self._base_revision:
            return None
        return [c for c in self._records if c.revision > revision]

    def state_at(self, revision: int) -> dict[int, DeviceState] | None:
        """Every device's state as of `revision`, or None when that is older than the log keeps."""
        if revision < self._base_revision:
            return None
        states = dict(self._base)
        for change in self._records:
            if change.revision > revision:
                break
            states[change.state.phy_id] = change.state
        return states

    # ---- sink cursors -------------------------------------------------------------------------

    def cursor(self, sink: str) -> int | None:
        """Where `sink` stands in this epoch; None when it has no usable position (new, from another
        epoch, or behind what compaction kept): it must resynchronise its peer from `latest()`."""
        entry = self._sinks.get(sink)
        if (entry is None or entry.revision is None or entry.epoch != self.epoch
                or not self._base_revision <= entry.revision <= self.revision):
            return None
        return entry.revision

    def sink_state(self, sink: str) -> dict | None:
        """What `sink` saved with its last commit, in whatever epoch."""
        entry = self._sinks.get(sink)
        return entry.state if entry is not None else None

    async def commit_async(self, sink: str, revision: int, state: dict | None = None) -> None:
        """`sink`'s peer acknowledged everything up to `revision` (OSError: not saved, try again)."""
        await asyncio.shield(self._commit_in_order(sink, revision, state))

    async def _commit_in_order(self, sink: str, revision: int, state: dict | None) -> None:
        async with self._busy:
            previous = self._set_cursor(sink, revision, state)
            try:
                await self._save_cursors()
            except OSError:
                self._put_back(sink, previous)
                raise
            await self._compact()

    def _set_cursor(self, sink: str, revision: int, state: dict | None) -> SinkEntry | None:
        """Set the cursor in memory; returns the one it replaced, to put back if the save fails."""
        previous = self._sinks.get(sink)
        self._sinks[sink] = SinkEntry(revision, self.epoch, state)
        return previous

    def _put_back(self, sink: str, previous: SinkEntry | None) -> None:
        if previous is None:
            del self._sinks[sink]
        else:
            self._sinks[sink] = previous

    def pending(self, sink: str) -> int:
        """Changes the sink's peer has not acknowledged (all of them when it must resynchronise)."""
        cursor = self.cursor(sink)
        return self.revision - (self._base_revision if cursor is None else cursor)

    async def _save_cursors(self, clean: bool = False) -> None:
        await self._io(atomic_write, self._cursors_path, self._cursors_data(clean))

    def _cursors_data(self, clean: bool = False) -> bytes:
        data = {"epoch": self.epoch, "revision": self.revision, "clean": clean,
                "sinks": {name: {"revision": e.revision, "epoch": e.epoch, **({"state": e.state} if e.state else {}),
                                 **({"unconfigured_since": e.unconfigured_since}
                                    if e.unconfigured_since is not None else {})}
                          for name, e in sorted(self._sinks.items())}}
        return json.dumps(data, sort_keys=True).encode()

    # ---- retiring the cursors of sinks no longer configured -----------------------------------

    def _retire(self) -> bool:
        """Start, end or finish the retirement of each cursor (see the module's doc); True when one was
        dropped. The configuration is read once per run, so a sink starts or stops retiring only at open."""
        if self._configured is None:
            return False
        now = self._clock()
        dropped = False
        for name, entry in self._sinks.items():
            if name in self._configured:
                entry.unconfigured_since = None  # back within the while: it resumes from its cursor
                continue
            if entry.revision is None:
                continue
            if entry.unconfigured_since is None:
                entry.unconfigured_since = now
                log.info("cursor of a sink that is not configured; kept for a while, then dropped", extra={
                    "sink": name, "revision": entry.revision, "drop_after_s": self._retire_after_s})
            # A clock stepped back (or a saved time in the future) must not keep it for good.
            entry.unconfigured_since = min(entry.unconfigured_since, now)
            if now - entry.unconfigured_since >= self._retire_after_s:
                entry.revision = None
                dropped = True
                log.info("cursor of a sink no longer configured dropped; the fault log compacts without it", extra={
                    "sink": name, "unconfigured_for_s": round(now - entry.unconfigured_since)})
        return dropped

    # ---- compaction ---------------------------------------------------------------------------

    def _compaction_due(self) -> int | None:
        """The revision to compact up to, when enough is dead (at least 1024 records, half the log)."""
        cursors = [c for c in map(self.cursor, self._sinks) if c is not None]
        boundary = min([self.revision - self._keep_recent, *cursors])
        dead = boundary - self._base_revision
        return None if dead < 1024 or dead * 2 < len(self._records) else boundary

    async def _compact(self) -> None:
        """Drop the cursors whose retirement is over, then, when enough is dead, fold every change up
        to the boundary into the base record and rewrite the file."""
        if self._retire():
            try:
                await self._save_cursors()
            except OSError:  # saved with the next commit, or dropped again at the next open
                pass
        boundary = self._compaction_due()
        if boundary is None:
            return
        base = self.state_at(boundary)  # not None: the boundary is past the base record
        kept = [c for c in self._records if c.revision > boundary]
        lines = [_line({"base": True, "rev": boundary, "devices": [state_to_dict(s) for s in base.values()]})]
        lines += [_line({"rev": c.revision, "state": state_to_dict(c.state)}) for c in kept]
        data = b"".join(lines)
        try:
            await self._io(atomic_write, self._path, data)
        except OSError as exc:  # the log stays as it is, only longer; the next append tries again
            log.warning("fault log compaction failed", extra={"error": str(exc), "records": len(self._records)})
            return
        self._size = len(data)
        self._base, self._base_revision = base, boundary
        self._records = deque(kept)
        log.info("fault log compacted", extra={"base_revision": boundary, "records": len(kept)})
