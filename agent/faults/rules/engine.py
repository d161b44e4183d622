"""The fault engine: a pure function of driver observations, the rule tables and the time.

It keeps, per device, the codes the driver reports, the one-off events still on show, and the
escalation state of the customization rules (frequency and duration). Every input returns the
devices whose public state changed. Time is always passed in (unix milliseconds), so tests drive
it with a fake clock and nothing here sleeps, reads files or touches the driver.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from agent.faults.rules.codes import FaultCodeTable
from agent.faults.rules.customization import NEVER_RELEASE_S, NO_CUSTOMIZATION, Customization
from agent.model import ActiveCode, Assertion, DeviceState, Health, Level

FREQUENCY = "FaultFrequency"
DURATION = "FaultDuration"


@dataclass(frozen=True)
class EngineSettings:
    unknown_code_level: Level | None = None  # None: follow the driver's severity like the device plugin
    once_hold_ms: int = 5000  # a one-off event stays on show this long (one device-plugin cycle)


@dataclass
class _Track:
    """One code on one device."""

    since_ms: int
    active: bool = False  # the driver reports it
    active_since_ms: int | None = None  # when we saw it become active (duration timing)
    once_until_ms: int | None = None  # on show for a one-off event until then
    duration_escalated: bool = False
    held_since_ms: int | None = None  # escalated by duration and clear since then

    @property
    def alive(self) -> bool:
        return self.active or self.once_until_ms is not None or self.duration_escalated


@dataclass
class _Escalation:
    """A frequency escalation: stays until the code has been quiet for `release_s`."""

    level: Level
    since_ms: int
    release_s: int
    quiet_since_ms: int | None = None


@dataclass(eq=False)
class _Device:
    phy_id: int
    logic_id: int
    health: Health = Health.HEALTHY
    tracks: dict[int, _Track] = field(default_factory=dict)
    occurrences: dict[int, list[int]] = field(default_factory=dict)  # code -> times counted by a frequency rule
    escalations: dict[int, _Escalation] = field(default_factory=dict)  # code -> frequency escalation
    deadline_ms: int | None = None  # the next time something changes by time alone
    observed: bool = False  # published only once the driver (or the last known state) said something
    level: Level = Level.NormalNPU  # as last rendered
    level_since_ms: int = 0


class FaultEngine:
    def __init__(self, table: FaultCodeTable, customization: Customization = NO_CUSTOMIZATION,
                 settings: EngineSettings = EngineSettings()):
        self.table = table
        self.rules = customization
        self.settings = settings
        self._devices: dict[int, _Device] = {}
        self._published: dict[int, DeviceState] = {}
        self._severity: dict[int, int] = {}  # last severity the driver gave each code
        self.event_counts: Counter[str] = Counter()  # occur / recover / once, by assertion name
        self.history_dirty = False  # escalation history changed since the last export

    # ---- inputs -------------------------------------------------------------------------------

    def add_device(self, phy_id: int, logic_id: int, now_ms: int) -> list[DeviceState]:
        device = self._devices.get(phy_id)
        if device is None:
            device = self._devices[phy_id] = _Device(phy_id, logic_id)
        else:
            device.logic_id = logic_id
        return self._finish(now_ms, [device])

    def seed(self, phy_id: int, codes: list[tuple[int, int]], health: Health, now_ms: int,
             level: Level = Level.NormalNPU, level_since_ms: int = 0) -> list[DeviceState]:
        """Start from the last known state (after a restart): these (code, since_ms) are taken as
        active until a reading says otherwise, so a driver that does not answer yet recovers nothing
        and a code still present keeps its original start. The last level and its start carry on,
        so an occurrence that continues keeps its identity."""
        device = self._devices.get(phy_id)
        if device is None:
            return []
        device.level, device.level_since_ms = level, max(device.level_since_ms, level_since_ms)
        for code, since_ms in codes:
            track = device.tracks.setdefault(code, _Track(since_ms=since_ms))
            track.since_ms = min(track.since_ms, since_ms)
            track.active, track.active_since_ms = True, now_ms
        device.health = health
        device.observed = True
        return self._finish(now_ms, [device])

    def on_event(self, phy_id: int, code: int, assertion: Assertion, severity: int | None,
                 raised_ms: int | None, now_ms: int) -> list[DeviceState]:
        """A driver fault event. `raised_ms` is the driver's own timestamp when it gave one."""
        device = self._devices.get(phy_id)
        if device is None:
            return []
        self._advance_device(device, now_ms)  # time-outs due before this input apply first
        device.observed = True
        if severity is not None:
            self._severity[code] = severity
        self.event_counts[assertion.name.lower()] += 1
        if assertion is Assertion.OCCUR:
            self._occur(device, code, raised_ms or now_ms, now_ms)
        elif assertion is Assertion.RECOVER:
            self._recover(device, code, now_ms)
        else:
            self._once(device, code, raised_ms or now_ms, now_ms)
        return self._finish(now_ms, [device])

    def on_reading(self, phy_id: int, codes: frozenset[int] | None, health: Health,
                   now_ms: int, started_ms: int | None = None) -> list[DeviceState]:
        """A poll of the device. `codes` None means they could not be read: the last known stay.

        `started_ms` is when the read began: a code that an event raised after that is newer than
        the reading, so the reading's silence about it does not recover it.
        """
        started_ms = now_ms if started_ms is None else started_ms
        device = self._devices.get(phy_id)
        if device is None:
            return []
        self._advance_device(device, now_ms)
        device.observed = True
        device.health = health
        if codes is not None:
            # Mend lost events: what the driver lists is the truth about persistent codes.
            for code in sorted(codes):
                track = device.tracks.get(code)
                if track is None or not track.active:
                    self.event_counts["occur"] += 1
                    self._occur(device, code, now_ms, now_ms)
            for code, track in list(device.tracks.items()):
                if track.active and code not in codes and (track.active_since_ms or 0) < started_ms:
                    self.event_counts["recover"] += 1
                    self._recover(device, code, now_ms)
        return self._finish(now_ms, [device])

    def tick(self, now_ms: int) -> list[DeviceState]:
        """Apply what time alone changes (rule time-outs, release windows, one-off events ending)."""
        return self._finish(now_ms, [])

    def reconfigure(self, table: FaultCodeTable, customization: Customization,
                    now_ms: int) -> list[DeviceState]:
        """New tables: every device is classified again; escalations already granted stay."""
        self.table = table
        self.rules = customization
        for device in self._devices.values():
            for code, track in device.tracks.items():
                if track.duration_escalated and code not in customization.duration:
                    track.duration_escalated = False
                    track.held_since_ms = None
                    self.history_dirty = True
        return self._finish(now_ms, list(self._devices.values()))

    def next_deadline_ms(self) -> int | None:
        """The earliest time at which `tick` would change something, if any."""
        return min((d.deadline_ms for d in self._devices.values() if d.deadline_ms is not None), default=None)

    # ---- outputs ------------------------------------------------------------------------------

    def states(self) -> list[DeviceState]:
        return [self._published[phy] for phy in sorted(self._published)]

    def state(self, phy_id: int) -> DeviceState | None:
        return self._published.get(phy_id)

    def export_history(self) -> dict:
        """The escalation history worth keeping across restarts (JSON-ready)."""
        self.history_dirty = False
        devices = {}
        for device in self._devices.values():
            entry = {
                "occurrences": {f"{c:X}": list(times) for c, times in device.occurrences.items() if times},
                "frequency": {
                    f"{c:X}": {"level": e.level.name, "since_ms": e.since_ms, "release_s": e.release_s,
                               "quiet_since_ms": e.quiet_since_ms}
                    for c, e in device.escalations.items()
                },
                "duration": {
                    f"{c:X}": {"since_ms": t.since_ms, "held_since_ms": t.held_since_ms}
                    for c, t in device.tracks.items() if t.duration_escalated
                },
            }
            if any(entry.values()):
                devices[str(device.phy_id)] = entry
        return {"version": 1, "devices": devices}

    def import_history(self, history: dict, now_ms: int) -> list[DeviceState]:
        """Restore what `export_history` wrote; devices must be added first (unknown ones are skipped).

        All or nothing: ValueError (nothing applied) when the history has the wrong shape."""
        try:
            parsed = []
            for phy_text, entry in history.get("devices", {}).items():
                occurrences = {int(code, 16): sorted(int(t) for t in times)
                               for code, times in entry.get("occurrences", {}).items()}
                frequency = {int(code, 16): _Escalation(
                    Level[item["level"]], int(item["since_ms"]), int(item["release_s"]),
                    None if item.get("quiet_since_ms") is None else int(item["quiet_since_ms"]))
                    for code, item in entry.get("frequency", {}).items()}
                duration = {int(code, 16): _Track(
                    since_ms=int(item["since_ms"]), duration_escalated=True,
                    held_since_ms=now_ms if item.get("held_since_ms") is None else int(item["held_since_ms"]))
                    for code, item in entry.get("duration", {}).items()}
                parsed.append((int(phy_text), occurrences, frequency, duration))
        except (AttributeError, KeyError, TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"escalation history of the wrong shape: {type(exc).__name__}: {exc}") from None
        for phy, occurrences, frequency, duration in parsed:
            device = self._devices.get(phy)
            if device is None:
                continue
            device.occurrences.update(occurrences)
            device.escalations.update(frequency)
            device.tracks.update(duration)
        return self._finish(now_ms, list(self._devices.values()))

    # ---- the rules ----------------------------------------------------------------------------

    def _occur(self, device: _Device, code: int, since_ms: int, now_ms: int) -> None:
        track = device.tracks.get(code)
        if track is None:
            track = device.tracks[code] = _Track(since_ms=min(since_ms, now_ms))
        elif not track.alive:
            track.since_ms = min(since_ms, now_ms)
        if track.active:
            return
        track.active = True
        track.active_since_ms = now_ms
        track.once_until_ms = None
        track.held_since_ms = None  # re-occurring inside the recover window keeps the escalation
        if code not in self.rules.duration:
            self._count_occurrence(device, code, now_ms)

    def _recover(self, device: _Device, code: int, now_ms: int) -> None:
        track = device.tracks.get(code)
        if track is None or not track.active:
            return
        track.active = False
        track.active_since_ms = None
        if track.duration_escalated:
            track.held_since_ms = now_ms

    def _once(self, device: _Device, code: int, since_ms: int, now_ms: int) -> None:
        track = device.tracks.get(code)
        if track is None:
            track = device.tracks[code] = _Track(since_ms=min(since_ms, now_ms))
        if not track.active:
            track.once_until_ms = now_ms + self.settings.once_hold_ms
        self._count_occurrence(device, code, now_ms)

    def _count_occurrence(self, device: _Device, code: int, now_ms: int) -> None:
        rule = self.rules.frequency.get(code)
        if rule is None:
            return
        window_start = now_ms - rule.window_s * 1000
        times = [t for t in device.occurrences.get(code, []) if t > window_start]
        times.append(now_ms)
        device.occurrences[code] = times
        self.history_dirty = True
        if len(times) >= rule.times and code not in device.escalations:
            device.escalations[code] = _Escalation(rule.level, now_ms, rule.release_s)

    def _advance_device(self, device: _Device, now_ms: int) -> None:
        """Apply every time-out of `device` due at `now_ms`."""
        if device.deadline_ms is None or now_ms < device.deadline_ms:
            return
        for code, track in device.tracks.items():
            if track.once_until_ms is not None and now_ms >= track.once_until_ms:
                track.once_until_ms = None
            rule = self.rules.duration.get(code)
            if rule is None:
                continue
            if (track.active and not track.duration_escalated and track.active_since_ms is not None
                    and now_ms - track.active_since_ms >= rule.fault_timeout_s * 1000):
                track.duration_escalated = True
                self.history_dirty = True
                # With a duration rule, the frequency rule counts time-outs, not raw occurrences.
                self._count_occurrence(device, code, track.active_since_ms + rule.fault_timeout_s * 1000)
            if (track.duration_escalated and track.held_since_ms is not None
                    and now_ms - track.held_since_ms >= rule.recover_timeout_s * 1000):
                track.duration_escalated = False
                track.held_since_ms = None
                self.history_dirty = True
        for code, escalation in list(device.escalations.items()):
            if (escalation.quiet_since_ms is not None and escalation.release_s < NEVER_RELEASE_S
                    and now_ms - escalation.quiet_since_ms >= escalation.release_s * 1000):
                del device.escalations[code]
                device.occurrences.pop(code, None)  # a released chip starts counting afresh
                self.history_dirty = True

    def _deadline(self, device: _Device) -> int | None:
        deadlines: list[int] = []
        for code, track in device.tracks.items():
            if track.once_until_ms is not None:
                deadlines.append(track.once_until_ms)
            rule = self.rules.duration.get(code)
            if rule is None:
                continue
            if track.active and not track.duration_escalated and track.active_since_ms is not None:
                deadlines.append(track.active_since_ms + rule.fault_timeout_s * 1000)
            if track.duration_escalated and track.held_since_ms is not None:
                deadlines.append(track.held_since_ms + rule.recover_timeout_s * 1000)
        for escalation in device.escalations.values():
            if escalation.quiet_since_ms is not None and escalation.release_s < NEVER_RELEASE_S:
                deadlines.append(escalation.quiet_since_ms + escalation.release_s * 1000)
        return min(deadlines, default=None)

    def _finish(self, now_ms: int, touched: list[_Device]) -> list[DeviceState]:
        """Settle the touched devices and those with a time-out due, and return what changed.

        Only those devices are looked at, so an input costs the same however many devices and
        codes the node has.
        """
        due = [d for d in self._devices.values()
               if d.deadline_ms is not None and d.deadline_ms <= now_ms and all(d is not t for t in touched)]
        changed = []
        for device in [*touched, *due]:
            device.deadline_ms = self._deadline(device)
            self._advance_device(device, now_ms)  # also fires a rule with a zero time-out armed just now
            for code in [c for c, t in device.tracks.items() if not t.alive]:
                del device.tracks[code]
            for code, escalation in device.escalations.items():
                if code in device.tracks:
                    if escalation.quiet_since_ms is not None:
                        escalation.quiet_since_ms = None
                        self.history_dirty = True
                elif escalation.quiet_since_ms is None:
                    escalation.quiet_since_ms = now_ms
                    self.history_dirty = True
            device.deadline_ms = self._deadline(device)
            if not device.observed:
                continue  # nothing is known of it yet: saying "healthy" would be a guess
            state = self._render(device, now_ms)
            if self._published.get(device.phy_id) != state:
                self._published[device.phy_id] = state
                changed.append(state)
        return changed

    def _render(self, device: _Device, now_ms: int) -> DeviceState:
        codes = []
        for code in sorted(set(device.tracks) | set(device.escalations)):
            track = device.tracks.get(code)
            base = self._base_level(code)
            level, escalated_by = base, ""
            if track is not None and track.duration_escalated:
                rule_level = self.rules.duration[code].level
                if rule_level > level:
                    level, escalated_by = rule_level, DURATION
            escalation = device.escalations.get(code)
            if escalation is not None and escalation.level > level:
                level, escalated_by = escalation.level, FREQUENCY
            since = track.since_ms if track is not None else escalation.since_ms
            if escalated_by == FREQUENCY:
                # Held at its escalated level since then: an occurrence within the hold does not move the start
                # (it did, and the state changed back and forth with every occurrence of the code).
                since = min(since, escalation.since_ms)
            codes.append(ActiveCode(code, self.table.spell(code), level, since, self._severity.get(code), escalated_by))
        level = max((c.level for c in codes), default=Level.NormalNPU)
        since = min((c.since_ms for c in codes), default=0)
        if level != device.level:
            device.level, device.level_since_ms = level, max(now_ms, device.level_since_ms + 1)
        return DeviceState(device.phy_id, device.logic_id, device.health, level, since, tuple(codes),
                           device.level_since_ms)

    def _base_level(self, code: int) -> Level:
        level = self.table.lookup(code)
        if level is not None:
            return level
        if self.settings.unknown_code_level is not None:
            return self.settings.unknown_code_level
        # The device plugin's fallback: major/critical, or never seen with a severity, isolates.
        severity = self._severity.get(code)
        return Level.NotHandleFault if severity is not None and severity <= 1 else Level.SeparateNPU
