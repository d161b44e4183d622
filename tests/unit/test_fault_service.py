"""The fault service's tasks: supervised, so a run that fails is restarted and later changes and files get through."""

from __future__ import annotations

import asyncio
import json

from agent import lifecycle as tasks
from agent.common.executor import Executor
from agent.config import FaultsConfig
from agent.model import DeviceInfo, Health, Level, Reading
from agent.faults.hub import FaultHub
from agent.faults.log import FaultLog
from agent.faults.service import FaultService
from testkit.wait import until

DEVICE = DeviceInfo(0, 0, 0, 0, "910B3", "910B3-Ascend-V1")


def test_a_pass_that_fails_is_restarted_and_the_next_file_loads(tmp_path):
    table = tmp_path / "faultCode.json"
    table.write_text(json.dumps({"NotHandleFaultCodes": ["12345678"]}))
    published: list = []

    def sink(changes) -> None:  # a sink with a bug: the reload's batch (the one at SeparateNPU) makes it raise
        published.append(changes)
        if changes[-1].state.level is Level.SeparateNPU:
            raise RuntimeError("sink failed")

    async def body():
        executor = Executor()
        fault_log = FaultLog(tmp_path / "faultlog", lane=executor.lane("fault-log"))
        fault_log.open()
        hub = FaultHub("n")
        service = FaultService(FaultsConfig(fault_code_file=str(table)), str(tmp_path), fault_log, hub,
                               files=executor.lane("rule-files"), once_hold_s=5, listeners=[sink],
                               reload_interval_s=0.05)
        before = tasks.restarts["faults/writer"]
        await service.start()
        try:
            service.on_inventory([DEVICE])
            service.on_reading(DEVICE, Reading(Health.UNHEALTHY, frozenset({0x12345678})), 0)
            service.on_polled()
            await until(lambda: hub.current, 20, "the first poll's findings in the hub")
            assert hub.latest(0).level is Level.NotHandleFault and published[-1][-1].state == hub.latest(0)
            table.write_text(json.dumps({"SeparateNPUCodes": ["12345678"]}))
            await until(lambda: tasks.restarts["faults/writer"] == before + 1, 20, "the pass whose sink fails")
            assert "RuntimeError: sink failed" in service.tasks.problem  # on /readyz until it runs well for 10 s
            table.write_text(json.dumps({"RestartNPUCodes": ["12345678"], "NotHandleFaultCodes": []}))
            await until(lambda: published[-1][-1].state.level is Level.RestartNPU, 20, "the next file's change handed on")
            assert fault_log.latest()[0].state.level is Level.RestartNPU
        finally:
            await service.stop()
            await fault_log.close_async()
            executor.close()

    asyncio.run(body())
