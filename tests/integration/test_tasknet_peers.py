"""Self-test of the TaskNet peer stand-ins (testkit/fakes/tasknet): workers wired straight to a manager.

With no proxy in between, the manager plays the worker's upstream itself, which is what TaskD's
net layer does for any level-1 client: each peer is a separate process speaking real gRPC.  Where a
test needs a route TaskD would only build through a proxy, it sends a raw PathDiscovery itself (the
manager records routes from anyone, as TaskD's does).
"""

from __future__ import annotations

import json
import time
import uuid as uuidlib
from contextlib import contextmanager

import grpc
import pytest

from agent._proto import tasknet_pb2 as pb
from agent._proto import tasknet_pb2_grpc as pb_grpc
from testkit.fakes.tasknet import driver
from testkit.fakes.tasknet.driver import MGR, pos

BODY = json.dumps({"msg_type": "STATUS", "code": 0, "message": "naïve \"quoted\"\nline", "extension": {"k": "v"}})
REGISTER = '{"msg_type":"REGISTER","code":101,"message":"","extension":null}'


def status(code: int) -> str:
    return json.dumps({"msg_type": "STATUS", "code": code, "message": "", "extension": None})


@pytest.fixture
def peers():
    """Start peers through this, so each one is stopped (and must quit cleanly) after the test."""
    started: list[driver.PeerProcess] = []

    def keep(peer: driver.PeerProcess) -> driver.PeerProcess:
        started.append(peer)
        return peer

    yield keep
    unclean = []
    for peer in reversed(started):  # workers before the managers they talk to
        running = peer.process.poll() is None
        code = peer.stop()
        if running and code != 0:
            unclean.append(f"{peer.name} exited {code}:\n{peer.stderr_tail()}")
    assert not unclean


@pytest.fixture
def mgr(peers):
    return peers(driver.manager("127.0.0.1:0"))  # the port it bound comes with its ready event


def join(peers, mgr, server_rank, process_rank="-1", **options) -> driver.PeerProcess:
    """A worker wired to `mgr`, once the manager holds its stream."""
    since = mgr.mark()
    w = peers(driver.worker(mgr.address, server_rank, process_rank, **options))
    mgr.wait_event(lambda e: e["event"] == "stream" and e["pos"] == w.pos, since=since)
    return w


def as_pb(p: dict) -> pb.Position:
    return pb.Position(role=p["role"], serverRank=p["server_rank"], processRank=p["process_rank"])


@contextmanager
def raw_client(mgr):
    """A bare TaskNet client of `mgr`, for calls no well-behaved peer would make."""
    with grpc.insecure_channel(mgr.address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        yield pb_grpc.TaskNetStub(channel)


def point_at(mgr, hop: dict, *targets: dict) -> None:
    """Make the manager route each of `targets` through `hop`, as a proxy's PathDiscovery would."""
    with raw_client(mgr) as stub:
        ack = stub.PathDiscovery(pb.PathDiscoveryReq(uuid=str(uuidlib.uuid4()), proxyPos=as_pb(hop),
                                                     path=[as_pb(t) for t in targets]), timeout=10)
    assert ack.code == 0


def received(peer, uuid: str) -> dict:
    return peer.wait_event(lambda e: e["event"] == "received" and e["uuid"] == uuid)


def settle(mgr, w) -> None:
    """Wait until every message the manager sent `w` before now has been handled by it: a sync marker
    goes down the same ordered stream, so once its ack is back, earlier messages are in."""
    marker = mgr.transfer(w.pos, "marker", sync=True)
    assert (marker["code"], marker["ack_src"]) == (0, w.pos), marker
    received(w, marker["uuid"])


def test_join_sequence_and_upward_message(peers, mgr):
    # A long grace, so "confirmed" cannot come from the grace running out on a loaded machine.
    w = join(peers, mgr, 0, 3, extra_args=["--stream-grace", "30"])
    me = pos("Worker", 0, 3)
    assert w.events("ready")[0]["confirmed"] is True  # the manager confirms the stream with headers

    # register -> path -> stream, in that order, for exactly this position
    kinds = [(e["event"], e.get("pos") or e.get("proxy_pos")) for e in mgr.events()
             if e["event"] in ("registered", "path", "stream")]
    assert kinds == [("registered", me), ("path", me), ("stream", me)]
    assert mgr.events("path")[0]["path"] == [me]
    assert mgr.routes() == [[me, me]]

    sent = w.transfer(MGR, BODY, sync=True, mtype="DEFAULT")
    assert sent["code"] == 0 and sent["error"] is None and sent["ack_src"] == MGR
    got = received(mgr, sent["uuid"])
    assert got["body"] == BODY and got["src"] == me and got["dst"] == MGR and got["mtype"] == "DEFAULT"

    # A big body made inside the peer (7 MiB, under TaskD's 8 MiB limit) arrives whole.
    big = w.transfer(MGR, body_size=7 * 1024 * 1024, sync=True)
    assert big["code"] == 0, big
    assert received(mgr, big["uuid"])["body"] == "x" * (7 * 1024 * 1024)

    # Another manager is "same level": TaskD would send it upstream, and a Mgr has none.  The
    # refusal is a bare gRPC status, with no TaskD code.
    other = w.transfer(pos("Mgr", 1))
    assert other["code"] is None and other["error"].startswith("UNKNOWN: client not inited, role=Mgr"), other


def test_downward_unicast_sync_is_received_and_acked(peers, mgr):
    w = join(peers, mgr, 0, 3)

    sent = mgr.transfer(w.pos, BODY, sync=True)
    assert sent == {"event": "sent", "uuid": sent["uuid"], "code": 0, "ack_src": w.pos, "error": None}
    got = received(w, sent["uuid"])
    assert got["body"] == BODY and got["sync"] is True and got["src"] == MGR and got["dst"] == w.pos

    # A worker nobody discovered has no route (TaskD NoRoute 5002), and a rank list is never a
    # route key: the Mgr itself answers 5002.
    assert mgr.transfer(pos("Worker", 0, 7), "x", sync=True)["code"] == 5002
    listed = mgr.transfer(pos("Worker", 0, "0,1"), "x", sync=True)
    assert (listed["code"], listed["ack_src"]) == (5002, None) and "no route" in listed["error"], listed
    listed = mgr.transfer(pos("Worker", "0,1", 3), "x", sync=True)
    assert (listed["code"], listed["ack_src"]) == (5002, None), listed
    assert not w.events("dropped")


def test_worker_drops_what_is_not_for_it_and_answers_5002_when_sync(peers, mgr):
    w = join(peers, mgr, 0, 3)
    strangers = [pos("Worker", 0, 9), pos("Worker", 1, 3), pos("Worker", 0, "0,1"), pos("Agent", 0),
                 pos("Proxy", 0), pos("Boss", 0)]
    point_at(mgr, w.pos, *strangers)  # all of them "reached through" w

    for dst in strangers:
        sent = mgr.transfer(dst, "not yours", sync=True)
        # The worker's own Ack 5002 travels back: src is the worker, and no local error.
        assert (sent["code"], sent["ack_src"], sent["error"]) == (5002, w.pos, None), (dst, sent)
        dropped = w.wait_event(lambda e: e["event"] == "dropped" and e["uuid"] == sent["uuid"])
        assert dropped["dst"] == dst and dropped["sync"] is True and dropped["reason"], dropped
    assert "upper" in w.events("dropped")[4]["reason"]  # Proxy: an upper level
    assert "unknown role" in w.events("dropped")[5]["reason"]

    # An async drop is silent on the wire: no ack comes back for it.
    quiet = mgr.transfer(pos("Worker", 0, 9), "async", sync=False)
    assert quiet["code"] == 0
    w.wait_event(lambda e: e["event"] == "dropped" and e["uuid"] == quiet["uuid"] and e["sync"] is False)
    settle(mgr, w)
    assert not [e for e in mgr.events("ack") if e["uuid"] == quiet["uuid"]]
    assert not [e for e in w.events("received") if e["body"] != "marker"]  # nothing was taken

    # The configured ack code shapes the acks of messages the worker takes, never those of drops.
    w.config(ack_code=5001)
    assert mgr.transfer(w.pos, "mine", sync=True)["code"] == 5001
    assert mgr.transfer(pos("Worker", 0, 9), "not mine", sync=True)["code"] == 5002


def test_agent_takes_any_level1_destination_of_its_server(peers, mgr):
    a = join(peers, mgr, 0, role="Agent")
    assert a.pos == pos("Agent", 0, -1)
    point_at(mgr, a.pos, pos("Worker", 0, 0), pos("Worker", 1, 0))

    sent = mgr.transfer(pos("Worker", 0, 0), "for my node", sync=True)
    assert (sent["code"], sent["ack_src"]) == (0, a.pos), sent
    assert received(a, sent["uuid"])["dst"] == pos("Worker", 0, 0)
    sent = mgr.transfer(pos("Worker", 1, 0), "another node", sync=True)
    assert (sent["code"], sent["ack_src"]) == (5002, a.pos), sent
    a.wait_event(lambda e: e["event"] == "dropped" and e["uuid"] == sent["uuid"])


def test_broadcast_sends_one_copy_per_matching_route(peers, mgr):
    w, other = join(peers, mgr, 0, 3), join(peers, mgr, 1, 8)
    point_at(mgr, w.pos, pos("Worker", 0, 5))  # a second route through w, as behind one proxy

    everyone = mgr.transfer(pos("Worker", "All", "All"), "to everyone", sync=True)
    assert everyone["code"] == 0
    assert sorted(h["process_rank"] for h in everyone["hops"]) == ["3", "3", "8"]  # no dedup of hops
    node0 = mgr.transfer(pos("Worker", 0, "All"), "to node 0")
    assert [h["process_rank"] for h in node0["hops"]] == ["3", "3"]
    # "All" in one rank and a list in the other: nothing matches, and that is still a success.
    none = mgr.transfer(pos("Worker", "All", "0,1"), "to nobody")
    assert (none["code"], none["hops"]) == (0, [])
    for peer in (w, other):
        settle(mgr, peer)

    def copies(peer, uuid):
        return [e for e in peer.events("received") if e["uuid"] == uuid]

    assert len(copies(w, everyone["uuid"])) == 2 and len(copies(other, everyone["uuid"])) == 1
    assert len(copies(w, node0["uuid"])) == 2 and not copies(other, node0["uuid"])
    first = copies(w, everyone["uuid"])[0]
    assert first["sync"] is False and first["dst"] == pos("Worker", "All", "All")  # broadcast is never sync

    # Worker to worker straight through the manager: it routes a lower destination down, and the
    # receiver's ack comes back; a rank list there is a bare "no route" with no TaskD code.
    sent = w.transfer(other.pos, "hello", sync=True)
    assert (sent["code"], sent["ack_src"]) == (0, other.pos), sent
    assert received(other, sent["uuid"])["src"] == w.pos
    sent = w.transfer(pos("Worker", 1, "8,9"), "hello?", sync=True)
    assert sent["code"] is None and sent["error"].startswith("UNKNOWN: no route"), sent


def test_drop_rebuilds_the_link_with_a_new_path_discovery(peers, mgr):
    w = join(peers, mgr, 0, 3)
    first_path = mgr.events("path")[0]
    since_mgr, since_w = mgr.mark(), w.mark()

    assert w.drop()["joined"] is True
    w.wait_event("stream_lost", since=since_w)
    w.wait_event("rejoined", since=since_w)
    mgr.wait_event(lambda e: e["event"] == "stream" and e["pos"] == w.pos, since=since_mgr)
    later = [(e["event"], e.get("replaced")) for e in mgr.events()[since_mgr:]
             if e["event"] in ("registered", "path", "stream")]
    assert later == [("registered", True), ("path", None), ("stream", None)]
    again = mgr.wait_event("path", since=since_mgr)
    assert again["path"] == [w.pos] and again["uuid"] != first_path["uuid"]
    mgr.wait_event(lambda e: e["event"] == "stream_closed" and e["pos"] == w.pos, since=since_mgr)
    settle(mgr, w)  # and the new stream carries messages


def test_worker_register_action_and_status_with_the_manager(peers, mgr):
    w = join(peers, mgr, 0, 3)
    late = join(peers, mgr, 0, 4)

    # A STATUS before any REGISTER is acked 0 by the net layer, then dropped by the business layer.
    early = late.transfer(MGR, status(1400), sync=True, mtype="default")
    assert (early["code"], early["ack_src"]) == (0, MGR)
    assert mgr.wait_event("status_dropped") == {"event": "status_dropped", "name": "Worker4", "code": 1400}

    reg = w.transfer(MGR, REGISTER, sync=True, mtype="default")
    assert reg["code"] == 0
    assert mgr.wait_event("worker_registered") == {"event": "worker_registered", "name": "Worker3", "pos": w.pos}

    done = mgr.action(710)
    assert done["workers"] == ["Worker3"]
    sent = mgr.wait_event("action_sent")
    assert (sent["name"], sent["code"], sent["ack_src"], sent["error"], sent["tries"]) == ("Worker3", 0, w.pos, None, 1)
    action = received(w, sent["uuid"])
    assert action["body"] == '{"msg_type":"ACTION","code":710,"message":"","extension":null}'
    assert (action["mtype"], action["sync"], action["src"], action["dst"]) == ("default", True, MGR, w.pos)

    w.transfer(MGR, status(1410), sync=True, mtype="default")
    assert mgr.wait_event("status") == {"event": "status", "name": "Worker3", "code": 1410}
    assert mgr.workers() == {"Worker3": {"pos": w.pos, "status": 1410}}
    # A re-REGISTER overwrites the worker and forgets its status.
    since = mgr.mark()
    w.transfer(MGR, REGISTER, sync=True, mtype="default")
    mgr.wait_event("worker_registered", since=since)
    assert mgr.workers() == {"Worker3": {"pos": w.pos, "status": None}}


def test_action_retries_only_local_failures(peers, mgr):
    w = join(peers, mgr, 0, 3)
    gone = join(peers, mgr, 0, 4)
    for peer in (w, gone):
        assert peer.transfer(MGR, REGISTER, sync=True, mtype="default")["code"] == 0
    # "Worker9" registers from a position the manager reaches through w, which w then drops.
    with raw_client(mgr) as stub:
        header = pb.MessageHeader(uuid="raw-register", mtype="default", sync=True,
                                  src=as_pb(pos("Worker", 0, 9)), dst=as_pb(MGR))
        assert stub.TransferMessage(pb.Message(header=header, body=REGISTER), timeout=10).code == 0
    point_at(mgr, w.pos, pos("Worker", 0, 9))
    for name in ("Worker3", "Worker4", "Worker9"):
        mgr.wait_event(lambda e: e["event"] == "worker_registered" and e["name"] == name)
    gone.stop()  # its entry and route stay, with a dead stream: sends to it fail locally (6000)
    mgr.wait_event(lambda e: e["event"] == "stream_closed" and e["pos"] == gone.pos)

    since = mgr.mark()
    done = mgr.action(700, tries=3, retry_interval=0.05)
    assert done["workers"] == ["Worker3", "Worker4", "Worker9"]
    sent = {e["name"]: e for e in mgr.events()[since:] if e["event"] == "action_sent"}
    assert sorted(sent) == ["Worker3", "Worker4", "Worker9"]
    assert (sent["Worker3"]["code"], sent["Worker3"]["tries"]) == (0, 1)
    assert (sent["Worker4"]["code"], sent["Worker4"]["tries"], sent["Worker4"]["ack_src"]) == (6000, 3, None)
    assert len(set(sent["Worker4"]["uuids"])) == 3  # a fresh message per try
    # An Ack 5002 from a later hop is "delivered" to TaskD's callers: no retry.
    assert (sent["Worker9"]["code"], sent["Worker9"]["tries"], sent["Worker9"]["ack_src"]) == (5002, 1, w.pos)


def test_register_and_path_delays_hold_the_answers(mgr):
    assert mgr.config(register_delay=0.25, path_delay=0.25)["event"] == "configured"
    me = as_pb(pos("Worker", 0, 3))
    with raw_client(mgr) as stub:
        started = time.monotonic()
        assert stub.Register(pb.RegisterReq(uuid="r", pos=me), timeout=10).code == 0
        registered = time.monotonic()
        assert stub.PathDiscovery(pb.PathDiscoveryReq(uuid="p", proxyPos=me, path=[me]), timeout=10).code == 0
        discovered = time.monotonic()
    assert registered - started >= 0.25 and discovered - registered >= 0.25


def test_a_stream_is_installed_a_moment_after_it_is_accepted_and_sends_meanwhile_fail_6002(peers):
    """TaskD's manager stores a down stream in its entry when the stream's handler gets to run; until
    then a send to that position fails with NetStreamNotInited 6002 ("stream not inited", all a remote
    caller gets), and an ACTION the manager answers a REGISTER with at once is lost."""
    mgr = peers(driver.manager("127.0.0.1:0", config={"stream_delay": 3.0, "register_reply": 710}))
    w = peers(driver.worker(mgr.address, 0, 3))  # ready once the manager took the call, 3 s before it is installed
    with raw_client(mgr) as stub:
        header = pb.MessageHeader(uuid="through", mtype="default", sync=True, src=as_pb(pos("Worker", 0, 4)),
                                  dst=as_pb(w.pos))
        with pytest.raises(grpc.RpcError) as failed:
            stub.TransferMessage(pb.Message(header=header, body="too early"), timeout=10)
    assert (failed.value.code(), failed.value.details()) == (grpc.StatusCode.UNKNOWN, "stream not inited")
    early = mgr.transfer(w.pos, "too early", sync=True)
    assert (early["code"], early["ack_src"], early["error"]) == (6002, None, "stream not inited"), early
    reg = w.transfer(MGR, REGISTER, sync=True, mtype="default")
    assert (reg["code"], reg["ack_src"]) == (0, MGR)  # taken, and acked before the business layer answers
    lost = mgr.wait_event(lambda e: e["event"] == "action_sent" and e.get("reply_to") == reg["uuid"])
    assert (lost["code"], lost["ack_src"], lost["error"], lost["tries"]) == (6002, None, "stream not inited", 1)
    assert not mgr.events("stream")  # all of the above happened before the stream was installed

    mgr.wait_event(lambda e: e["event"] == "stream" and e["pos"] == w.pos)
    settle(mgr, w)
    reg = w.transfer(MGR, REGISTER, sync=True, mtype="default")
    answer = mgr.wait_event(lambda e: e["event"] == "action_sent" and e.get("reply_to") == reg["uuid"])
    assert (answer["code"], answer["ack_src"]) == (0, w.pos), answer
    assert received(w, answer["uuid"])["body"] == '{"msg_type":"ACTION","code":710,"message":"","extension":null}'


def test_a_rejoin_leaves_the_dead_stream_in_the_entry_until_the_new_one_is_installed(peers, mgr):
    w = join(peers, mgr, 0, 3)
    mgr.config(stream_delay=3.0)
    since = mgr.mark()
    w.drop()
    mgr.wait_event(lambda e: e["event"] == "stream_closed" and e["pos"] == w.pos, since=since)
    mgr.wait_event(lambda e: e["event"] == "registered" and e["pos"] == w.pos and e["replaced"], since=since)
    # TaskD keeps the entry and its old stream: sending on it fails (6000), not "not inited".
    sent = mgr.transfer(w.pos, "between", sync=True)
    assert (sent["code"], sent["ack_src"]) == (6000, None), sent
    mgr.wait_event(lambda e: e["event"] == "stream" and e["pos"] == w.pos, since=since)
    settle(mgr, w)


def test_stream_without_register_is_refused(mgr):
    stranger = pos("Worker", 5, 40)
    with raw_client(mgr) as stub:
        stream = stub.InitServerDownStream(
            iter(()), metadata=(("role", "Worker"), ("serverrank", "5"), ("processrank", "40")), timeout=5)
        with pytest.raises(grpc.RpcError) as refused:
            next(stream)
    assert refused.value.code() == grpc.StatusCode.UNKNOWN
    assert refused.value.details() == "un registry error"
    mgr.wait_event(lambda e: e["event"] == "stream_refused" and e["pos"] == stranger)
    assert not mgr.events("stream")


def test_manager_killed_and_restarted_worker_rejoins(peers):
    # On a second loopback address, like a job's manager on another host.
    address = f"127.0.0.2:{driver.free_port(('127.0.0.2',))}"
    first = peers(driver.manager(address))
    w = join(peers, first, 2, 17)
    assert w.transfer(MGR, REGISTER, sync=True, mtype="default")["code"] == 0
    first.wait_event("worker_registered")

    first.kill()  # SIGKILL mid-stream: nothing is closed gracefully
    w.wait_event("stream_lost")
    assert w.transfer(MGR, "while down")["code"] == 5999  # no upstream: TaskD's ServerErr, no queueing

    second = peers(driver.manager(address))
    w.wait_event("rejoined")
    second.wait_event(lambda e: e["event"] == "stream" and e["pos"] == w.pos)
    assert second.routes() == [[w.pos, w.pos]]  # rebuilt by the worker's new PathDiscovery
    assert second.workers() == {}  # a new process: the REGISTER was the old manager's

    up = w.transfer(MGR, BODY, sync=True)
    assert up["code"] == 0 and up["ack_src"] == MGR
    assert received(second, up["uuid"])["body"] == BODY
    down = second.transfer(w.pos, "welcome back", sync=True)
    assert down["code"] == 0 and down["ack_src"] == w.pos
    assert received(w, down["uuid"])["body"] == "welcome back"


def test_a_free_port_stays_free_until_a_manager_binds_it():
    """Outside the ephemeral range: no process's outgoing connection can take it meanwhile (on a busy machine
    one did, between a bind to port 0 and the manager's bind)."""
    ephemeral = driver.ephemeral_ports()
    ports = [driver.free_port(("127.0.0.2", "127.0.0.3")) for _ in range(20)]
    assert [p for p in ports if p in ephemeral] == []


def test_two_managers_share_a_port_on_different_hosts(peers):
    port = driver.free_port(("127.0.0.2", "127.0.0.3"))
    managers = [peers(driver.manager(f"{host}:{port}")) for host in ("127.0.0.2", "127.0.0.3")]
    assert [m.port for m in managers] == [port, port]
    workers = [peers(driver.worker(f"{host}:{port}", 0, rank)) for host, rank in (("127.0.0.2", 0), ("127.0.0.3", 1))]
    for m, w in zip(managers, workers):
        m.wait_event(lambda e: e["event"] == "stream" and e["pos"] == w.pos)
        assert m.routes() == [[w.pos, w.pos]]  # each job's manager sees only its own worker
