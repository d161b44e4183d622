"""A TaskNet message kept in wire form: the header parsed, the body passed on untouched."""

import pytest

from agent._proto import tasknet_pb2 as pb
from agent.taskd.frames import Frame, Malformed


def header(**changes):
    h = pb.MessageHeader(uuid="u1", mtype="default", sync=True,
                         src=pb.Position(role="Worker", serverRank="0", processRank="3"),
                         dst=pb.Position(role="Mgr", serverRank="0", processRank="7"))
    for key, value in changes.items():
        setattr(h, key, value)
    return h


def test_unchanged_header_sends_the_very_same_bytes():
    raw = pb.Message(header=header(), body="x" * 100_000).SerializeToString()
    frame = Frame(raw)
    assert frame.uuid == "u1" and len(frame.raw) == len(raw)
    frame.header.dst.CopyFrom(pb.Position(role="Mgr", serverRank="0", processRank="7"))  # same value
    assert frame.wire() is raw


def test_a_changed_header_is_re_encoded_and_the_body_kept():
    body = '{"msg_type":"ACTION","code":710}' * 1000
    frame = Frame(pb.Message(header=header(), body=body).SerializeToString())
    frame.header.dst.processRank = "-1"
    frame.header.sync = False
    again = pb.Message.FromString(frame.wire())
    assert again.body == body and again.header.dst.processRank == "-1" and not again.header.sync
    assert again.header.uuid == "u1"


def test_field_order_and_repeated_headers_as_protobuf_reads_them():
    # The body first, then the header in two parts: protobuf merges repeated message fields.
    raw = (pb.Message(body="b").SerializeToString() + pb.Message(header=header()).SerializeToString()
           + pb.Message(header=pb.MessageHeader(uuid="u2")).SerializeToString())
    frame = Frame(raw)
    expected = pb.Message.FromString(raw)
    assert frame.header == expected.header and frame.uuid == "u2"
    frame.header.mtype = "DEFAULT"
    again = pb.Message.FromString(frame.wire())
    assert again.body == "b" and again.header.mtype == "DEFAULT" and again.header.uuid == "u2"


def test_no_header_and_malformed_input():
    assert Frame(pb.Message(body="only").SerializeToString()).header is None
    assert Frame(b"").header is None
    for bad in (b"\x0a\x05ab", b"\x0a", b"\x0b\x00", b"\xff" * 11, b"\x0a\x02\xff\xff"):
        with pytest.raises(Malformed):
            Frame(bad)
