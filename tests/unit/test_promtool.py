"""The chart's Prometheus rules under the real promtool: `check rules`, and the unit tests of
tests/rules/ (`test rules`), which must cover every alert, firing and not firing.

promtool compares an alert's annotations whole, so the unit tests run against a copy of the rule
file without them: the tests are about when alerts fire and with which labels; the annotation
templates are parsed by `check rules` and their labels checked in test_dashboard_and_rules.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from testkit import REPO

RULES = REPO / "helm" / "npu-node-agent" / "files" / "prometheus-rules.yaml"
TESTS = sorted((REPO / "tests" / "rules").glob("*.yaml"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed: install Debian's `prometheus` package "
                             "(apt-get install --no-install-recommends prometheus); CI does (.ci/run)")


def promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def alerts() -> set[str]:
    document = yaml.safe_load(RULES.read_text())
    return {r["alert"] for g in document["groups"] for r in g["rules"] if "alert" in r}


@needs_promtool
def test_promtool_checks_the_rules():
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_promtool_unit_tests_pass(tmp_path):
    document = yaml.safe_load(RULES.read_text())
    for group in document["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(document))
    for test in TESTS:
        suite = yaml.safe_load(test.read_text())
        assert [(test.parent / f).resolve() for f in suite["rule_files"]] == [RULES], test.name
        suite["rule_files"] = ["rules.yaml"]
        (tmp_path / test.name).write_text(yaml.safe_dump(suite))
    done = promtool("test", "rules", *(t.name for t in TESTS), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_test_that_fires_it_and_one_that_does_not():
    fires, quiet = set(), set()
    for test in TESTS:
        for case in yaml.safe_load(test.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert TESTS and alerts() - fires == set(), "alerts no test fires"
    assert alerts() - quiet == set(), "alerts no test keeps quiet"
    assert (fires | quiet) <= alerts(), "tests of alerts that do not exist"


def test_one_straggler_is_one_alert():
    """The case the slow-worker rules are for: every alert that could fire is counted."""
    suite = yaml.safe_load((REPO / "tests" / "rules" / "training.yaml").read_text())
    case = next(c for c in suite["tests"] if c["name"] == "one worker straggler")
    counts = {t["eval_time"]: t["exp_samples"] for t in case["promql_expr_test"] if t["expr"] == "count(ALERTS)"}
    assert counts == {"10s": [], "20s": [{"labels": "{}", "value": 1}], "10m": [{"labels": "{}", "value": 1}]}
