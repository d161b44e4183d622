"""One declaration per Prometheus family, read by both halves of a custom collector: `describe()`
returns the families empty (so the registry refuses a second collector of the same name) and
`collect()` fills them from the components' state at scrape time.

Every family of the agent has `node` as its first label (a scrape that is not relabelled still
tells nodes apart), so a declaration names the labels that follow it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
                                    SummaryMetricFamily)


@dataclass(frozen=True)
class Family:
    kind: type[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily | SummaryMetricFamily]
    name: str  # a counter's as written in the code (the client drops its `_total`)
    help: str
    labels: tuple[str, ...] = ()  # after `node`

    def empty(self) -> Metric:
        return self.kind(self.name, self.help, labels=["node", *self.labels])

    def one(self, node: str, value: float) -> Metric:
        """The family with its one series, labelled `node` only."""
        family = self.empty()
        family.add_metric([node], value)
        return family

    def series(self, node: str, values: Iterable[tuple[str, float]]) -> Metric:
        """One series per (value of the one label after `node`, sample value), in the order given."""
        family = self.empty()
        for key, value in values:
            family.add_metric([node, key], value)
        return family

    def counts(self, node: str, counts: Mapping[str, float]) -> Metric:
        """One series per key of `counts`, by key."""
        return self.series(node, sorted(counts.items()))


def gauge(name: str, help: str, *labels: str) -> Family:
    return Family(GaugeMetricFamily, name, help, labels)


def counter(name: str, help: str, *labels: str) -> Family:
    return Family(CounterMetricFamily, name, help, labels)


def histogram(name: str, help: str, *labels: str) -> Family:
    return Family(HistogramMetricFamily, name, help, labels)


def summary(name: str, help: str, *labels: str) -> Family:
    """`_count` and `_sum` only (no quantiles): a mean, at two series where a histogram costs one per bucket."""
    return Family(SummaryMetricFamily, name, help, labels)


def described(families: Iterable[Family]) -> list[Metric]:
    """What a collector's describe() returns: its families, empty."""
    return [family.empty() for family in families]
