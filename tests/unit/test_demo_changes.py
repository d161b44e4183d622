"""The demo's fault lines: one per change, each saying what changed (LEVEL and HEALTH apart)."""

from __future__ import annotations

from agent.demo.changes import Lines, change_line, describe, first_readings_line
from agent.model import ActiveCode, DeviceState, Health, Level

T = 1_780_000_000_000


def code(text: str, level: Level, by: str = "", since: int = T) -> ActiveCode:
    return ActiveCode(int(text, 16), text, level, since, 2, by)


def state(health=Health.HEALTHY, *codes: ActiveCode) -> DeviceState:
    level = max((c.level for c in codes), default=Level.NormalNPU)
    return DeviceState(1, 1, health, level, min((c.since_ms for c in codes), default=0), codes)


def test_a_fault_event_then_the_polled_health_are_two_lines_that_say_so():
    event = state(Health.HEALTHY, code("80E18402", Level.SeparateNPU))
    polled = state(Health.UNHEALTHY, code("80E18402", Level.SeparateNPU))
    assert describe(state(), event) == "80E18402 occurred: SeparateNPU"
    assert describe(event, polled) == "driver health healthy -> unhealthy"
    assert change_line(2.13, 9, state(), event, "[pod demo/w-0]") == (
        "[  2.1s] rev 9   NPU1   SeparateNPU         healthy   80E18402 occurred: SeparateNPU  [pod demo/w-0]")


def test_escalation_clearing_and_a_held_level_on_a_healthy_chip():
    link = code("81078603", Level.NotHandleFault)
    held = code("81078603", Level.PreSeparateNPU, "FaultDuration")
    sick = state(Health.UNHEALTHY, link)
    assert describe(sick, state(Health.UNHEALTHY, held)) == "81078603 NotHandleFault -> PreSeparateNPU by FaultDuration"
    assert describe(state(Health.UNHEALTHY, held), state(Health.HEALTHY, held)) == (
        "driver health unhealthy -> healthy; 81078603 stays PreSeparateNPU (held by FaultDuration)")
    assert describe(state(Health.UNHEALTHY, held), state()) == "81078603 cleared; driver health unhealthy -> healthy"
    assert describe(state(Health.HEALTHY, held), state(Health.HEALTHY, link)) == (
        "81078603 PreSeparateNPU -> NotHandleFault (rule released)")
    dropped = state(Health.UNKNOWN, code("40F84E00", Level.RestartNPU))
    assert describe(state(), dropped) == "40F84E00 occurred: RestartNPU; driver health healthy -> unknown"


def test_a_change_the_columns_do_not_show_still_says_what_it_is():
    before = state(Health.HEALTHY, code("80E18005", Level.ManuallySeparateNPU, "FaultFrequency", since=T))
    after = state(Health.HEALTHY, code("80E18005", Level.ManuallySeparateNPU, "FaultFrequency", since=T + 5000))
    assert describe(before, after) == "no change in level, codes or health (a start time or severity)"


def test_the_first_readings_are_one_line():
    states = [DeviceState(n, n) for n in range(8)]
    assert first_readings_line(0.8, list(range(1, 9)), states) == (
        "[  0.8s] rev 1-8 NPU0-7 NormalNPU           healthy   first reading of 8 NPU(s): no fault")
    assert describe(None, state(Health.UNHEALTHY, code("80E18402", Level.SeparateNPU))) == (
        "first reading; 80E18402 active: SeparateNPU")


def test_the_health_a_poll_reads_right_after_a_fault_event_joins_the_event_line():
    lines = Lines()
    event = state(Health.HEALTHY, code("80E18402", Level.SeparateNPU))
    polled = state(Health.UNHEALTHY, code("80E18402", Level.SeparateNPU))
    assert lines.add(2.1, 9, state(), event) == []
    assert lines.add(2.2, 10, event, polled) == []  # health only: joins the held line
    assert lines.due(2.5) == []  # held JOIN_S from its first change
    [line] = lines.due(2.7)
    assert line.line("[pod demo/w-0]") == (
        "[  2.1s] rev 9,10 NPU1   SeparateNPU         unhealthy 80E18402 occurred: SeparateNPU; "
        "driver health healthy -> unhealthy  [pod demo/w-0]")


def test_a_change_beyond_health_ends_the_held_line_and_lines_keep_their_order():
    lines = Lines()
    event = state(Health.HEALTHY, code("80E18402", Level.SeparateNPU))
    assert lines.add(2.1, 9, state(), event) == []
    [ended] = lines.add(2.2, 10, event, state())  # cleared at once: two lines, each true
    assert ended.line("").endswith("rev 9   NPU1   SeparateNPU         healthy   80E18402 occurred: SeparateNPU")
    other = DeviceState(3, 3, Health.UNHEALTHY, Level.NormalNPU)
    assert lines.add(2.3, 11, DeviceState(3, 3), other) == []
    assert [p.revisions for p in lines.due(0.0, everything=True)] == [[10], [11]]
