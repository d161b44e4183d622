"""agent.worker.jsonlines: Go encoding/json escaping of C strings and TaskD's record lines, byte for byte."""

from __future__ import annotations

import json

import pytest

from agent.steps import records
from agent.worker.jsonlines import api_line, escape, kernel_line, marker_line, quote


@pytest.mark.parametrize("raw, expected", [
    (b"", b""),
    (b"step 120", b"step 120"),
    (b"forward", b"forward"),
    (b'a"b', b'a\\"b'),
    (b"a\\b", b"a\\b"),  # \b is a valid JSON escape: decoded (a backspace) and written back as \b
    (b"a\\c", b"a\\\\c"),  # \c is not: the backslash is escaped
    (b'\\"', b'\\"'),  # an already escaped quote (torch_npu's HCCL names) is decoded, then encoded again
    (b'\\" "', b'\\\\\\" \\"'),  # ...unless the string is no JSON literal (a bare quote): escaped as it is
    (b"\n\r\t\b\f", b"\\n\\r\\t\\b\\f"),
    (b"\x00\x01\x1f", b"\\u0000\\u0001\\u001f"),
    (b"\x0b\x0e\x1a\x1b", b"\\u000b\\u000e\\u001a\\u001b"),  # lowercase hex
    (b" ~\x7f", b" ~\x7f"),  # space, tilde and DEL are not escaped
    (b"<a href='x'>&</a>", b"\\u003ca href='x'\\u003e\\u0026\\u003c/a\\u003e"),
    (b"'", b"'"),
    (b"/", b"/"),
    ("é".encode(), "é".encode()),  # valid UTF-8 is copied
    ("日本語".encode(), "日本語".encode()),
    ("😀".encode(), "😀".encode()),  # 4-byte sequence
    ("\u2028x\u2029".encode(), b"\\u2028x\\u2029"),
    ("\u2027\u202a".encode(), "\u2027\u202a".encode()),  # the neighbours are not escaped
    ("\ufffd".encode(), "\ufffd".encode()),  # a real U+FFFD is copied
    (b"\xff", b"\\ufffd"),
    (b"a\x80b", b"a\\ufffdb"),
    (b"\xc3", b"\\ufffd"),  # truncated 2-byte sequence at the end
    (b"\xe2\x82", b"\\ufffd\\ufffd"),  # truncated 3-byte sequence: one per byte, as Go
    (b"\xe2\x82x", b"\\ufffd\\ufffdx"),
    (b"\xf0\x9f\x98", b"\\ufffd\\ufffd\\ufffd"),
    (b"\xc0\xaf", b"\\ufffd\\ufffd"),  # overlong encoding of '/'
    (b"\xe0\x80\xaf", b"\\ufffd\\ufffd\\ufffd"),  # overlong 3-byte
    (b"\xed\xa0\x80", b"\\ufffd\\ufffd\\ufffd"),  # an encoded surrogate (U+D800)
    (b"\xf4\x90\x80\x80", b"\\ufffd\\ufffd\\ufffd\\ufffd"),  # above U+10FFFF
    (b"\xf5\x80", b"\\ufffd\\ufffd"),
    (b"\xc3\xa9\xff\xc3\xa9", "é".encode() + b"\\ufffd" + "é".encode()),
    (b'\xff"<\n', b'\\ufffd\\"\\u003c\\n'),
    (b"\xe2\x80\xa8\xe2\x80", b"\\u2028\\ufffd\\ufffd"),
])
def test_escape(raw, expected):
    assert escape(raw) == expected


def test_escape_every_single_byte():
    """Each byte alone: the control characters, the specials, ASCII as is, every high byte invalid."""
    short = {0x08: b"\\b", 0x09: b"\\t", 0x0A: b"\\n", 0x0C: b"\\f", 0x0D: b"\\r", 0x22: b'\\"', 0x5C: b"\\\\",
             0x3C: b"\\u003c", 0x3E: b"\\u003e", 0x26: b"\\u0026"}
    for byte in range(256):
        raw = bytes([byte])
        if byte in short:
            expected = short[byte]
        elif byte < 0x20:
            expected = b"\\u00" + b"%02x" % byte
        elif byte < 0x80:
            expected = raw
        else:
            expected = b"\\ufffd"
        assert escape(raw) == expected, byte


def test_escaped_valid_utf8_round_trips_through_json():
    raw = 'a"b\\c\n\x01<>&\u2028é😀'.encode()
    assert json.loads(b'"' + escape(raw) + b'"') == raw.decode()


def test_quote_null_is_the_string_null():
    assert quote(None) == b'"NULL"'
    assert quote(b"") == b'""'
    assert quote(b"x") == b'"x"'


def test_marker_line_is_taskd_format():
    line = marker_line(16, 0, 1755771234123456789, 1024, 48213, 48230, b"step 120", b"default")
    assert line == (b'{"Kind":1,"Flag":16,"SourceKind":0,"Timestamp":1755771234123456789,"Id":1024,'
                    b'"MsptiObjectId":{"Pt":{"ProcessId":48213,"ThreadId":48230},"Ds":{"DeviceId":48213,'
                    b'"StreamId":48230}},"Name":"step 120","Domain":"default"}\n')


def test_marker_line_nulls_and_extremes():
    line = marker_line(32, 1, 18446744073709551615, 18446744073709551615, 4294967295, 0, None, None)
    assert line == (b'{"Kind":1,"Flag":32,"SourceKind":1,"Timestamp":18446744073709551615,'
                    b'"Id":18446744073709551615,"MsptiObjectId":{"Pt":{"ProcessId":4294967295,"ThreadId":0},'
                    b'"Ds":{"DeviceId":4294967295,"StreamId":0}},"Name":"NULL","Domain":"NULL"}\n')


def test_marker_line_negative_int32_flag():
    line = marker_line(-1, 0, 0, 0, 0, 0, b"", b"")
    assert line.startswith(b'{"Kind":1,"Flag":-1,"SourceKind":0,"Timestamp":0,"Id":0,')
    assert line.endswith(b'"Name":"","Domain":""}\n')


def test_marker_line_hccl_name_with_escaped_quotes():
    """torch_npu's pre-escaped HCCL name comes out as TaskD writes it: the JSON text FD-OL unmarshals."""
    name = b'{\\"opName\\": \\"HcclAllReduce\\",\\"count\\": \\"4\\"}'
    line = marker_line(2, 0, 5, 7, 1, 2, name, b"communication")
    assert b'"Name":"{\\"opName\\": \\"HcclAllReduce\\",\\"count\\": \\"4\\"}",' in line
    assert json.loads(json.loads(line)["Name"]) == {"opName": "HcclAllReduce", "count": "4"}


@pytest.mark.parametrize("raw, expected", [
    (b'{\\"opName\\":\\"hcom_allReduce_1\\"}', b'{\\"opName\\":\\"hcom_allReduce_1\\"}'),
    (b"C:\\temp", b"C:\\temp"),  # \t is a valid escape: decoded to a tab, which Go writes as \t
    (b"C:\\Users\\data", b"C:\\\\Users\\\\data"),  # \U is not: the bytes as they are
    (b"a\\nb", b"a\\nb"),  # backslash-n decodes to a newline
    (b"caf\\u00e9", "café".encode()),
    (b"\\u00E9\\u00e9", "éé".encode()),  # upper- or lowercase hex
    (b"\\ud83d\\ude00", "😀".encode()),  # a surrogate pair
    (b"\\ud800", "\ufffd".encode()),  # lone surrogates: U+FFFD, written as it is (valid UTF-8)
    (b"\\udc00\\ud800x", "\ufffd\ufffdx".encode()),
    (b"\\ud800\\ud83d\\ude00", "\ufffd😀".encode()),  # a high one not followed by a low one stands alone
    (b"\\u003c\\u0026\\u0000\\u001f\\u2028", b"\\u003c\\u0026\\u0000\\u001f\\u2028"),  # re-encoded by Go's rules
    (b"\\/\\b\\f\\r\\t\\\\", b"/\\b\\f\\r\\t\\\\"),
    (b"\\u0041<", b"A\\u003c"),
    ("é\\n".encode(), "é\\n".encode()),
    (b"\\x", b"\\\\x"),  # invalid escape
    (b"\\u12g4", b"\\\\u12g4"),
    (b"\\u12", b"\\\\u12"),
    (b"end\\", b"end\\\\"),  # a trailing backslash
    (b"a\\n\tb", b"a\\\\n\\tb"),  # a raw control character: no JSON literal
    (b"a\\n\xff", b"a\\\\n\\ufffd"),  # invalid UTF-8: no JSON literal
    (b'"\\n', b'\\"\\\\n'),  # a bare quote: no JSON literal
])
def test_json_literal_names_are_decoded_like_taskd(raw, expected):
    assert escape(raw) == expected
    text = json.loads(b'"' + escape(raw) + b'"')
    try:
        assert text == json.loads(b'"' + raw + b'"').encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    except ValueError:  # not a literal: the bytes themselves come back
        assert text == raw.decode("utf-8", "replace")


def test_marker_lines_parse_with_the_agents_reader():
    names = [b"step 1", None, b'quote " and \\ back', b"<html>&", b"\xff\xfe bad", "日本".encode(), b"tab\there"]
    data = b"".join(marker_line(2, 0, 10 + i, i, 1, 2, name, b"default") for i, name in enumerate(names))
    parsed = records.parse(data)
    assert parsed.errors == []
    assert len(parsed.markers) == len(names)
    assert [records.text(m[records.NAME]) for m in parsed.markers] == [
        b"step 1", b"NULL", b'quote " and \\ back', b"<html>&", "\ufffd\ufffd bad".encode(), "日本".encode(),
        b"tab\there"]


def test_api_line():
    assert api_line(100, 200, 7, 8, 9, b"aclnnAdd") == (
        b'{"Kind":3,"Start":100,"End":200,"Pt":{"ProcessId":7,"ThreadId":8},"CorrelationId":9,'
        b'"Name":"aclnnAdd"}\n')
    assert api_line(0, 0, 0, 0, 0, None).endswith(b'"Name":"NULL"}\n')


def test_kernel_line():
    assert kernel_line(100, 200, 3, 4, 9, b"KERNEL_AICORE", b"Add<float>") == (
        b'{"Kind":2,"Start":100,"End":200,"Ds":{"DeviceId":3,"StreamId":4},"CorrelationId":9,'
        b'"Type":"KERNEL_AICORE","Name":"Add\\u003cfloat\\u003e"}\n')
    assert kernel_line(0, 0, 0, 0, 0, None, None).endswith(b'"Type":"NULL","Name":"NULL"}\n')


def test_api_and_kernel_lines_count_as_other_kinds():
    parsed = records.parse(api_line(1, 2, 3, 4, 5, b"x") + kernel_line(1, 2, 3, 4, 5, b"t", b"n"))
    assert parsed.errors == [] and parsed.other_kinds == 2
