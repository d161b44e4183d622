"""MSPTI activity records -> TaskD's on-disk JSON lines, byte for byte (pure).

TaskD prints each record with Go's `json.Marshal` of a struct without tags: the
keys are the Go field names in declaration order, compact, one object per line. Strings come from C
(`const char *`, raw bytes) and are escaped exactly as Go 1.22+ `encoding/json` does with HTML
escaping on:

* `"` -> `\\"`, `\\` -> `\\\\`; `\\n \\r \\t \\b \\f` short forms; other bytes < 0x20 -> `\\u00xx` (lowercase hex);
* `<` `>` `&` -> `\\u003c \\u003e \\u0026`; U+2028 / U+2029 -> `\\u2028` / `\\u2029`;
* every byte that is not part of valid UTF-8 -> `\\ufffd` (one per byte, as Go's `DecodeRune` steps
  one byte on an error); valid UTF-8 is copied as it is.

A string with a backslash that makes `"` + raw + `"` a valid JSON string literal (RFC 8259: UTF-8,
no control characters, no bare `"`, only the escapes `\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX`) is
*decoded* first, as TaskD's snprintf -> `json.Unmarshal` -> `json.Marshal` round trip does: torch_npu's
HCCL names arrive with their quotes pre-escaped (`{\\"opName\\":...}`) and are written as the JSON text
`{"opName":...}`. `\\uXXXX` surrogate pairs make one character, a lone surrogate is U+FFFD (Go's
rules). Any other string is escaped byte for byte; for a string without a backslash both read the same.

A NULL `name`/`domain` (None here) is printed as `"NULL"`, as TaskD's `Marshal()` does.
The native collector (`native/`) implements the same rules; the two must stay identical.
"""

from __future__ import annotations

import re

KIND_MARKER, KIND_KERNEL, KIND_API = 1, 2, 3
NULL = b"NULL"

_SHORT = {0x08: "\\b", 0x09: "\\t", 0x0A: "\\n", 0x0C: "\\f", 0x0D: "\\r", 0x22: '\\"', 0x5C: "\\\\",
          0x3C: "\\u003c", 0x3E: "\\u003e", 0x26: "\\u0026", 0x2028: "\\u2028", 0x2029: "\\u2029"}
# Characters to rewrite: controls, quote, backslash, HTML, the JS line separators, and the lone
# surrogates U+DC80..U+DCFF that `surrogateescape` puts where a byte is not valid UTF-8.
_NEEDS = re.compile("[\x00-\x1f\"\\\\<>&\u2028\u2029\udc80-\udcff]")
_ASCII_NEEDS = re.compile(rb'[\x00-\x1f"\\<>&\x80-\xff]')


def _replace(match: re.Match) -> str:
    code = ord(match.group())
    short = _SHORT.get(code)
    if short is not None:
        return short
    if code >= 0xDC80:
        return "\\ufffd"
    return "\\u%04x" % code


_LITERAL = re.compile(rb'(?:[^"\\\x00-\x1f]|\\["\\\\/bfnrt]|\\u[0-9a-fA-F]{4})*')
_ESCAPES = re.compile(r"\\u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})|\\u([0-9a-fA-F]{4})|\\(.)")
_UNESCAPE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _unescape(match: re.Match) -> str:
    high, low, unit, char = match.groups()
    if high is not None:
        return chr(0x10000 + ((int(high, 16) - 0xD800) << 10) + (int(low, 16) - 0xDC00))
    if unit is not None:
        code = int(unit, 16)
        return "\ufffd" if 0xD800 <= code <= 0xDFFF else chr(code)
    return _UNESCAPE[char]


def _decoded(raw: bytes) -> str | None:
    """The text of the JSON string literal `"raw"` as Go's json.Unmarshal reads it, or None when
    that is not a valid literal."""
    if _LITERAL.fullmatch(raw) is None:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return _ESCAPES.sub(_unescape, text)


def escape(raw: bytes) -> bytes:
    """The content of a Go JSON string (without the quotes) for the C string `raw`."""
    if _ASCII_NEEDS.search(raw) is None:  # plain printable ASCII: the common case
        return raw
    text = _decoded(raw) if b"\\" in raw else None
    if text is None:
        text = raw.decode("utf-8", "surrogateescape")
    return _NEEDS.sub(_replace, text).encode("utf-8")


def quote(raw: bytes | None) -> bytes:
    """`"..."` for a C string; None (a NULL pointer) is `"NULL"`."""
    return b'"' + (NULL if raw is None else escape(raw)) + b'"'


def marker_line(flag: int, source_kind: int, timestamp: int, ident: int, a: int, b: int,
                name: bytes | None, domain: bytes | None, kind: int = KIND_MARKER) -> bytes:
    """One `MsptiActivityMark` line; `a`, `b` are the 8-byte object-id union, printed as Pt and Ds."""
    return b'{"Kind":%d,"Flag":%d,"SourceKind":%d,"Timestamp":%d,"Id":%d,"MsptiObjectId":{"Pt":{"ProcessId":%d,' \
           b'"ThreadId":%d},"Ds":{"DeviceId":%d,"StreamId":%d}},"Name":%s,"Domain":%s}\n' % (
               kind, flag, source_kind, timestamp, ident, a, b, a, b, quote(name), quote(domain))


def api_line(start: int, end: int, process_id: int, thread_id: int, correlation_id: int,
             name: bytes | None, kind: int = KIND_API) -> bytes:
    """One `MsptiActivityApi` line."""
    return b'{"Kind":%d,"Start":%d,"End":%d,"Pt":{"ProcessId":%d,"ThreadId":%d},"CorrelationId":%d,"Name":%s}\n' % (
        kind, start, end, process_id, thread_id, correlation_id, quote(name))


def kernel_line(start: int, end: int, device_id: int, stream_id: int, correlation_id: int,
                type_: bytes | None, name: bytes | None, kind: int = KIND_KERNEL) -> bytes:
    """One `MsptiActivityKernel` line."""
    return (b'{"Kind":%d,"Start":%d,"End":%d,"Ds":{"DeviceId":%d,"StreamId":%d},"CorrelationId":%d,'
            b'"Type":%s,"Name":%s}\n' % (kind, start, end, device_id, stream_id, correlation_id,
                                          quote(type_), quote(name)))
