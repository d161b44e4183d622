"""A TaskNet `Message` as it travels through the proxy: the header parsed, the body left as bytes.

The proxy routes by the header alone. Parsing the body (up to 8 MiB) into a protobuf object and
serialising it again for the next hop costs a copy each way and most of the CPU of a relay, so a
message stays in its wire form: the header field is found by walking the top-level fields, and the
original bytes are sent on unless the proxy changed the header (a normalised destination, sync
turned off for a broadcast).
"""

from __future__ import annotations

from agent._proto import tasknet_pb2 as pb

HEADER_FIELD = 1
_HEADER_TAG = (HEADER_FIELD << 3) | 2  # field 1, length-delimited


class Malformed(ValueError):
    pass


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise Malformed("truncated or overlong varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(data: bytes):
    """(field number, start of the field, start of its payload, end) for each top-level field."""
    at = 0
    while at < len(data):
        start = at
        tag, at = _varint(data, at)
        kind = tag & 7
        if kind == 0:
            _, at = _varint(data, at)
            payload = at
        elif kind == 1:
            payload, at = at, at + 8
        elif kind == 5:
            payload, at = at, at + 4
        elif kind == 2:
            length, payload = _varint(data, at)
            at = payload + length
        else:
            raise Malformed(f"wire type {kind} is not used by TaskNet")
        if at > len(data):
            raise Malformed("a field runs past the end of the message")
        yield tag >> 3, start, payload, at


class Frame:
    """One message; `header` may be changed in place, `wire()` gives the bytes to send on."""

    __slots__ = ("raw", "header", "_header_bytes", "_spans")

    def __init__(self, raw: bytes):
        self.raw = raw
        self.header: pb.MessageHeader | None = None
        headers, spans = [], []
        for number, start, payload, end in _fields(raw):
            if number == HEADER_FIELD:
                headers.append(raw[payload:end])
                spans.append((start, end))
        if headers:
            self._header_bytes = b"".join(headers)  # protobuf merges repeated occurrences
            try:
                self.header = pb.MessageHeader.FromString(self._header_bytes)
            except Exception as exc:  # protobuf's DecodeError
                raise Malformed(f"header does not parse: {exc}") from None
        else:
            self._header_bytes = b""
        self._spans = spans

    @property
    def uuid(self) -> str:
        return self.header.uuid if self.header is not None else ""

    def wire(self) -> bytes:
        if self.header is None:
            return self.raw
        encoded = self.header.SerializeToString()
        if encoded == self._header_bytes and len(self._spans) == 1:
            return self.raw
        parts, at = [], 0
        for start, end in self._spans:  # drop every old header occurrence, keep the rest as it was
            parts.append(self.raw[at:start])
            at = end
        parts.append(self.raw[at:])
        return _encode_header(encoded) + b"".join(parts)


def _encode_header(encoded: bytes) -> bytes:
    out = bytearray([_HEADER_TAG])
    length = len(encoded)
    while length >= 0x80:
        out.append((length & 0x7F) | 0x80)
        length >>= 7
    out.append(length)
    return bytes(out) + encoded
