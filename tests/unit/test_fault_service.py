"""The fault service's rule-file watcher: supervised, so a run that fails is restarted and later files load."""

from __future__ import annotations

import asyncio
import json

from agent import lifecycle as tasks
from agent.config import FaultsConfig
from agent.model import DeviceInfo, Health, Level, Reading
from agent.faults.hub import FaultHub
from agent.faults.log import FaultLog
from agent.faults.service import FaultService
from testkit.wait import until

DEVICE = DeviceInfo(0, 0, 0, 0, "910B3", "910B3-Ascend-V1")


def test_a_reload_that_fails_is_restarted_and_the_next_file_loads(tmp_path):
    table = tmp_path / "faultCode.json"
    table.write_text(json.dumps({"NotHandleFaultCodes": ["12345678"]}))
    published: list = []

    def sink(changes) -> None:  # a sink with a bug: the second batch (the first reload's) makes it raise
        published.append(changes)
        if len(published) == 2:
            raise RuntimeError("sink failed")

    async def body():
        fault_log = FaultLog(tmp_path / "faultlog")
        fault_log.open()
        service = FaultService(FaultsConfig(fault_code_file=str(table)), str(tmp_path), fault_log, FaultHub("n"),
                               once_hold_s=5, listeners=[sink], reload_interval_s=0.05)
        before = tasks.restarts["faults/rule-reload"]
        await service.start()
        try:
            service.on_inventory([DEVICE])
            service.on_reading(DEVICE, Reading(Health.UNHEALTHY, frozenset({0x12345678})), 0)
            assert service.engine.state(0).level is Level.NotHandleFault and len(published) == 1
            table.write_text(json.dumps({"SeparateNPUCodes": ["12345678"]}))
            await until(lambda: len(published) == 2, 20, "the reload that fails")
            table.write_text(json.dumps({"RestartNPUCodes": ["12345678"], "NotHandleFaultCodes": []}))
            await until(lambda: service.engine.state(0).level is Level.RestartNPU, 20, "the next file in force")
            assert tasks.restarts["faults/rule-reload"] == before + 1
            assert "RuntimeError: sink failed" in service.tasks.problem  # on /readyz until it runs well for 10 s
        finally:
            await service.stop()
            fault_log.close()

    asyncio.run(body())
