"""Routing decisions and validation of the TaskD proxy's pure core (TaskD §3.2-3.5)."""

import pytest

from agent._proto import tasknet_pb2 as pb
from agent.taskd.routes import Code, Invalid, Position, RouteTable, checked_destination, checked_own_position

ME = Position("Proxy", "1", "1700000000")
MGR = Position("Mgr", "0", "-1")


def worker(node, rank):
    return Position("Worker", str(node), str(rank))


def message(dst: Position | None, header=True):
    """A message's header as the proxy reads it (None: a message without one)."""
    if not header:
        return None
    h = pb.MessageHeader(uuid="u1", mtype="DEFAULT", src=worker(1, 4).pb())
    if dst is not None:
        h.dst.CopyFrom(dst.pb())
    return h


def table_with(*positions):
    table = RouteTable(ME)
    for pos in positions:
        table.learn(pos, [pos])  # what a worker's own path discovery teaches the first proxy
    return table


def test_validation_codes_are_taskds():
    cases = [
        (message(None, header=False), Code.NIL_HEADER),
        (message(None), Code.NIL_POSITION),
        (message(Position("Boss", "0", "-1")), Code.DST_ROLE_ILLEGAL),
        (message(Position("Worker", "x", "1")), Code.DST_SRV_RANK_ILLEGAL),
        (message(Position("Worker", "1", "-3")), Code.DST_PROCESS_RANK_ILLEGAL),
        (message(Position("Worker", "", "1")), Code.DST_SRV_RANK_ILLEGAL),
    ]
    for msg, code in cases:
        with pytest.raises(Invalid) as err:
            checked_destination(msg)
        assert err.value.code == code, (msg, code)


def test_destination_normalised_like_taskd():
    assert checked_destination(message(Position("Mgr", "0", "7"))) == Position("Mgr", "0", "-1")
    assert checked_destination(message(Position("Worker", "AllNodes", "1"))) == Position("Worker", "All", "1")
    assert checked_destination(message(Position("Worker", "0,1", "3,4"))) == Position("Worker", "0,1", "3,4")


def test_own_positions_must_be_level_one_with_natural_ranks():
    assert checked_own_position(worker(1, 4)) == worker(1, 4)
    assert checked_own_position(Position("Agent", "1", "-1")) == Position("Agent", "1", "-1")
    for bad in (Position("Mgr", "0", "-1"), Position("Proxy", "1", "5"), Position("Worker", "a", "1"),
                Position("Worker", "1", "-1"), Position("Agent", "-2", "-1")):
        with pytest.raises(Invalid):
            checked_own_position(bad)


def test_up_down_self_and_no_route():
    table = table_with(worker(1, 4), worker(1, 5))
    assert table.decide(MGR, from_upper=False).action == "up"
    assert table.decide(Position("Proxy", "2", "-1"), from_upper=False).action == "up"  # TaskD: same level goes up
    assert table.decide(Position("Proxy", "1", "-1"), from_upper=False).action == "self"
    down = table.decide(worker(1, 5), from_upper=False)
    assert (down.action, down.hops) == ("down", (worker(1, 5),))
    missing = table.decide(worker(1, 9), from_upper=False)
    assert (missing.action, missing.code) == ("reject", Code.NO_ROUTE)


def test_messages_from_the_manager_never_go_back_up():
    table = table_with(worker(1, 4))
    for dst in (MGR, Position("Proxy", "2", "-1")):
        decision = table.decide(dst, from_upper=True)
        assert (decision.action, decision.code) == ("reject", Code.NO_ROUTE)


def test_broadcast_reaches_each_match_once_and_rank_lists_find_no_route():
    agent = Position("Agent", "1", "-1")
    table = table_with(worker(1, 4), worker(1, 5), worker(1, 6), agent)
    everyone = table.decide(Position("Worker", "All", "All"), from_upper=True)
    assert everyone.hops == (worker(1, 4), worker(1, 5), worker(1, 6))
    assert table.decide(Position("Worker", "1", "All"), from_upper=True).hops == everyone.hops
    assert table.decide(Position("Worker", "All", "5"), from_upper=True).hops == (worker(1, 5),)
    agents = table.decide(Position("Agent", "All", "-1"), from_upper=True)
    assert agents.hops == (agent,)
    # TaskD looks a rank list up as one key (no hop expands it) and every receiver drops it, so it
    # reaches nobody: no route, never a 0 for a message no one takes.
    for nobody in (Position("Worker", "1", "4,6"), Position("Worker", "All", "4,6"), Position("Worker", "1,2", "All"),
                   Position("Worker", "2", "All")):
        decision = table.decide(nobody, from_upper=True)
        assert (decision.action, decision.code) == ("reject", Code.NO_ROUTE), nobody


def test_a_gone_worker_takes_its_routes_with_it():
    below = Position("Proxy", "9", "1")  # a proxy below this one, reached through it
    table = table_with(worker(1, 4))
    table.learn(below, [worker(9, 1), worker(9, 2)])
    assert table.forget(below) == [worker(9, 1), worker(9, 2)]
    assert table.forget(worker(1, 4)) == [worker(1, 4)]
    assert table.routes == {}
    assert table.decide(worker(1, 4), from_upper=True).code == Code.NO_ROUTE
