"""Self-test of the TaskNet peer stand-ins (tests/fakes/tasknet): workers wired straight to a manager.

With no proxy in between, the manager plays the worker's upstream itself, which is what TaskD's
net layer does for any level-1 client: each peer is a separate process speaking real gRPC.
"""

from __future__ import annotations

import json

import grpc
import pytest

from agent._proto import tasknet_pb2_grpc as pb_grpc
from tests.fakes.tasknet import driver
from tests.fakes.tasknet.driver import MGR, pos

BODY = json.dumps({"msg_type": "STATUS", "code": 0, "message": "naïve \"quoted\"\nline", "extension": {"k": "v"}})


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
    return peers(driver.manager(f"127.0.0.1:{driver.free_port()}"))


def join(peers, mgr, server_rank, process_rank, **options) -> driver.PeerProcess:
    """A worker wired to `mgr`, once the manager holds its stream."""
    since = mgr.mark()
    w = peers(driver.worker(mgr.address, server_rank, process_rank, **options))
    mgr.wait_event(lambda e: e["event"] == "stream" and e["pos"] == w.pos, since=since)
    return w


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
    got = mgr.wait_event(lambda e: e["event"] == "received" and e["uuid"] == sent["uuid"])
    assert got["body"] == BODY and got["src"] == me and got["dst"] == MGR and got["mtype"] == "DEFAULT"


def test_downward_unicast_sync_is_received_and_acked(peers, mgr):
    w = join(peers, mgr, 0, 3)

    sent = mgr.transfer(w.pos, BODY, sync=True)
    assert sent == {"event": "sent", "uuid": sent["uuid"], "code": 0, "ack_src": w.pos, "error": None}
    got = w.wait_event(lambda e: e["event"] == "received" and e["uuid"] == sent["uuid"])
    assert got["body"] == BODY and got["sync"] is True and got["src"] == MGR and got["dst"] == w.pos

    # A worker nobody discovered has no route (TaskD NoRoute 5002).
    assert mgr.transfer(pos("Worker", 0, 7), "x", sync=True)["code"] == 5002


def test_broadcast_reaches_each_worker_once(peers, mgr):
    workers = [join(peers, mgr, 0, 0), join(peers, mgr, 1, 8)]

    sent = mgr.transfer(pos("Worker", "All", "All"), "to everyone", sync=True)
    assert sent["code"] == 0 and sorted(h["server_rank"] for h in sent["hops"]) == ["0", "1"]
    # A unicast marker sent afterwards arrives after any copy of the broadcast (one ordered
    # stream per worker), so once it is in, the number of copies is final.
    for w in workers:
        marker = mgr.transfer(w.pos, "marker", sync=True)
        assert marker["code"] == 0
        w.wait_event(lambda e: e["event"] == "received" and e["uuid"] == marker["uuid"])
        copies = [e for e in w.events("received") if e["uuid"] == sent["uuid"]]
        assert len(copies) == 1, copies
        assert copies[0]["sync"] is False  # broadcast is never sync
        assert copies[0]["dst"] == pos("Worker", "All", "All")


def test_stream_without_register_is_refused(mgr):
    stranger = pos("Worker", 5, 40)
    with grpc.insecure_channel(f"127.0.0.1:{mgr.port}", options=[("grpc.enable_http_proxy", 0)]) as channel:
        stream = pb_grpc.TaskNetStub(channel).InitServerDownStream(
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

    first.kill()  # SIGKILL mid-stream: nothing is closed gracefully
    w.wait_event("stream_lost")
    assert w.transfer(MGR, "while down")["code"] == 5999  # no upstream: TaskD's ServerErr, no queueing

    second = peers(driver.manager(address))
    w.wait_event("rejoined")
    second.wait_event(lambda e: e["event"] == "stream" and e["pos"] == w.pos)
    assert second.routes() == [[w.pos, w.pos]]  # rebuilt by the worker's new PathDiscovery

    up = w.transfer(MGR, BODY, sync=True)
    assert up["code"] == 0 and up["ack_src"] == MGR
    assert second.wait_event(lambda e: e["event"] == "received" and e["uuid"] == up["uuid"])["body"] == BODY
    down = second.transfer(w.pos, "welcome back", sync=True)
    assert down["code"] == 0 and down["ack_src"] == w.pos
    assert w.wait_event(lambda e: e["event"] == "received" and e["uuid"] == down["uuid"])["body"] == "welcome back"


def test_two_managers_share_a_port_on_different_hosts(peers):
    port = driver.free_port(("127.0.0.2", "127.0.0.3"))
    managers = [peers(driver.manager(f"{host}:{port}")) for host in ("127.0.0.2", "127.0.0.3")]
    assert [m.port for m in managers] == [port, port]
    workers = [peers(driver.worker(f"{host}:{port}", 0, rank)) for host, rank in (("127.0.0.2", 0), ("127.0.0.3", 1))]
    for m, w in zip(managers, workers):
        m.wait_event(lambda e: e["event"] == "stream" and e["pos"] == w.pos)
        assert m.routes() == [[w.pos, w.pos]]  # each job's manager sees only its own worker
