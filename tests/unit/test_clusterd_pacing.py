"""The ClusterD sink's pacing, sharding and reconciliation period, with a clock the test moves.

The storm tests run many `Pacing`s against one token bucket with ClusterD's numbers (1 request/s,
burst 100) as a discrete-event simulation: each node tries, is served if the bucket holds a token,
and otherwise waits what its pacing says."""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter

import pytest

from agent.common.ratelimit import TokenBucket
from agent.config import Config, resource_names, validate
from agent.sinks.clusterd.pacing import (BURST, MAX_DELAY_S, MIN_DELAY_S, SPACING, Pacing, reconcile_period_s,
                                         resource_of)
from tests.support.clock import FakeClock


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list (as the benchmarks report it)."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def middle(low: float, high: float) -> float:
    return (low + high) / 2


def test_the_first_refusal_waits_a_share_of_the_burst_and_the_delay_grows_with_the_wait():
    clock = FakeClock(0.0)
    pacing = Pacing(clock, uniform=middle)
    assert pacing.waited() == 0
    assert pacing.refused() == pytest.approx(SPACING * BURST)  # 10 s: the burst is 100 s of the refill
    clock.advance(10)
    assert pacing.waited() == 10
    assert pacing.refused() == pytest.approx(SPACING * (10 + BURST))
    clock.advance(390)
    assert pacing.refused() == pytest.approx(SPACING * (400 + BURST))


def test_a_delivery_ends_the_wait_and_the_next_refusal_starts_a_new_one():
    clock = FakeClock(0.0)
    pacing = Pacing(clock, uniform=middle)
    pacing.refused()
    clock.advance(300)
    pacing.refused()
    pacing.delivered()
    assert pacing.waited() == 0
    clock.advance(5)
    assert pacing.refused() == pytest.approx(SPACING * BURST)


def test_a_refusal_long_after_the_last_one_starts_a_new_wait():
    clock = FakeClock(0.0)
    pacing = Pacing(clock, uniform=middle)
    pacing.refused()
    clock.advance(5 * MAX_DELAY_S)  # the sink stopped trying (a failure backoff, a stop): not one long wait
    assert pacing.refused() == pytest.approx(SPACING * BURST)


def test_delays_are_drawn_around_the_mean_and_bounded():
    clock = FakeClock(0.0)
    low = Pacing(clock, uniform=lambda a, b: a)
    high = Pacing(clock, uniform=lambda a, b: b)
    assert low.refused() == pytest.approx(0.25 * SPACING * BURST)
    assert high.refused() == pytest.approx(1.75 * SPACING * BURST)
    for _ in range(20):  # a wait of hours (a storm of thousands on one resource)
        clock.advance(MAX_DELAY_S)
        delay = high.refused()
    assert delay == MAX_DELAY_S
    tiny = Pacing(FakeClock(0.0), refill_per_s=1000.0, uniform=lambda a, b: a)
    assert tiny.refused() == MIN_DELAY_S


def storm(k: int, seed: int, old_backoff: bool = False) -> tuple[dict[int, float], int]:
    """K nodes each with one request to deliver at t=0; returns (node -> when it was served, refused
    tries). `old_backoff`: the sink's retry before the pacing, uniform(0.5, min(30, 2^tries)) s."""
    clock = FakeClock(0.0)
    bucket = TokenBucket(1.0, BURST, clock)
    rng = random.Random(seed)
    pacings = {i: Pacing(clock, uniform=rng.uniform) for i in range(k)}
    tries = Counter()
    queue = [(0.0, rng.random(), i) for i in range(k)]
    heapq.heapify(queue)
    served, refused = {}, 0
    while queue:
        at, _, node = heapq.heappop(queue)
        clock.at(at)
        if bucket.take():
            served[node] = at
            pacings[node].delivered()
            continue
        refused += 1
        tries[node] += 1
        delay = rng.uniform(0.5, min(30.0, 2.0 ** tries[node])) if old_backoff else pacings[node].refused()
        heapq.heappush(queue, (at + delay, rng.random(), node))
    return served, refused


@pytest.mark.parametrize("k", [300, 500, 1000, 3000])
def test_a_storm_drains_near_the_bound_fairly(k):
    bound = k - BURST
    for seed in range(3):
        served, _ = storm(k, seed)
        delays = list(served.values())
        assert max(delays) <= 1.2 * bound, (seed, max(delays) / bound)
        assert percentile(delays, 99) <= 1.1 * bound


@pytest.mark.parametrize("k", [500, 1000, 3000])
def test_a_storm_costs_far_fewer_refused_calls_than_the_old_backoff(k):
    _, refused = storm(k, seed=3)
    _, old = storm(k, seed=3, old_backoff=True)
    assert refused <= 0.7 * old, (refused / (k - BURST), old / (k - BURST))


def test_the_order_of_a_storm_is_a_lottery_not_a_queue_of_the_unlucky():
    """Every node of a storm has waited as long: half of the nodes are served by about half the bound,
    whichever they are (no node is pushed back by its own refusals more than the others)."""
    served, _ = storm(1000, seed=7)
    order = sorted(served, key=served.get)
    halves = Counter(node < 500 for node in order[:500])
    assert 200 < halves[True] < 300
    assert percentile(list(served.values()), 50) <= 0.6 * (1000 - BURST)


def test_a_node_alone_is_never_paced():
    served, refused = storm(int(BURST), seed=1)
    assert refused == 0 and max(served.values()) == 0


def test_resource_of_is_stable_per_node_and_spreads_nodes_evenly():
    resources = ["npu-node-agent-a", "npu-node-agent-b", "npu-node-agent-c", "npu-node-agent-d"]
    assert resource_of("node-1", "npu-node-agent", []) == "npu-node-agent"
    assert resource_of("node-1", "npu-node-agent", resources) == resource_of("node-1", "other", list(resources))
    spread = Counter(resource_of(f"node-{i}", "", resources) for i in range(4000))
    assert set(spread) == set(resources)
    assert all(900 < count < 1100 for count in spread.values()), spread


def test_the_reconciliation_period_keeps_the_cluster_under_its_share_of_the_budget():
    assert reconcile_period_s(1800, 10, 1) == 1800  # a small cluster: the configured period
    period = reconcile_period_s(1800, 1000, 1, budget_share=0.04)
    assert period == pytest.approx(25_000)
    assert 1000 * 3600 / period / 3600 == pytest.approx(0.04)  # requests/h of 1,000 faulty nodes / budget
    assert reconcile_period_s(1800, 1000, 4, budget_share=0.04) == pytest.approx(6250)  # four budgets


@pytest.mark.parametrize("text, problem", [
    ("npu-node-agent-a,,npu-node-agent-b", "has an empty resource name"),
    ("npu-node-agent-a, npu-node-agent-a", "lists a resource twice"),
])
def test_a_resource_list_with_a_hole_or_a_repeat_is_refused(text, problem):
    config = Config()
    config.clusterd.resources = text
    assert any("clusterd.resources" in p and problem in p for p in validate(config)), validate(config)


def test_resource_names_reads_the_list():
    assert resource_names("") == [] and resource_names(" a , b") == ["a", "b"]


def test_opening_a_connection_is_spread_over_a_second_per_500_nodes_at_most_two():
    clock = FakeClock(0.0)
    assert Pacing(clock, uniform=lambda low, high: high, cluster_nodes=1000).opening() == pytest.approx(2.0)
    assert Pacing(clock, uniform=lambda low, high: high, cluster_nodes=5000).opening() == pytest.approx(2.0)  # capped
    assert Pacing(clock, uniform=lambda low, high: high, cluster_nodes=250).opening() == pytest.approx(0.5)
    draws = [Pacing(clock, cluster_nodes=1000).opening() for _ in range(2000)]
    assert 0 <= min(draws) < 0.1 and 1.9 < max(draws) <= 2.0
    assert 0.9 < sum(draws) / len(draws) < 1.1  # uniform: a thousand nodes open about 500 connections a second


def test_a_backoff_after_days_of_failures_is_the_longest_wait_not_an_overflow():
    from agent.common.ratelimit import doubling
    assert [doubling(n, 1.0, 30.0) for n in (0, 1, 4, 5, 6)] == [1.0, 2.0, 16.0, 30.0, 30.0]
    assert doubling(5000, 1.0, 30.0) == 30.0  # 2 ** 5000 would not fit a float
    assert doubling(-1, 1.0, 30.0) == 1.0
