"""The profilingSwitch file -> (default_on, comm_on), with TaskD's rules (pure).

TaskD reads at most 1 MiB and `json.Unmarshal`s it into
`ProfilingSwitch{CommunicationOperator, Step, SaveCheckpoint, FP, DataLoader string}`:

* keys match the field names case-insensitively (Go's fold: ASCII letters, plus U+017F `ſ` ~ `S`
  and U+212A (Kelvin sign) ~ `K`); a later duplicate key wins; unknown keys are ignored;
* a JSON `null` (the whole document or a field's value) leaves the field as it was (`""`);
* any syntax error, a document that is not an object, or a non-string value for a known field is
  an error: the caller keeps its previous state;
* `default_on = not (all five == "off")` (a missing key is `""`, i.e. not off);
  `comm_on = CommunicationOperator == "on"`.
"""

from __future__ import annotations

import json

MAX_BYTES = 1 << 20
FIELDS = ("CommunicationOperator", "Step", "SaveCheckpoint", "FP", "DataLoader")
_BY_FOLD = {name.upper(): name for name in FIELDS}
_FOLD_SPECIAL = str.maketrans({"\u017f": "S", "\u212a": "K"})

ALL_OFF = (False, False)


class _Invalid(ValueError):
    pass


def _fold(key: str) -> str | None:
    key = key.translate(_FOLD_SPECIAL)
    if not key.isascii():
        return None  # no other character folds onto an ASCII letter
    return key.upper()


def _reject_constant(name: str):
    raise _Invalid(f"not JSON: {name}")  # NaN, Infinity: Python extensions that Go rejects


def _fields(pairs: list[tuple[str, object]]) -> dict:
    return {"__pairs__": pairs}


def parse_switch(data: bytes) -> tuple[bool, bool] | None:
    """(default_on, comm_on) for the first MAX_BYTES of a switch file, or None when TaskD would fail."""
    data = data[:MAX_BYTES]
    # Go replaces invalid UTF-8 inside strings with U+FFFD; anywhere else it is a syntax error either way.
    text = data.decode("utf-8", "replace")
    try:
        doc = json.loads(text, object_pairs_hook=_fields, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    values = dict.fromkeys(FIELDS, "")
    if doc is None:
        pass  # `null` into a struct: no error, nothing set
    elif isinstance(doc, dict):
        for key, value in doc["__pairs__"]:
            folded = _fold(key)
            name = _BY_FOLD.get(folded) if folded is not None else None
            if name is None:
                continue
            if value is None:
                continue
            if not isinstance(value, str):
                return None
            values[name] = value
    else:
        return None
    default_on = not all(values[name] == "off" for name in FIELDS)
    comm_on = values["CommunicationOperator"] == "on"
    return default_on, comm_on
