"""How the demo prints fault changes: one line per change of a device's state, saying what changed.

A device's state has two independent parts, and a change may touch either: LEVEL, the agent's
verdict (the worst active code's level after the escalation rules: what ClusterD is sent), and
HEALTH, the driver's own reading of the chip (npu-exporter's health status), which only polling
reads. A fault event therefore changes LEVEL at once and HEALTH at the next poll, and a chip held
by an escalation rule keeps its LEVEL while the driver calls it healthy again; each line says which.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.model import ActiveCode, DeviceState, Health, Level

# A fault event changes LEVEL and the poll that follows it HEALTH: a health-only change of the same NPU
# this soon after the line it follows joins that line (both revisions named), instead of a second line.
JOIN_S = 0.5


LEGEND = """\
  fault changes, one line per change of an NPU's state (the same changes as `npu-node-agent faults --follow`):
    [time] rev N  NPUn  LEVEL  HEALTH  what changed  [pod holding the NPU]
    LEVEL   the agent's verdict: the worst active fault's level (NormalNPU: none, up to ManuallySeparateNPU),
            from the fault-code table and the escalation rules; what ClusterD is sent
    HEALTH  the driver's own reading of the chip: healthy, unhealthy (an alarm), unknown (no answer, or the
            card dropped). Read by polling (every 2 s here), so it follows a fault event a moment later; a
            chip an escalation rule holds keeps its LEVEL while the driver calls it healthy again"""


def _rule(code: ActiveCode) -> str:
    return f" by {code.escalated_by}" if code.escalated_by else ""


def describe(before: DeviceState | None, after: DeviceState) -> str:
    """What changed from `before` to `after` (None: the device's first state), in a few words."""
    if before is None:
        return "first reading" + "".join(f"; {c.text} active: {c.level.name}{_rule(c)}" for c in after.codes)
    said: list[str] = []
    old = {c.code: c for c in before.codes}
    new = {c.code: c for c in after.codes}
    for code, now in new.items():
        was = old.get(code)
        if was is None:
            said.append(f"{now.text} occurred: {now.level.name}{_rule(now)}")
        elif (was.level, was.escalated_by) != (now.level, now.escalated_by):
            said.append(f"{now.text} {was.level.name} -> {now.level.name}{_rule(now) or ' (rule released)'}")
    said += [f"{code.text} cleared" for key, code in old.items() if key not in new]
    if before.health != after.health:
        held = [c for c in after.codes if c.escalated_by] if after.health is Health.HEALTHY else []
        said.append(f"driver health {before.health.name.lower()} -> {after.health.name.lower()}"
                    + "".join(f"; {c.text} stays {c.level.name} (held by {c.escalated_by})" for c in held))
    if not said:  # a change the columns do not show (a start time, a severity): still one line, saying so
        said.append("no change in level, codes or health (a start time or severity)")
    return "; ".join(said)


def change_line(elapsed_s: float, revision: int | str, before: DeviceState | None, after: DeviceState,
                pods: str) -> str:
    return (f"[{elapsed_s:5.1f}s] rev {revision!s:<3} {'NPU' + str(after.phy_id):<6} {after.level.name:<19} "
            f"{after.health.name.lower():<9} {describe(before, after)}" + (f"  {pods}" if pods else ""))


def first_readings_line(elapsed_s: float, revisions: list[int], states: list[DeviceState]) -> str:
    """The devices' first states at once, when none has a fault (the agent has just listed them)."""
    ids = sorted(s.phy_id for s in states)
    span = f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1 else ",".join(map(str, ids))
    healths = sorted({s.health.name.lower() for s in states})
    revs = f"{min(revisions)}-{max(revisions)}" if len(revisions) > 1 else str(revisions[0])
    return (f"[{elapsed_s:5.1f}s] rev {revs:<3} {'NPU' + span:<6} {Level.NormalNPU.name:<19} {'/'.join(healths):<9} "
            f"first reading of {len(states)} NPU(s): no fault")


@dataclass
class Pending:
    """A line not printed yet: the changes of one NPU from `before` to `after`."""

    since_s: float  # when its first change arrived
    revisions: list[int]
    before: DeviceState | None
    after: DeviceState

    def line(self, pods: str) -> str:
        revisions = ",".join(str(r) for r in self.revisions)
        return change_line(self.since_s, revisions, self.before, self.after, pods)


class Lines:
    """Holds each NPU's line for JOIN_S, so that the driver's health read right after a fault event
    is said on the event's line (`80E18402 occurred: SeparateNPU; driver health healthy -> unhealthy`)."""

    def __init__(self, join_s: float = JOIN_S):
        self._join_s = join_s
        self._pending: dict[int, Pending] = {}

    def add(self, elapsed_s: float, revision: int, before: DeviceState | None, after: DeviceState) -> list[Pending]:
        """Takes a change; returns the lines it ends (a change other than health ends the NPU's held line)."""
        held = self._pending.get(after.phy_id)
        if held is not None and health_only(held.after, after):
            held.revisions.append(revision)
            held.after = after
            return []
        done = [self._pending.pop(after.phy_id)] if held is not None else []
        self._pending[after.phy_id] = Pending(elapsed_s, [revision], before, after)
        return done

    def due(self, elapsed_s: float, everything: bool = False) -> list[Pending]:
        """The lines held JOIN_S (all of them with `everything`), in the order their changes came."""
        done = [p for p in self._pending.values() if everything or elapsed_s - p.since_s >= self._join_s]
        for pending in done:
            del self._pending[pending.after.phy_id]
        return sorted(done, key=lambda p: p.revisions[0])


def health_only(before: DeviceState, after: DeviceState) -> bool:
    """Whether `after` differs from `before` in the driver's health alone (the codes and level the same)."""
    return (before.health != after.health and before.level == after.level
            and [(c.code, c.level, c.escalated_by) for c in before.codes]
            == [(c.code, c.level, c.escalated_by) for c in after.codes])
