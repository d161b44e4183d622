"""The chart's Prometheus rules judged by the real `promtool test rules` on what simulated nodes
exported (testkit.training.cluster): which alerts fired, first and last.

Slot k of the recorded scrapes is the sample at k x `interval` seconds of the test; a series absent
from a scrape after being present is marked `stale`, as Prometheus marks a series that leaves a
target. The rules are evaluated at the same interval. Alert annotations are dropped (promtool would
expand their templates at every evaluation; they are checked in tests/unit).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from testkit import REPO
from testkit.training.cluster import SeriesKey

RULES = REPO / "helm" / "npu-node-agent" / "files" / "prometheus-rules.yaml"
PROMTOOL = shutil.which("promtool")


@dataclass
class Recording:
    """Scrapes, slot by slot: series -> its values (None: absent at that scrape)."""

    interval_s: float = 10.0
    slots: int = 0
    series: dict[SeriesKey, list] = field(default_factory=dict)

    def add(self, slot: int, samples: dict[SeriesKey, float]) -> None:
        """The scrape of slot `slot` (1, 2, ...: slot 0 is the empty start)."""
        for key, value in samples.items():
            self.series.setdefault(key, [None] * slot).append(value)
        for values in self.series.values():
            values.extend([None] * (slot + 1 - len(values)))
        self.slots = slot + 1

    def input_series(self) -> list[dict]:
        return [{"series": _selector(name, labels), "values": _values(values)}
                for (name, labels), values in self.series.items()]


@dataclass(frozen=True)
class Alert:
    name: str
    labels: dict
    first_s: float  # when it first fired, seconds into the test
    last_s: float


def fired(recording: Recording, workdir: Path, *, extra_rules: Iterable[dict] = (), timeout_s: float = 1800) -> list[Alert]:
    """Every alert that fired at some evaluation, with the first and last time it did."""
    if PROMTOOL is None:
        raise RuntimeError("promtool is not installed (Debian: apt-get install prometheus)")
    document = yaml.safe_load(RULES.read_text())
    for group in document["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    if extra_rules:
        document["groups"].append({"name": "extra", "interval": f"{recording.interval_s:g}s", "rules": list(extra_rules)})
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "rules.yaml").write_text(yaml.safe_dump(document))
    end = int((recording.slots - 1) * recording.interval_s)
    window = f"[{end + int(recording.interval_s)}s:{recording.interval_s:g}s]"
    firing = 'timestamp(ALERTS{alertstate="firing"})'
    suite = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": f"{recording.interval_s:g}s",
        "tests": [{
            "interval": f"{recording.interval_s:g}s",
            "input_series": recording.input_series(),
            "promql_expr_test": [
                {"expr": f"min_over_time({firing}{window})", "eval_time": f"{end}s", "exp_samples": []},
                {"expr": f"max_over_time({firing}{window})", "eval_time": f"{end}s", "exp_samples": []},
            ],
        }],
    }
    (workdir / "test.yaml").write_text(yaml.safe_dump(suite, width=1 << 30))
    done = subprocess.run([PROMTOOL, "test", "rules", "test.yaml"], cwd=workdir, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode == 0:
        return []  # no alert ever fired: both expressions were empty, as expected
    got = [_samples(line) for line in (done.stdout + done.stderr).splitlines() if line.strip().startswith("got:")]
    if len(got) != 2:
        raise RuntimeError(f"promtool failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    first, last = got
    alerts = []
    for key, value in first.items():
        labels = dict(key)
        labels.pop("alertstate", None)
        alerts.append(Alert(labels.pop("alertname"), labels, value, last[key]))
    return alerts


def _selector(name: str, labels: tuple) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return f"{name}{{{inner}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _values(values: list) -> str:
    """promtool's notation, run-length encoded: `1x4` is five 1s, `_x3` three missing samples."""
    out, index = [], 0
    seen = False
    while index < len(values):
        value = values[index]
        run = 1
        while index + run < len(values) and values[index + run] == value:
            run += 1
        if value is None:
            if seen:
                out.append("stale")  # it left the scrape: stale at once, not 5 minutes later
                run_left = run - 1
            else:
                run_left = run
            if run_left:
                out.append("_" if run_left == 1 else f"_x{run_left}")
        else:
            seen = True
            text = repr(float(value))
            out.append(text if run == 1 else f"{text}x{run - 1}")
        index += run
    return " ".join(out)


_SAMPLE = re.compile(r'\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\}\s+(\S+?)(?:,\s|$)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _samples(line: str) -> dict[frozenset, float]:
    """`got: {a="1", b="x,y"} 6E+01, {...} 3E+01` -> {labels: value}."""
    text = line.split("got:", 1)[1]
    out = {}
    for labels, value in _SAMPLE.findall(text):
        pairs = frozenset((k, bytes(v, "utf-8").decode("unicode_escape")) for k, v in _LABEL.findall(labels))
        out[pairs] = float(value)
    return out
