"""Self-test of the ClusterD stand-in, through a plain gRPC client over a real socket."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from agent._proto import pubfault_pb2 as pb
from agent._proto import pubfault_pb2_grpc as pb_grpc
from tests.fakes.clusterd import DEFAULT_CONFIG, ClusterdStandIn

T0 = 1_760_000_000.0  # fake-clock start, seconds
NOW_MS = 1_760_000_000_000
# Short reconnect backoff, so a call after the stand-in comes back doesn't wait ~1 s.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 100)]


class FakeClock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


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
    return FakeClock()


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
    clock.advance(6)
    assert client.send(request(fault(assertion="recover"))).code == 0
    assert clusterd.active() == {}
    assert clusterd.assertions("fault-0001") == ["occur", "recover"]


def test_recover_soon_after_occur_is_deferred(clusterd, client, clock):
    client.send(request(fault()))
    clock.advance(1)
    client.send(request(fault(assertion="recover")))
    assert len(clusterd.active()) == 1  # kept until added_at + 5 s
    clock.advance(3.9)
    assert len(clusterd.active()) == 1
    clock.advance(0.1)
    assert clusterd.active() == {}


def test_recover_before_occur(clusterd, client, clock):
    client.send(request(fault(assertion="recover")))
    clock.advance(2)
    client.send(request(fault()))
    assert len(clusterd.active()) == 1
    clock.advance(3)  # recover time + 5 s
    assert clusterd.active() == {}


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
    clock.advance(5)
    assert clusterd.active() == {}


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
    client.send(request(fault("fault-0001")))
    client.send(request(fault("fault-0001", assertion="recover")))  # deferred; the queue dies with the process
    port = clusterd.port
    clusterd.stop()
    with pytest.raises(grpc.RpcError) as err:
        client.send(request(), timeout=1.0)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    clusterd.start()
    assert clusterd.port == port
    # Same channel: the client reconnects on its own.
    assert client.send(request(fault("fault-0002")), wait_for_ready=True).code == 0
    clock.advance(10)
    assert sorted(key[2] for key in clusterd.active()) == ["fault-0001", "fault-0002"]


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
