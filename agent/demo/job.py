"""The demo's training job: ranks writing TaskD-format profiling records in real time.

It plays `SyntheticJob` (16 ranks in 4 pipeline stages by default) against the wall clock and
writes what TaskD's worker would: per step a `step N` range on a stream
(host and device records), two `forward` ranges on the stream and a host `dataloader` range, one
compact JSON object per line, appended to `<root>/<job>/<rank>/<10-digit unix seconds>` every
`flush_s` (with the start record of the step in progress, as MSPTI hands a start over on its own),
a new file every `rotate_s`, and each rank's `parallel_group.json`. From `slow_after_s`
on, one rank's forward is 15 % slower. The agent's disk guard ages these files and its step metrics
read them.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from agent.demo.synthetic import RankTiming, SyntheticJob

DEVICE_LAG_NS = 40_000  # device timestamps trail the host's a little


@dataclass
class DemoJob:
    root: Path
    job_id: str = "demo-job"
    ranks: int = 16
    stages: int = 4
    step_s: float = 0.25
    slow_rank: int = 5
    slow_after_s: float = 60.0
    flush_s: float = 1.0
    rotate_s: float = 4.0
    started: float = field(default_factory=time.time)
    seed: int = 5

    def __post_init__(self) -> None:
        self.model = SyntheticJob(ranks=self.ranks, stages=self.stages, step_s=self.step_s, forward_share=0.85,
                                  checkpoint_every=0, slow_rank=self.slow_rank,
                                  slow_from_step=int(self.slow_after_s / self.step_s), seed=self.seed)
        self._ids = [1] * self.ranks
        self._pids = [41000 + rank for rank in range(self.ranks)]
        self._step, self._step_start = 1, self.started
        self._timings = self.model.step(1)
        self._open_written = False  # the step in progress has its start record on disk

    @property
    def slow_from(self) -> float:
        """Wall time the slow rank's first slow step starts."""
        return self.started + self.model.slow_from_step * self.step_s

    def prepare(self) -> None:
        """The rank directories with their parallel_group.json."""
        for rank in range(self.ranks):
            directory = self.rank_dir(rank)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "parallel_group.json").write_text(json.dumps(self.model.parallel_group(rank)))

    def append(self, rank: int, file_name: str, text: str) -> None:
        with open(self.rank_dir(rank) / file_name, "a", encoding="utf-8") as handle:
            handle.write(text)

    def lines_until(self, now: float) -> list[str]:
        """Per rank, the lines of every step that has ended by `now` and was not handed out yet."""
        lines = [""] * self.ranks
        while True:
            end = self._step_start + max(t.duration_s for t in self._timings)
            if end > now:
                return lines
            for timing in self._timings:
                records = self.records(timing, self._step, self._step_start)
                if self._open_written:
                    records.remove(self._start_line(timing.rank, records))
                lines[timing.rank] += "".join(records)
            self._step, self._step_start = self._step + 1, end
            self._timings = self.model.step(self._step)  # drawn once per step: the seed replays the run
            self._open_written = False

    def open_lines(self, now: float) -> list[str]:
        """Per rank, the start record of the step in progress, once: MSPTI hands a start marker over on
        its own, so a step's beginning is on disk before its end (what tells a step in progress)."""
        if self._open_written or self._step_start > now:
            return [""] * self.ranks
        self._open_written = True
        start = int(self._step_start * 1e9)
        return [_marker(16, 0, start, self._ids[rank], self._pids[rank], f"step {self._step}") for rank in range(self.ranks)]

    def _start_line(self, rank: int, records: list[str]) -> str:
        """The host start record of the step among its records (written early by open_lines)."""
        return next(line for line in records if line.startswith('{"Kind":1,"Flag":16,"SourceKind":0,') and
                    '"Name":"step ' in line)

    async def run(self) -> None:
        self.prepare()
        while True:
            now = time.time()
            file_name = f"{int(self.started + (now - self.started) // self.rotate_s * self.rotate_s):010d}"
            for rank, (text, opened) in enumerate(zip(self.lines_until(now), self.open_lines(now))):
                if text or opened:
                    self.append(rank, file_name, text + opened)
            await asyncio.sleep(self.flush_s)

    def rank_dir(self, rank: int) -> Path:
        return self.root / self.job_id / str(rank)

    def records(self, timing: RankTiming, step: int, start_s: float) -> list[str]:
        """The lines TaskD would write for one rank's step that started at `start_s`."""
        rank, pid = timing.rank, self._pids[timing.rank]
        start = int(start_s * 1e9)
        end = start + int(timing.duration_s * 1e9)
        loader_end = start + int(timing.dataloader_s * 1e9)
        half = int(timing.forward_s / 2 * 1e9)
        out = self._range(rank, pid, f"step {step}", start, end, on_stream=True)
        out += self._range(rank, pid, "dataloader", start, loader_end, on_stream=False)
        out += self._range(rank, pid, "forward", loader_end, loader_end + half, on_stream=True)
        out += self._range(rank, pid, "forward", loader_end + half, loader_end + 2 * half, on_stream=True)
        return [line for _, line in sorted(out)]  # in the order the markers were called, as mspti buffers them

    def _range(self, rank: int, pid: int, name: str, start: int, end: int,
               on_stream: bool) -> list[tuple[int, str]]:
        ident = self._ids[rank]
        self._ids[rank] += 1
        device = rank  # the device view prints the device and stream ids
        if not on_stream:
            return [(start, _marker(2, 0, start, ident, pid, name)), (end, _marker(4, 0, end, ident, pid, "NULL"))]
        device_start, device_end = start + DEVICE_LAG_NS, end + DEVICE_LAG_NS
        return [(start, _marker(16, 0, start, ident, pid, name)),
                (device_start, _marker(16, 1, device_start, ident, device, name)),
                (end, _marker(32, 0, end, ident, pid, "NULL")),
                (device_end, _marker(32, 1, device_end, ident, device, "NULL"))]


def _marker(flag: int, source: int, timestamp: int, ident: int, pid: int, name: str) -> str:
    """One record as TaskD's writer prints it: Go field order, compact, the one union printed twice."""
    domain = "default" if name != "NULL" else "NULL"
    return (f'{{"Kind":1,"Flag":{flag},"SourceKind":{source},"Timestamp":{timestamp},"Id":{ident},'
            f'"MsptiObjectId":{{"Pt":{{"ProcessId":{pid},"ThreadId":{pid}}},"Ds":{{"DeviceId":{pid},"StreamId":{pid}}}}},'
            f'"Name":"{name}","Domain":"{domain}"}}\n')


def disk_summary(root: Path) -> str:
    """`files per rank: 2-3` for the demo's status line."""
    counts = [sum(1 for n in os.listdir(d) if n.isdigit()) for d in sorted(root.glob("*/*")) if d.is_dir()]
    return f"record files per rank: {min(counts)}-{max(counts)}" if counts else "no record files"
