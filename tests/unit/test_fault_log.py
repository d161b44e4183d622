"""The durable fault log: revisions across restarts, torn tails, cursors, compaction."""

from __future__ import annotations

from agent.faults.engine import ActiveCode, DeviceState, Health
from agent.faults.levels import Level
from agent.faults.log import FaultLog


def state(phy: int, code: int | None = None) -> DeviceState:
    if code is None:
        return DeviceState(phy, phy)
    active = ActiveCode(code, f"{code:08X}", Level.SeparateNPU, 1_780_000_000_000, 3, "")
    return DeviceState(phy, phy, Health.UNHEALTHY, Level.SeparateNPU, 1_780_000_000_000, (active,))


def opened(tmp_path, **kwargs) -> FaultLog:
    log = FaultLog(tmp_path / "faultlog", **kwargs)
    log.open()
    return log


def test_revisions_and_states_survive_a_reopen(tmp_path):
    log = opened(tmp_path)
    assert [c.revision for c in log.append([state(0), state(1, 0x80E18402)])] == [1, 2]
    log.append([state(1)])
    epoch = log.epoch
    log.close()
    again = opened(tmp_path)
    assert (again.epoch, again.revision) == (epoch, 3)
    assert again.latest()[1].state == state(1) and again.latest()[1].revision == 3
    assert [c.revision for c in again.changes_after(1)] == [2, 3]
    assert again.state_at(2)[1] == state(1, 0x80E18402)
    assert [c.revision for c in again.append([state(2)])] == [4]


def test_a_torn_tail_is_cut_off_and_logged(tmp_path, caplog):
    log = opened(tmp_path)
    log.append([state(0), state(1, 0x80E18402)])
    log.close()
    path = tmp_path / "faultlog" / "log"
    whole = path.read_bytes()
    path.write_bytes(whole + whole.splitlines(keepends=True)[1][:30])  # a crash mid-write
    again = opened(tmp_path)
    assert again.revision == 2 and again.truncated_bytes == 30
    assert path.read_bytes() == whole
    assert "torn or corrupt tail" in caplog.text
    assert [c.revision for c in again.append([state(3)])] == [3]


def test_a_corrupt_record_cuts_the_log_there(tmp_path):
    log = opened(tmp_path)
    log.append([state(0), state(1), state(2)])
    log.close()
    path = tmp_path / "faultlog" / "log"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"phy":1', b'"phy":7')  # checksum no longer matches
    path.write_bytes(b"".join(lines))
    again = opened(tmp_path)
    assert again.revision == 1 and set(again.latest()) == {0}


def test_cursors_persist_and_pending_counts(tmp_path):
    log = opened(tmp_path)
    assert log.cursor("clusterd") == 0
    log.append([state(0), state(1)])
    assert log.pending("clusterd") == 2
    log.commit("clusterd", 1)
    log.close()
    again = opened(tmp_path)
    assert again.cursor("clusterd") == 1 and again.pending("clusterd") == 1


def test_compaction_keeps_what_a_lagging_sink_still_needs(tmp_path):
    log = opened(tmp_path, keep_recent=10)
    log.cursor("clusterd")
    for i in range(3000):
        log.append([state(i % 4, 0x80E18402 if i % 2 else None)])
    log.commit("clusterd", 2500)  # compaction may fold everything up to 2500
    assert log.changes_after(2499) is None
    assert [c.revision for c in log.changes_after(2500)][:2] == [2501, 2502]
    size = (tmp_path / "faultlog" / "log").stat().st_size
    log.close()
    again = opened(tmp_path, keep_recent=10)
    assert again.revision == 3000 and again.cursor("clusterd") == 2500
    assert again.state_at(2500) == log.state_at(2500)
    assert again.latest() == log.latest()
    assert size < 200_000
