"""Marker records of one rank -> completed training steps (pure).

Records pair by (`Id`, `SourceKind`): a start (flag 2 or 16) and an end (4 or 32), in either order,
possibly in different writes or files (`taskd.md` §1.5). A name is only on the start record, so names
are remembered by `Id`. A `step N` range gives the step; `forward`, `dataloader` and
`save_checkpoint` ranges inside its window give the phases. A range started with flag 16 is on a
stream, so its device pair (SourceKind 1) is awaited and the step is timed on the device clock; a
host-only range (flag 2) is timed on the host clock. A step whose device pair never arrives is timed
on the host clock once a later step of the same process is complete.

Steps are finalised at the end of a batch of records, not at their end record, so the phases of
a write all count whatever order the records came in. The assembler also knows the oldest input
position it still needs (a range or step not finished): that is what may be committed, so a restart
reads again from there and loses no step; steps it finalises twice are dropped by the consumer
(by process and step number).
"""

from __future__ import annotations

import re
import sys
from bisect import bisect_left
from collections import Counter
from itertools import accumulate, islice
from dataclasses import dataclass, field

from agent.steps.records import END_FLAGS, START_FLAGS, WITH_DEVICE_FLAGS, text

FORWARD, DATALOADER, CHECKPOINT = "forward", "dataloader", "save_checkpoint"
_PHASES = {b"forward": FORWARD, b"dataloader": DATALOADER, b"save_checkpoint": CHECKPOINT}
_STEP = re.compile(rb"step\D{0,8}?(\d{1,18})")
_NO_NAME = frozenset((b"", b"NULL", b"(null)"))
MAX_OPEN = 4096  # half-seen ranges kept per rank; the oldest beyond are dropped as unpaired
MAX_STEPS = 16_384  # steps kept per rank until a batch ends (a 4 MiB read holds ~1,500)
MAX_PHASES = 20_000  # completed phase ranges waiting for their step


@dataclass(frozen=True, slots=True)
class StepSample:
    step: int
    pid: int  # the host process that wrote the step; with `step`, what identifies it
    clock: str  # "device" or "host"
    start_ns: int
    end_ns: int
    wall_end_s: float  # when it ended, in host (wall) seconds when known
    forward_s: float | None  # sum of forward ranges in the step; None without forward markers
    dataloader_s: float  # sum of dataloader ranges in the step
    checkpoint_s: float  # sum of the save_checkpoint ranges overlapping the step

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def checkpoint(self) -> bool:
        return self.checkpoint_s > 0


@dataclass(slots=True)
class _Step:
    number: int
    pid: int
    position: object  # where its first record was read
    host: tuple[int, int] | None = None
    device: tuple[int, int] | None = None
    device_expected: bool = False


@dataclass(slots=True)
class _Range:
    phase: str
    source: int
    start: int
    end: int
    position: object


@dataclass
class RankAssembler:
    """Pairs one rank's markers into steps. `position` values only need to be ordered (the
    tailer's (file, offset) tuples)."""

    errors: Counter = field(default_factory=Counter)  # reason (agent.steps.reasons.PAIRING) -> count; the caller logs and exports them
    newest_host_ns: int = 0  # the newest host timestamp seen: the parser's lag
    _names: dict = field(default_factory=dict)  # id -> [name, domain, pid | None, halves paired]
    _open: tuple = field(default_factory=lambda: ({}, {}))  # per source: id -> (is_start, ts, flag, position)
    _steps: dict = field(default_factory=dict)  # range id -> _Step
    _phases: list = field(default_factory=list)  # _Range, in completion order

    def feed(self, markers: list[tuple], position: object) -> None:
        """Pair `records.parse` markers (raw fields); `position` is where they were read."""
        names, (host_open, device_open), errors = self._names, self._open, self.errors
        newest = self.newest_host_ns
        for flag, source, stamp, ident, pid, name, domain in markers:
            if flag in START_FLAGS:
                is_start = True
            elif flag in END_FLAGS:
                is_start = False
            else:
                continue  # instantaneous markers carry no duration
            ts = int(stamp)
            host = source == b"0"
            if host and ts > newest:
                newest = ts
            if is_start:  # only a start carries the name
                known = names.get(ident)
                if known is None:
                    if name not in _NO_NAME:
                        names[ident] = [name, domain, pid if host else None, 0]
                        if len(names) > MAX_OPEN:
                            del names[next(iter(names))]
                elif host and known[2] is None:
                    known[2] = pid  # device records carry the device id there, not the process
            pending = host_open if host else device_open  # records pair by (Id, SourceKind)
            other = pending.pop(ident, None)
            if other is None:
                pending[ident] = (is_start, ts, flag, position)
                if len(pending) > MAX_OPEN:
                    del pending[next(iter(pending))]
                    errors["unpaired"] += 1
                continue
            if other[0] == is_start:  # two starts (or two ends) for one id: ids reused
                errors["id_reused"] += 1
                pending[ident] = (is_start, ts, flag, position)
                continue
            if is_start:
                start, end, start_flag, first = ts, other[1], flag, other[3]
            else:
                start, end, start_flag, first = other[1], ts, other[2], other[3]
            if end < start:
                errors["negative_duration"] += 1
                continue
            self._range(ident, host, start, end, start_flag in WITH_DEVICE_FLAGS or flag in WITH_DEVICE_FLAGS, first)
        self.newest_host_ns = newest

    def _range(self, ident: bytes, host: bool, start: int, end: int, on_stream: bool, position: object) -> None:
        known = self._names.get(ident)
        if known is None:
            self.errors["unnamed_range"] += 1
            return
        name, domain, pid, halves = known
        if halves + 1 >= (2 if on_stream else 1):
            del self._names[ident]  # every half of the range is paired: the name is not needed again
        else:
            known[3] = halves + 1
        if domain != b"default":
            return  # communication and other domains: not used without their markers switched on
        source = 0 if host else 1
        phase = _PHASES.get(name)
        if phase is None:
            lowered = text(name).lower()
            phase = _PHASES.get(lowered)
        if phase is not None:
            self._phases.append(_Range(phase, source, start, end, position))
            if len(self._phases) > MAX_PHASES:
                del self._phases[:len(self._phases) - MAX_PHASES]
            return
        if b"step" not in lowered:
            return
        match = _STEP.search(lowered)
        if match is None:
            self.errors["bad_step_name"] += 1
            return
        step = self._steps.get(ident)  # both halves of a step share its range id
        if step is None:
            if len(self._steps) >= MAX_STEPS:
                self._steps.pop(next(iter(self._steps)))  # the oldest: steps arrive in order
                self.errors["step_incomplete"] += 1
            step = self._steps[ident] = _Step(int(match.group(1)), 0, position)
        if source == 1:
            step.device, step.device_expected = (start, end), True
        else:
            step.host, step.pid = (start, end), int(pid or 0)
            step.device_expected = step.device_expected or on_stream

    def finalize(self) -> list[StepSample]:
        """The steps completed so far, in step order per process."""
        ready = [k for k, s in self._steps.items() if s.device or (s.host and not s.device_expected)]
        newest = {}
        for key in ready:
            step = self._steps[key]
            newest[step.pid] = max(newest.get(step.pid, -1), step.number)
        for key, step in self._steps.items():  # the device half that never came, once a later step is done
            if step.host and not step.device and step.number < newest.get(step.pid, -1):
                ready.append(key)
                self.errors["device_range_missing"] += 1
        done = sorted((self._steps.pop(key) for key in set(ready)), key=lambda s: (s.pid, s.number))
        index = _index(self._phases) if done else {}
        samples = [self._sample(step, index) for step in done]
        if done:
            self._prune(done)
        return samples

    def _sample(self, step: _Step, index: dict) -> StepSample:
        clock, (start, end) = ("device", step.device) if step.device else ("host", step.host)
        host_window = step.host or step.device
        forward = _sum(index, FORWARD, 1, step.device) if step.device else None
        if forward is None and step.host:
            forward = _sum(index, FORWARD, 0, step.host)
        dataloader = _sum(index, DATALOADER, 0, host_window) or 0.0
        checkpoint = sum(r.end - r.start for r in index.get(CHECKPOINT, ())
                         if r.start < host_window[1] and r.end > host_window[0]) / 1e9
        return StepSample(step.number, step.pid, clock, start, end, host_window[1] / 1e9, forward, dataloader,
                          checkpoint)

    def _prune(self, done: list[_Step]) -> None:
        """Forget the ranges no step still to come can hold: steps follow each other, so what ended
        before the end of the newest finished step (per clock) is used or outside every step."""
        cut = {}
        for step in done:
            for source, window in ((0, step.host), (1, step.device)):
                if window is not None:
                    cut[source] = max(cut.get(source, 0), window[1])
        self._phases = [r for r in self._phases if r.source not in cut
                        or (r.end if r.phase == CHECKPOINT else r.start) >= cut[r.source]]

    def in_progress(self) -> tuple[tuple[int, int, int] | None, int | None]:
        """What is started and not ended, from the host records: the newest step as (pid, number,
        start ns), and the oldest save_checkpoint's start ns. Ranges whose end was lost stay here
        until dropped, so the caller checks them against what completed since."""
        step = checkpoint = None
        for ident, (is_start, ts, _, _) in self._open[0].items():
            known = self._names.get(ident) if is_start else None
            if known is None or known[1] != b"default":
                continue
            lowered = text(known[0]).lower()
            if lowered == b"save_checkpoint":
                checkpoint = ts if checkpoint is None else min(checkpoint, ts)
            elif b"step" in lowered and (match := _STEP.search(lowered)) and (step is None or ts > step[2]):
                step = (int(known[2] or 0), int(match.group(1)), ts)
        return step, checkpoint

    @property
    def held(self) -> int:
        """Entries kept for what is still to come (names, half-seen ranges, steps, phases): what grows."""
        return len(self._names) + len(self._open[0]) + len(self._open[1]) + len(self._steps) + len(self._phases)

    def shed(self, keep: int) -> int:
        """Drop the oldest entries of each kind, in proportion, so that at most `keep` stay; how many went."""
        held = self.held
        if held <= keep:
            return 0
        share = keep / held

        def newest(entries: dict) -> dict:
            return dict(islice(entries.items(), len(entries) - int(len(entries) * share), None))

        self._names, self._steps, self._open = newest(self._names), newest(self._steps), tuple(map(newest, self._open))
        self._phases = self._phases[len(self._phases) - int(len(self._phases) * share):]
        return held - self.held

    def compact(self) -> None:
        """Give back the room of entries gone: a dict keeps the size it once grew to (a list shrinks)."""
        self._names, self._steps = _compact(self._names), _compact(self._steps)
        self._open = tuple(map(_compact, self._open))

    def oldest_needed(self) -> object | None:
        """The position of the oldest record that a step still to come may need; None: nothing."""
        candidates = [v[3] for pending in self._open for v in pending.values()]
        candidates += [s.position for s in self._steps.values()]
        candidates += [r.position for r in self._phases]
        return min(candidates) if candidates else None


def _compact(entries: dict) -> dict:
    size = sys.getsizeof(entries)  # O(1): the table, not the entries; a fresh dict takes 36-47 bytes per entry
    return dict(entries) if size > 8192 and size > 256 * len(entries) else entries


def _index(ranges: list[_Range]) -> dict:
    """(phase, source) -> (starts sorted, running sums of durations in that order), and CHECKPOINT ->
    its ranges: a step's phases by bisection, so a batch of N steps costs N log N, not N x ranges."""
    grouped: dict = {}
    checkpoints = []
    for r in ranges:
        if r.phase == CHECKPOINT:
            checkpoints.append(r)
        else:
            grouped.setdefault((r.phase, r.source), []).append((r.start, r.end - r.start))
    index: dict = {CHECKPOINT: checkpoints}
    for key, pairs in grouped.items():
        pairs.sort()
        index[key] = ([start for start, _ in pairs], list(accumulate((d for _, d in pairs), initial=0)))
    return index


def _sum(index: dict, phase: str, source: int, window: tuple[int, int]) -> float | None:
    """Seconds of `phase` ranges of that clock starting inside the window; None when there are none."""
    found = index.get((phase, source))
    if found is None:
        return None
    starts, sums = found
    low, high = bisect_left(starts, window[0]), bisect_left(starts, window[1])
    return (sums[high] - sums[low]) / 1e9 if high > low else None
