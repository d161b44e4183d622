"""agent.worker.tasknet's pure parts, the client's message handling without a network, and the
worker's switch shared by the file and the TaskD manager."""

from __future__ import annotations

import json
import queue

import pytest

from agent._proto import tasknet_pb2 as pb
from agent.worker import tasknet
from agent.worker.runtime import Worker
from agent.worker.tasknet import ManagerClient, Position

ME = Position("Worker", "1", "5")


# -- codes and bodies ----------------------------------------------------------------------------------

@pytest.mark.parametrize("code, state", [(700, (False, False)), (710, (True, False)), (701, (False, True)),
                                         (711, (True, True))])
def test_action_codes(code, state):
    assert tasknet.action_state(code) == state


@pytest.mark.parametrize("code", [0, 101, 702, 712, 720, 1410, -700])
def test_other_codes_are_no_action(code):
    assert tasknet.action_state(code) is None


@pytest.mark.parametrize("results, code", [((0, 0), 1400), ((1, 0), 1410), ((0, 1), 1401), ((1, 1), 1411),
                                           ((2, 0), 1420), ((2, 1), 1421), ((0, 2), 1402), ((1, 2), 1412),
                                           ((2, 2), 1422)])
def test_status_codes(results, code):
    assert tasknet.status_code(results) == code


def test_bodies_are_gos_compact_marshal_in_field_order():
    assert tasknet.body("REGISTER", 101).encode() == b'{"msg_type":"REGISTER","code":101,"message":"","extension":null}'
    assert tasknet.body("STATUS", 1420).encode() == b'{"msg_type":"STATUS","code":1420,"message":"","extension":null}'


@pytest.mark.parametrize("text, parsed", [
    ('{"msg_type":"ACTION","code":710,"message":"","extension":null}', ("ACTION", 710)),
    ('{"msg_type":"ACTION","code":711,"message":"x","extension":{"a":"b","c":null}}', ("ACTION", 711)),
    ('{"MSG_TYPE":"ACTION","Code":701}', ("ACTION", 701)),  # Go matches keys case-insensitively
    ('{"code":700,"code":710,"msg_type":"ACTION"}', ("ACTION", 710)),  # the later duplicate wins
    ('{"msg_type":"ACTION","code":null,"other":[1]}', ("ACTION", 0)),
    ("null", ("", 0)),
    ("{}", ("", 0)),
])
def test_parse_body(text, parsed):
    assert tasknet.parse_body(text) == parsed


@pytest.mark.parametrize("text", ["", "not json", "[]", '[["msg_type","ACTION"]]', '"ACTION"', "710",
                                  '{"msg_type":"ACTION","code":"710"}', '{"msg_type":"ACTION","code":710.0}',
                                  '{"msg_type":"ACTION","code":7e2}', '{"msg_type":"ACTION","code":true}',
                                  '{"msg_type":"ACTION","code":2147483648}', '{"msg_type":7,"code":710}',
                                  '{"msg_type":"ACTION","code":710,"message":1}',
                                  '{"msg_type":"ACTION","code":710,"extension":{"a":1}}',
                                  '{"msg_type":"ACTION","code":710,"extension":[]}'])
def test_parse_body_rejects_what_go_cannot_unmarshal(text):
    assert tasknet.parse_body(text) is None


# -- the environment ------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, on", [
    ({}, False),
    ({"MINDX_TASK_ID": "j"}, False),
    ({"MASTER_ADDR": "10.0.0.1"}, False),
    ({"MINDX_TASK_ID": "j", "MASTER_ADDR": "10.0.0.1"}, True),
    ({"MINDX_TASK_ID": "j", "MS_SCHED_HOST": "10.0.0.1"}, True),
    ({"MINDX_TASK_ID": "j", "LOCAL_PROXY_ENABLE": "on"}, True),
    ({"MINDX_TASK_ID": "j", "LOCAL_PROXY_ENABLE": "off"}, False),
    ({"MINDX_TASK_ID": "j", "MASTER_ADDR": ""}, False),
    ({"MINDX_TASK_ID": "", "MASTER_ADDR": "10.0.0.1"}, False),
    ({"MINDX_TASK_ID": "j", "MASTER_ADDR": "10.0.0.1", "NPU_AGENT_TASKD_MANAGER": "off"}, False),
    ({"MINDX_TASK_ID": "j", "MASTER_ADDR": "10.0.0.1", "NPU_AGENT_TASKD_MANAGER": "OFF"}, False),
    ({"MINDX_TASK_ID": "j", "MASTER_ADDR": "10.0.0.1", "NPU_AGENT_TASKD_MANAGER": "on"}, True),
])
def test_enabled(env, on):
    assert tasknet.enabled(env) is on
    client = tasknet.client_from_env(3, env)
    assert (client is not None) is on


def test_proxy_address():
    assert tasknet.proxy_address({}) == "127.0.0.1:9602"
    assert tasknet.proxy_address({"NPU_AGENT_TASKD_PROXY": " "}) == "127.0.0.1:9602"
    assert tasknet.proxy_address({"NPU_AGENT_TASKD_PROXY": "10.1.2.3:19602"}) == "10.1.2.3:19602"


@pytest.mark.parametrize("env, rank", [
    ({}, "0"),
    ({"RANK": "13", "LOCAL_WORLD_SIZE": "8"}, "1"),
    ({"RANK": "7", "LOCAL_WORLD_SIZE": "8"}, "0"),
    ({"RANK": "16", "LOCAL_WORLD_SIZE": "8", "MS_NODE_RANK": "5"}, "2"),  # PyTorch's pair first
    ({"RANK": "16", "LOCAL_WORLD_SIZE": "0", "MS_NODE_RANK": "5"}, "5"),
    ({"RANK": "16", "MS_NODE_RANK": "5"}, "5"),
    ({"RANK": "x", "LOCAL_WORLD_SIZE": "8", "MS_NODE_RANK": "3"}, "3"),
    ({"RANK": "-8", "LOCAL_WORLD_SIZE": "8"}, "0"),
    ({"MS_NODE_RANK": "04"}, "4"),
    ({"MS_NODE_RANK": "abc"}, "0"),
    ({"RANK": "\u0661", "LOCAL_WORLD_SIZE": "1"}, "0"),  # non-ASCII digits are no rank
])
def test_node_rank(env, rank):
    assert tasknet.node_rank(env) == rank


def test_own_position():
    env = {"RANK": "9", "LOCAL_WORLD_SIZE": "4"}
    assert tasknet.own_position(9, env) == Position("Worker", "2", "9")
    client = tasknet.client_from_env(9, {**env, "MINDX_TASK_ID": "j", "MASTER_ADDR": "a",
                                         "NPU_AGENT_TASKD_PROXY": "127.0.0.1:1"})
    assert client.position == Position("Worker", "2", "9") and client.address == "127.0.0.1:1"


# -- the receive rule ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dst, taken", [
    (("Worker", "1", "5"), True),
    (("Worker", "All", "5"), True),
    (("Worker", "1", "All"), True),
    (("Worker", "All", "All"), True),
    (("Agent", "1", "5"), True),  # levels are compared, not roles
    (("Worker", "1", "6"), False),
    (("Worker", "2", "5"), False),
    (("Worker", "1", "5,6"), False),  # a rank list matches nothing
    (("Worker", "0,1", "5"), False),
    (("Worker", "1", "all"), False),
    (("Worker", "1", "All,5"), False),
    (("Worker", " 1", "5"), False),
    (("Mgr", "0", "-1"), False),
    (("Proxy", "1", "5"), False),
    (("Boss", "1", "5"), False),
])
def test_receive_rule(dst, taken):
    assert tasknet.accepts(ME, Position(*dst)) is taken


# -- the client without a network ----------------------------------------------------------------------

def message(dst, body="", sync=True, uuid="u1"):
    header = pb.MessageHeader(uuid=uuid, mtype="default", sync=sync, src=pb.Position(role="Mgr", serverRank="0",
                                                                                     processRank="-1"),
                              dst=pb.Position(role=dst[0], serverRank=dst[1], processRank=dst[2]))
    return pb.Message(header=header, body=body)


class Acks:
    def __init__(self, taken=True):
        self.sent = []
        self.taken = taken

    def send(self, ack, timeout):
        self.sent.append((ack.uuid, ack.code, (ack.src.role, ack.src.serverRank, ack.src.processRank)))
        return self.taken


def test_receive_takes_acks_drops_and_reports_a_full_inbox():
    client = ManagerClient(ME, "127.0.0.1:1")
    acks = Acks()
    assert client._receive(message(("Worker", "1", "5"), uuid="a"), acks)
    assert client._receive(message(("Worker", "1", "6"), uuid="b"), acks)
    assert client._receive(message(("Worker", "All", "All"), uuid="c", sync=False), acks)  # async: no ack
    assert client._receive(message(("Worker", "1", "5,6"), uuid="d", sync=False), acks)  # dropped silently
    assert acks.sent == [("a", 0, ME), ("b", 5002, ME)]
    assert [client._inbox.get_nowait().header.uuid for _ in range(2)] == ["a", "c"]
    for i in range(tasknet.INBOX_SIZE):
        client._inbox.put_nowait(message(("Worker", "1", "5"), uuid=f"fill{i}"))
    assert client._receive(message(("Worker", "1", "5"), uuid="e"), acks)
    assert acks.sent[-1] == ("e", 5001, ME)
    s = client.stats()
    assert (s["manager_messages"], s["manager_messages_dropped"], s["manager_messages_busy"],
            s["manager_acks_sent"]) == (5, 2, 1, 3)
    # An ack that gRPC does not take in time: the caller rebuilds the connection.
    assert not client._receive(message(("Worker", "1", "5"), uuid="f"), Acks(taken=False))


class Switch:
    def __init__(self, results):
        self.results = list(results)
        self.commands = []

    def manager_registered(self):
        pass

    def manager_action(self, state):
        self.commands.append(state)
        return self.results.pop(0)


def test_actions_are_applied_and_answered_with_one_status(caplog):
    client = ManagerClient(ME, "127.0.0.1:1")
    sent = []
    client._send = lambda msg_type, code: sent.append((msg_type, code))  # None: delivered
    client._switch = Switch([(1, 0), None, (2, 1), (0, 0)])
    for code in (710, 710, 711, 700):
        client._handle(message(("Worker", "1", "5"), tasknet.body("ACTION", code)))
    assert client._switch.commands == [(True, False), (True, False), (True, True), (False, False)]
    assert sent == [("STATUS", 1410), ("STATUS", 1421), ("STATUS", 1400)]  # none for the repeat
    with caplog.at_level("WARNING", logger="agent.worker"):
        for body in ("nonsense", tasknet.body("ACTION", 799), tasknet.body("KEEP_ALIVE", 0), "{}",
                     tasknet.body("ACTION", 799)):
            client._handle(message(("Worker", "1", "5"), body))
    assert len(client._switch.commands) == 4 and len(sent) == 3
    s = client.stats()
    assert (s["actions"], s["manager_actions_applied"], s["statuses_sent"], s["manager_messages_ignored"]) == (4, 3, 3, 5)
    # three kinds logged once each; the repeated unknown code is within the rate limit
    assert len(caplog.records) == 3


def test_a_status_that_cannot_be_sent_is_counted_not_retried():
    client = ManagerClient(ME, "127.0.0.1:1")
    calls = []
    client._send = lambda msg_type, code: calls.append(code) or "UNAVAILABLE: gone"
    client._switch = Switch([(1, 1)])
    client._handle(message(("Worker", "1", "5"), tasknet.body("ACTION", 711)))
    assert calls == [1411]
    s = client.stats()
    assert s["statuses_sent"] == 0 and s["manager_status_errors"] == 1


def test_register_gives_up_without_a_connection_and_stop_is_safe():
    client = ManagerClient(ME, "127.0.0.1:1", give_up_s=0.05, register_delays=[0, 0])
    client._started = client._monotonic()
    assert client._register() is False
    assert client.given_up and not client.registered and client.stats()["manager_register_tries"] == 0
    client.stop()
    client.stop()
    assert client.start(Switch([])) is False  # a stopped client does not start again


def test_register_tries_on_the_schedule_and_fails_while_the_stream_is_down():
    client = ManagerClient(ME, "127.0.0.1:1", give_up_s=60, register_delays=[0, 0, 0])
    client._started = client._monotonic()
    client._up.set()
    answers = iter(["UNAVAILABLE: x", "not joined", None])
    sent = []
    client._send = lambda msg_type, code: sent.append((msg_type, code)) or next(answers)
    assert client._register() is True
    assert sent == [("REGISTER", 101)] * 3 and client.registered
    failing = ManagerClient(ME, "127.0.0.1:1", give_up_s=60, register_delays=[0, 0])
    failing._started = failing._monotonic()
    failing._up.set()
    failing._send = lambda msg_type, code: "UNKNOWN: client not inited"
    assert failing._register() is False and failing.given_up
    assert failing.stats()["manager_register_tries"] == 2


# -- the worker: one switch for the file and the manager ------------------------------------------------

class Collector:
    def __init__(self, results=None):
        self.calls = []
        self.results = results
        self.fail = False

    def set_switch(self, default_on, comm_on):
        self.calls.append((default_on, comm_on))
        if self.fail:
            raise RuntimeError("boom")
        return self.results if self.results is not None else (int(default_on), int(comm_on))

    def flush(self):
        pass

    def drain(self):
        return b""

    def close(self):
        pass

    def counters(self):
        return {}


def make_worker(tmp_path, collector):
    return Worker(0, 5000, collector, root=str(tmp_path / "root"), job="j", switch_path=str(tmp_path / "switch"),
                  interval=3600)


def test_the_file_is_ignored_once_the_manager_drives(tmp_path):
    c = Collector()
    w = make_worker(tmp_path, c)
    (tmp_path / "switch").write_text('{"Step":"on"}')
    w.tick()
    assert c.calls == [(True, False)]
    w.manager_registered()
    # The manager's first command is applied and answered even though it is already in force.
    assert w.manager_action((True, False)) == (1, 0)
    assert w.manager_action((True, False)) is None
    (tmp_path / "switch").write_text('{"CommunicationOperator":"on"}')
    w.tick()
    assert w.apply_switch((False, False), "file") is None
    assert c.calls == [(True, False), (True, False)]
    assert w.manager_action((True, True)) == (1, 1)
    s = w.stats()
    assert s["manager_mode"] is True and s["switch_comm_on"] is True and s["switch_results"] == [1, 1]
    assert s["manager_enabled"] is False  # no client in this worker


def test_exception_results_are_reported_and_the_command_counts_as_applied(tmp_path, caplog):
    c = Collector(results=(2, 0))
    w = make_worker(tmp_path, c)
    w.manager_registered()
    with caplog.at_level("WARNING", logger="agent.worker"):
        assert w.manager_action((True, False)) == (2, 0)
    assert "an MSPTI call failed" in caplog.text
    assert w.manager_action((True, False)) is None  # TaskD compares commands, not results
    c.results = None
    assert w.manager_action((False, False)) == (0, 0)


def test_a_collector_error_is_an_exception_of_both_and_not_applied(tmp_path):
    c = Collector()
    c.fail = True
    w = make_worker(tmp_path, c)
    w.manager_registered()
    assert w.manager_action((True, True)) == (2, 2)
    assert w.state == (False, False)
    c.fail = False
    assert w.manager_action((True, True)) == (1, 1)  # the same command again is tried again


def test_nothing_is_applied_after_stop(tmp_path):
    c = Collector()
    w = make_worker(tmp_path, c)
    w.stop()
    assert w.manager_action((True, False)) is None
    assert w.apply_switch((True, False), "file") is None
    assert c.calls == []


def test_worker_starts_and_stops_its_client(tmp_path):
    class Client:
        def __init__(self):
            self.events = []

        def start(self, switch):
            self.events.append(("start", switch))
            return True

        def stop(self):
            self.events.append("stop")

        def stats(self):
            return {"manager_registered": True, "actions": 3, "statuses_sent": 2}

    client = Client()
    w = Worker(0, 5000, Collector(), root=str(tmp_path), job="j", switch_path=str(tmp_path / "s"), interval=3600,
               manager=client)
    assert w.start()
    assert client.events == [("start", w)]
    s = w.stats()
    assert s["manager_enabled"] and s["manager_registered"] and s["actions"] == 3 and s["statuses_sent"] == 2
    w.stop()
    assert client.events[-1] == "stop"


def test_acks_iterator_hands_over_in_order_and_ends_on_close():
    acks = tasknet._Acks()
    it = iter(acks)
    results = queue.Queue()
    import threading

    def send(name):
        results.put((name, acks.send(name, 5)))

    t = threading.Thread(target=send, args=("a",))
    t.start()
    assert next(it) == "a"
    t.join()
    assert results.get_nowait() == ("a", True)
    assert acks.send("late", 0.01) is False  # nobody takes it
    acks.close()
    assert list(it) in (["late"], [])  # the queued one may still be handed over, then it ends


def test_stats_before_anything_happened():
    s = ManagerClient(ME, "127.0.0.1:1").stats()
    assert s["manager_registered"] is False and s["manager_joined"] is False and s["actions"] == 0
    json.dumps(s)


def test_an_ack_is_abandoned_at_once_when_the_stream_ends_or_the_client_stops():
    import threading
    import time

    class Ended:
        def done(self):
            return True

    acks = tasknet._Acks()
    acks.call = Ended()
    started = time.monotonic()
    assert acks.send("x", 10) is False and time.monotonic() - started < 2
    closing = tasknet._Acks()
    threading.Thread(target=closing.close).start()
    started = time.monotonic()
    assert closing.send("y", 10) is False and time.monotonic() - started < 2
