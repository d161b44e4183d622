"""Record lines -> markers: TaskD's own format on the fast path, anything else validated line by line."""

from __future__ import annotations

import json
import random

from agent.steps.records import parse, text


def line(flag=16, source=0, ts=1_755_771_234_123_456_789, ident=1024, name="step 120", domain="default", pid=48213,
         **extra) -> bytes:
    record = {"Kind": 1, "Flag": flag, "SourceKind": source, "Timestamp": ts, "Id": ident,
              "MsptiObjectId": {"Pt": {"ProcessId": pid, "ThreadId": pid + 1}, "Ds": {"DeviceId": pid, "StreamId": pid + 1}},
              "Name": name, "Domain": domain, **extra}
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def test_taskd_lines_parse_to_marker_tuples():
    data = line() + line(32, 1, 1_755_771_234_987_654_321, 1024, "(null)", "(null)", 3)
    parsed = parse(data)
    assert parsed.errors == [] and parsed.other_kinds == 0
    assert parsed.markers == [(b"16", b"0", b"1755771234123456789", b"1024", b"48213", b"step 120", b"default"),
                              (b"32", b"1", b"1755771234987654321", b"1024", b"3", b"(null)", b"(null)")]


def test_a_communication_name_with_escaped_quotes_and_html_escapes_is_unescaped():
    name = '{"opName": "HcclAllReduce","groupName": "10.0.0.1%eth0_60000_0_1755771200"}'
    raw = line(name=name, domain="communication").replace(b"%", b"\\u0025")
    parsed = parse(raw)
    assert parsed.errors == [] and text(parsed.markers[0][5]) == name.encode() and parsed.markers[0][6] == b"communication"


def test_other_key_orders_take_the_slow_path_and_give_the_same_marker():
    reordered = {"Domain": "default", "Name": "forward", "Id": 7, "Timestamp": 5, "SourceKind": 1, "Flag": 16,
                 "Kind": 1, "MsptiObjectId": {"Pt": {"ProcessId": 9, "ThreadId": 9}}}
    parsed = parse(json.dumps(reordered).encode() + b"\n" + line(ident=8))
    assert [m[:6] for m in parsed.markers] == [(b"16", b"1", b"5", b"7", b"9", b"forward"),
                                               (b"16", b"0", b"1755771234123456789", b"8", b"48213", b"step 120")]


def test_bad_lines_are_reported_by_reason_and_the_good_ones_kept():
    data = b"".join([
        b"not json at all\n",
        b"[1, 2]\n",
        line()[:-1] + b"\n",
        b'{"Kind":1,"Flag":16,"SourceKind":0,"Id":3,"Name":"x","Domain":"default"}\n',  # no Timestamp
        b'{"Kind":1,"Flag":"16","SourceKind":0,"Timestamp":1,"Id":3,"Name":"x","Domain":"default"}\n',
        b'{"Kind":1,"Flag":16,"SourceKind":2,"Timestamp":1,"Id":3,"Name":"x","Domain":"default"}\n',
        b'{"Kind":1,"Flag":16,"SourceKind":0,"Timestamp":-1,"Id":3,"Name":"x","Domain":"default"}\n',
        b'{"Kind":1,"Flag":16,"SourceKind":0,"Timestamp":1,"Id":3,"Name":5,"Domain":"default"}\n',
        b'{"Kind":3,"Start":1,"End":2,"Pt":{"ProcessId":1,"ThreadId":1},"CorrelationId":1,"Name":"aclnnAdd"}\n',
        b"\n",
        b'{"Kind":"1"}\n',
        b'\xff\xfe{"Kind":1}\n',
    ])
    parsed = parse(data)
    assert [reason for reason, _ in parsed.errors] == [
        "not_json", "not_object", "missing_field", "bad_field", "bad_field", "bad_field", "bad_field", "bad_field",
        "not_json"]
    assert len(parsed.markers) == 1 and parsed.other_kinds == 1
    assert parsed.errors[0][1] == b"not json at all"


def test_an_overlong_bad_line_is_cut_in_the_report():
    parsed = parse(b"x" * 10_000 + b"\n")
    assert parsed.errors == [("not_json", b"x" * 200)]


def reference(raw: bytes) -> tuple | None:
    """What `json.loads` makes of a marker line: (flag, timestamp, name, domain), or None if it refuses it or a
    field is not what the writer writes (a number out of 0..2**64-1, a string that is not text)."""
    try:
        record = json.loads(raw.decode())
        name, domain = record["Name"].encode(), record["Domain"].encode()
    except (ValueError, RecursionError):  # UnicodeEncodeError: a lone surrogate from a \ud800 escape
        return None
    numbers = (record["Flag"], record["Timestamp"], record["Id"], record["MsptiObjectId"]["Pt"]["ProcessId"])
    if not all(type(n) is int and 0 <= n < 2**64 for n in numbers):
        return None
    return record["Flag"], record["Timestamp"], name, domain


def test_the_fast_path_accepts_only_what_json_loads_accepts_with_the_same_values():
    rng = random.Random(18)
    fine = [b"a", b"u", b"d", b"8", b"0", b"x", b"/", b"\x7f", b"\xc3\xa9", b"\\u0041", b"\\ud83d\\ude00", b"\\/",
            b'\\"', b"\\\\", b"\\n"]
    odd = [b"\\", b'"', b"\t", b"\xff", b"\xed\xa0\x80", b"\\ud800", b"\\udc00", b"\\x41", b"\\uZZZZ", b"\\U0041"]
    numbers = [b"0", b"00", b"01", b"7", b"-1", b"1e3", b"1.0", b"18446744073709551615", b"18446744073709551616",
               b"99999999999999999999", b"0x10"]
    good = line(name="forward")
    for _ in range(3000):
        raw = line(name="NAME", domain="DOMAIN", ts=111, flag=2, pid=222)[:-1]
        for placeholder in (b"NAME", b"DOMAIN"):
            raw = raw.replace(placeholder, b"".join(rng.choice(odd if rng.random() < 0.05 else fine)
                                                    for _ in range(rng.randint(0, 6))))
        for placeholder in (b"111", b"222", b":2,"):
            if rng.random() < 0.05:
                raw = raw.replace(placeholder, placeholder.replace(placeholder.strip(b":,"), rng.choice(numbers)))
        want = reference(raw)
        for parsed in (parse(raw + b"\n"), parse(good + raw + b"\n" + good)):  # alone, and among good lines
            got = [m for m in parsed.markers if m[5] != b"forward"]
            if want is None:
                assert got == [] and len(parsed.errors) == 1, raw
            else:
                [m] = got
                assert (int(m[0]), int(m[2]), text(m[5]), text(m[6])) == want, raw


def test_escapes_json_refuses_or_that_give_no_text_are_refused_and_the_other_lines_kept():
    bad = [line(name="a\\x41").replace(b"\\\\x41", b"\\x41"), line(name="\\uZZZZ").replace(b"\\\\uZZZZ", b"\\uZZZZ"),
           line(name="\ud800", ident=3), line(name="\t"), line(ts=7).replace(b'"Timestamp":7', b'"Timestamp":07'),
           b"[" * 200_000 + b"\n"]
    assert bad[2].count(b"\\ud800") == 1 and bad[3].count(b"\\t") == 1
    bad[3] = bad[3].replace(b"\\t", b"\t")
    parsed = parse(line(ident=1) + b"".join(bad) + line(ident=2))
    assert [m[3] for m in parsed.markers] == [b"1", b"2"]
    assert [reason for reason, _ in parsed.errors] == ["not_json", "not_json", "bad_field", "not_json", "not_json",
                                                       "not_json"]
