"""How a node shares ClusterD's budget with the rest of the cluster: pure, with an injected clock.

ClusterD's PubFault limiter is one token bucket per resource for the whole cluster (1 request/s,
burst 100); a request that finds it empty is refused (410) and costs nothing but the call. Nodes
cannot talk to each other; all a node learns is ClusterD's answers. When K nodes have something to
send at once (a switch, a firmware push, a cooling failure), the best the cluster can do is the
burst at once and then one request a second: about K - 100 seconds. The bucket wastes no token as
long as somebody asks for it before it fills up, so the cluster is as fast as it can be when the
nodes still waiting try, all together, a little more than once a second, and every try beyond
that is a refused call.

`Pacing` spaces a node's tries without coordination. A node cannot learn how many wait with it:
every node still waiting has seen the same thing, refusals, whatever the storm's size. What it
knows is how long it has waited, and that a refusal means ClusterD's burst is spent (about
BURST / refill seconds of the cluster's requests). So it retries after a random delay around
SPACING x (waited + BURST / refill): the waiting nodes together try about K / (SPACING x age) times
a second, well above the refill while many wait, and the delays grow with the storm, so a storm of
thousands costs a few tries per node instead of one every few seconds each. The last nodes of a
storm try about every SPACING x its length, so the cluster ends within about that fraction of the
bound; the delays are drawn, not fixed, so the nodes spread out, and all the nodes of a storm have
waited about as long, so each has the same chance at every token (the order is a lottery, and no
node's delay grows faster than the others').

A node alone meets no refusal and never waits for the pacing. On a large cluster, a node that has
to open a connection to send waits a random moment first (`opening`), up to one second per
OPENING_CALLS_PER_S nodes and at most MAX_OPENING_S: a storm on every node then reaches ClusterD's
listener (1,024 connections for everybody) and its 1,000 calls/s spread over that time, not in one
instant, and a fault alone waits a second on average.
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable

SPACING = 0.1  # the delay, as a share of how long the node (and its storm) has waited
BURST = 100.0  # ClusterD's burst per resource: a refusal means at least this many were sent before
MIN_DELAY_S, MAX_DELAY_S = 1.0, 600.0
EPISODE_GAP_S = 3 * MAX_DELAY_S  # a refusal this long after the last one starts a new wait
OPENING_CALLS_PER_S = 500.0  # half of ClusterD's unary calls per second, for the whole cluster
MAX_OPENING_S = 2.0


class Pacing:
    def __init__(self, clock: Callable[[], float], refill_per_s: float = 1.0,
                 uniform: Callable[[float, float], float] = random.uniform, cluster_nodes: int = 1):
        self._clock = clock
        self._burst_s = BURST / refill_per_s
        self._opening_s = min(MAX_OPENING_S, cluster_nodes / OPENING_CALLS_PER_S)
        self._uniform = uniform
        self._since: float | None = None  # when this wait began (the first refusal since the last delivery)
        self._last = 0.0  # the last refusal

    def waited(self) -> float:
        """Seconds since the first refusal of the current wait (0 when not waiting)."""
        return 0.0 if self._since is None else self._clock() - self._since

    def opening(self) -> float:
        """Seconds to wait before opening a connection to send (see the module's docstring)."""
        return self._uniform(0.0, self._opening_s)

    def refused(self) -> float:
        """ClusterD refused a request for its rate: the seconds to wait before the next try."""
        now = self._clock()
        if self._since is None or now - self._last > EPISODE_GAP_S:
            self._since = now
        self._last = now
        mean = SPACING * (now - self._since + self._burst_s)
        return min(MAX_DELAY_S, max(MIN_DELAY_S, self._uniform(0.25, 1.75) * mean))

    def delivered(self) -> None:
        """ClusterD accepted a request: the wait is over."""
        self._since = None


def resource_of(node: str, resource: str, resources: list[str]) -> str:
    """The resource this node sends under: always the same for the same node and list, so that a
    recover goes where its occur went; spread evenly over the list by a hash of the node name."""
    if not resources:
        return resource
    digest = hashlib.sha256(node.encode()).digest()
    return resources[int.from_bytes(digest[:8], "big") % len(resources)]


def reconcile_period_s(floor_s: float, cluster_nodes: int, resources: int, budget_share: float = 0.04,
                       refill_per_s: float = 1.0) -> float:
    """The period of a node's periodic re-assertion (one request while it holds faults), so that the
    whole cluster's re-assertions stay under `budget_share` of every resource's refill."""
    nodes_per_resource = cluster_nodes / max(1, resources)
    return max(floor_s, nodes_per_resource / (budget_share * refill_per_s))
