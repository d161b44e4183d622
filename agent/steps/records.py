"""Profiling record lines -> marker tuples (pure).

TaskD's writer (`taskd.md` §1.5) prints every marker with Go's `json.Marshal` of a struct without
tags: the keys always come in the same order, compact, one object per line. One anchored regular
expression over a whole chunk therefore parses the common case in C; a line it does not match
(another key order, an API or kernel record, garbage) goes through `json.loads` and is validated
field by field. The expression accepts only what `json.loads` accepts too, with the same values
(JSON's escapes and numbers, no control character, UTF-8), and no escaped surrogate: a name must
be text, and an unpaired `\\ud800`, which `json.loads` lets through, is refused by the slow path.
Names stay bytes: only a start record's name is ever looked at.

A marker is the plain tuple of its fields' raw JSON text, `(flag, source, timestamp_ns, id, pid,
name, domain)`, all bytes: at several hundred thousand records a second, converting only what the
pairing needs (the timestamp, a start record's name) is what keeps up; `int()` of a field, or
`text()` of a name, gives its value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

FLAG, SOURCE, TIMESTAMP, ID, PID, NAME, DOMAIN = range(7)

KIND_MARKER = 1
SOURCE_HOST, SOURCE_DEVICE = 0, 1
START_FLAGS = frozenset((b"2", b"16"))  # MARKER_START (host-only range), MARKER_START_WITH_DEVICE
END_FLAGS = frozenset((b"4", b"32"))
WITH_DEVICE_FLAGS = frozenset((b"16", b"32"))
MAX_U64 = (1 << 64) - 1

_DIGITS = rb"(?:0|[1-9]\d{0,18})"  # 19 digits at most: below 2**64 unchecked; longer ones take the slow path
_NUMBER = b"(" + _DIGITS + b")"
_STRING = rb'"([^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u(?![dD][89a-fA-F])[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*)"'
_MARKER = re.compile(
    rb'^\{"Kind":1,"Flag":' + _NUMBER + rb',"SourceKind":([01]),"Timestamp":' + _NUMBER + rb',"Id":' + _NUMBER +
    rb',"MsptiObjectId":\{"Pt":\{"ProcessId":' + _NUMBER + rb',"ThreadId":' + _DIGITS +
    rb'\},"Ds":\{"DeviceId":' + _DIGITS + rb',"StreamId":' + _DIGITS + rb'\}\},'
    rb'"Name":' + _STRING + rb',"Domain":' + _STRING + rb'\}$', re.M)


@dataclass(frozen=True, slots=True)
class RankKey:
    """One rank's directory of records: `<root>/<job_id>/<rank>/`."""
    job_id: str
    rank: int


@dataclass
class Parsed:
    markers: list[tuple] = field(default_factory=list)
    errors: list[tuple[str, bytes]] = field(default_factory=list)  # (reason, the line, cut to 200 bytes)
    other_kinds: int = 0  # API, kernel, ... records: valid, not used


def parse(data: bytes) -> Parsed:
    """Parse complete lines (`data` ends with b"\\n"); blank lines are skipped silently."""
    out = Parsed()
    found = _MARKER.findall(data)
    if len(found) == data.count(b"\n") and _utf8(data):  # every line matched: the writer's own format
        out.markers = found
        return out
    for line in data.split(b"\n"):
        if line.strip():
            _parse_line(line, out)
    return out


def text(raw: bytes) -> bytes:
    """A JSON string's content, unescaped (rare: names with quotes, \\u escapes)."""
    if b"\\" not in raw:
        return raw
    return json.loads(b'"' + raw + b'"').encode()


def _utf8(data: bytes) -> bool:
    if data.isascii():
        return True
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _parse_line(line: bytes, out: Parsed) -> None:
    match = _MARKER.fullmatch(line) if line.startswith(b'{"Kind":1,') else None
    if match is not None and _utf8(line):
        out.markers.append(match.groups())
        return
    try:
        record = json.loads(line.decode())  # UTF-8, as the writer writes: no guess at UTF-16, no raw surrogate
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        out.errors.append(("not_json", line[:200]))
        return
    if not isinstance(record, dict):
        out.errors.append(("not_object", line[:200]))
        return
    kind = record.get("Kind")
    if not _is_int(kind, 0, MAX_U64):
        out.errors.append(("bad_field", line[:200]))
        return
    if kind != KIND_MARKER:
        out.other_kinds += 1
        return
    fields = [record.get(k) for k in ("Flag", "SourceKind", "Timestamp", "Id")]
    name, domain = record.get("Name"), record.get("Domain")
    obj = record.get("MsptiObjectId")
    pt = obj.get("Pt") if isinstance(obj, dict) else None
    pid = pt.get("ProcessId", 0) if isinstance(pt, dict) else 0
    if any(v is None for v in fields) or name is None or domain is None:
        out.errors.append(("missing_field", line[:200]))
        return
    if not (all(_is_int(v, 0, MAX_U64) for v in fields) and fields[1] in (0, 1) and _is_text(name)
            and _is_text(domain) and _is_int(pid, 0, MAX_U64)):
        out.errors.append(("bad_field", line[:200]))
        return
    flag, source, timestamp, ident = (str(v).encode() for v in fields)
    out.markers.append((flag, source, timestamp, ident, str(pid).encode(), _escaped(name), _escaped(domain)))


def _escaped(value: str) -> bytes:
    """The raw JSON text of a string's content, as the fast path leaves it."""
    return json.dumps(value)[1:-1].encode()


def _is_text(value) -> bool:
    """A str that is Unicode text: `json.loads` also gives unpaired surrogates from `\\ud800` escapes."""
    if not isinstance(value, str):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _is_int(value, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high
