"""The fault component: feeds driver observations to the engine and publishes what changed.

It owns the engine's surroundings: the rule tables and their reload on change (read off the event
loop), the escalation history in `state_dir`, and the timer that lets time-based rules fire without
new input.

Changes reach the hub and the sinks only once they are in the durable fault log. The writer task
appends them, in order, off the event loop, then hands them on. While the log cannot be written
(disk full, read-only), the latest state of each changed device waits here and the write is
retried with backoff; /readyz says so, and nothing is published out of order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from agent.config import FaultsConfig
from agent.model import (MIN_TIME_MS, Assertion, Change, DeviceInfo, DeviceState, DriverEvent, Level,
                         Reading)
from agent.common.executor import Lane
from agent.common.errors import MAX_PROBLEMS, ConfigError, Once
from agent.faults.rules.codes import FaultCodeTable, load_fault_code_table
from agent.faults.rules.customization import Customization, load_customization
from agent.faults.rules.engine import EngineSettings, FaultEngine
from agent.faults.hub import FaultHub
from agent.faults.log import FaultLog
from agent.common.fsutil import WriteRetry, file_identity, read_state
from agent.lifecycle import Tasks

log = logging.getLogger(__name__)

HISTORY_FILE = "fault-history.json"
RULE_READ_TIMEOUT_S = 10.0  # rule files that take longer to read fail the reload task (/readyz says so)


def load_tables(config: FaultsConfig) -> tuple[FaultCodeTable, Customization]:
    """Both rule files; raises ConfigError naming the file and every problem in it."""
    problems: list[str] = []
    table = customization = None
    try:
        table = load_fault_code_table(config.fault_code_file)
    except ConfigError as exc:
        problems += exc.problems
    try:
        customization = load_customization(config.customization_file)
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        raise ConfigError(problems)
    return table, customization


class FaultService:
    name = "faults"

    def __init__(self, config: FaultsConfig, state_dir: str, fault_log: FaultLog, hub: FaultHub, *,
                 files: Lane, once_hold_s: float, listeners: Sequence[Callable[[list[Change]], None]] = (),
                 clock: Callable[[], float] = time.time, reload_interval_s: float = 2.0):
        self._config = config
        self._history_path = Path(state_dir) / HISTORY_FILE
        self._log = fault_log
        self._hub = hub
        self._listeners = tuple(listeners)  # sinks woken after each durable append
        self._clock = clock
        self._reload_interval_s = reload_interval_s
        self._table_error = ""
        self._watched = self._identities()
        try:
            table, customization = load_tables(config)
        except ConfigError as exc:
            # Keep detecting with the built-in table rather than not at all; /readyz says why.
            self._table_error = "; ".join(exc.problems)
            log.error("fault rule files are invalid; using the built-in table until they are fixed",
                      extra={"problems": exc.problems})
            table, customization = load_fault_code_table(""), load_customization("")
        self._log_table(table, customization)
        unknown = Level.parse(config.unknown_code_level) if config.unknown_code_level else None
        self.engine = FaultEngine(table, customization, EngineSettings(unknown, int(once_hold_s * 1000)))
        self.reloads = {"success": 0, "failure": 0}
        self._history_loaded = False
        self._timer: asyncio.TimerHandle | None = None
        self.tasks = Tasks(self.name)
        # Rule files are read in this lane: a file on a hung file system holds up a thread, never the
        # loop (nor SIGTERM: the thread is a daemon).
        self._files = files
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started_ms = self._now_ms()
        self.clamped_times = 0  # driver fault times older than this process, replaced by when it saw them
        self._clamped_first = Once()  # (device, code) whose clamped time was logged
        self._unwritten: list[DeviceState] = []  # changes not in the fault log yet, in order
        self._newest: dict[int, DeviceState] = {}  # each device's last change, written or not
        self._dirty = asyncio.Event()  # wakes the writer
        self._polled = False  # every device was read once: the hub is current once that is written
        self._log_writes, self._history_writes = WriteRetry("fault log"), WriteRetry("escalation history")
        self.writes = (self._log_writes, self._history_writes)

    # ---- component --------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.tasks.start("writer", self._write, reset=self._dirty.set)
        self.tasks.start("rule-reload", self._watch_files, reset=self._forget_files)

    async def stop(self) -> None:
        await self.tasks.stop()
        self._files.close()
        if self._timer is not None:
            self._timer.cancel()
        await self._flush()  # what changed since the writer's last pass
        await self._save_history(always=True)

    def readiness(self) -> tuple[bool, str]:
        problems = [f"fault rule files invalid: {self._table_error}" if self._table_error else "",
                    *(w.problem for w in self.writes), self._log.stalled]
        problems = [p for p in problems if p]
        return not problems, "; ".join(problems)

    # ---- what the metrics read (agent.faults.metrics), so they need not know the engine ------

    def states(self) -> list[DeviceState]:
        """Every device's fault state as the engine holds it now (logged or not yet)."""
        return self.engine.states()

    @property
    def event_counts(self) -> Mapping[str, int]:
        """Fault events applied, by assertion (occur / recover / once)."""
        return self.engine.event_counts

    # ---- FaultObserver ------------------------------------------------------------------------

    def on_inventory(self, devices: list[DeviceInfo]) -> None:
        now = self._now_ms()
        changes: list[DeviceState] = []
        last_known = self._log.latest()
        for device in devices:
            changes += self.engine.add_device(device.phy_id, device.logic_id, now)
        self._hub.chip_name = devices[0].chip_name if devices else ""
        if not self._history_loaded:
            self._history_loaded = True
            # Escalations first: the devices are not observed yet, so nothing is rendered until the
            # seed below renders each device once, with its escalated level (an occurrence that goes
            # on across the restart keeps its start, hence its public faultId).
            # All or nothing: a history of the wrong shape is moved aside and the engine starts without it.
            changes += read_state(self._history_path, "escalation history",
                                  lambda doc: self.engine.import_history(doc, now), self._clock) or []
            # Start from what was known before the restart: a fault still present keeps its start,
            # and a driver that does not answer yet does not make faults vanish. Not from a log that
            # lost records: what it says last may be long over.
            for device in devices if not self._log.resets else ():
                last = last_known.get(device.phy_id)
                if last is not None:
                    raw = [(c.code, self._fault_time(device.phy_id, c.code, c.since_ms, now, MIN_TIME_MS))
                           for c in last.state.codes if not c.escalated_by]
                    changes += self.engine.seed(device.phy_id, raw, last.state.health, now,
                                                last.state.level, last.state.level_since_ms)
        self._publish(changes)

    def on_polled(self) -> None:
        self._polled = True
        self._dirty.set()

    def on_event(self, device: DeviceInfo, event: DriverEvent) -> None:
        """An event whose assertion is occur, recover or once (the monitor skips any other)."""
        now = self._now_ms()
        # The driver's clock, in whole seconds: a time before this process started cannot be checked
        # against anything this process saw (a stale or broken clock reports 1970 or last year).
        raised_ms = (self._fault_time(device.phy_id, event.code, event.raised_s * 1000, now, self._started_ms - 1000)
                     if event.raised_s else None)
        self._publish(self.engine.on_event(device.phy_id, event.code, Assertion(event.assertion), event.severity,
                                           raised_ms, now))

    def on_reading(self, device: DeviceInfo, reading: Reading, started_ms: int) -> None:
        self._publish(self.engine.on_reading(device.phy_id, reading.codes, reading.health, self._now_ms(),
                                             started_ms))

    # ---- internals ----------------------------------------------------------------------------

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _fault_time(self, phy_id: int, code: int, time_ms: int, now_ms: int, oldest_ms: int) -> int:
        """A fault time before `oldest_ms` (or before 2025, which ClusterD refuses) is not believable:
        the fault starts when this process first saw it."""
        if time_ms >= max(oldest_ms, MIN_TIME_MS):
            return time_ms
        self.clamped_times += 1
        if self._clamped_first((phy_id, code)):
            log.warning("fault time too old to be true; using when the agent first saw the fault", extra={
                "device": phy_id, "code": f"{code:08X}", "fault_time_ms": time_ms, "now_ms": now_ms})
        return now_ms

    def _publish(self, changes: list[DeviceState]) -> None:
        for state in changes:
            previous = self._newest.get(state.phy_id, self._hub.latest(state.phy_id))
            self._newest[state.phy_id] = state
            quiet = not state.faulty and (previous is None or not previous.faulty)
            (log.debug if quiet else log.info)("device fault state changed", extra={
                "device": state.phy_id, "logic_id": state.logic_id, "fault_level": state.level.name,
                "health": int(state.health), "codes": [f"{c.text}:{c.level.name}" + (f"({c.escalated_by})" if c.escalated_by else "")
                                                       for c in state.codes]})
        self._unwritten += changes
        self._dirty.set()
        self._arm_timer()

    async def _write(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            retry_s = await self._flush()
            await self._save_history()
            if retry_s is not None:  # again after the backoff, or at the next change
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._dirty.wait(), retry_s)
                self._dirty.set()

    async def _flush(self) -> float | None:
        """Write what changed to the fault log, then hand it on; on failure keep it (the latest
        state of each device) and return the seconds until the next try."""
        latest = {phy: change.state for phy, change in self._log.latest().items()}
        batch, self._unwritten = self._unwritten, []
        fresh = []
        for state in batch:  # a state the log already has last for its device is not written again
            if latest.get(state.phy_id) != state:
                fresh.append(state)
                latest[state.phy_id] = state
        appended = []
        if fresh:
            try:
                appended = await self._log.append_async(fresh)
            except OSError as exc:
                kept = {state.phy_id: state for state in [*fresh, *self._unwritten]}
                self._unwritten = list(kept.values())
                return self._log_writes.failed(exc, devices=sorted(kept))
            self._log_writes.succeeded()
        if appended:
            self._hub.publish(appended)
        if self._polled and not self._unwritten:
            self._hub.current = True  # the first poll's findings are in the log and the hub
        if appended:
            for listener in self._listeners:
                listener(appended)
        return None

    def _arm_timer(self) -> None:
        if self._loop is None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.engine.next_deadline_ms()
        if deadline is not None:
            delay = max(0.0, (deadline - self._now_ms()) / 1000)
            self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._publish(self.engine.tick(self._now_ms()))

    async def _save_history(self, always: bool = False) -> None:
        if not (always or self.engine.history_dirty):
            return
        data = json.dumps(self.engine.export_history(), sort_keys=True).encode()
        try:
            await self._log.save_file(self._history_path, data)
        except OSError as exc:
            self.engine.history_dirty = True  # tried again with the next change (the engine holds it meanwhile)
            self._history_writes.failed(exc, path=str(self._history_path))
            return
        self._history_writes.succeeded()

    def _identities(self) -> tuple:
        return tuple(file_identity(p) if p else None
                     for p in (self._config.fault_code_file, self._config.customization_file))

    def _load_if_changed(self, watched: tuple) -> tuple[tuple, object]:
        """(identities now, None when they are `watched`, else the tables or the ConfigError); blocking."""
        current = self._identities()
        if current == watched:
            return current, None
        try:
            return current, load_tables(self._config)
        except ConfigError as exc:
            return current, exc

    async def _watch_files(self) -> None:
        while True:
            await asyncio.sleep(self._reload_interval_s)
            current, loaded = await self._files.run(self._load_if_changed, self._watched, timeout=RULE_READ_TIMEOUT_S,
                                                    key="rule-files")
            if loaded is not None:
                self._watched = current
                self._apply(loaded)

    def _forget_files(self) -> None:
        """Before a restart of the watcher: read the files again, whatever the failed run saw of them."""
        self._watched = ()

    def _apply(self, loaded: tuple[FaultCodeTable, Customization] | ConfigError) -> None:
        """New rules in force, or a bad file that keeps the rules in force and says why."""
        if isinstance(loaded, ConfigError):
            self.reloads["failure"] += 1
            self._table_error = "; ".join(loaded.problems)
            log.error("fault rule reload failed; the previous rules stay in force", extra={"problems": loaded.problems})
            return
        table, customization = loaded
        self.reloads["success"] += 1
        self._table_error = ""
        self._log_table(table, customization)
        self._publish(self.engine.reconfigure(table, customization, self._now_ms()))

    @staticmethod
    def _log_table(table: FaultCodeTable, customization: Customization) -> None:
        warnings = [*table.warnings, *customization.warnings]
        for warning in warnings[:MAX_PROBLEMS]:
            log.warning(warning)
        if len(warnings) > MAX_PROBLEMS:
            log.warning("more fault rule warnings not logged", extra={"count": len(warnings) - MAX_PROBLEMS})
        log.info("fault rules loaded", extra={
            "fault_codes": table.source, "codes": len(table), "customization": customization.source,
            "frequency_rules": len(set(customization.frequency.values())),
            "duration_rules": len(set(customization.duration.values()))})
