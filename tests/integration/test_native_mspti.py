"""agent._native.Collector against the fake libmspti.so (testkit/fakes/mspti), in this process.

Nothing here is skipped: CI builds the extension with `pip install -e .`, so an import failure is
a test failure that carries the reason."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from testkit import REPO
from testkit.fakes.mspti import load_fake_mspti
from testkit.wait import wait_until

try:
    import agent._native as native

    IMPORT_ERROR = None
except Exception as exc:  # noqa: BLE001 - reported by the tests below
    native = None
    IMPORT_ERROR = exc

MARKER, KERNEL, API, MEMORY = 1, 2, 3, 5
MARKER_KEYS = ["Kind", "Flag", "SourceKind", "Timestamp", "Id", "MsptiObjectId", "Name", "Domain"]
API_KEYS = ["Kind", "Start", "End", "Pt", "CorrelationId", "Name"]
KERNEL_KEYS = ["Kind", "Start", "End", "Ds", "CorrelationId", "Type", "Name"]
COUNTER_KEYS = {"records", "bytes", "buffers_requested", "buffers_declined", "buffers_completed",
                "records_dropped", "records_skipped", "complete_ns", "complete_max_ns"}
TS_BASE = 1755771234000000000  # the fake's timestamps: TS_BASE + id * 1000


JSON_LITERAL = re.compile(rb'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')


def taskd_text(raw: bytes) -> str | None:
    """What TaskD's json.Unmarshal makes of `"raw"` (Go replaces lone surrogates with U+FFFD), or
    None when that is not a valid JSON string literal (RFC 8259, UTF-8)."""
    if JSON_LITERAL.fullmatch(raw) is None:
        return None
    try:
        text = json.loads(b'"' + raw + b'"')
    except ValueError:  # not UTF-8
        return None
    return re.sub("[\ud800-\udfff]", "\ufffd", text)


def go_encode(text: str) -> str:
    """Go encoding/json (1.22+, HTML escaping) of a valid string."""
    short = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f",
             "\u2028": "\\u2028", "\u2029": "\\u2029"}
    return '"' + "".join(short.get(ch) or (f"\\u{ord(ch):04x}" if ch < " " or ch in "<>&" else ch)
                         for ch in text) + '"'


def go_string(raw: bytes | None) -> str:
    """How a C string ends up on disk: a valid JSON literal decoded then Go-encoded (TaskD's
    Unmarshal/Marshal round trip), anything else Go-encoded byte for byte; None -> "NULL"."""
    if raw is None:
        return '"NULL"'
    text = taskd_text(raw)
    if text is not None:
        return go_encode(text)
    out, i = ['"'], 0
    while i < len(raw):
        c = raw[i]
        if c < 0x80:
            out.append(go_encode(chr(c))[1:-1])
            i += 1
            continue
        for n in (2, 3, 4):
            try:
                ch = raw[i:i + n].decode("utf-8")
            except UnicodeDecodeError:
                continue
            out.append(go_encode(ch)[1:-1])
            i += n
            break
        else:
            out.append("\\ufffd")  # Go: each invalid byte on its own
            i += 1
    out.append('"')
    return "".join(out)


def marker_line(id_: int, name: bytes | None, domain: bytes | None, flag: int, source: int, a: int, b: int) -> bytes:
    return (f'{{"Kind":1,"Flag":{flag},"SourceKind":{source},"Timestamp":{TS_BASE + id_ * 1000},"Id":{id_},'
            f'"MsptiObjectId":{{"Pt":{{"ProcessId":{a},"ThreadId":{b}}},"Ds":{{"DeviceId":{a},"StreamId":{b}}}}},'
            f'"Name":{go_string(name)},"Domain":{go_string(domain)}}}\n').encode("utf-8")


@pytest.fixture(scope="session")
def fake(fake_mspti_path):
    return fake_mspti_path, load_fake_mspti(fake_mspti_path)


@pytest.fixture
def lib(fake):
    lib = fake[1]
    lib.fake_mspti_reset()
    yield lib
    lib.fake_mspti_wait_idle()


@pytest.fixture
def open_collector(fake, lib):
    """open_collector(**kw) -> a Collector on the fake; closed after the test."""
    if native is None:
        pytest.fail(f"agent._native failed to import: {IMPORT_ERROR!r}")
    made = []

    def open_(**kw):
        c = native.Collector(str(fake[0]), **kw)
        made.append(c)
        return c

    yield open_
    for c in made:
        c.close()


def settle(c, lib) -> bytes:
    lib.fake_mspti_wait_idle()
    c.flush()
    return c.drain()


def parse(data: bytes) -> list:
    assert data == b"" or data.endswith(b"\n")
    return [json.loads(line) for line in data.splitlines()]


def test_extension_imports():
    assert native is not None, f"agent._native failed to import (CI builds it): {IMPORT_ERROR!r}"
    assert hasattr(native, "Collector")


def test_every_record_exactly_once_in_taskd_key_order(open_collector, lib):
    c = open_collector(buffers=8, buffer_bytes=4096)
    c.set_switch(True, True)
    first = lib.fake_mspti_next_id()
    streams = [(20000, b"step 1", b"default", 16, 0), (5000, b'{"opName":"HcclAllReduce"}', b"communication", 2, 0),
               (3000, None, None, 32, 1), (2000, b"dataloader", b"default", 4, 0)]
    for count, name, domain, flag, source in streams:
        assert lib.fake_mspti_emit(count, name, domain, flag, source) == 0
    chunks = []
    while lib.fake_mspti_emitted() + lib.fake_mspti_dropped() < sum(s[0] for s in streams):
        chunks.append(c.drain())  # drain concurrently with the callbacks
    chunks.append(settle(c, lib))
    data = b"".join(chunks)
    assert lib.fake_mspti_dropped() == 0
    lines = data.splitlines()
    assert len(lines) == lib.fake_mspti_emitted() == 30000
    ids = []
    for line in lines:
        pairs = json.loads(line, object_pairs_hook=list)
        assert [k for k, _ in pairs] == MARKER_KEYS
        rec = dict(pairs)
        obj = rec["MsptiObjectId"]
        assert [k for k, _ in obj] == ["Pt", "Ds"]
        pt, ds = dict(obj)["Pt"], dict(obj)["Ds"]
        assert [k for k, _ in pt] == ["ProcessId", "ThreadId"] and [k for k, _ in ds] == ["DeviceId", "StreamId"]
        assert [v for _, v in pt] == [v for _, v in ds]
        assert rec["Timestamp"] == TS_BASE + rec["Id"] * 1000
        ids.append(rec["Id"])
    assert len(set(ids)) == len(ids)
    assert set(ids) == set(range(first, lib.fake_mspti_next_id()))
    counters = c.counters()
    assert set(counters) == COUNTER_KEYS
    assert counters["records"] == 30000 and counters["bytes"] == len(data)
    assert counters["records_dropped"] == counters["records_skipped"] == counters["buffers_declined"] == 0
    assert counters["buffers_completed"] == counters["buffers_requested"] == lib.fake_mspti_completed()


NAMES = [
    b"step 120",
    b'say "hi"',
    b"back\\slash \\\" \\n",
    b"new\nline\r\ttab\bbs\fff",
    bytes(range(1, 32)) + b"\x7f",
    b'<a href="x">&amp;</a>',
    "naïve 日本語 🚀 ä".encode(),
    b"bad \xff\xfe \xc3 \xe2\x82 \xed\xa0\x80 \xf4\x90\x80\x80 \xc0\xaf \xe0\x80\x80 \xf0\x8f\xbf\xbf end\xe2",
    "line\u2028para\u2029".encode(),
    b"",
    None,
    b"{\\\"opName\\\": \\\"HcclAllReduce\\\",\\\"count\\\": \\\"4194304\\\"}",
    (b"0123456789<>&\"\\\xc3\xa9" * 8000)[: 100 * 1024],
]

# Names with a backslash: decoded when `"name"` is a valid JSON string literal (TaskD's
# Unmarshal/Marshal round trip), escaped byte for byte otherwise.
LITERAL_NAMES = [
    (b'{\\"opName\\":\\"hcom_allReduce_1\\"}', '"{\\"opName\\":\\"hcom_allReduce_1\\"}"'),  # torch_npu HCCL
    (b"C:\\temp", '"C:\\temp"'),  # \t is a valid escape: a tab, written back as \t
    (b"C:\\Users\\data", '"C:\\\\Users\\\\data"'),  # \U is not: faithful
    (b"a\\nb", '"a\\nb"'),  # a literal backslash-n is a newline
    (b"caf\\u00e9 \\u00E9", '"caf\u00e9 \u00e9"'),
    (b"\\ud83d\\ude00!", '"\U0001f600!"'),  # a surrogate pair is one character
    (b"x\\ud800y \\udc00\\ud800\\ud83d\\ude00", '"x\ufffdy \ufffd\ufffd\U0001f600"'),  # lone ones: U+FFFD
    (b"\\u003c\\u2028\\u0000\\/\\b\\f\\r\\\\", '"\\u003c\\u2028\\u0000/\\b\\f\\r\\\\"'),
    (b"<&> \\\"q\\\" \xc3\xa9\xe2\x80\xa9", '"\\u003c\\u0026\\u003e \\"q\\" \u00e9\\u2029"'),
    (b'say "x\\n"', '"say \\"x\\\\n\\""'),  # a bare quote: faithful
    (b"a\\nb\x01", '"a\\\\nb\\u0001"'),  # a control character: faithful
    (b"a\\n\xff", '"a\\\\n\\ufffd"'),  # invalid UTF-8: faithful
    (b"end\\", '"end\\\\"'),
    (b"\\u12", '"\\\\u12"'),
    (b"\\x41", '"\\\\x41"'),
]


def test_names_escaped_like_go_json(open_collector, lib):
    c = open_collector()
    c.set_switch(True, True)
    lib.fake_mspti_set_object_id(1, 48213, 48230)
    expected = []
    domains = [b"default", b"communication", None, b"d<o>m\"ain\n", b"\xff"]
    for i, name in enumerate(NAMES):
        domain = domains[i % len(domains)]
        id_ = lib.fake_mspti_next_id()
        assert lib.fake_mspti_emit(1, name, domain, 2, 0) == 0
        lib.fake_mspti_wait_idle()
        expected.append(marker_line(id_, name, domain, 2, 0, 48213, 48230))
    got = settle(c, lib)
    assert got.splitlines(keepends=True) == expected
    for line, name in zip(got.splitlines(), NAMES):
        rec = json.loads(line)
        if name is None:
            assert rec["Name"] == "NULL"
        elif b"\xff" not in name and b"\xc3 " not in name:
            assert rec["Name"] == taskd_text(name) or name.decode("utf-8")
    long_line = got.splitlines()[-1]
    assert len(long_line) > 100 * 1024


def test_json_literal_names_are_decoded_like_taskd(open_collector, lib):
    c = open_collector()
    c.set_switch(True, False)
    lib.fake_mspti_set_object_id(1, 1, 2)
    expected = []
    for name, encoded in LITERAL_NAMES:
        assert go_string(name) == encoded, name  # the oracle agrees with the table
        id_ = lib.fake_mspti_next_id()
        lib.fake_mspti_emit(1, name, b"default", 2, 0)
        lib.fake_mspti_wait_idle()
        expected.append(marker_line(id_, name, b"default", 2, 0, 1, 2))
    got = settle(c, lib)
    assert got.splitlines(keepends=True) == expected
    hccl = json.loads(got.splitlines()[0])["Name"]
    assert json.loads(hccl) == {"opName": "hcom_allReduce_1"}  # what FD-OL unmarshals


def test_byte_exact_lines(open_collector, lib):
    c = open_collector()
    c.set_switch(True, True)
    lib.fake_mspti_set_object_id(1, 48213, 48230)
    id_ = lib.fake_mspti_next_id()
    lib.fake_mspti_emit(1, b"step 120", b"default", 16, 0)
    lib.fake_mspti_wait_idle()
    lib.fake_mspti_set_object_id(1, 3, 2)
    lib.fake_mspti_emit(1, None, None, 32, 1)
    lib.fake_mspti_wait_idle()
    lib.fake_mspti_emit(1, b'a"b\\c\n\x01<&>\xe2\x80\xa8\xff\xc3\xa9', b"communication", 8, 1)
    got = settle(c, lib)
    t = TS_BASE + id_ * 1000
    assert got == (
        b'{"Kind":1,"Flag":16,"SourceKind":0,"Timestamp":%d,"Id":%d,"MsptiObjectId":{"Pt":{"ProcessId":48213,'
        b'"ThreadId":48230},"Ds":{"DeviceId":48213,"StreamId":48230}},"Name":"step 120","Domain":"default"}\n'
        b'{"Kind":1,"Flag":32,"SourceKind":1,"Timestamp":%d,"Id":%d,"MsptiObjectId":{"Pt":{"ProcessId":3,'
        b'"ThreadId":2},"Ds":{"DeviceId":3,"StreamId":2}},"Name":"NULL","Domain":"NULL"}\n'
        b'{"Kind":1,"Flag":8,"SourceKind":1,"Timestamp":%d,"Id":%d,"MsptiObjectId":{"Pt":{"ProcessId":3,'
        b'"ThreadId":2},"Ds":{"DeviceId":3,"StreamId":2}},"Name":"a\\"b\\\\c\\n\\u0001\\u003c\\u0026\\u003e'
        b'\\u2028\\ufffd\xc3\xa9","Domain":"communication"}\n'
        % (t, id_, t + 1000, id_ + 1, t + 2000, id_ + 2)
    )


def test_api_and_kernel_records(open_collector, lib):
    c = open_collector()
    c.set_switch(True, False)
    for kind in (API, KERNEL, MEMORY):
        assert lib.msptiActivityEnable(kind) == 0
    lib.fake_mspti_set_object_id(1, 7, 9)
    id_ = lib.fake_mspti_next_id()
    lib.fake_mspti_emit_kind(API, 2, b"aclnnAdd<fp16>", None, 0, 0)
    lib.fake_mspti_wait_idle()
    lib.fake_mspti_emit_kind(KERNEL, 1, b"Add_\"k\"", b"AI_CORE", 0, 1)
    lib.fake_mspti_wait_idle()
    lib.fake_mspti_emit_kind(KERNEL, 1, None, None, 0, 1)
    lib.fake_mspti_wait_idle()
    lib.fake_mspti_emit_kind(MEMORY, 3, b"x", None, 0, 0)
    lib.fake_mspti_wait_idle()
    lib.fake_mspti_emit(1, b"m", b"default", 1, 0)
    got = settle(c, lib)
    t = [TS_BASE + (id_ + k) * 1000 for k in range(4)]
    lines = got.splitlines(keepends=True)
    assert lines[:4] == [
        b'{"Kind":3,"Start":%d,"End":%d,"Pt":{"ProcessId":7,"ThreadId":9},"CorrelationId":%d,'
        b'"Name":"aclnnAdd\\u003cfp16\\u003e"}\n' % (t[0], t[0] + 500, id_),
        b'{"Kind":3,"Start":%d,"End":%d,"Pt":{"ProcessId":7,"ThreadId":9},"CorrelationId":%d,'
        b'"Name":"aclnnAdd\\u003cfp16\\u003e"}\n' % (t[1], t[1] + 500, id_ + 1),
        b'{"Kind":2,"Start":%d,"End":%d,"Ds":{"DeviceId":7,"StreamId":9},"CorrelationId":%d,"Type":"AI_CORE",'
        b'"Name":"Add_\\"k\\""}\n' % (t[2], t[2] + 500, id_ + 2),
        b'{"Kind":2,"Start":%d,"End":%d,"Ds":{"DeviceId":7,"StreamId":9},"CorrelationId":%d,"Type":"NULL",'
        b'"Name":"NULL"}\n' % (t[3], t[3] + 500, id_ + 3),
    ]
    assert [k for k, _ in json.loads(lines[0], object_pairs_hook=list)] == API_KEYS
    assert [k for k, _ in json.loads(lines[2], object_pairs_hook=list)] == KERNEL_KEYS
    assert len(lines) == 5 and json.loads(lines[4])["Name"] == "m"
    assert c.counters()["records_skipped"] == 3 and c.counters()["records"] == 5


def test_switch_semantics(open_collector, lib):
    c = open_collector()
    state = lib.fake_mspti_state
    assert c.set_switch(False, False) == (0, 0)
    assert state() & ((1 << 33) | (1 << 32) | (1 << MARKER)) == 0
    lib.fake_mspti_emit(100, b"step 1", b"default", 2, 0)
    lib.fake_mspti_emit(100, b"{}", b"communication", 2, 0)
    assert settle(c, lib) == b""
    assert lib.fake_mspti_filtered() == 200

    assert c.set_switch(True, False) == (1, 0)  # default on, comm off
    assert state() & (1 << 33) and state() & (1 << MARKER) and not state() & (1 << 32)
    lib.fake_mspti_emit(100, b"step 1", b"default", 2, 0)
    lib.fake_mspti_emit(100, b"{}", b"communication", 2, 0)
    recs = parse(settle(c, lib))
    assert len(recs) == 100 and {r["Domain"] for r in recs} == {"default"}

    assert c.set_switch(True, True) == (1, 1)  # subscribing again is skipped, comm on
    assert state() & (1 << 33) and state() & (1 << 32)
    lib.fake_mspti_emit(100, b"step 1", b"default", 2, 0)
    lib.fake_mspti_emit(100, b"{}", b"communication", 2, 0)
    recs = parse(settle(c, lib))
    assert len(recs) == 200 and sorted({r["Domain"] for r in recs}) == ["communication", "default"]

    assert lib.msptiActivityEnable(API) == 0 and lib.msptiActivityEnable(KERNEL) == 0
    assert c.set_switch(False, True) == (0, 1)  # off: MARKER, KERNEL, API disabled and unsubscribed
    s = state()
    assert s & ((1 << MARKER) | (1 << API) | (1 << KERNEL) | (1 << 33)) == 0 and s & (1 << 32)
    lib.fake_mspti_emit(100, b"{}", b"communication", 2, 0)
    assert settle(c, lib) == b""


def switch_scenario(c, lib) -> list:
    """Switch `c` through failures of every kind; each step's results and the fake's state after it."""
    steps = []

    def step(default_on, comm_on):
        steps.append((c.set_switch(default_on, comm_on), lib.fake_mspti_state()))

    step(True, False)
    lib.fake_mspti_set_foreign_subscriber(1)  # another profiler takes the slot once ours is free
    step(False, False)
    step(True, True)  # subscribe fails: the default domain is an exception, MARKER enabled all the same
    step(True, True)  # still not subscribed, so it is tried (and fails) again
    lib.fake_mspti_set_foreign_subscriber(0)
    step(True, True)
    lib.fake_mspti_set_result(b"msptiActivityEnableMarkerDomain", 999)
    step(True, True)
    lib.fake_mspti_set_result(b"msptiActivityEnableMarkerDomain", 0)
    lib.fake_mspti_set_result(b"msptiActivityDisable", 1)
    step(False, False)  # one failed disable: exception; the unsubscribe is still made
    lib.fake_mspti_set_result(b"msptiActivityDisable", 0)
    lib.fake_mspti_set_result(b"msptiActivityEnable", 4)
    step(True, False)
    lib.fake_mspti_set_result(b"msptiActivityEnable", 0)
    lib.fake_mspti_set_result(b"msptiUnsubscribe", 999)
    step(False, True)  # a failed unsubscribe: exception, and the handle counts as released
    lib.fake_mspti_set_result(b"msptiUnsubscribe", 0)
    lib.fake_mspti_set_result(b"msptiActivityDisableMarkerDomain", 1)
    step(False, False)
    lib.fake_mspti_set_result(b"msptiActivityDisableMarkerDomain", 0)
    return steps


def test_switch_results_match_the_python_collector(open_collector, lib, fake):
    from agent.worker.fallback import Collector as PythonCollector

    M, COMM, SUB, FOREIGN = 1 << MARKER, 1 << 32, 1 << 33, 1 << 34
    expected = [((1, 0), M | SUB), ((0, 0), FOREIGN), ((2, 1), M | COMM | FOREIGN), ((2, 1), M | COMM | FOREIGN),
                ((1, 1), M | COMM | SUB), ((1, 2), M | COMM | SUB), ((2, 0), M), ((2, 0), M | SUB),
                ((2, 1), SUB | COMM), ((0, 2), SUB | COMM)]  # (the fake's slot stays taken after the failed unsubscribe)
    assert lib.fake_mspti_set_result(b"msptiActivityFlushAll", 1) == -1  # only the switch functions
    python = PythonCollector(str(fake[0]))
    try:
        assert switch_scenario(python, lib) == expected
    finally:
        python.close()
    lib.fake_mspti_reset()
    assert switch_scenario(open_collector(), lib) == expected


def test_pool_exhaustion_declines_without_blocking(open_collector, lib):
    c = open_collector(buffers=2, buffer_bytes=128)  # two records per buffer
    c.set_switch(True, False)
    lib.fake_mspti_hold_completions(1)  # mspti sits on full buffers: the pool runs dry
    t0 = time.monotonic()
    lib.fake_mspti_emit(5000, b"step 1", b"default", 2, 0)
    lib.fake_mspti_wait_idle()
    assert time.monotonic() - t0 < 5
    counters = c.counters()
    assert counters["buffers_declined"] == lib.fake_mspti_declined() > 0
    assert counters["buffers_requested"] == lib.fake_mspti_requests()
    lib.fake_mspti_hold_completions(0)
    recs = parse(settle(c, lib))
    assert len(recs) == lib.fake_mspti_emitted() == 4
    assert lib.fake_mspti_emitted() + lib.fake_mspti_dropped() == 5000
    # The buffers came back: collection resumes.
    lib.fake_mspti_emit(10, b"step 2", b"default", 2, 0)
    assert len(parse(settle(c, lib))) == 10


def test_ring_full_drops_whole_records(open_collector, lib):
    c = open_collector(buffers=4, buffer_bytes=1024, ring_bytes=4096)
    c.set_switch(True, False)
    lib.fake_mspti_emit(500, "step ü".encode(), b"default", 2, 0)
    data = settle(c, lib)
    counters = c.counters()
    assert counters["records_dropped"] > 0
    assert counters["records"] + counters["records_dropped"] == lib.fake_mspti_emitted() == 500
    assert 0 < len(data) <= 4096 and len(parse(data)) == counters["records"]
    lib.fake_mspti_emit(5, b"after", b"default", 2, 0)
    assert [r["Name"] for r in parse(settle(c, lib))] == ["after"] * 5


def emit_lines(lib, n: int, name: bytes = b"step 7") -> list[bytes]:
    """n records with known bytes (fixed object id), one emitter at a time; their expected lines."""
    lib.fake_mspti_set_object_id(1, 5, 6)
    first = lib.fake_mspti_next_id()
    lib.fake_mspti_emit(n, name, b"default", 2, 0)
    lib.fake_mspti_wait_idle()
    return [marker_line(first + i, name, b"default", 2, 0, 5, 6) for i in range(n)]


def test_drain_to_writes_whole_lines_across_the_ring_wrap(open_collector, lib, tmp_path):
    c = open_collector(buffers=4, buffer_bytes=1024, ring_bytes=4096)  # ~19 lines: wraps every few rounds
    c.set_switch(True, False)
    expected = []
    with open(tmp_path / "out", "wb") as handle:
        for round_ in range(40):
            expected += emit_lines(lib, 1 + round_ % 7)
            c.flush()
            size = c.pending()
            assert c.drain_to(handle.fileno()) == (size, 1 + round_ % 7)
            assert c.pending() == 0
    assert (tmp_path / "out").read_bytes() == b"".join(expected)
    assert c.counters()["records_dropped"] == 0


def test_drain_to_max_bytes_pending_and_discard_cut_at_line_ends(open_collector, lib, tmp_path):
    c = open_collector()
    c.set_switch(True, False)
    lines = emit_lines(lib, 10)
    n = len(lines[0])
    assert all(len(line) == n for line in lines)
    c.flush()
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        assert c.pending() == 10 * n
        assert c.pending(3 * n + 5) == 3 * n and c.pending(n - 1) == 0 and c.pending(0) == 0
        assert c.drain_to(fd, 3 * n + 5) == (3 * n, 3)
        assert c.drain_to(fd, n - 1) == (0, 0)  # not even one line fits: nothing taken
        assert c.pending() == 7 * n
        assert c.discard(2 * n + n - 1) == (2 * n, 2)
        assert c.drain_to(fd, max_bytes=-1) == (5 * n, 5)
        assert c.drain_to(fd) == (0, 0) and c.discard() == (0, 0)
    finally:
        os.close(fd)
    assert (tmp_path / "out").read_bytes() == b"".join(lines[:3] + lines[5:])


def test_drain_to_errors_raise_oserror_and_drop_the_batch(open_collector, lib, tmp_path):
    c = open_collector()
    c.set_switch(True, False)
    lines = emit_lines(lib, 4)
    c.flush()
    (tmp_path / "ro").write_bytes(b"")
    fd = os.open(tmp_path / "ro", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            c.drain_to(fd)
    finally:
        os.close(fd)
    assert info.value.errno == errno.EBADF
    assert (info.value.written, info.value.size, info.value.lines) == (0, len(b"".join(lines)), 4)
    assert c.pending() == 0  # taken either way: a failed batch is never written twice
    emit_lines(lib, 3)
    c.flush()
    if os.path.exists("/dev/full"):
        with open("/dev/full", "wb") as full, pytest.raises(OSError) as info:
            c.drain_to(full)  # any object with fileno()
        assert info.value.errno == errno.ENOSPC and info.value.lines == 3
    with pytest.raises(TypeError):
        c.drain_to("not a file")
    with pytest.raises(ValueError):
        c.drain_to(-1)


def test_drain_to_partial_write_is_reported(open_collector, lib):
    c = open_collector()
    c.set_switch(True, False)
    lines = emit_lines(lib, 2000)  # ~430 KB, more than the pipe holds (64 KiB)
    c.flush()
    r, w = os.pipe()
    try:
        os.set_blocking(w, False)
        with pytest.raises(BlockingIOError) as info:
            c.drain_to(w)
        assert info.value.errno == errno.EAGAIN
        assert 0 < info.value.written < info.value.size == len(b"".join(lines))
        got = b""
        while len(got) < info.value.written:
            got += os.read(r, 1 << 16)
        assert got == b"".join(lines)[: info.value.written]
        assert c.pending() == 0
    finally:
        os.close(r)
        os.close(w)



PAGE = os.sysconf("SC_PAGE_SIZE")


def leave_room(fs, pages: int) -> None:
    """Fill the file system, then free `pages` pages: a longer write is cut short, the next fails (ENOSPC)."""
    fs.fill()
    filler = fs.path / ".filler"
    os.truncate(filler, filler.stat().st_size - pages * PAGE)


@pytest.mark.parametrize("cut", ["before the ring's end", "after the ring's end"])
def test_drain_to_cut_short_by_a_full_disk_reports_the_whole_lines_and_the_rest(open_collector, lib, small_fs, cut):
    """The line cut by a short write straddles the ring's end; the write stops before or after it."""
    cap = 64 * 1024
    c = open_collector(ring_bytes=cap)
    c.set_switch(True, False)
    long_name = b"n" * (5 * PAGE)
    ident = lib.fake_mspti_next_id()  # the sizes of the lines to come, near enough (checked below)
    short = len(marker_line(ident, b"step 7", b"default", 2, 0, 5, 6))
    long_size = len(marker_line(ident, long_name, b"default", 2, 0, 5, 6))
    # move the ring's tail so that the long line will straddle the ring's end in its middle
    skip = []
    while True:
        at = sum(len(line) for line in skip) % cap
        if at + 10 * short + long_size // 2 >= cap - short:
            break
        skip += emit_lines(lib, 1)
    c.flush()
    c.discard()
    batch = emit_lines(lib, 10) + emit_lines(lib, 1, long_name) + emit_lines(lib, 10)
    c.flush()
    data = b"".join(batch)
    whole = len(b"".join(batch[:10]))
    wrap = cap - at  # where in the batch the ring ends: inside the long line
    assert whole < wrap < whole + len(batch[10])
    pages = (wrap // PAGE if cut == "before the ring's end" else wrap // PAGE + 1)
    assert whole < pages * PAGE < whole + len(batch[10]) and (pages * PAGE < wrap) == (cut == "before the ring's end")
    out = small_fs.path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        leave_room(small_fs, pages)
        with pytest.raises(OSError) as info:
            c.drain_to(fd)
    finally:
        os.close(fd)
    e = info.value
    assert e.errno == errno.ENOSPC and (e.size, e.lines) == (len(data), 21)
    assert e.written == pages * PAGE and out.read_bytes() == data[:e.written]
    assert (e.whole, e.whole_lines) == (whole, 10)
    assert e.rest == batch[10][e.written - whole:]  # what completes the cut line
    assert c.pending() == 0


@pytest.mark.parametrize("truncatable", [True, False], ids=["truncated", "append-only file"])
def test_worker_never_leaves_a_partial_record_on_a_full_disk(open_collector, lib, small_fs, tmp_path, truncatable):
    from agent.worker.runtime import Worker

    c = open_collector()
    (tmp_path / "switch").write_text('{"Step":"on"}')
    w = Worker(0, 5000, c, root=str(small_fs.path / "p"), job="j", switch_path=str(tmp_path / "switch"),
               interval=3600, clock=lambda: 1_755_771_234)
    w.tick()  # applies the switch
    first = emit_lines(lib, 20)
    w.tick()
    target = small_fs.path / "p" / "j" / "0" / "1755771234"
    if not truncatable:
        done = subprocess.run(["chattr", "+a", str(target)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"this file system cannot make a file append-only: {done.stderr.strip()}")
    try:
        leave_room(small_fs, 2)
        before, long = emit_lines(lib, 10), emit_lines(lib, 1, b"n" * 5 * PAGE)
        emit_lines(lib, 10)
        w.tick()
        data = target.read_bytes()
        kept = b"".join(first + before)
        s = w.stats()
        assert s["records_written"] == 30 and s["write_errors"] == 1
        if truncatable:
            assert data == kept and s["records_dropped_error"] == 11
        else:  # the partial record stays until it can be completed; nothing is glued to it
            assert (kept + long[0]).startswith(data) and len(kept) < len(data) < len(kept + long[0])
            assert s["records_dropped_error"] == 10
            emit_lines(lib, 3)
            w.tick()
            assert target.read_bytes() == data and w.stats()["records_dropped_error"] == 13
        small_fs.free()
        last = emit_lines(lib, 5)
        w.tick()
        w.stop()
    finally:
        subprocess.run(["chattr", "-a", str(target)], capture_output=True)
    expected = kept + (b"" if truncatable else long[0]) + b"".join(last)
    assert target.read_bytes() == expected  # every line whole
    s = w.stats()
    assert s["records_written"] == expected.count(b"\n") == 35 + (not truncatable)
    assert s["bytes_written"] == len(expected)


def test_drain_to_survives_signals_while_blocked(open_collector, lib):
    """A blocking write interrupted by signals (EINTR, short writes) goes on where it stopped."""
    c = open_collector()
    c.set_switch(True, False)
    data = b"".join(emit_lines(lib, 2000))  # ~430 KB through a pipe that holds 64 KB
    c.flush()
    r, w = os.pipe()
    result = []
    old = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        writer = threading.Thread(target=lambda: result.append(c.drain_to(w)))
        writer.start()
        got = bytearray()
        while len(got) < len(data):
            if writer.is_alive():
                signal.pthread_kill(writer.ident, signal.SIGUSR1)
            got += os.read(r, 4096)
        writer.join(10)
        assert not writer.is_alive()
    finally:
        signal.signal(signal.SIGUSR1, old)
        os.close(r)
        os.close(w)
    assert result == [(len(data), 2000)]
    assert bytes(got) == data


def test_drain_to_concurrently_with_the_callbacks(open_collector, lib, tmp_path):
    c = open_collector(buffers=8, buffer_bytes=4096, ring_bytes=64 * 1024)
    c.set_switch(True, False)
    for t in range(3):
        lib.fake_mspti_emit(20000, f"step {t} <&>".encode(), b"default", 16, 0)
    written = lines = 0
    with open(tmp_path / "out", "wb") as handle:
        while lib.fake_mspti_emitted() + lib.fake_mspti_dropped() < 60000:
            size, n = c.drain_to(handle)
            written, lines = written + size, lines + n
        lib.fake_mspti_wait_idle()
        c.flush()
        size, n = c.drain_to(handle)
        written, lines = written + size, lines + n
    data = (tmp_path / "out").read_bytes()
    counters = c.counters()
    assert len(data) == written == counters["bytes"]
    assert lines == counters["records"] == lib.fake_mspti_emitted() - counters["records_dropped"]
    ids = [json.loads(line)["Id"] for line in data.splitlines()]
    assert len(ids) == len(set(ids)) == lines


def test_completion_callback_time_is_counted(open_collector, lib):
    c = open_collector(buffers=4, buffer_bytes=4096)
    assert c.counters()["complete_ns"] == c.counters()["complete_max_ns"] == 0
    c.set_switch(True, False)
    emit_lines(lib, 500)
    c.flush()
    counters = c.counters()
    assert counters["buffers_completed"] >= 500 * 56 // 4096
    assert 0 < counters["complete_max_ns"] <= counters["complete_ns"]
    assert counters["complete_ns"] < 10 * 1e9  # nanoseconds, not something else


def test_drain_to_after_close_writes_the_tail(open_collector, lib, tmp_path):
    c = open_collector()
    c.set_switch(True, False)
    lines = emit_lines(lib, 30)
    c.close()  # flushes: the last, partly filled buffer ends up in the leftover
    assert c.pending() == len(b"".join(lines))
    with open(tmp_path / "out", "wb") as handle:
        assert c.drain_to(handle, len(lines[0]) * 10) == (len(lines[0]) * 10, 10)
        assert c.discard(len(lines[0])) == (len(lines[0]), 1)
        assert c.drain_to(handle) == (len(lines[0]) * 19, 19)
    assert (tmp_path / "out").read_bytes() == b"".join(lines[:10] + lines[11:])
    assert c.pending() == 0 and c.drain() == b""


def test_worker_writes_straight_from_the_native_ring(open_collector, lib, tmp_path):
    from agent.worker.runtime import Worker
    from agent.worker.writer import FILE_LIMIT

    c = open_collector()
    (tmp_path / "switch").write_text('{"Step":"on"}')
    rank_dir = tmp_path / "root" / "job" / "4"
    rank_dir.mkdir(parents=True)
    (rank_dir / "1700000000").write_bytes(b"x" * FILE_LIMIT + b"\n")  # over 10 MiB: the next write rotates
    w = Worker(4, 1, c, root=str(tmp_path / "root"), job="job", switch_path=str(tmp_path / "switch"),
               interval=3600, clock=lambda: 1_755_771_234)
    w.tick()  # applies the switch
    lines = emit_lines(lib, 6000)  # ~1.3 MB: more than the 1 MiB cap
    w.tick()
    emit_lines(lib, 10)  # over the cap: dropped and counted as well
    w.stop()
    data = (rank_dir / "1755771234").read_bytes()
    sizes = [len(line) for line in lines]  # ids of 1 to 4 digits
    fit = max(k for k in range(len(lines) + 1) if sum(sizes[:k]) <= 1 << 20)
    assert data == b"".join(lines[:fit])
    s = w.stats()
    assert s["records_written"] == fit and s["bytes_written"] == len(data) <= 1 << 20
    assert s["records_dropped_limit"] == 6010 - fit and s["tick_errors"] == s["write_errors"] == 0
    assert c.pending() == 0


def test_close_is_idempotent_and_keeps_the_tail(open_collector, lib, fake):
    c = open_collector(buffers=4, buffer_bytes=4096)
    c.set_switch(True, False)
    lib.fake_mspti_emit(30, b"step 3", b"default", 2, 0)
    lib.fake_mspti_wait_idle()
    c.close()  # switches off, flushes: the partly filled buffer's records end up in the last drain
    c.close()
    assert len(parse(c.drain())) == 30 and c.drain() == b""
    assert c.counters()["records"] == 30
    assert lib.fake_mspti_state() & ((1 << MARKER) | (1 << 33)) == 0
    c.flush()
    with pytest.raises(ValueError):
        c.set_switch(True, True)
    lib.fake_mspti_emit(10, b"late", b"default", 2, 0)  # MARKER is off now
    lib.fake_mspti_wait_idle()
    assert lib.fake_mspti_filtered() == 10


def test_close_while_streaming_then_reopen(open_collector, lib):
    c = open_collector(buffers=4, buffer_bytes=2048)
    c.set_switch(True, False)
    lib.fake_mspti_emit(300000, b"step 4", b"default", 2, 0)
    wait_until(lambda: c.counters()["records"] > 0, 10, "the stream to be flowing")  # close mid-stream
    c.close()
    # Re-enable MARKER behind the closed collector's back: late requests are declined, nothing crashes.
    assert lib.msptiActivityEnable(MARKER) == 0
    lib.fake_mspti_wait_idle()
    lib.msptiActivityFlushAll(1)
    closed = c.counters()
    assert closed == c.counters()
    assert len(parse(c.drain())) == closed["records"]
    c2 = open_collector(buffers=4, buffer_bytes=2048)
    c2.set_switch(True, False)
    lib.fake_mspti_emit(1000, b"step 5", b"default", 2, 0)
    recs = parse(settle(c2, lib))
    assert len(recs) == 1000 and {r["Name"] for r in recs} == {"step 5"}
    assert c2.counters()["records"] == 1000


def test_one_open_collector_and_load_errors(open_collector, fake, tmp_path):
    c = open_collector()
    with pytest.raises(RuntimeError):
        native.Collector(str(fake[0]))
    c.close()
    with pytest.raises(OSError, match="nope.so"):
        native.Collector(str(tmp_path / "nope.so"))
    libm = ctypes.util.find_library("m")
    with pytest.raises(OSError, match="missing symbol msptiActivityEnable"):
        native.Collector(libm or "libm.so.6")
    with pytest.raises(ValueError):
        native.Collector(str(fake[0]), buffers=0)
    with pytest.raises(ValueError, match="1 GiB"):
        native.Collector(str(fake[0]), ring_bytes=(1 << 30) + 1)
    with pytest.raises(TypeError):
        native.Collector(str(fake[0]), 4)  # buffers is keyword-only
    native.Collector(fake[0]).close()  # os.PathLike works too


EXIT_SCRIPT = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
from testkit.fakes.mspti import load_fake_mspti
import agent._native as native
lib = load_fake_mspti(sys.argv[2])
variant = int(sys.argv[3])
c = native.Collector(sys.argv[2], buffers=4, buffer_bytes=8192, ring_bytes=1 << 20)
c.set_switch(True, True)
for _ in range(2):
    lib.fake_mspti_emit(50_000_000, b"step 9 <&>", b"default", 16, 0)
lib.fake_mspti_emit(50_000_000, b'{"opName":"x"}', b"communication", 2, 0)
deadline = time.monotonic() + 0.01 * (1 + variant % 3)
while time.monotonic() < deadline:
    c.drain()
    if variant % 2:
        c.flush()
mode = variant % 5
if mode == 0:
    c.close(); sys.exit(0)
elif mode == 1:
    sys.exit(0)                  # Collector freed (or not) during interpreter finalisation
elif mode == 2:
    c.close(); os._exit(0)
elif mode == 3:
    os._exit(0)
else:
    c.close(); del c; lib.msptiActivityEnable(1); time.sleep(0.01); raise SystemExit(0)
"""


def test_exit_mid_stream_never_crashes(fake):
    if native is None:
        pytest.fail(f"agent._native failed to import: {IMPORT_ERROR!r}")
    procs = []
    for variant in range(30):
        procs.append(subprocess.Popen([sys.executable, "-c", EXIT_SCRIPT, str(REPO), str(fake[0]), str(variant)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        if len(procs) % 6 == 0:
            for p in procs[-6:]:
                p.wait(timeout=30)
    for variant, p in enumerate(procs):
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, f"variant {variant}: exit {p.returncode}\n{err.decode(errors='replace')}"
        assert b"double free" not in err and b"Segmentation" not in err, err



FORK_SCRIPT = r"""
import array, fcntl, json, os, signal, sys, termios, threading, time
sys.path.insert(0, sys.argv[1])
from testkit.fakes.mspti import load_fake_mspti
import agent._native as native
lib = load_fake_mspti(sys.argv[2])
c = native.Collector(sys.argv[2])
c.set_switch(True, False)
lib.fake_mspti_emit(2000, b"parent", b"default", 2, 0)
lib.fake_mspti_wait_idle()
c.flush()
size = c.pending()
r, w = os.pipe()
writer = threading.Thread(target=c.drain_to, args=(w,))
writer.start()  # blocks once the pipe is full, inside drain_to, holding the collector's consumer lock

def in_pipe():
    n = array.array("i", [0])
    fcntl.ioctl(r, termios.FIONREAD, n)
    return n[0]

deadline = time.monotonic() + 10
while in_pipe() < fcntl.fcntl(w, 1032) and time.monotonic() < deadline:  # F_GETPIPE_SZ
    time.sleep(0.001)
pid = os.fork()
if pid == 0:
    signal.alarm(10)  # a hang (on the lock the writer holds for good here) ends the child with SIGALRM
    out = {"parent": os.getppid(), "pending": c.pending(), "drain": len(c.drain()), "discard": c.discard()}
    with open(os.devnull, "wb") as devnull:
        out["drain_to"] = c.drain_to(devnull)
    c.flush()
    c.close()
    try:
        c.set_switch(True, False)
    except ValueError as exc:
        out["set_switch"] = str(exc)
    out["records"] = c.counters()["records"]
    own = native.Collector(sys.argv[2])  # the child may collect for itself
    own.set_switch(True, False)
    lib.fake_mspti_emit(5, b"child", b"default", 2, 0)
    lib.fake_mspti_wait_idle()
    own.flush()
    out["own"] = [json.loads(line)["Name"] for line in own.drain().splitlines()]
    own.close()
    print(json.dumps(out), flush=True)
    sys.exit(0)  # interpreter exit frees the parent's Collector here too
got = bytearray()
while len(got) < size:
    got += os.read(r, 1 << 16)
writer.join()
status = os.waitpid(pid, 0)[1]
print(json.dumps({"child_exit": os.waitstatus_to_exitcode(status), "read": len(got), "size": size,
                  "names": sorted({json.loads(line)["Name"] for line in got.splitlines()}),
                  "lines": got.count(b"\n")}), flush=True)
c.close()
"""


def test_a_forked_child_gets_an_inert_collector_and_may_open_its_own(fake):
    if native is None:
        pytest.fail(f"agent._native failed to import: {IMPORT_ERROR!r}")
    proc = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(REPO), str(fake[0])], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[-1]["child_exit"] == 0, f"the child did not finish: {lines}"
    child, parent = lines
    assert child == {"parent": child["parent"], "pending": 0, "drain": 0, "discard": [0, 0], "drain_to": [0, 0],
                     "set_switch": f"Collector belongs to process {child['parent']}, not to this fork of it",
                     "records": 2000, "own": ["child"] * 5}
    # the parent's writer went on where it was: each of its records once, none of the child's
    assert parent["read"] == parent["size"] and parent["lines"] == 2000 and parent["names"] == ["parent"]


def test_extension_source_compiles_without_warnings(tmp_path):
    import shlex
    import sysconfig

    cmd = [*shlex.split(os.environ.get("CC") or "cc"), "-fsyntax-only", "-O2", "-Wall", "-Wextra", "-Werror",
           "-std=gnu11", f"-I{sysconfig.get_paths()['include']}", str(REPO / "native" / "mspti_buffer.c")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{shlex.join(cmd)}:\n{result.stderr}"
