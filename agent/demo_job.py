"""A simulated training job for the demo: ranks appending TaskD-format marker records.

Each rank writes `<root>/<job>/<rank>/<10-digit unix seconds>` files the way TaskD's worker does
(`taskd.md` §1.5–1.6): one compact JSON marker per line, a start and an end record per range, a new
file every `rotate_s` seconds. The demo gives the agent a small disk limit, so its disk guard ages
the oldest files while the job runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class DemoJob:
    root: Path
    job_id: str = "demo-job"
    ranks: int = 4
    step_s: float = 0.25
    rotate_s: float = 2.0
    padding: int = 4000  # bytes of forward-pass markers per step, to fill the disk at a visible pace

    async def run(self) -> None:
        files: dict[int, tuple[int, object]] = {}
        name_base = int(time.time())
        rotation = 0
        step = 0
        started = time.monotonic()
        try:
            while True:
                now_rotation = int((time.monotonic() - started) / self.rotate_s)
                if now_rotation != rotation or not files:
                    rotation = now_rotation
                    for _, handle in files.values():
                        handle.close()
                    files = {rank: (rotation, self._open(rank, name_base + rotation)) for rank in range(self.ranks)}
                for rank, (_, handle) in files.items():
                    handle.write(self._step_records(rank, step))
                    handle.flush()
                step += 1
                await asyncio.sleep(self.step_s)
        finally:
            for _, handle in files.values():
                handle.close()

    def _open(self, rank: int, name: int):
        directory = self.root / self.job_id / str(rank)
        directory.mkdir(parents=True, exist_ok=True)
        return open(directory / f"{name:010d}", "a", encoding="utf-8")

    def _step_records(self, rank: int, step: int) -> str:
        pid = 40000 + rank
        now = time.time_ns()
        duration = int(self.step_s * 1e9)

        def mark(flag: int, ts: int, ident: int, name: str, domain: str = "default") -> str:
            return json.dumps({"Kind": 1, "Flag": flag, "SourceKind": 0, "Timestamp": ts, "Id": ident,
                               "MsptiObjectId": {"Pt": {"ProcessId": pid, "ThreadId": pid},
                                                 "Ds": {"DeviceId": pid, "StreamId": pid}},
                               "Name": name, "Domain": domain}, separators=(",", ":"))
        ident = step * 100
        lines = [mark(2, now - duration, ident, f"step {step}")]
        forward = 1
        while sum(map(len, lines)) < self.padding:
            lines.append(mark(2, now - duration + forward * 1000, ident + forward, "forward"))
            lines.append(mark(4, now - duration + forward * 1000 + 500, ident + forward, "forward"))
            forward += 1
        lines.append(mark(4, now, ident, f"step {step}"))
        return "\n".join(lines) + "\n"


def disk_summary(root: Path) -> str:
    """`rank 0: 6 files, …` for the demo's status line."""
    parts = []
    for rank_dir in sorted(root.glob("*/*")):
        names = [n for n in os.listdir(rank_dir) if n.isdigit()]
        parts.append(f"rank {rank_dir.name}: {len(names)} files")
    return ", ".join(parts)
