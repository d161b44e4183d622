"""Self-test of the ClusterD stand-in, through a plain gRPC client over a real socket."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from agent._proto import pubfault_pb2 as pb
from agent._proto import pubfault_pb2_grpc as pb_grpc
from testkit.fakes.clusterd import DEFAULT_CONFIG, ClusterdStandIn, OtherSender
from testkit.wait import wait_until
from tests.support.clock import FakeClock

T0 = 1_760_000_000.0  # fake-clock start, seconds
NOW_MS = 1_760_000_000_000
KEY = ("node-a", "npu-node-agent", "fault-0001")
# Short reconnect backoff, so a call after the stand-in comes back doesn't wait ~1 s.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 100)]


def fault(fault_id="fault-0001", assertion="occur", code="020011001", **overrides) -> pb.Fault:
    fields = dict(faultId=fault_id, faultType="NPU", faultCode=code, faultTime=NOW_MS, assertion=assertion,
                  influence=[pb.PubFaultInfo(nodeName="node-a", deviceIds=[0, 1])], description="HBM ECC")
    fields.update(overrides)
    return pb.Fault(**fields)


def request(*faults: pb.Fault, **overrides) -> pb.PublicFaultRequest:
    fields = dict(id="req-00000001", timestamp=NOW_MS, version="1.0", resource="npu-node-agent",
                  faults=list(faults) or [fault()])
    fields.update(overrides)
    return pb.PublicFaultRequest(**fields)


class Client:
    def __init__(self, port: int):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.PubFaultStub(self.channel)

    def send(self, req: pb.PublicFaultRequest, timeout: float = 5.0, **kw) -> pb.RespStatus:
        return self.stub.SendPublicFault(req, timeout=timeout, **kw)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def clusterd(clock):
    with ClusterdStandIn(clock=clock) as standin:
        yield standin


@pytest.fixture
def client(clusterd):
    c = Client(clusterd.port)
    yield c
    c.channel.close()


def test_success(clusterd, client):
    resp = client.send(request())
    assert (resp.code, resp.info) == (0, "public fault send successfully")
    stored = clusterd.active()[("node-a", "npu-node-agent", "fault-0001")]
    assert stored.level == "SeparateNPU" and stored.added_at == T0
    assert stored.fault.faultCode == "020011001" and list(stored.fault.influence[0].deviceIds) == [0, 1]
    [received] = clusterd.requests
    assert received.code == 0 and received.request == request() and received.dropped == []
    assert clusterd.assertions("fault-0001") == ["occur"]


@pytest.mark.parametrize("overrides, reason", [
    (dict(id="short"), "invalid id"),
    (dict(id="bad id with spaces"), "invalid id"),
    (dict(timestamp=1_760_000_000), "invalid timestamp"),  # seconds, not ms
    (dict(timestamp=1_735_689_599_999), "invalid timestamp"),  # before 2025
    (dict(version="2.0"), "invalid version"),
    (dict(faults=[fault(f"fault-{i:04}") for i in range(101)]), "invalid faults length"),
])
def test_request_level_409(clusterd, client, overrides, reason):
    resp = client.send(request(**overrides))
    assert resp.code == 409
    assert resp.info == f"check public fault info failed, error: {reason}"
    assert clusterd.active() == {}


def test_no_valid_fault_is_409(clusterd, client):
    resp = client.send(request(fault(faultType="GPU")))
    assert (resp.code, resp.info) == (409, "check public fault info failed, error: there is no valid fault")
    assert clusterd.dropped_faults() == [("fault-0001", "invalid fault type")]
    assert clusterd.assertions("fault-0001") == []


@pytest.mark.parametrize("overrides", [
    dict(fault_id="bad"),
    dict(faultType="GPU"),
    dict(code="99999999"),  # 8 characters
    dict(code="999999999"),  # not in the config
    dict(faultTime=1_760_000_000),
    dict(assertion="clear"),
    dict(faultLocation={f"k{i}": "v" for i in range(11)}),
    dict(faultLocation={"k" * 17: "v"}),
    dict(influence=[]),
    dict(influence=[pb.PubFaultInfo(nodeName="node-a", deviceIds=[0]),
                    pb.PubFaultInfo(nodeName="Node_B", deviceIds=[0])]),
    dict(influence=[pb.PubFaultInfo(nodeSN="unknown-sn", deviceIds=[0])]),
    dict(influence=[pb.PubFaultInfo(nodeName="node-a", deviceIds=[])]),
    dict(influence=[pb.PubFaultInfo(nodeName="node-a", deviceIds=[1, 1])]),
    dict(influence=[pb.PubFaultInfo(nodeName="node-a", deviceIds=[32])]),
    dict(description="tab\there"),
])
def test_invalid_fault_dropped_silently(clusterd, client, overrides):
    resp = client.send(request(fault("good-fault-1"), fault(**{"fault_id": "bad-fault-1", **overrides})))
    assert resp.code == 0
    [(fault_id, reason)] = clusterd.dropped_faults()
    assert fault_id == overrides.get("fault_id", "bad-fault-1") and reason.startswith("invalid")
    assert [key[2] for key in clusterd.active()] == ["good-fault-1"]


def test_node_sn_and_several_influences(clock):
    with ClusterdStandIn(clock=clock, node_sns={"SN0001": "node-b"}) as clusterd:
        influence = [pb.PubFaultInfo(nodeName="node-a", deviceIds=[0]), pb.PubFaultInfo(nodeSN="SN0001", deviceIds=[3])]
        assert Client(clusterd.port).send(request(fault(influence=influence))).code == 0
        assert sorted(node for node, _, _ in clusterd.active()) == ["node-a", "node-b"]


def test_unknown_resource_is_410(clusterd, client):
    resp = client.send(request(resource="my-own-thing"))
    assert (resp.code, resp.info) == (410, "limiter work by resource failed")


def test_bucket_exhausted_also_by_invalid_requests(clock):
    with ClusterdStandIn(clock=clock, burst=2, rate_per_s=1.0) as clusterd:
        client = Client(clusterd.port)
        assert client.send(request(version="0.9")).code == 409  # invalid, still costs a token
        assert client.send(request(version="0.9")).code == 409
        assert client.send(request()).code == 410
        assert client.send(request(resource="CCAE")).code == 0  # buckets are per resource
        clock.advance(1.0)  # one token back
        assert client.send(request()).code == 0
        assert client.send(request()).code == 410
        clusterd.refill_now()
        assert [client.send(request()).code for _ in range(3)] == [0, 0, 410]


def test_occur_recover_after_defer_deletes_now(clusterd, client, clock):
    client.send(request(fault()))
    clock.at(6)
    assert client.send(request(fault(assertion="recover"))).code == 0
    assert clusterd.active() == {} and clusterd.queue() == []
    assert clusterd.assertions("fault-0001") == ["occur", "recover"]


def test_age_is_counted_in_whole_seconds(clusterd, client, clock):
    clock.at(0.9)
    client.send(request(fault("fault-0001"), fault("fault-0002")))  # both added at T0
    clock.at(5.0)  # 4.1 s later, but 5 whole seconds: deleted at once
    client.send(request(fault("fault-0001", assertion="recover")))
    assert list(clusterd.active()) == [("node-a", "npu-node-agent", "fault-0002")]
    clock.at(0.9 + 4.99)
    client.send(request(fault("fault-0003")))
    clock.at(9.99)  # 4.99 s later, but only 4 whole seconds: queued
    client.send(request(fault("fault-0003", assertion="recover")))
    assert clusterd.queue() == [(T0 + 10, ("node-a", "npu-node-agent", "fault-0003"))]


def test_recover_soon_after_occur_is_deferred(clusterd, client, clock):
    client.send(request(fault()))  # added at T0
    clock.at(1)
    client.send(request(fault(assertion="recover")))
    assert clusterd.queue() == [(T0 + 5, KEY)]
    # The idle loop polls every 0.5 s from the start (T0): it sees the entry at T0+1.5, when
    # floor(now) is T0+1, and sleeps 4 whole seconds.
    clock.at(5.4)
    assert KEY in clusterd.active()
    clock.at(5.5)
    assert clusterd.active() == {} and clusterd.queue() == []


def test_recover_of_an_absent_key_removes_a_later_occur(clusterd, client, clock):
    client.send(request(fault(assertion="recover")))  # absent: queued for T0+5 all the same
    assert clusterd.queue() == [(T0 + 5, KEY)]
    clock.at(2)
    client.send(request(fault()))
    assert KEY in clusterd.active()
    clock.at(5.4)
    assert KEY in clusterd.active()
    clock.at(5.5)  # the queued deletion removes whatever holds the key
    assert clusterd.active() == {}
    clock.at(6)
    client.send(request(fault()))  # nothing queued any more: this one stays
    clock.at(60)
    assert KEY in clusterd.active()


def test_duplicate_occur_ignored(clusterd, client, clock):
    client.send(request(fault(code="020011001")))
    clock.advance(2)
    assert client.send(request(fault(code="010011001"))).code == 0
    [stored] = clusterd.active().values()
    assert (stored.fault.faultCode, stored.added_at, stored.level) == ("020011001", T0, "SeparateNPU")


def test_once(clusterd, client, clock):
    client.send(request(fault(assertion="once", code="010011002")))
    [stored] = clusterd.active().values()
    assert stored.fault.assertion == "occur" and stored.level == "PreSeparateNPU"
    assert clusterd.queue() == [(T0 + 5, KEY)]
    clock.at(1)
    client.send(request(fault(assertion="once", code="010011002")))  # present: ignored, nothing queued
    assert len(clusterd.queue()) == 1
    clock.at(5.4)
    assert KEY in clusterd.active()
    clock.at(5.5)
    assert clusterd.active() == {}


def test_a_due_deletion_waits_behind_a_head_with_a_later_deadline(clusterd, client, clock):
    k2 = ("node-a", "npu-node-agent", "fault-0002")
    client.send(request(fault("fault-0002")))  # added at T0
    clock.at(3)
    client.send(request(fault("fault-0001", assertion="recover")))  # absent: deadline T0+8
    clock.at(3.2)
    client.send(request(fault("fault-0002", assertion="recover")))  # deadline T0+5, behind it
    assert clusterd.queue() == [(T0 + 8, KEY), (T0 + 5, k2)]
    # The loop's next poll, T0+3.5, finds the head not due and sleeps 5 s on it.
    clock.at(8.4)  # due since T0+5, still waiting: nothing is reordered
    assert k2 in clusterd.active()
    clock.at(8.5)  # the head goes, then the due entry right after it
    assert clusterd.active() == {} and clusterd.queue() == []


def test_the_phase_is_kept_back_to_back_and_reset_by_an_idle_poll(clock):
    a, b, c = (("node-a", "npu-node-agent", f"fault-000{i}") for i in (1, 2, 3))
    with ClusterdStandIn(clock=clock, poll_phase=0.9) as clusterd:  # polls at T0+0.9, +1.4, +1.9, ...
        client = Client(clusterd.port)
        client.send(request(fault("fault-0001", assertion="once")))  # deadline T0+5
        clock.at(1)
        client.send(request(fault("fault-0002", assertion="once")))  # deadline T0+6
        # The loop saw A at T0+0.9 and slept 5 s: A goes at deadline + 0.9.
        clock.at(5.8)
        assert {a, b} == set(clusterd.active())
        clock.at(5.9)
        assert [b] == list(clusterd.active())
        # B is drained right after A: slept 6 - 5 s from T0+5.9, so the phase .9 stays.
        clock.at(6.8)
        assert [b] == list(clusterd.active())
        clock.at(6.9)
        assert clusterd.active() == {}
        # Idle again: polls 0.5 s apart from the last deletion (T0+7.4, +7.9, +8.4): a new phase.
        clock.at(8)
        client.send(request(fault("fault-0003", assertion="once")))  # deadline T0+13
        clock.at(13.3)
        assert [c] == list(clusterd.active())
        clock.at(13.4)
        assert clusterd.active() == {}


def test_holds(clusterd, client):
    client.send(request(fault()))  # devices 0 and 1 of node-a
    assert clusterd.holds("node-a", 1) and clusterd.holds("node-a", 0, "020011001")
    assert not clusterd.holds("node-a", 2)
    assert not clusterd.holds("node-a", 1, "020011002")
    assert not clusterd.holds("node-b", 0)


def test_cache_cap_drops_adds_but_replies_ok(clock):
    with ClusterdStandIn(clock=clock, max_cached_faults=1) as clusterd:
        client = Client(clusterd.port)
        assert client.send(request(fault("fault-0001"), fault("fault-0002"))).code == 0
        assert [key[2] for key in clusterd.active()] == ["fault-0001"]


def test_config_from_file_and_level_precedence(tmp_path, clock):
    config = {"publicFaultCode": {"SubHealthFaultCodes": ["010011001"], "SeparateNPUCodes": ["010011001"]},
              "publicFaultResource": ["npu-node-agent"]}
    path = tmp_path / "publicCustomization.json"
    path.write_text(json.dumps(config))
    with ClusterdStandIn(str(path), clock=clock) as clusterd:
        client = Client(clusterd.port)
        assert client.send(request(fault(code="010011001"))).code == 0
        assert [s.level for s in clusterd.active().values()] == ["SeparateNPU"]
        assert client.send(request(resource="CCAE")).code == 410  # the file replaces the defaults
    assert "npu-node-agent" in DEFAULT_CONFIG["publicFaultResource"]


def test_unavailable_touches_nothing(clock):
    with ClusterdStandIn(clock=clock, burst=1) as clusterd:
        client = Client(clusterd.port)
        clusterd.unavailable(True)
        with pytest.raises(grpc.RpcError) as err:
            client.send(request())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert clusterd.requests == [] and clusterd.active() == {}
        clusterd.unavailable(False)
        assert client.send(request()).code == 0  # the only token was not spent


def test_stop_and_start_on_the_same_port(clusterd, client, clock):
    client.send(request(fault("fault-0001")))  # written at once
    client.send(request(fault("fault-0001", assertion="recover")))  # queued; the queue dies with the process
    port = clusterd.port
    clusterd.stop()
    assert clusterd.active() == {} and list(clusterd.persisted()) == [KEY]
    with pytest.raises(grpc.RpcError) as err:
        client.send(request(), timeout=1.0)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    clusterd.start()
    assert clusterd.port == port
    # Same channel: the client reconnects on its own.
    assert client.send(request(fault("fault-0002")), wait_for_ready=True).code == 0
    clock.advance(10)
    assert sorted(key[2] for key in clusterd.active()) == ["fault-0001", "fault-0002"]


def test_the_writer_lags_and_a_restart_loses_what_it_had_not_written(clusterd, client, clock):
    a, b, c = (("node-a", "npu-node-agent", f"fault-000{i}") for i in (1, 2, 3))
    client.send(request(fault("fault-0001")))  # the writer is idle: written at once, then it sleeps 1 s
    clock.at(0.5)
    client.send(request(fault("fault-0002")))  # waits for the end of the sleep
    assert list(clusterd.persisted()) == [a]
    clock.at(0.75)
    clusterd.restart()
    assert list(clusterd.active()) == [a]  # B is lost
    client.send(request(fault("fault-0002")), wait_for_ready=True)  # the new writer is idle: at once
    assert set(clusterd.persisted()) == {a, b}
    clock.at(1.0)
    client.send(request(fault("fault-0003")))
    clock.at(1.74)
    assert c not in clusterd.persisted()
    clock.at(1.75)  # the sleep that began at T0+0.75 ends: C is written
    assert set(clusterd.persisted()) == {a, b, c}
    clock.at(1.8)
    clusterd.restart()
    assert set(clusterd.active()) == {a, b, c}


def test_restart_without_the_configmap_comes_back_empty(clusterd, client, clock):
    client.send(request(fault()))
    clock.at(2)
    clusterd.restart(persisted=False)
    assert clusterd.active() == {} and clusterd.persisted() == {}


def test_reloaded_entries_are_occurs_added_at_the_reload(clusterd, client, clock):
    client.send(request(fault(faultLocation={"codes": "80E18402"})))
    assert clusterd.persisted() == {KEY: {
        "node": "node-a", "resource": "npu-node-agent", "faultId": "fault-0001", "faultType": "NPU",
        "faultCode": "020011001", "level": "SeparateNPU", "faultTime": NOW_MS, "deviceIds": [0, 1]}}
    clock.at(100)
    clusterd.restart()
    stored = clusterd.active()[KEY]
    assert (stored.added_at, stored.level, stored.device_ids) == (T0 + 100, "SeparateNPU", (0, 1))
    # Rebuilt from the stored fields: the location and description are gone.
    assert stored.fault == pb.Fault(faultId="fault-0001", faultType="NPU", faultCode="020011001",
                                    faultTime=NOW_MS, assertion="occur",
                                    influence=[pb.PubFaultInfo(nodeName="node-a", deviceIds=[0, 1])])
    clock.at(101)
    client.send(request(fault(assertion="recover")), wait_for_ready=True)  # young again: queued
    assert clusterd.queue() == [(T0 + 105, KEY)]
    clock.at(105.4)
    assert KEY in clusterd.active()
    clock.at(105.5)
    assert clusterd.active() == {}


def test_a_once_inside_its_window_survives_a_restart_for_good(clusterd, client, clock):
    client.send(request(fault(assertion="once")))
    clock.at(2)
    clusterd.restart()  # the pending deletion is lost; the entry was written
    clock.at(100)
    assert KEY in clusterd.active()


def test_reload_delay(clock):
    b = ("node-a", "npu-node-agent", "fault-0002")
    with ClusterdStandIn(clock=clock, reload_delay_s=3) as clusterd:
        client = Client(clusterd.port)
        client.send(request(fault("fault-0001"), fault("fault-0002")))
        clock.at(10)
        clusterd.restart()  # the reload runs at T0+13
        clock.at(10.2)
        assert clusterd.active() == {}
        # A recover of a persisted key before the reload: queued for T0+15.
        client.send(request(fault("fault-0002", assertion="recover")), wait_for_ready=True)
        clock.at(11)
        client.send(request(fault("fault-0001", code="010011001")))  # absent now: added
        assert clusterd.active()[KEY].fault.faultCode == "010011001"
        assert clusterd.persisted()[KEY]["faultCode"] == "020011001"  # the writer starts with the reload
        clock.at(13)
        stored = clusterd.active()[KEY]
        assert (stored.fault.faultCode, stored.level, stored.added_at) == ("020011001", "SeparateNPU", T0 + 13)
        assert b in clusterd.active()
        # The queued deletion removes the reloaded entry: the loop (started at T0+10) saw it at T0+10.5.
        clock.at(15.4)
        assert b in clusterd.active()
        clock.at(15.5)
        assert list(clusterd.active()) == [KEY]


def test_lose_persistence(clusterd, client, clock):
    b = ("node-a", "npu-node-agent", "fault-0002")
    client.send(request(fault("fault-0001")))
    clusterd.lose_persistence()
    assert clusterd.persisted() == {} and list(clusterd.active()) == [KEY]
    clock.at(2)
    client.send(request(fault("fault-0002")))  # the next write recreates it, with the whole cache
    assert set(clusterd.persisted()) == {KEY, b}
    clusterd.lose_persistence()
    clock.at(4)
    clusterd.restart()
    assert clusterd.active() == {}


def test_forget_all_is_a_restart_with_nothing_saved_that_keeps_connections(clock):
    with ClusterdStandIn(clock=clock, burst=2) as clusterd:
        client = Client(clusterd.port)
        client.send(request(fault("fault-0001"), fault("fault-0002", assertion="recover")))
        assert client.send(request()).code == 0  # the bucket is empty now
        clusterd.forget_all()
        assert clusterd.active() == {} and clusterd.persisted() == {} and clusterd.queue() == []
        assert client.send(request()).code == 0  # no reconnect needed (no wait_for_ready), and a full bucket
        assert list(clusterd.active()) == [KEY]


def test_the_persisted_list_goes_stale_above_4500_faults(clusterd, client, clock):
    for r in range(45):
        client.send(request(*(fault(f"fault-{r:02}-{i:03}") for i in range(100))))
    assert len(clusterd.persisted()) == 100  # the first write; the rest wait for the writer's sleep
    clock.at(1)
    assert len(clusterd.persisted()) == 4500
    client.send(request(fault("fault-one-more")))
    clock.at(2)
    assert len(clusterd.active()) == 4501 and len(clusterd.persisted()) == 4500
    clusterd.restart()
    assert len(clusterd.active()) == 4500


def test_delay_trips_client_deadline(clusterd, client):
    clusterd.delay(0.5)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        client.send(request(), timeout=0.1)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 0.4
    # Like ClusterD, the server still applies the call the client gave up on.
    clusterd.wait_for(lambda s: s.active(), timeout=2.0)
    assert [r.code for r in clusterd.requests] == [0]


def test_wait_for_times_out(clusterd):
    with pytest.raises(AssertionError):
        clusterd.wait_for(lambda s: s.requests, timeout=0.05)


def test_other_sender_keeps_the_delete_queue_busy():
    with ClusterdStandIn() as clusterd, OtherSender(clusterd.port, interval_s=0.5, jitter_s=0.25,
                                                    faults_per_request=1) as sender:
        first = clusterd.wait_for(lambda s: s.queue(), timeout=10)[0]

        def first_deleted(standin):
            pending = standin.queue()
            assert pending, "the delete queue went idle"
            return first not in pending

        # ~5.5 s: the first entry is deleted while later ones are still pending.
        clusterd.wait_for(first_deleted, timeout=30, interval=0.05)
        assert {key[0] for _, key in clusterd.queue()} == {"other-node"}
        assert clusterd.active() == {}  # recovers of absent keys add nothing
        started = time.monotonic()
    assert time.monotonic() - started < 1.5  # stopping the sender doesn't wait for a full interval
    assert sender.sent >= 5 and sender.rejected == sender.failed == 0


def test_unary_calls_over_the_interceptors_rate_fail_unknown_before_the_handler(clock):
    with ClusterdStandIn(clock=clock, unary_qps=2) as clusterd:
        client = Client(clusterd.port)
        assert [client.send(request(id=f"req-0000000{i}")).code for i in range(2)] == [0, 0]
        with pytest.raises(grpc.RpcError) as caught:
            client.send(request(id="req-00000003"))
        assert caught.value.code() == grpc.StatusCode.UNKNOWN
        assert caught.value.details() == "qps exceeded, method=/PubFault/SendPublicFault"
        assert len(clusterd.requests) == 2 and clusterd.qps_exceeded == 1  # no token of the resource spent
        clock.advance(0.5)
        assert client.send(request(id="req-00000004")).code == 0
        client.channel.close()


def own_connection(port: int) -> Client:
    client = Client.__new__(Client)
    client.channel = grpc.insecure_channel(f"127.0.0.1:{port}",
                                           options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
    client.stub = pb_grpc.PubFaultStub(client.channel)
    return client


@pytest.mark.parametrize("cap, in_grpc", [((2, None), False), ((10, 2), False), ((2, None), True)])
def test_connections_over_the_listeners_cap_are_reset_and_admitted_once_one_closes(clock, cap, in_grpc):
    with ClusterdStandIn(clock=clock, listener_cap=cap, cap_in_grpc=in_grpc) as clusterd:
        first, second, third = (own_connection(clusterd.port) for _ in range(3))
        assert first.send(request(id="req-00000001")).code == 0
        assert second.send(request(id="req-00000002")).code == 0
        with pytest.raises(grpc.RpcError) as caught:
            third.send(request(id="req-00000003"))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert clusterd.connections[:2] == (2, 2)
        if not in_grpc:  # gRPC's own cap: refusals are a lower bound from the socket table (CoreCap)
            assert clusterd.connections[2] >= 1
        assert len(clusterd.requests) == 2
        first.channel.close()
        wait_until(lambda: clusterd.connections[0] == 1, 5, "the closed connection released")
        wait_until(lambda: _sends(third), 5, "the third client admitted")
        second.channel.close()
        third.channel.close()


def _sends(client: Client) -> bool:
    try:
        return client.send(request(id="req-00000009"), timeout=1).code == 0
    except grpc.RpcError:
        return False


@pytest.mark.parametrize("in_grpc", [False, True])
def test_a_stop_closes_every_connection_of_the_capped_listener_and_a_start_listens_again(clock, in_grpc):
    with ClusterdStandIn(clock=clock, listener_cap=(4, None), cap_in_grpc=in_grpc) as clusterd:
        client = own_connection(clusterd.port)
        assert client.send(request()).code == 0
        assert clusterd.connections[0] == 1
        clusterd.stop()
        assert clusterd.connections[0] == 0
        with pytest.raises(grpc.RpcError) as caught:
            client.send(request(id="req-00000002"), timeout=1)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        clusterd.start()
        wait_until(lambda: _sends(client), 10, "the client connects to the restarted stand-in")
        assert clusterd.connections[0] == 1
        client.channel.close()
