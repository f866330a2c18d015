"""A benchmark shape run through a fixed fleet: what `kvfleet bench` (or vLLM's, AIPerf's, GuideLLM's client) would
measure against it.

A benchmark runs against the replicas that are up, for minutes: nothing scales, every replica is warm at t = 0.
A Poisson load is a trace of its own arrivals. A closed loop is not a trace, since each client's next arrival is the
end of its last request; the replicas are then advanced in time order, one step (or one run of decode steps) at a
time, so that a request sent when another ends reaches its replica at that moment.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import replace

from kvfleet.scaling import AutoscalerKind
from kvfleet.sim.fleet import Fleet, FleetResult, FleetSpec, Scaling, finish, simulate
from kvfleet.sim.replica import Replica, Request
from kvfleet.workload.shapes import ClosedLoop, PoissonLoad


def fixed(spec: FleetSpec, replicas: int) -> FleetSpec:
    """``spec`` with ``replicas`` warm replicas and no autoscaler."""
    s = spec.scaling
    return replace(
        spec,
        initial_replicas=replicas,
        scaling=Scaling(
            kind=AutoscalerKind.NONE,
            min_replicas=replicas,
            max_replicas=replicas,
            kv_cache_target=s.kv_cache_target,
            queue_target=s.queue_target,
        ),
        warm_pool=None,
    )


def run(spec: FleetSpec, shape: ClosedLoop | PoissonLoad, replicas: int) -> FleetResult:
    if isinstance(shape, PoissonLoad):
        return simulate(shape.trace(), fixed(spec, replicas))
    return closed_loop(fixed(spec, replicas), shape)


def closed_loop(spec: FleetSpec, loop: ClosedLoop, *, pairs: Sequence[tuple[int, int]] | None = None) -> FleetResult:
    """``loop.concurrency`` clients from t = 0, each sending again as its request ends (answered, refused or cut),
    until ``loop.requests`` have been sent; ``pairs``: each request's (prompt, output) tokens, where the benchmark
    sent its own (else drawn from ``loop.lengths``)."""
    fleet = Fleet(spec)
    stats = fleet.stats
    pairs = list(pairs) if pairs is not None else loop.lengths.draw(loop.requests)
    sent = 0

    def send(t: float) -> None:
        nonlocal sent
        while sent < loop.requests:
            refused = stats.rejected_429 + stats.rejected_503
            prompt, output = pairs[sent]
            fleet.route(Request(sent, t, prompt, output), t)
            sent += 1
            if stats.rejected_429 + stats.rejected_503 == refused:
                return  # admitted: this client now waits for it; a refused one sends its next at once

    # Sends not yet made, by time: a client sends when its answer is back, which can be later than the engine's
    # clock (the request's overhead outside the steps); a replica never runs a step past a send still to come.
    pending = [0.0] * min(loop.concurrency, loop.requests)
    replicas = [m.replica for m in fleet.members]
    seen = 0
    aborted = stats.aborted
    while True:
        busy = sorted((r for r in replicas if r.outstanding), key=_clock)
        if pending and (not busy or pending[0] <= busy[0].clock):
            send(heapq.heappop(pending))
            continue
        if not busy:
            break
        first = busy[0]
        first.step(min(busy[1].clock if len(busy) > 1 else math.inf, pending[0] if pending else math.inf))
        done = stats.finished
        while seen < len(done):
            heapq.heappush(pending, done[seen].done_s + spec.request_overhead_s)
            seen += 1
        while aborted < stats.aborted:  # an engine that refused a request answers that client at once
            heapq.heappush(pending, first.clock)
            aborted += 1
    end = max([r.clock for r in replicas] + [0.0])
    return finish(fleet, end, sent)


def _clock(r: Replica) -> float:
    return r.clock
