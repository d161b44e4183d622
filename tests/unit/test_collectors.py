"""Every family has one owner: each collector describes the families it renders (so the registry
refuses a second collector of a family), and every fault sink offers what the rest of the agent reads
of it (agent.model.Sink), checked on the real sink classes."""

from __future__ import annotations

import pytest

from agent.common.executor import Executor
from agent.config import ClusterdConfig
from agent.faults.hub import FaultHub
from agent.faults.metrics import REVISION, FaultLogCollector
from agent.metrics import make_registry
from agent.model import Sink
from agent.sinks.clusterd.sink import ClusterdSink
from agent.sinks.configmap.sink import DeviceInfoConfigMapSink
from agent.sinks.events.sink import KubeEventsSink
from agent.sinks.nodecondition.sink import NodeConditionSink
from tests.support import gendocs

COLLECTORS = gendocs.collector_classes()


def shapes(families) -> list[tuple[str, str, tuple[str, ...], str]]:
    return [(f.name, f.type, tuple(f._labelnames), f.documentation) for f in families]


@pytest.mark.parametrize("collector", COLLECTORS, ids=lambda cls: cls.__name__)
def test_a_collector_describes_every_family_it_collects_and_describes_them_empty(collector):
    built = gendocs.build(collector)
    described = built.describe()
    assert described and all(family.samples == [] for family in described)
    assert len({family.name for family in described}) == len(described)
    assert set(shapes(built.collect())) <= set(shapes(described))


def test_every_collector_of_the_agent_registers_together_each_family_has_one_owner():
    assert len(COLLECTORS) >= 14  # the agent's own, ClusterD's, telemetry, profiling, datatrace, the proxy
    make_registry(*map(gendocs.build, COLLECTORS))


def test_the_registry_refuses_a_second_collector_of_a_family():
    class Impostor:
        def describe(self):
            return [REVISION.empty()]

        def collect(self):
            return []

    with pytest.raises(ValueError, match="npu_agent_fault_log_revision"):
        make_registry(FaultLogCollector("n", gendocs.Nothing()), Impostor())


def test_every_sink_is_a_sink():
    empty_log = gendocs.Nothing()  # a fault log with nothing in it
    kube, hub = Executor(name="test").lane("kube"), FaultHub("n")
    sinks = [ClusterdSink(ClusterdConfig(), "n", empty_log),
             DeviceInfoConfigMapSink("n", hub, lambda: "910B3", kube=kube),
             NodeConditionSink("n", hub, lambda phy: (), polled=lambda: True, driver_problem=lambda: "", kube=kube),
             KubeEventsSink("n", hub, lambda phy: (), kube=kube)]
    assert [isinstance(sink, Sink) for sink in sinks] == [True] * 4
    assert [[write.what for write in sink.writes] for sink in sinks] == [["ClusterD sink's cursor"], [], [], []]
    assert len({sink.name for sink in sinks}) == 4  # their `sink` label tells them apart
    assert not isinstance(FaultHub("n"), Sink)  # the stream's hub is not delivered to from the log
