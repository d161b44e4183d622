"""The durable fault log: every device state change, with its revision, on disk before any sink sees it.

`<state_dir>/faultlog/log` holds one record per line, `<crc32 hex> <json>`: an optional base record
(the state of every device at some revision, written by compaction) and then one record per change.
A torn or corrupt tail (a crash in the middle of a write) is cut off at open and logged; it never
stops the agent. Each sink keeps a cursor in `cursors.json` that it advances only after its peer
acknowledged; compaction folds only what every sink has passed (and what the stream no longer needs
for resuming) into the base record.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import zlib
from collections import deque
from pathlib import Path

from agent.faults.engine import ActiveCode, DeviceState, Health
from agent.faults.hub import Change
from agent.faults.levels import Level
from agent.fsutil import atomic_write

log = logging.getLogger(__name__)


def state_to_dict(state: DeviceState) -> dict:
    return {"phy": state.phy_id, "logic": state.logic_id, "health": int(state.health), "level": state.level.name,
            "since": state.since_ms,
            "codes": [[c.code, c.text, c.level.name, c.since_ms, c.severity, c.escalated_by] for c in state.codes]}


def state_from_dict(item: dict) -> DeviceState:
    codes = tuple(ActiveCode(int(code), text, Level[level], int(since), severity, escalated_by)
                  for code, text, level, since, severity, escalated_by in item["codes"])
    return DeviceState(int(item["phy"]), int(item["logic"]), Health(int(item["health"])), Level[item["level"]],
                       int(item["since"]), codes)


def _line(record: dict) -> bytes:
    body = json.dumps(record, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse(line: bytes) -> dict:
    if not line.endswith(b"\n") or len(line) < 10 or line[8:9] != b" ":
        raise ValueError("incomplete record")
    body = line[9:-1]
    if int(line[:8], 16) != zlib.crc32(body):
        raise ValueError("checksum mismatch")
    return json.loads(body)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


class FaultLog:
    def __init__(self, directory: Path, keep_recent: int = 4096, fsync: bool = True):
        self._dir = Path(directory)
        self._path = self._dir / "log"
        self._keep_recent = keep_recent
        self._fsync = fsync
        self.epoch = ""
        self.revision = 0
        self._base_revision = 0
        self._base: dict[int, DeviceState] = {}  # state of every device at _base_revision
        self._records: deque[Change] = deque()  # every change after _base_revision
        self._latest: dict[int, Change] = {}
        self._cursors: dict[str, int] = {}
        self._file = None
        self.truncated_bytes = 0
        self.previous_commit_at: float | None = None  # wall-clock time of the last commit before open()
        self.previous_append_at: float | None = None  # wall-clock time of the last append before open()

    # ---- opening ------------------------------------------------------------------------------

    def open(self) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        meta = self._read_json(self._dir / "meta.json")
        self.epoch = meta.get("epoch") or secrets.token_hex(8)
        if meta.get("epoch") != self.epoch:
            atomic_write(self._dir / "meta.json", json.dumps({"epoch": self.epoch}).encode())
        self._cursors = {k: int(v) for k, v in self._read_json(self._dir / "cursors.json").items()}
        self.previous_commit_at = _mtime(self._dir / "cursors.json")
        self.previous_append_at = _mtime(self._path)
        self._load()
        self._file = open(self._path, "ab")

    def _read_json(self, path: Path) -> dict:
        try:
            value = json.loads(path.read_text("utf-8"))
            return value if isinstance(value, dict) else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.error("fault log metadata unreadable; starting it afresh", extra={"path": str(path), "error": str(exc)})
            return {}

    def _load(self) -> None:
        good = 0
        try:
            with open(self._path, "rb") as handle:
                for line in handle:
                    try:
                        record = _parse(line)
                        self._apply(record)
                    except (ValueError, KeyError, TypeError) as exc:
                        size = self._path.stat().st_size
                        self.truncated_bytes = size - good
                        log.warning("fault log has a torn or corrupt tail; cut off", extra={
                            "path": str(self._path), "offset": good, "bytes_dropped": self.truncated_bytes,
                            "reason": str(exc), "revision": self.revision})
                        break
                    good += len(line)
        except FileNotFoundError:
            return
        if self.truncated_bytes:
            with open(self._path, "r+b") as handle:
                handle.truncate(good)
                os.fsync(handle.fileno())

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

    def append(self, states: list[DeviceState]) -> list[Change]:
        """Write the changes and sync them to disk; only then are they handed to anyone."""
        changes = []
        lines = []
        for state in states:
            self.revision += 1
            change = Change(self.revision, state)
            changes.append(change)
            lines.append(_line({"rev": change.revision, "state": state_to_dict(state)}))
        if not changes:
            return []
        self._file.write(b"".join(lines))
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())
        for change in changes:
            self._records.append(change)
            self._latest[change.state.phy_id] = change
        self._maybe_compact()
        return changes

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

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

    def cursor(self, sink: str) -> int:
        """Where `sink` stands; a new sink starts at the oldest revision the log still has."""
        if sink not in self._cursors:
            self._cursors[sink] = self._base_revision
            self._save_cursors()
        return self._cursors[sink]

    def commit(self, sink: str, revision: int) -> None:
        """`sink`'s peer acknowledged everything up to `revision`."""
        self._cursors[sink] = revision
        self._save_cursors()
        self._maybe_compact()

    def pending(self, sink: str) -> int:
        return self.revision - self._cursors.get(sink, self._base_revision)

    def _save_cursors(self) -> None:
        atomic_write(self._dir / "cursors.json", json.dumps(self._cursors, sort_keys=True).encode())

    # ---- compaction ---------------------------------------------------------------------------

    def _maybe_compact(self) -> None:
        boundary = min([self.revision - self._keep_recent, *self._cursors.values()])
        dead = boundary - self._base_revision
        if dead < 1024 or dead * 2 < len(self._records):
            return
        self.compact(boundary)

    def compact(self, boundary: int) -> None:
        """Fold every change up to `boundary` into the base record and rewrite the file."""
        base = self.state_at(boundary)
        if base is None or boundary <= self._base_revision:
            return
        kept = [c for c in self._records if c.revision > boundary]
        lines = [_line({"base": True, "rev": boundary, "devices": [state_to_dict(s) for s in base.values()]})]
        lines += [_line({"rev": c.revision, "state": state_to_dict(c.state)}) for c in kept]
        self.close()
        atomic_write(self._path, b"".join(lines))
        self._file = open(self._path, "ab")
        self._base, self._base_revision = base, boundary
        self._records = deque(kept)
        log.info("fault log compacted", extra={"base_revision": boundary, "records": len(kept)})
