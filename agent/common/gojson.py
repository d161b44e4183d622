"""JSON exactly as Go's encoding/json.Marshal writes it, so Go readers get the same bytes and hashes.

Compact, raw UTF-8, `<`, `>`, `&`, U+2028 and U+2029 escaped as \\u003c, \\u003e, \\u0026,
\\u2028, \\u2029. Go writes struct fields in declaration order and map keys sorted: pass dicts
in struct order, and `go_map(...)` for maps.
"""

from __future__ import annotations

import hashlib
import json

_ESCAPES = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def go_map(mapping: dict) -> dict:
    return {key: mapping[key] for key in sorted(mapping)}


def marshal(value) -> str:
    # Python already escapes quotes, backslashes and control characters the way Go 1.22+ does
    # (\b \f \n \r \t, else \u00xx); the characters above occur only inside strings, so a plain
    # replacement is exact.
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for raw, escaped in _ESCAPES:
        text = text.replace(raw, escaped)
    return text


def check_code(value) -> str:
    """The device plugin's CheckCode: hex SHA-256 of the Go JSON of `value`."""
    return hashlib.sha256(marshal(value).encode("utf-8")).hexdigest()
