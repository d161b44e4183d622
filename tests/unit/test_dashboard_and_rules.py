"""The chart's Prometheus rules and Grafana dashboard (the renderer of its picture is tested in bench/).

Every PromQL expression is parsed with promql-parser, the Rust parser of the Prometheus grammar, which
is in the `test` extra. The tests walk its syntax tree. Every selector must name a series the agent
exports (the metric contract below) or a recording rule of the rule file. Every label in a
matcher, `by`, `on`, `group_left` or template must exist on the series at that point of the
expression. Vector matching without `on`/`ignoring` must compare identical label sets, or it
silently matches nothing.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta

import promql_parser as pq
import pytest
import yaml

from testkit import REPO

FILES = REPO / "helm" / "npu-node-agent" / "files"
RULES = FILES / "prometheus-rules.yaml"
DASHBOARD = FILES / "grafana-dashboard.json"

# ---------------------------------------------------------------------------------------------
# The metric contract, as the agent exports it (docs/metrics.md).

PER_RANK = frozenset({"node", "namespace", "job_name", "job_id", "rank", "pp_stage"})
PER_WORKER = frozenset({"node", "namespace", "job_name", "job_id", "pp_stage", "worker"})
PER_JOB = frozenset({"node", "namespace", "job_name", "job_id"})  # a job's ranks on one node
WORKER = PER_WORKER - {"node"}  # a worker whichever nodes its ranks are on
CONTAINER = frozenset({"namespace", "pod_name", "container_name"})
METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "training_step_duration_seconds": ("summary", PER_RANK | {"clock"}),
    "training_node_step_duration_seconds": ("histogram", PER_JOB | {"clock"}),
    "training_node_phase_duration_seconds": ("histogram", PER_JOB | {"phase"}),
    "training_step_last_duration_seconds": ("gauge", PER_RANK),
    "training_step_last_completed_timestamp_seconds": ("gauge", PER_RANK),
    "training_steps_completed_total": ("counter", PER_RANK),
    "training_step_baseline_seconds": ("gauge", PER_RANK),
    "training_rank_slowdown_ratio": ("gauge", PER_RANK),
    "training_rank_slow": ("gauge", PER_RANK | {"reason"}),
    "training_node_slow": ("gauge", PER_JOB | {"reason"}),
    "training_profiling_records_total": ("counter", frozenset({"node", "job_id", "rank"})),
    "training_profiling_parse_errors_total": ("counter", frozenset({"node", "reason"})),
    "training_profiling_lag_seconds": ("gauge", frozenset({"node", "job_id", "rank"})),
    "training_rank_active": ("gauge", PER_RANK),
    "training_step_open_since_timestamp_seconds": ("gauge", PER_RANK),
    "training_checkpoint_open_since_timestamp_seconds": ("gauge", PER_RANK),
    "training_worker_compute_seconds": ("gauge", PER_WORKER | {"window"}),
    "training_worker_compute_stderr_seconds": ("gauge", PER_WORKER | {"window"}),
    "training_worker_slow": ("gauge", PER_WORKER | {"reason"}),
    "training_worker_info": ("gauge", PER_WORKER | {"ranks", "pod_name"}),
    # Optional: the rules must fire without it (they join it only on the left of an `or`).
    "training_rank_info": ("gauge", frozenset({"node", "namespace", "job_name", "job_id", "rank", "pod_name"})),
    # The chips, fault delivery and the agent itself (docs/metrics.md).
    "npu_agent_device_fault_level": ("gauge", CONTAINER | {"node", "id"}),
    "npu_agent_device_fault": ("gauge", CONTAINER | {"node", "id", "fault_code", "fault_level"}),
    "npu_chip_info_health_status": ("gauge", CONTAINER | {"node", "id", "model_name", "vdie_id", "pcie_bus_info"}),
    "npu_agent_outbox_pending": ("gauge", frozenset({"node"})),
    "npu_agent_sink_last_success_timestamp_seconds": ("gauge", frozenset({"node", "sink"})),
    "npu_agent_component_ready": ("gauge", frozenset({"node", "component"})),
    "npu_agent_fault_rule_reloads_total": ("counter", frozenset({"node", "result"})),
    "npu_agent_task_restarts_total": ("counter", frozenset({"node", "task"})),
    "npu_agent_profiling_disk_usage_bytes": ("gauge", frozenset({"node"})),
    "npu_agent_profiling_disk_limit_bytes": ("gauge", frozenset({"node"})),
    "npu_agent_build_info": ("gauge", frozenset({"node", "version"})),
}
# kube-state-metrics' series the presence alerts read (its docs/metrics: pod, node and DaemonSet
# metrics), with the labels it exports. Its scrape adds target labels too (job, instance, and with
# honorLabels its own pod where a series has none): the rules aggregate them away.
DAEMONSET = frozenset({"namespace", "daemonset"})
METRICS |= {
    "kube_pod_info": ("gauge", frozenset({"namespace", "pod", "uid", "node", "host_ip", "pod_ip", "created_by_kind",
                                          "created_by_name", "priority_class", "host_network"})),
    "kube_pod_status_ready": ("gauge", frozenset({"namespace", "pod", "uid", "condition"})),
    "kube_node_status_condition": ("gauge", frozenset({"node", "condition", "status"})),
    "kube_daemonset_status_desired_number_scheduled": ("gauge", DAEMONSET),
    "kube_daemonset_status_current_number_scheduled": ("gauge", DAEMONSET),
    "kube_daemonset_status_updated_number_scheduled": ("gauge", DAEMONSET),
    "kube_daemonset_status_number_available": ("gauge", DAEMONSET),
}
VALUES: dict[tuple[str, str], set[str]] = {
    ("training_step_duration_seconds", "clock"): {"device", "host"},
    ("training_node_step_duration_seconds", "clock"): {"device", "host"},
    ("training_node_phase_duration_seconds", "phase"): {"forward", "dataloader", "save_checkpoint"},
    ("training_rank_slow", "reason"): {"temporal", "compute", "io"},
    ("training_node_slow", "reason"): {"ranks", "host"},
    ("training_worker_slow", "reason"): {"compute", "io"},
    ("training_worker_compute_seconds", "window"): {"8", "32", "128"},
    ("training_worker_compute_stderr_seconds", "window"): {"8", "32", "128"},
    ("npu_agent_sink_last_success_timestamp_seconds", "sink"): {"clusterd", "configmap", "stream"},
    ("npu_agent_fault_rule_reloads_total", "result"): {"success", "failure"},
    ("kube_pod_status_ready", "condition"): {"true", "false", "unknown"},
    ("kube_node_status_condition", "status"): {"true", "false", "unknown"},
    ("kube_pod_info", "created_by_kind"): {"DaemonSet", "ReplicaSet", "StatefulSet", "Job", "Node", "<none>"},
}


def exported_series() -> dict[str, tuple[str, frozenset[str]]]:
    """Series name -> (metric name, labels): a histogram is its _bucket (with le), _sum and _count, a
    summary (without quantiles) its _sum and _count."""
    series = {}
    for name, (kind, labels) in METRICS.items():
        if kind == "histogram":
            series[name + "_bucket"] = (name, labels | {"le"})
        if kind in ("histogram", "summary"):
            series[name + "_sum"] = (name, labels)
            series[name + "_count"] = (name, labels)
        else:
            series[name] = (name, labels)
    return series


SERIES = exported_series()
SCALAR_FUNCTIONS = {"time", "scalar", "pi", "minute", "hour", "day_of_week", "day_of_month", "days_in_month",
                    "month", "year"}
DURATION = re.compile(r"^(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$")
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s", "__range_ms"}


# ---------------------------------------------------------------------------------------------
# Label flow through a PromQL syntax tree.

class Checker:
    """Works out the labels of each sub-expression and collects what is wrong with them."""

    def __init__(self, recorded: dict[str, frozenset[str]]):
        self.recorded = recorded
        self.problems: list[str] = []
        self.names: set[str] = set()
        self.numbers: set[float] = set()
        self.optional: set[str] = set()  # labels that only some series of the result carry (`or`)

    def labels(self, node) -> frozenset[str] | None:
        """The labels of the result, None for a scalar."""
        kind = type(node).__name__
        if kind == "NumberLiteral":
            self.numbers.add(node.val)
            return None
        if kind == "StringLiteral":
            return None
        if kind == "VectorSelector":
            return self.selector(node)
        if kind == "MatrixSelector":
            return self.selector(node.vector_selector)
        if kind in ("ParenExpr", "UnaryExpr", "SubqueryExpr"):
            return self.labels(node.expr)
        if kind == "AggregateExpr":
            return self.aggregate(node)
        if kind == "Call":
            return self.call(node)
        if kind == "BinaryExpr":
            return self.binary(node)
        self.problems.append(f"unexpected expression {kind}")
        return frozenset()

    def selector(self, node) -> frozenset[str]:
        matchers = {m.name: m for m in node.matchers.matchers}
        name = node.name or (matchers["__name__"].value if "__name__" in matchers else None)
        if name is None:
            self.problems.append(f"selector without a metric name: {node}")
            return frozenset()
        self.names.add(name)
        if name in SERIES:
            metric, labels = SERIES[name]
        elif name in self.recorded:
            metric, labels = name, self.recorded[name]
        else:
            self.problems.append(f"unknown metric {name!r}")
            return frozenset()
        for label, matcher in matchers.items():
            if label == "__name__":
                continue
            if label not in labels:
                self.problems.append(f"{name} has no label {label!r}")
            allowed = VALUES.get((metric, label))
            if allowed and str(matcher.op) == "MatchOp.Equal" and matcher.value not in allowed:
                self.problems.append(f"{name}{{{label}={matcher.value!r}}}: not one of {sorted(allowed)}")
        return labels

    def aggregate(self, node) -> frozenset[str]:
        inner = self.labels(node.expr)
        if node.param is not None:
            self.labels(node.param)
        op = str(node.op)
        if inner is None:
            self.problems.append(f"{op} of a scalar")
            return frozenset()
        if op in ("topk", "bottomk", "limitk", "limit_ratio"):
            return inner
        modifier = node.modifier
        if modifier is None:
            grouping = frozenset()
        else:
            named = frozenset(modifier.labels)
            if not named <= inner:
                self.problems.append(f"{op} by/without {sorted(named - inner)}: not labels of its argument {sorted(inner)}")
            grouping = named & inner if str(modifier.type).endswith("By") else inner - named
        if op == "count_values":
            grouping |= {node.param.val}
        return grouping

    def call(self, node) -> frozenset[str] | None:
        name = node.func.name
        args = [self.labels(a) for a in node.args]
        vectors = [a for a in args if a is not None]
        if name in SCALAR_FUNCTIONS and not vectors:
            return None
        if name == "scalar":
            return None
        if name == "vector":
            return frozenset()
        if name == "histogram_quantile":
            if "le" not in args[1]:
                self.problems.append("histogram_quantile of series without le")
            return args[1] - {"le"}
        if name == "label_replace":
            return args[0] | {node.args[1].val}
        if name in ("absent", "absent_over_time"):  # only the labels its selector fixes with `=`
            selector = node.args[0]
            selector = getattr(selector, "vector_selector", selector)
            return frozenset(m.name for m in selector.matchers.matchers
                             if m.name != "__name__" and str(m.op) == "MatchOp.Equal")
        return vectors[0] if vectors else None

    def binary(self, node) -> frozenset[str] | None:
        left, right = self.labels(node.lhs), self.labels(node.rhs)
        op = str(node.op)
        if left is None or right is None:
            return right if left is None else left
        modifier = node.modifier
        matching = modifier.matching if modifier is not None else None
        on = frozenset(matching.labels) if matching is not None else None
        include = matching is not None and str(matching.type).endswith("Include")
        if on is not None:
            for side, labels in (("left", left), ("right", right)):
                if include and not on <= labels:
                    self.problems.append(f"{op} on {sorted(on - labels)}: not labels of its {side} side {sorted(labels)}")
        if op in ("and", "unless"):
            return left
        if op == "or":
            self.optional |= left ^ right  # on some of the result's series only
            return left & right
        card = str(modifier.card) if modifier is not None else "VectorMatchCardinality.OneToOne"
        group = frozenset(modifier.group_labels or ()) if modifier is not None else frozenset()
        if matching is None:
            if left != right:
                self.problems.append(f"{op} between different label sets {sorted(left)} and {sorted(right)} "
                                     "without on()/ignoring(): nothing matches")
            return left
        # The "one" side must have one series per match group, or Prometheus fails the query at run
        # time ("many-to-many matching not allowed"). Here that means it has no labels beyond on()
        # and the group_left/right ones (stricter than needed in general, always true in these files).
        if card.endswith("ManyToOne"):
            if not group <= right:
                self.problems.append(f"group_left {sorted(group - right)}: not labels of the right side")
            if include and not right <= on | group:
                self.problems.append(f"group_left on {sorted(on)}: the right side has more labels {sorted(right)}")
            return left | group
        if card.endswith("OneToMany"):
            if not group <= left:
                self.problems.append(f"group_right {sorted(group - left)}: not labels of the left side")
            if include and not left <= on | group:
                self.problems.append(f"group_right on {sorted(on)}: the left side has more labels {sorted(left)}")
            return right | group
        return on if include else left - on


def duration(text: str) -> timedelta:
    """A rule file's duration (Prometheus' model.Duration: "0s" too, unlike a PromQL range)."""
    match = DURATION.match(str(text))
    assert text != "" and match, f"not a duration: {text!r}"
    y, w, d, h, m, s, ms = (int(g or 0) for g in match.groups())
    value = timedelta(days=365 * y + 7 * w + d, hours=h, minutes=m, seconds=s, milliseconds=ms)
    if value > timedelta(0):
        assert pq.parse_duration(text) == value, text
    return value


def parse(expr: str):
    try:
        return pq.parse(expr)
    except ValueError as exc:
        pytest.fail(f"PromQL does not parse ({exc}): {expr}")


def check(expr: str, recorded: dict[str, frozenset[str]]) -> tuple[frozenset[str] | None, Checker]:
    checker = Checker(recorded)
    labels = checker.labels(parse(expr))
    return labels, checker


def test_the_contract_is_what_the_agent_exports():
    """Every training family of the contract is the agent's, of its type, with at least these labels,
    and every one the agent exports is in it: a family taken out of the agent fails here before any
    rule or panel reading it is left behind."""
    from tests.support import gendocs

    exported = {name: (kind, frozenset(labels)) for name, (kind, labels, _) in gendocs.metric_families().items()
                if name.startswith("training_")}
    contract = {name: spec for name, spec in METRICS.items() if name.startswith("training_")}
    assert sorted(contract) == sorted(exported)
    for name, (kind, labels) in contract.items():
        assert exported[name][0] == kind and labels <= exported[name][1], name


def test_the_checker_catches_what_it_is_for():
    """The checks below pass because the files are right, not because the checker sees nothing."""
    cases = {
        "training_rank_slowdown_rati": "unknown metric",
        "training_node_step_duration_seconds": "unknown metric",  # a histogram has no bare series
        "training_step_duration_seconds": "unknown metric",  # nor a summary
        "training_step_duration_seconds_bucket": "unknown metric",  # a summary has no buckets (its job's histogram has)
        "sum by (stage) (training_rank_slowdown_ratio)": "not labels of its argument",
        'training_rank_slow{reason="host"}': "not one of",
        'training_node_slow{rank="1"}': "has no label",
        "training_rank_slowdown_ratio / on (job_id, pp_stage) group_left training_node_slow":
            "not labels of its right side",
        "training_rank_slowdown_ratio / on (job_id) group_left (rank) training_node_slow": "group_left ['rank']",
        "training_rank_slowdown_ratio / sum by (job_id) (training_rank_slowdown_ratio)": "nothing matches",
        "histogram_quantile(0.5, training_rank_slowdown_ratio)": "without le",
        "training_rank_slowdown_ratio / on (job_id) group_left training_rank_slowdown_ratio": "has more labels",
    }
    for expr, message in cases.items():
        _, checker = check(expr, {})
        assert any(message in p for p in checker.problems), (expr, checker.problems)
    labels, checker = check(
        "histogram_quantile(0.5, sum by (le, node) (rate(training_node_step_duration_seconds_bucket[1m])))", {})
    assert checker.problems == [] and labels == {"node"}
    labels, checker = check("x / on (job_id) group_left (job_name) max by (job_id, job_name) (training_node_slow)",
                            {"x": frozenset({"job_id", "rank"})})
    assert checker.problems == [] and labels == {"job_id", "rank", "job_name"}
    labels, _ = check("training_rank_slow > on (rank) training_rank_slowdown_ratio", {})
    assert labels == {"rank"}  # one-to-one matching with on() keeps only those labels
    labels, _ = check('absent(training_rank_slow{rank="3", reason=~"io|compute"})', {})
    assert labels == {"rank"}  # absent() has no labels but those its selector fixes
    with pytest.raises(pytest.fail.Exception):
        parse("sum(rate(training_steps_completed_total[5m])")


# ---------------------------------------------------------------------------------------------
# Rules

TEMPLATE_LABEL = re.compile(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)")
RECORD_NAME = re.compile(r"^[a-z_]+:[a-z_]+[a-z0-9_]*:[a-z0-9_]+$")


@pytest.fixture(scope="module")
def rules() -> dict:
    with open(RULES) as f:
        document = yaml.safe_load(f)
    assert isinstance(document, dict) and set(document) == {"groups"}, "a rule file has only `groups:`"
    return document


@pytest.fixture(scope="module")
def recorded(rules) -> dict[str, frozenset[str]]:
    """Recording rule -> its labels, worked out in file order: a rule may use only the ones above it
    (Prometheus runs a group's rules in order, so later ones see the fresh results)."""
    recorded: dict[str, frozenset[str]] = {}
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                labels, checker = check(rule["expr"], recorded)
                assert checker.problems == [], (rule["record"], checker.problems)
                assert labels is not None, f"{rule['record']} records a scalar"
                recorded[rule["record"]] = labels
    return recorded


def all_rules(rules):
    return [rule for group in rules["groups"] for rule in group["rules"]]


def test_groups_and_rules_have_the_required_keys(rules):
    names = [g.get("name") for g in rules["groups"]]
    assert names and all(isinstance(n, str) and n for n in names) and len(set(names)) == len(names)
    for group in rules["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit", "query_offset"}, group["name"]
        assert isinstance(group["rules"], list) and group["rules"], group["name"]
        if "interval" in group:
            assert duration(group["interval"]) > timedelta(0)
        for rule in group["rules"]:
            assert ("record" in rule) != ("alert" in rule), rule
            assert isinstance(rule.get("expr"), str) and rule["expr"].strip(), rule
            if "record" in rule:
                assert set(rule) <= {"record", "expr", "labels"}, rule["record"]
            else:
                assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule["alert"]


def test_recording_rules_follow_the_naming_convention_and_the_worker_rule(rules, recorded):
    records = [r["record"] for r in all_rules(rules) if "record" in r]
    assert len(records) == len(set(records))
    for name in records:
        assert RECORD_NAME.match(name), f"{name}: level:metric:operations"
        assert name not in SERIES
    by_name = {r["record"]: r["expr"] for r in all_rules(rules) if "record" in r}
    stage = frozenset({"job_id", "pp_stage", "window"})
    # The reference and the noise of agent.steps.evidence.judge: the 0.25 quantile of the medians,
    # the median of the standard errors, per stage and window.
    for record, q, of in (("job_id_pp_stage_window:training_worker_compute_seconds:q25", 0.25,
                           "worker_window:training_worker_compute_seconds:max"),
                          ("job_id_pp_stage_window:training_worker_compute_stderr_seconds:median", 0.5,
                           "worker_window:training_worker_compute_stderr_seconds:max")):
        assert recorded[record] == stage
        tree = pq.parse(by_name[record])
        tree = tree.lhs if type(tree).__name__ == "BinaryExpr" else tree
        assert type(tree).__name__ == "AggregateExpr" and str(tree.op) == "quantile"
        assert tree.param.val == q and tree.expr.name == of
    for name in ("worker_window:training_worker_compute:excess", "worker_window:training_worker_compute:z"):
        assert recorded[name] == WORKER | {"window"}
    for name in ("worker:training_worker_compute:excess", "worker:training_worker_compute:z",
                 "worker:training_worker_compute:slow", "worker:training_worker_slow:compute"):
        assert recorded[name] == WORKER
    assert recorded["worker:training_worker_slow:cause"] == WORKER | {"reason"}
    assert recorded["job:training_job_slow:cause"] == {"namespace", "job_name", "job_id", "cause"}


def test_the_rules_use_the_agents_thresholds(rules, recorded):
    from agent.steps.evidence import EXCESS_MIN, Z_MIN
    slow = next(r["expr"] for r in all_rules(rules) if r.get("record") == "worker:training_worker_compute:slow")
    _, checker = check(slow, recorded)
    assert checker.numbers == {EXCESS_MIN, Z_MIN}


def test_every_expression_names_only_exported_metrics_or_recording_rules(rules, recorded):
    for rule in all_rules(rules):
        _, checker = check(rule["expr"], recorded)
        assert checker.problems == [], (rule.get("alert") or rule.get("record"), checker.problems)
        assert checker.names, rule


def alert(rules, name) -> dict:
    found = [r for r in all_rules(rules) if r.get("alert") == name]
    assert len(found) == 1, f"alert {name}: {len(found)} rules"
    return found[0]


def constants(rules, recorded, expr: str) -> set[float]:
    """The numbers in an expression and in the recording rules it uses, transitively."""
    by_name = {r["record"]: r["expr"] for r in all_rules(rules) if "record" in r}
    numbers, todo, seen = set(), [expr], set()
    while todo:
        _, checker = check(todo.pop(), recorded)
        numbers |= checker.numbers
        for name in checker.names - seen:
            seen.add(name)
            if name in by_name:
                todo.append(by_name[name])
    return numbers


def test_alerts_have_severity_summary_description_runbook_and_only_existing_labels(rules, recorded):
    alerts = [r for r in all_rules(rules) if "alert" in r]
    names = [a["alert"] for a in alerts]
    assert len(names) == len(set(names))
    assert {"NPUFaultLevelHigh", "NPUCardDropped", "NPUHealthUnknown", "NPUAgentClusterDNotAcknowledging",
            "NPUAgentFaultDeliveryStalled", "NPUAgentComponentNotReady", "NPUAgentFaultRulesReloadFailed",
            "NPUAgentProfilingDiskOverLimit", "TrainingWorkerStraggler", "TrainingNodeSlow", "TrainingJobSlow",
            "TrainingRankHung", "TrainingProfilingLagHigh", "TrainingProfilingParseErrors"} <= set(names)
    for rule in alerts:
        name = rule["alert"]
        assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", name)
        duration(rule.get("for", "0s"))
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook"}, name
        assert all(text.strip() for text in annotations.values()), name
        labels, checker = check(rule["expr"], recorded)
        available = (labels or frozenset()) | set(rule["labels"])
        for text in annotations.values():
            assert text.count("{{") == text.count("}}"), (name, text)
            for label in TEMPLATE_LABEL.findall(text):
                if label in checker.optional:  # on some series only: the text must not depend on it
                    assert f"{{{{ with $labels.{label} }}}}" in text, f"{name}: {label} is optional, use `with`"
                    continue
                assert label in available, f"{name}: {{{{ $labels.{label} }}}} is not a label of the alert {sorted(available)}"


def test_alert_thresholds_are_the_specs(rules, recorded):
    straggler = alert(rules, "TrainingWorkerStraggler")
    assert duration(straggler.get("for", "0s")) == timedelta(0)  # the evidence holds many steps already
    labels, checker = check(straggler["expr"], recorded)
    assert labels == WORKER | {"reason"}
    assert checker.optional == {"node", "ranks", "pod_name"}  # absent for a worker spread over nodes
    # Nothing in the worker rules counts evaluations over time: a stopped job's frozen values confirm nothing.
    for rule in all_rules(rules):
        if "worker" in rule.get("record", "") or rule.get("alert") == "TrainingWorkerStraggler":
            assert "_over_time" not in rule["expr"] and "[" not in rule["expr"], rule
    [training] = [g for g in rules["groups"] if any(r.get("alert") == "TrainingWorkerStraggler" for r in g["rules"])]
    assert duration(training["interval"]) == timedelta(seconds=10)  # the chart's default scrape interval
    assert "unless on (job_id) worker:training_worker_slow:cause" in " ".join(alert(rules, "TrainingNodeSlow")["expr"].split())
    job = alert(rules, "TrainingJobSlow")
    labels, _ = check(job["expr"], recorded)
    assert labels == {"namespace", "job_name", "job_id", "cause"} and job["labels"]["severity"] == "info"
    assert {1.10, 1.25} <= constants(rules, recorded, job["expr"])
    hung = alert(rules, "TrainingRankHung")
    _, checker = check(hung["expr"], recorded)
    assert checker.names == {"training_step_open_since_timestamp_seconds", "training_step_baseline_seconds",
                             "training_checkpoint_open_since_timestamp_seconds"}
    assert {10.0, 60.0} <= checker.numbers
    lag = alert(rules, "TrainingProfilingLagHigh")
    assert duration(lag["for"]) == timedelta(minutes=2)
    _, checker = check(lag["expr"], recorded)
    assert checker.names == {"training_profiling_lag_seconds", "training_rank_active"} and 30.0 in checker.numbers
    errors = alert(rules, "TrainingProfilingParseErrors")
    assert duration(errors["for"]) == timedelta(minutes=10)
    tree = pq.parse(errors["expr"])
    assert type(tree.lhs).__name__ == "Call" and tree.lhs.func.name == "rate" and tree.rhs.val == 0
    # The chart sets the fault level by replacing this text (templates/prometheusrule.yaml).
    assert "(npu_agent_device_fault_level >= 3)" in alert(rules, "NPUFaultLevelHigh")["expr"]


# ---------------------------------------------------------------------------------------------
# Dashboard

GRAFANA_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::[a-z]+)?\}|([A-Za-z_][A-Za-z0-9_]*))")
LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
LABEL_VALUES = re.compile(r"^label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)$", re.S)


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def grafana_to_promql(expr: str) -> str:
    """What Grafana sends: its interval variables are durations, the others sit inside label values."""
    expr = re.sub(r"\$(__rate_interval|__interval|__range)\b", "1m", expr)
    return expr


def test_the_dashboard_is_importable(dashboard):
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["title"] and dashboard["uid"]
    inputs = {i["name"]: i for i in dashboard["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource" and inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    assert "${DS_PROMETHEUS}" in DASHBOARD.read_text(), "the input must be used, or the import ignores it"
    required = {r["id"] for r in dashboard["__requires"] if r["type"] == "panel"}
    assert {p["type"] for p in dashboard["panels"]} <= required


def test_template_variables_exist_and_query_exported_labels(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "job_name", "job_id", "node"} <= set(variables)
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    for name in ("namespace", "job_name", "job_id", "node"):
        variable = variables[name]
        assert variable["type"] == "query" and variable["datasource"]["uid"] == "${datasource}"
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = LABEL_VALUES.match(query)
        assert match, f"${name}: {query}"
        assert match.group(2) == name
        labels, checker = check(grafana_to_promql(match.group(1)), {})
        assert checker.problems == [] and name in labels, (name, checker.problems)
        for used in GRAFANA_VARIABLE.findall(query):
            assert (used[0] or used[1]) in variables


def panels(dashboard):
    return dashboard["panels"]


def test_panels_have_unique_ids_titles_and_a_place_on_the_grid(dashboard):
    ids = [p["id"] for p in panels(dashboard)]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids)
    titles = [p["title"] for p in panels(dashboard)]
    assert all(titles) and len(set(titles)) == len(titles)
    cells: dict[tuple[int, int], str] = {}
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in "xywh"), panel["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_every_target_is_promql_over_exported_metrics_with_existing_labels(dashboard):
    variables = {v["name"] for v in dashboard["templating"]["list"]} | GRAFANA_BUILTINS
    for panel in panels(dashboard):
        title = panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", title
        targets = panel["targets"]
        assert targets, title
        assert len({t["refId"] for t in targets}) == len(targets), title
        for target in targets:
            assert target["datasource"]["uid"] == "${datasource}", title
            expr = target["expr"]
            for used in GRAFANA_VARIABLE.findall(expr):
                assert (used[0] or used[1]) in variables, (title, used)
            labels, checker = check(grafana_to_promql(expr), {})
            assert checker.problems == [], (title, checker.problems)
            for label in LEGEND_LABEL.findall(target.get("legendFormat", "")):
                assert labels is not None and label in labels, f"{title}: legend {{{{{label}}}}} not in {sorted(labels or ())}"


def test_the_panels_the_readme_shows_exist(dashboard):
    by_title = {p["title"]: p for p in panels(dashboard)}

    def names(panel) -> set[str]:
        found = set()
        for target in panel["targets"]:
            found |= check(grafana_to_promql(target["expr"]), {})[1].names
        return found

    kinds = {p["type"] for p in panels(dashboard)}
    assert {"timeseries", "heatmap", "state-timeline"} <= kinds
    heat = next(p for p in panels(dashboard) if p["type"] == "heatmap")
    assert heat["targets"][0]["format"] == "heatmap" and names(heat) == {"training_node_step_duration_seconds_bucket"}
    expected = {
        "training_step_duration_seconds_sum", "training_step_duration_seconds_count",
        "training_node_step_duration_seconds_bucket", "training_node_phase_duration_seconds_bucket",
        "training_step_last_duration_seconds", "training_rank_slowdown_ratio",
        "training_worker_compute_seconds", "training_worker_slow", "training_worker_info", "training_rank_slow",
        "training_node_slow", "training_step_open_since_timestamp_seconds", "training_profiling_lag_seconds",
        "training_profiling_parse_errors_total", "training_steps_completed_total",
    }
    assert expected <= set().union(*(names(p) for p in by_title.values()))
    timeline = [p for p in panels(dashboard) if p["type"] == "state-timeline" and "training_rank_slow" in names(p)]
    assert timeline and any(t["expr"].rstrip().endswith("== 1") for p in timeline for t in p["targets"])


def test_every_alert_is_listed_in_the_monitoring_docs(rules):
    """docs/monitoring.md's table is where operators look an alert up; every one is there, once."""
    rows = re.findall(r"^\| `([A-Za-z0-9]+)` \| (critical|warning|info) \|", (REPO / "docs" / "monitoring.md").read_text(), re.M)
    severity = {r["alert"]: r["labels"]["severity"] for r in all_rules(rules) if "alert" in r}
    assert sorted(name for name, _ in rows) == sorted(severity)
    assert {name: level for name, level in rows} == severity
