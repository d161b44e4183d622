"""How many threads the real agent runs, counted from /proc/<pid>/task: at idle with the default
features (fake driver, pod attribution, disk guard, step metrics), and while every driver call hangs."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from agent.app import DRIVER_LANE
from tests.integration.conftest import CARDS
from testkit.wait import wait_until

# gRPC's C core: a timer thread, the thread pool's lifeguard, and its reserve of workers, which it
# sizes from the CPUs the machine has (sysconf _SC_NPROCESSORS_CONF, clamped to 4..16).
GRPC_C = ("grpc_global_tim", "lifeguard", "event_engine")
GRPC_C_THREADS = 2 + min(16, max(4, os.sysconf("SC_NPROCESSORS_CONF")))
# Everything else: the loop's thread, gRPC's Python poller, the executor's driver lane at idle, the
# two profiling followers' lanes (a thread each while they walk, ended after a minute idle), and the fake
# driver's control-socket thread; plus one for a rule-file read or a fault-log write that finds
# every driver thread busy.
OTHER_THREADS = 1 + 1 + DRIVER_LANE[0] + 2 + 1 + 1


def threads(pid: int) -> tuple[list[str], list[str]]:
    """(gRPC's C threads, the others) of `pid`, by their kernel names."""
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # ended meanwhile
            pass
    grpc_c = [name for name in names if name.startswith(GRPC_C)]
    return grpc_c, [name for name in names if not name.startswith(GRPC_C)]


def polls(agent) -> float:
    return agent.metric("npu_agent_device_polls_total") or 0


def test_an_idle_agent_runs_few_threads(start_agent):
    agent, _ = start_agent(devices={"poll_interval_seconds": 0.5})
    wait_until(lambda: polls(agent) >= 4 * CARDS, 20, "four poll rounds")
    grpc_c, others = threads(agent.process.pid)
    assert len(grpc_c) <= GRPC_C_THREADS, grpc_c
    assert len(others) <= OTHER_THREADS, others
    assert agent.metric("npu_agent_executor_threads") <= DRIVER_LANE[0] + 1


def test_every_read_hanging_holds_one_thread_per_device_and_sigterm_still_ends_the_agent(start_agent):
    agent, fake = start_agent(devices={"poll_interval_seconds": 0.5})
    fake.hang("dcmi_get_device_health", 600)
    # Each device's read is stuck once (its next ones are refused at once), in threads of its own.
    wait_until(lambda: (agent.metric("npu_agent_driver_call_timeouts_total") or 0) >= CARDS, 20,
               "a stuck read for every device")
    wait_until(lambda: agent.metric("npu_agent_executor_calls", lane="driver", state="stuck") == CARDS, 20,
               "one stuck read per device")
    start = polls(agent)
    wait_until(lambda: polls(agent) >= start + 4 * CARDS, 20, "four more poll rounds")
    assert agent.metric("npu_agent_executor_calls", lane="driver", state="stuck") == CARDS  # not one more
    assert agent.metric("npu_agent_executor_calls_refused_total", lane="driver") >= 4 * CARDS
    _, others = threads(agent.process.pid)
    assert len(others) <= OTHER_THREADS + CARDS, others
    assert agent.http("/healthz")[0] == 200
    assert agent.stop() < 10


def test_server_reflection_answers_on_demand(start_agent):
    agent, _ = start_agent()
    with grpc.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "grpc.health.v1.Health" in services and "grpc.reflection.v1alpha.ServerReflection" in services
    assert any(name.startswith("npu") for name in services), services
