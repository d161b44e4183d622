"""The fault engine with an injected clock: levels, escalation windows, release, persistence."""

from __future__ import annotations

import pytest

from agent.faults.rules.codes import parse_fault_code_table
from agent.model import Assertion, CARD_DROP_CODE, Health, Level
from agent.faults.rules.customization import parse_customization
from agent.faults.rules.engine import EngineSettings, FaultEngine

OCCUR, RECOVER, ONCE = Assertion.OCCUR, Assertion.RECOVER, Assertion.ONCE
T0 = 1_780_000_000_000  # a unix time in ms
S = 1000

TABLE = parse_fault_code_table({
    "NotHandleFaultCodes": ["80E21007", "81078603"],
    "SubHealthFaultCodes": ["81A3880C"],
    "RestartRequestCodes": ["80C98009"],
    "RestartBusinessCodes": ["80E01801", "A2301001"],
    "FreeRestartNPUCodes": ["8C084E00"],
    "RestartNPUCodes": ["80E18005", "40F84E00"],
    "PreSeparateNPUCodes": ["8118043C", "110001024"],
    "SeparateNPUCodes": ["80E18402", "A2301001", "020001002"],
}, "test table")

RULES = parse_customization({
    "FaultFrequency": [
        {"EventId": ["80E18005"], "TimeWindow": 3600, "Times": 3, "FaultHandling": "ManuallySeparateNPU"},
        {"EventId": ["80C98009"], "TimeWindow": 600, "Times": 2, "FaultHandling": "SeparateNPU",
         "ReleaseTimeWindow": 120},
        {"EventId": ["81078603"], "TimeWindow": 86400, "Times": 2, "FaultHandling": "ManuallySeparateNPU",
         "ReleaseTimeWindow": 300},
    ],
    "FaultDuration": [
        {"EventId": ["81078603"], "FaultTimeout": 20, "RecoverTimeout": 60, "FaultHandling": "PreSeparateNPU"},
    ],
}, "test rules")


def engine(rules=RULES, observed=True, **settings) -> FaultEngine:
    e = FaultEngine(TABLE, rules, EngineSettings(**settings))
    e.add_device(4, 0, T0)
    if observed:
        e.on_reading(4, frozenset(), Health.HEALTHY, T0)
    return e


def level(e: FaultEngine) -> Level:
    return e.state(4).level


def codes(e: FaultEngine) -> dict[str, tuple[str, str]]:
    return {c.text: (c.level.name, c.escalated_by) for c in e.state(4).codes}


@pytest.mark.parametrize("code,expected", [
    (0x80E21007, Level.NotHandleFault), (0x81A3880C, Level.SubHealthFault), (0x80C98009, Level.RestartRequest),
    (0x80E01801, Level.RestartBusiness), (0x8C084E00, Level.FreeRestartNPU), (0x80E18005, Level.RestartNPU),
    (0x8118043C, Level.PreSeparateNPU), (0x80E18402, Level.SeparateNPU),
    (0xA2301001, Level.SeparateNPU),  # listed under RestartBusiness and SeparateNPU: the more severe wins
    (0x020001002, Level.SeparateNPU),
])
def test_every_level_from_the_table(code, expected):
    e = engine()
    changes = e.on_event(4, code, OCCUR, 2, None, T0)
    assert [c.level for c in changes] == [expected]


def test_nine_digit_codes_keep_their_spelling():
    e = engine()
    e.on_event(4, 0x020001002, OCCUR, 2, None, T0)
    assert list(codes(e)) == ["020001002"]


def test_device_level_is_the_worst_code_and_since_is_the_oldest():
    e = engine()
    e.on_event(4, 0x80E21007, OCCUR, 0, (T0 - 5 * S), T0)
    e.on_event(4, 0x80E18402, OCCUR, 3, None, T0 + S)
    state = e.state(4)
    assert state.level is Level.SeparateNPU
    assert state.since_ms == T0 - 5 * S  # the driver's own time of the first fault is kept
    e.on_reading(4, frozenset({0x80E21007}), Health.UNHEALTHY, T0 + 10 * S)
    assert level(e) is Level.NotHandleFault


@pytest.mark.parametrize("severity,expected", [(0, Level.NotHandleFault), (1, Level.NotHandleFault),
                                               (2, Level.SeparateNPU), (3, Level.SeparateNPU)])
def test_unknown_code_follows_the_drivers_severity(severity, expected):
    e = engine()
    e.on_event(4, 0x12345678, OCCUR, severity, None, T0)
    assert level(e) is expected


def test_unknown_code_seen_only_by_polling_isolates_like_the_device_plugin():
    e = engine()
    e.on_reading(4, frozenset({0x12345678}), Health.UNHEALTHY, T0)
    assert level(e) is Level.SeparateNPU


def test_unknown_code_level_setting_overrides_the_fallback():
    e = engine(unknown_code_level=Level.SubHealthFault)
    e.on_event(4, 0x12345678, OCCUR, 3, None, T0)
    assert level(e) is Level.SubHealthFault


def test_network_codes():
    table = parse_fault_code_table({"RestartNPUCodes": ["81078607"], "SeparateNPUNetworkCodes": ["110000002"]}, "t")
    assert table.lookup(0x81078607) is Level.NotHandleFault  # a restart level is not allowed: downgraded
    assert any("downgraded" in w for w in table.warnings)
    assert table.lookup(0x110000002) is Level.SeparateNPU
    assert table.lookup(0x81078603) is Level.PreSeparateNPU  # a network code in no bucket


def test_poll_mends_lost_events_and_failed_reads_keep_the_last_known_codes():
    e = engine()
    e.on_reading(4, frozenset({0x80C98009}), Health.UNHEALTHY, T0)
    assert codes(e) == {"80C98009": ("RestartRequest", "")}
    assert e.event_counts["occur"] == 1
    e.on_reading(4, None, Health.UNKNOWN, T0 + S)
    assert codes(e) and e.state(4).health is Health.UNKNOWN
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + 2 * S)
    assert codes(e) == {} and level(e) is Level.NormalNPU and e.event_counts["recover"] == 1


def test_a_reading_older_than_an_event_does_not_undo_it():
    e = engine()
    e.on_event(4, 0x80E18402, OCCUR, 3, None, T0 + 100)
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + 200, started_ms=T0 + 50)
    assert "80E18402" in codes(e)
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + 400, started_ms=T0 + 300)
    assert codes(e) == {}


def test_card_drop_code_from_a_reading():
    e = engine()
    e.on_reading(4, frozenset({CARD_DROP_CODE}), Health.UNHEALTHY, T0)
    assert codes(e) == {"40F84E00": ("RestartNPU", "")}


def test_frequency_escalates_on_the_nth_occurrence_inside_the_window():
    e = engine()
    for i in range(2):
        e.on_event(4, 0x80E18005, OCCUR, 2, None, T0 + i * 100 * S)
        e.on_event(4, 0x80E18005, RECOVER, 2, None, T0 + i * 100 * S + S)
        e.on_reading(4, frozenset(), Health.HEALTHY, T0 + i * 100 * S + 2 * S)
    assert level(e) is Level.NormalNPU
    e.on_event(4, 0x80E18005, OCCUR, 2, None, T0 + 300 * S)
    assert codes(e) == {"80E18005": ("ManuallySeparateNPU", "FaultFrequency")}
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + 301 * S)
    # Recovered, but a ManuallySeparateNPU escalation without a release window stays.
    assert level(e) is Level.ManuallySeparateNPU
    assert e.next_deadline_ms() is None
    e.tick(T0 + 10**9)
    assert level(e) is Level.ManuallySeparateNPU


def test_frequency_window_edge_an_occurrence_exactly_window_old_no_longer_counts():
    e = engine()
    window = 600 * S
    e.on_event(4, 0x80C98009, OCCUR, 2, None, T0)
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + S)
    e.on_event(4, 0x80C98009, OCCUR, 2, None, T0 + window)  # the first is now exactly TimeWindow old
    assert level(e) is Level.RestartRequest
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + window + S)
    e.on_event(4, 0x80C98009, OCCUR, 2, None, T0 + window + window - 1)  # the second is 1 ms inside
    assert level(e) is Level.SeparateNPU


def test_frequency_release_after_quiet_for_the_release_window():
    e = engine()
    e.on_event(4, 0x80C98009, OCCUR, 2, None, T0)
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + S)
    e.on_event(4, 0x80C98009, OCCUR, 2, None, T0 + 2 * S)
    assert level(e) is Level.SeparateNPU
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + 10 * S)  # quiet from here
    assert e.next_deadline_ms() == T0 + 10 * S + 120 * S
    e.tick(T0 + 10 * S + 120 * S - 1)
    assert level(e) is Level.SeparateNPU
    changes = e.tick(T0 + 10 * S + 120 * S)
    assert [c.level for c in changes] == [Level.NormalNPU]
    # Released: counting starts afresh, one occurrence is not enough to escalate again.
    e.on_event(4, 0x80C98009, OCCUR, 2, None, T0 + 200 * S)
    assert level(e) is Level.RestartRequest


def test_frequency_release_clock_restarts_when_the_fault_returns():
    e = engine()
    for t in (0, 2):
        e.on_event(4, 0x80C98009, OCCUR, 2, None, T0 + t * S)
        e.on_reading(4, frozenset(), Health.HEALTHY, T0 + (t + 1) * S)
    e.tick(T0 + 100 * S)
    e.on_event(4, 0x80C98009, OCCUR, 2, None, T0 + 110 * S)  # back before the release
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + 111 * S)
    e.tick(T0 + 3 * S + 120 * S)
    assert level(e) is Level.SeparateNPU
    e.tick(T0 + 111 * S + 120 * S)
    assert level(e) is Level.NormalNPU


def test_duration_escalates_exactly_at_the_fault_timeout_and_holds_for_the_recover_timeout():
    e = engine()
    e.on_event(4, 0x81078603, OCCUR, 1, None, T0)
    assert codes(e) == {"81078603": ("NotHandleFault", "")}
    assert e.next_deadline_ms() == T0 + 20 * S
    e.tick(T0 + 20 * S - 1)
    assert level(e) is Level.NotHandleFault
    e.tick(T0 + 20 * S)
    assert codes(e) == {"81078603": ("PreSeparateNPU", "FaultDuration")}
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + 30 * S)  # link back up
    assert level(e) is Level.PreSeparateNPU  # held for RecoverTimeout
    e.tick(T0 + 90 * S - 1)
    assert level(e) is Level.PreSeparateNPU
    e.tick(T0 + 90 * S)
    assert level(e) is Level.NormalNPU


def test_duration_short_fault_never_escalates_and_a_flap_inside_the_hold_keeps_it():
    e = engine()
    e.on_event(4, 0x81078603, OCCUR, 1, None, T0)
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + 19 * S)
    e.tick(T0 + 100 * S)
    assert level(e) is Level.NormalNPU
    e.on_event(4, 0x81078603, OCCUR, 1, None, T0 + 200 * S)
    e.tick(T0 + 220 * S)
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + 230 * S)
    e.on_event(4, 0x81078603, OCCUR, 1, None, T0 + 260 * S)  # flaps back inside the hold
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + 270 * S)
    e.tick(T0 + 230 * S + 60 * S)
    assert level(e) is Level.PreSeparateNPU  # the hold restarted at the last recovery
    e.tick(T0 + 330 * S)
    assert level(e) is Level.NormalNPU


def test_with_a_duration_rule_frequency_counts_time_outs_not_occurrences():
    e = engine()
    for start in (0, 1000, 2000):  # three short link flaps: no time-out, no frequency count
        e.on_event(4, 0x81078603, OCCUR, 1, None, T0 + start * S)
        e.on_reading(4, frozenset(), Health.HEALTHY, T0 + (start + 5) * S)
    assert level(e) is Level.NormalNPU
    for start in (3000, 4000):  # two long outages: two time-outs
        e.on_event(4, 0x81078603, OCCUR, 1, None, T0 + start * S)
        e.tick(T0 + (start + 20) * S)
        e.on_reading(4, frozenset(), Health.HEALTHY, T0 + (start + 30) * S)
        e.tick(T0 + (start + 90) * S)
    assert codes(e) == {"81078603": ("ManuallySeparateNPU", "FaultFrequency")}


def test_once_event_shows_for_the_hold_and_counts_as_an_occurrence():
    e = engine(once_hold_ms=5 * S)
    e.on_event(4, 0x80E18005, ONCE, 1, None, T0)
    assert codes(e) == {"80E18005": ("RestartNPU", "")}
    assert e.next_deadline_ms() == T0 + 5 * S
    e.tick(T0 + 5 * S)
    assert level(e) is Level.NormalNPU
    e.on_event(4, 0x80E18005, ONCE, 1, None, T0 + 10 * S)
    e.on_event(4, 0x80E18005, ONCE, 1, None, T0 + 20 * S)
    assert level(e) is Level.ManuallySeparateNPU
    assert e.event_counts == {"once": 3}


def test_a_recover_for_an_inactive_code_changes_nothing():
    e = engine()
    assert e.on_event(4, 0x80E18402, RECOVER, 2, None, T0) == []


def test_events_for_unknown_devices_are_ignored():
    e = engine()
    assert e.on_event(9, 0x80E18402, OCCUR, 2, None, T0) == []


def test_escalation_history_survives_a_restart():
    e = engine()
    e.on_event(4, 0x80C98009, OCCUR, 2, None, T0)
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + S)
    e.on_event(4, 0x80C98009, OCCUR, 2, None, T0 + 2 * S)
    e.on_event(4, 0x80E18005, OCCUR, 2, None, T0 + 3 * S)  # one occurrence of a 3-times rule
    e.on_event(4, 0x81078603, OCCUR, 1, None, T0 + 3 * S)
    e.tick(T0 + 23 * S)  # duration escalated
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + 30 * S)
    assert e.history_dirty
    history = e.export_history()
    assert not e.history_dirty

    restarted = engine(observed=False)
    restarted.import_history(history, T0 + 40 * S)
    assert restarted.state(4) is None  # nothing published before the driver said something
    restarted.on_reading(4, frozenset(), Health.HEALTHY, T0 + 40 * S)
    assert codes(restarted) == {"80C98009": ("SeparateNPU", "FaultFrequency"),
                                "81078603": ("PreSeparateNPU", "FaultDuration")}
    # The release clock kept its start (quiet since T0+30 s), the duration hold too.
    restarted.tick(T0 + 30 * S + 60 * S)
    assert set(codes(restarted)) == {"80C98009"}
    restarted.tick(T0 + 30 * S + 120 * S)
    assert level(restarted) is Level.NormalNPU
    # The earlier occurrence still counts: two more make three.
    restarted.on_event(4, 0x80E18005, OCCUR, 2, None, T0 + 200 * S)
    restarted.on_reading(4, frozenset(), Health.HEALTHY, T0 + 201 * S)
    restarted.on_event(4, 0x80E18005, OCCUR, 2, None, T0 + 202 * S)
    assert level(restarted) is Level.ManuallySeparateNPU


def test_reconfigure_reclassifies_active_codes():
    e = engine()
    e.on_event(4, 0x12345678, OCCUR, 1, None, T0)
    assert level(e) is Level.NotHandleFault
    table = parse_fault_code_table({"SeparateNPUCodes": ["12345678"]}, "new")
    changes = e.reconfigure(table, RULES, T0 + S)
    assert [c.level for c in changes] == [Level.SeparateNPU]


def test_zero_fault_timeout_escalates_with_the_occurrence():
    rules = parse_customization({"FaultDuration": [
        {"EventId": ["80E21007"], "FaultTimeout": 0, "RecoverTimeout": 0, "FaultHandling": "SeparateNPU"}]}, "r")
    e = engine(rules)
    changes = e.on_event(4, 0x80E21007, OCCUR, 1, None, T0)
    assert [c.level for c in changes] == [Level.SeparateNPU]
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + S)
    assert level(e) is Level.NormalNPU


def test_health_is_part_of_the_state():
    e = engine()
    changes = e.on_reading(4, None, Health.UNKNOWN, T0)
    assert [c.health for c in changes] == [Health.UNKNOWN]
    assert e.on_reading(4, None, Health.UNKNOWN, T0 + S) == []


def test_a_device_is_published_only_once_observed():
    e = engine(observed=False)
    assert e.states() == []
    assert [c.level for c in e.on_reading(4, frozenset(), Health.HEALTHY, T0)] == [Level.NormalNPU]


def test_seeded_codes_stay_until_a_reading_answers_and_keep_their_start():
    e = engine(observed=False)
    changes = e.seed(4, [(0x80E18402, T0 - 60 * S)], Health.UNHEALTHY, T0)
    assert [(c.level, c.since_ms) for c in changes] == [(Level.SeparateNPU, T0 - 60 * S)]
    assert e.on_reading(4, None, Health.UNKNOWN, T0 + S)[0].level is Level.SeparateNPU  # driver silent: kept
    e.on_reading(4, frozenset({0x80E18402}), Health.UNHEALTHY, T0 + 2 * S)
    assert e.state(4).since_ms == T0 - 60 * S and e.event_counts["occur"] == 0
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + 3 * S)
    assert e.state(4).level is Level.NormalNPU


def test_each_entry_into_a_level_has_its_own_strictly_later_start():
    e = engine()
    first = e.on_event(4, 0x80E18402, OCCUR, 3, None, T0 + S)[0]
    assert (first.level, first.level_since_ms) == (Level.SeparateNPU, T0 + S)
    assert e.on_event(4, 0x80E18402, OCCUR, 3, None, T0 + 2 * S) == []  # still the same occurrence
    # Recovered and back within the same millisecond (a burst of driver events): still a new occurrence.
    healthy = e.on_event(4, 0x80E18402, RECOVER, 3, None, T0 + 3 * S)[0]
    again = e.on_event(4, 0x80E18402, OCCUR, 3, None, T0 + 3 * S)[0]
    assert first.level_since_ms < healthy.level_since_ms < again.level_since_ms
    # A clock that steps back does not make an occurrence repeat an earlier one's start.
    e.on_event(4, 0x80E18402, RECOVER, 3, None, T0)
    back = e.on_event(4, 0x80E18402, OCCUR, 3, None, T0)[0]
    assert back.level_since_ms > again.level_since_ms


def test_a_seeded_level_keeps_its_start_and_a_new_one_gets_a_new_start():
    e = engine(observed=False)
    [state] = e.seed(4, [(0x80E18402, T0 - 60 * S)], Health.UNHEALTHY, T0, Level.SeparateNPU, T0 - 30 * S)
    assert state.level_since_ms == T0 - 30 * S  # the occurrence goes on across the restart
    other = engine(observed=False)
    [changed] = other.seed(4, [(0x80E18005, T0 - 60 * S)], Health.UNHEALTHY, T0, Level.SeparateNPU, T0 - 30 * S)
    assert changed.level is Level.RestartNPU and changed.level_since_ms == T0  # the level differs: a new one


def test_an_escalated_level_keeps_its_start_across_a_restart():
    """As the fault service restarts the engine: escalation history first, then the last logged codes."""
    e = engine()
    e.on_event(4, 0x80C98009, OCCUR, 2, None, T0)
    e.on_reading(4, frozenset(), Health.HEALTHY, T0 + S)
    e.on_event(4, 0x80C98009, OCCUR, 2, None, T0 + 2 * S)  # twice in 600 s: SeparateNPU by frequency
    before = e.state(4)
    assert before.level is Level.SeparateNPU
    again = engine(observed=False)
    again.add_device(4, 4, T0 + 10 * S)
    changes = again.import_history(e.export_history(), T0 + 10 * S)
    raw = [(c.code, c.since_ms) for c in before.codes if not c.escalated_by]
    changes += again.seed(4, raw, before.health, T0 + 10 * S, before.level, before.level_since_ms)
    assert [(c.level, c.level_since_ms) for c in changes] == [(Level.SeparateNPU, before.level_since_ms)]
