"""Scaling thresholds derived on a trace: the cheapest policy whose replay meets the TTFT goal.

A policy is the saturation target, the queue target, the minimum replica count, the scale-in wait and the agent's
admission queue (what an environment file's ``scaling:`` section sets). Each candidate is replayed through the fleet
simulator with the target's real autoscaler (its metric period, datapoints, cooldowns or the HPA's sync and
stabilization, and the replica's cold start), and it *meets the goal* when at least ``goal`` of the requests offered
get their first token within the TTFT target (a refused or aborted request misses it).

The search walks from the most eager policy (lowest targets, smallest minimum that meets the goal) towards cheaper
ones, one setting at a time: it raises the saturation target, then the queue target, along their grids while the
goal holds, then lowers the minimum. Higher targets and fewer replicas are never dearer, so the walk stops at the
first value that misses; that value is the reason printed beside the one chosen ("at 0.9 TTFT within 2 s for
93.1% < 95%"). Last, the scale-in wait: from its floor, each longer wait on ``wait_grid`` is replayed with the
rest as chosen and the cheapest that meets the goal is kept (a longer wait holds replicas through a lull but saves
the relaunch after it, so cost does not order the waits). Before it, the admission queue: the requests per replica
the agent lets wait for a slot before it answers 429. The plan's queue (what can start within the TTFT target at
the replica's throughput) and 0, half, twice and four times it are replayed, and the cheapest that meets the goal
is kept, at equal cost the one that gets the most requests their first token in time (a shorter queue refuses
what a longer one would serve late; a longer one delays every request behind it, and what waits at the agent is
what the queue target scales on). The replay counts a 429 as a miss: it does not model a client's retry. A pinned
setting is held where the file puts it, and
the search reports what the pin costs against the best value along that setting alone.

A candidate is dropped as soon as it has missed more requests than the goal allows (``simulate(stop=...)``):
failing policies cost a fraction of a replay, which is most of what makes the search affordable at synth.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from kvfleet.sim.fleet import FleetSpec, Scaling, fleet_usd, simulate
from kvfleet.sim.replica import Stats
from kvfleet.workload.traces import Trace

# Grids the search walks. The saturation grid stops at 0.9, a cap rather than a measurement: the autoscaler acts
# only after 3 minutes above its target, and a fleet held closer to full has little room for what arrives meanwhile.
# The queue grid is requests waiting per replica.
SATURATION_GRID: tuple[float, ...] = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)
QUEUE_GRID: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0)
WINDOW_S = 300.0  # the burst a reason names: the 5-minute window of arrivals with the slowest p95 TTFT

# The scale-in waits replayed, as multiples of the target's floor (15 minutes and twice the drain budget), up to
# the hour the HPA's stabilization window allows (ScalingConfig.scale_in_after_s).
WAIT_FACTORS: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0)
WAIT_MAX_S = 3600.0

# The admission queues replayed, as multiples of the plan's (at least one request).
ADMISSION_FACTORS: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 4.0)
SAME_COST = 0.01  # admission queues whose replays cost within 1% are compared on the requests they serve in time

Setting = Literal["saturation_target", "queue_target", "min_replicas", "scale_in_wait_s", "admission_queue"]
SETTINGS: tuple[Setting, ...] = (
    "saturation_target",
    "queue_target",
    "min_replicas",
    "scale_in_wait_s",
    "admission_queue",
)
# Written as integers.
INTEGER_SETTINGS: frozenset[Setting] = frozenset({"min_replicas", "scale_in_wait_s", "admission_queue"})


@dataclass(frozen=True, kw_only=True)
class AdmissionSpace:
    """The agent's admission per replica as the search varies it: a budget of (running + queued) typical
    reservations, never below a batch of the longest requests (kvfleet.sizing.planner.admission)."""

    running: int  # max_num_seqs
    request_tokens: int  # a typical reservation: average prompt + max_output_tokens
    floor_tokens: int  # running x max_model_len
    planned_queue: int  # the plan's: what starts within the TTFT target

    def tokens(self, queued: float) -> int:
        return max((self.running + int(queued)) * self.request_tokens, self.floor_tokens)

    def effective(self, queued: float) -> int:
        """Typical requests that really may wait under ``queued``'s budget (more where the floor admits more)."""
        return self.tokens(queued) // self.request_tokens - self.running

    def grid(self) -> tuple[float, ...]:
        """The queues replayed, each a distinct budget: 0 to four times the plan's."""
        base = max(1, self.planned_queue)
        return tuple(sorted({float(self.effective(round(base * f))) for f in ADMISSION_FACTORS}))


@dataclass(frozen=True, kw_only=True)
class Policy:
    saturation_target: float
    queue_target: float
    min_replicas: int
    scale_in_wait_s: float | None = None  # None: the fleet spec's own
    admission_queue: float | None = None  # None: the fleet spec's own budget

    def with_(self, setting: Setting, value: float) -> Policy:
        if setting == "admission_queue":
            return replace(self, admission_queue=value)
        if setting == "min_replicas":
            return replace(self, min_replicas=int(value))
        if setting == "queue_target":
            return replace(self, queue_target=value)
        if setting == "scale_in_wait_s":
            return replace(self, scale_in_wait_s=value)
        return replace(self, saturation_target=value)

    def value(self, setting: Setting) -> float:
        v = getattr(self, setting)
        if v is None:
            raise ValueError(f"{setting} is the fleet spec's own here")
        return float(v)


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One policy's replay."""

    policy: Policy
    meets: bool
    offered: int  # the trace's requests
    missed: int  # first token later than the target, refused or aborted (a lower bound when ``stopped_s``)
    cost: float  # dollars when the spec has a price, else replica-hours
    priced: bool
    stopped_s: float | None  # the replay was dropped here: it had already missed more than the goal allows
    worst_window: tuple[float, float] | None  # (start s, p95 TTFT s) of the slowest 5-minute window

    @property
    def attainment(self) -> float:
        """Requests with their first token in time over those offered (an upper bound when stopped early)."""
        return 1 - self.missed / self.offered if self.offered else 1.0

    def cost_text(self) -> str:
        return f"${self.cost:,.2f}" if self.priced else f"{self.cost:,.2f} replica-hours"

    def describe(self, ttft_slo_s: float, goal: float) -> str:
        if self.stopped_s is not None:
            text = (
                f"more than {1 - goal:.0%} of requests miss TTFT {ttft_slo_s:g} s ({self.missed:,} of "
                f"{self.offered:,} by minute {self.stopped_s / 60:.0f})"
            )
        else:
            text = f"TTFT within {ttft_slo_s:g} s for {self.attainment:.1%}" + (" < " if not self.meets else " >= ")
            text += f"{goal:.0%}"
        if self.worst_window is not None:
            start, p95 = self.worst_window
            text += f"; p95 {p95:.1f} s for arrivals in minutes {start / 60:.0f}-{(start + WINDOW_S) / 60:.0f}"
        return text


@dataclass(frozen=True, kw_only=True)
class Choice:
    setting: Setting
    value: float
    pinned: bool
    reason: str


@dataclass(frozen=True, kw_only=True)
class PinCost:
    """What a pinned setting costs against the best value of that setting alone (the others as chosen)."""

    setting: Setting
    pinned: Outcome
    best: Outcome | None  # None: no value along the setting meets the goal


@dataclass(frozen=True, kw_only=True)
class Derivation:
    policy: Policy
    outcome: Outcome
    feasible: bool  # some policy within max_replicas meets the goal
    choices: tuple[Choice, ...]
    pin_costs: tuple[PinCost, ...]
    compared: Outcome | None  # the policy asked to be compared (the hand-set defaults), replayed the same way
    evaluated: int  # replays run (each at most once per policy)
    ttft_slo_s: float
    goal: float


def _worst_window(stats: Stats) -> tuple[float, float] | None:
    buckets: dict[int, list[float]] = {}
    for r in stats.finished:
        buckets.setdefault(int(r.arrival_s // WINDOW_S), []).append(r.first_token_s - r.arrival_s)
    worst: tuple[float, float] | None = None
    for b, ttfts in buckets.items():
        if len(ttfts) < 20:  # a window of a few requests says nothing about a burst
            continue
        ttfts.sort()
        p95 = ttfts[max(0, math.ceil(0.95 * len(ttfts)) - 1)]
        if worst is None or p95 > worst[1]:
            worst = (b * WINDOW_S, p95)
    return worst


class _Evaluator:
    def __init__(
        self, trace: Trace, base: FleetSpec, ttft_slo_s: float, goal: float, admission: AdmissionSpace | None = None
    ) -> None:
        self.trace = trace
        self.base = base
        self.admission = admission
        self.ttft_slo_s = ttft_slo_s
        self.goal = goal
        self.allowed = math.floor((1 - goal) * len(trace))  # misses the goal tolerates
        self.stop_after = self.allowed  # misses after which a replay is dropped
        self.cache: dict[Policy, Outcome] = {}

    def spec(self, p: Policy) -> FleetSpec:
        scaling: Scaling = replace(
            self.base.scaling,
            kv_cache_target=p.saturation_target,
            queue_target=p.queue_target,
            min_replicas=p.min_replicas,
        )
        if p.scale_in_wait_s is not None:
            scaling = replace(scaling, scale_in_cooldown_s=p.scale_in_wait_s, stabilization_s=p.scale_in_wait_s)
        limits = self.base.limits
        if p.admission_queue is not None and self.admission is not None:
            limits = replace(limits, admission_tokens=self.admission.tokens(p.admission_queue))
        # The fleet starts at its planned size, or at the minimum where that is larger.
        return replace(
            self.base,
            scaling=scaling,
            limits=limits,
            initial_replicas=max(self.base.initial_replicas, p.min_replicas),
        )

    def __call__(self, p: Policy) -> Outcome:
        hit = self.cache.get(p)
        if hit is not None:
            return hit
        slo = self.ttft_slo_s
        seen = [0, 0]  # finished requests looked at, late ones among them

        def stop(stats: Stats, _t: float) -> bool:
            done = stats.finished
            for r in done[seen[0] :]:
                if r.first_token_s - r.arrival_s > slo:
                    seen[1] += 1
            seen[0] = len(done)
            return seen[1] + stats.rejected_429 + stats.rejected_503 + stats.aborted > self.stop_after

        spec = self.spec(p)
        result = simulate(self.trace, spec, stop=stop)
        s = result.stats
        on_time = sum(1 for r in s.finished if r.first_token_s - r.arrival_s <= slo)
        offered = len(self.trace)
        if result.stopped_s is None:
            missed = offered - on_time
        else:  # what had missed by the stop (the rest of the trace was never offered)
            missed = len(s.finished) - on_time + s.rejected_429 + s.rejected_503 + s.aborted
        hours = result.replica_seconds / 3600
        priced = spec.usd_per_replica_hour is not None
        usd = fleet_usd(result, spec)
        cost = usd if usd is not None else hours
        out = Outcome(
            policy=p,
            meets=result.stopped_s is None and missed <= self.allowed,
            offered=offered,
            missed=missed,
            cost=cost,
            priced=priced,
            stopped_s=result.stopped_s,
            worst_window=_worst_window(s),
        )
        self.cache[p] = out
        return out


def replay(trace: Trace, spec: FleetSpec, *, ttft_slo_s: float, goal: float) -> Outcome:
    """One policy (``spec``'s scaling as it stands) replayed in full, for comparisons that report the attainment
    rather than stop at the goal."""
    s = spec.scaling
    p = Policy(
        saturation_target=s.kv_cache_target,
        queue_target=s.queue_target,
        min_replicas=s.min_replicas,
        scale_in_wait_s=s.scale_in_cooldown_s,
    )
    ev = _Evaluator(trace, spec, ttft_slo_s, goal)
    ev.stop_after = len(trace)
    return ev(p)


def wait_grid(floor_s: float) -> tuple[float, ...]:
    """The scale-in waits replayed: the floor and longer ones, up to an hour."""
    return tuple(sorted({min(WAIT_MAX_S, max(float(floor_s), round(floor_s * f / 60) * 60.0)) for f in WAIT_FACTORS}))


def _grid(
    setting: Setting, floor_min: int, max_replicas: int, wait_floor_s: float, admission: AdmissionSpace | None
) -> tuple[float, ...]:
    if setting == "admission_queue":
        return admission.grid() if admission is not None else ()
    if setting == "saturation_target":
        return SATURATION_GRID
    if setting == "queue_target":
        return QUEUE_GRID
    if setting == "scale_in_wait_s":
        return wait_grid(wait_floor_s)
    return tuple(float(m) for m in range(floor_min, max_replicas + 1))


UNORDERED: frozenset[Setting] = frozenset({"scale_in_wait_s", "admission_queue"})  # cost does not order them


def _cheaper(setting: Setting, grid: tuple[float, ...], current: float) -> list[float]:
    """The values of a setting that cost no more than ``current``, nearest first: higher targets, fewer replicas.
    A wait is not ordered by cost (a longer one holds replicas through a lull, but saves relaunching them after),
    nor is an admission queue: every other value is tried."""
    if setting == "min_replicas":
        return sorted((v for v in grid if v < current), reverse=True)
    if setting in UNORDERED:
        return sorted((v for v in grid if v != current), key=lambda v: abs(v - current))
    return sorted(v for v in grid if v > current)


@dataclass(kw_only=True)
class _Search:
    """One derivation's state: the replays (cached), each setting's grid, what the file pins, and why each setting
    ended where it did."""

    ev: _Evaluator
    grids: dict[Setting, tuple[float, ...]]
    pins: dict[Setting, float]
    settings: tuple[Setting, ...]
    ttft_slo_s: float
    goal: float
    floor_min: int
    searched_admission: bool
    reasons: dict[Setting, str]

    def admitted_differently(self, p: Policy) -> Policy:
        """Where ``p`` misses the goal, the admission queue nearest the plan's that meets it (``p`` if none): under
        an overload the fleet cannot outgrow, what the agent lets wait decides who is served in time."""
        if self.ev(p).meets or not self.searched_admission:
            return p
        planned = p.value("admission_queue")
        for v in sorted(self.grids["admission_queue"], key=lambda v: (abs(v - planned), v)):
            if self.ev(q := p.with_("admission_queue", v)).meets:
                return q
        return p


def derive(
    trace: Trace,
    base: FleetSpec,
    *,
    ttft_slo_s: float,
    goal: float,
    pinned: dict[Setting, float] | None = None,
    floor_min: int = 1,
    wait_floor_s: float | None = None,
    admission: AdmissionSpace | None = None,
    compare: Policy | None = None,
) -> Derivation:
    """The cheapest policy on ``trace`` that gets ``goal`` of its requests a first token within ``ttft_slo_s``
    (``wait_floor_s``: the shortest scale-in wait the target allows, by default ``base``'s own; ``admission``: the
    agent's admission, searched where given, else held at ``base``'s budget)."""
    if not trace.arrival_s:
        raise ValueError("an empty trace has nothing to derive from")
    pins = dict(pinned or {})
    max_r = base.scaling.max_replicas
    ev = _Evaluator(trace, base, ttft_slo_s, goal, admission)
    wait_floor = base.scaling.scale_in_cooldown_s if wait_floor_s is None else wait_floor_s
    settings = tuple(s for s in SETTINGS if s != "admission_queue" or admission is not None)
    if admission is None:
        pins.pop("admission_queue", None)  # nothing to hold: the agent admits what the base spec says
    search = _Search(
        ev=ev,
        grids={s: _grid(s, floor_min, max_r, wait_floor, admission) for s in settings},
        pins=pins,
        settings=settings,
        ttft_slo_s=ttft_slo_s,
        goal=goal,
        floor_min=floor_min,
        searched_admission=admission is not None and "admission_queue" not in pins,
        reasons={},
    )
    cur = _most_eager(search, _start(search, admission), max_r)
    feasible = ev(cur).meets
    if feasible:
        cur = _cheapest(search, cur, admission)
    else:
        for setting in settings:
            if setting not in pins and setting not in search.reasons:
                search.reasons[setting] = "the most eager value tried: no policy meets the goal"
    choices, pin_costs = _outcomes(search, cur, feasible)
    return Derivation(
        policy=cur,
        outcome=ev(cur),
        feasible=feasible,
        choices=choices,
        pin_costs=pin_costs,
        compared=None if compare is None else _replayed_in_full(ev, trace, compare),
        evaluated=len(ev.cache),
        ttft_slo_s=ttft_slo_s,
        goal=goal,
    )


def _outcomes(search: _Search, cur: Policy, feasible: bool) -> tuple[tuple[Choice, ...], tuple[PinCost, ...]]:
    """Each setting's value and why; what each pinned value costs (where the search failed, a pinned admission queue
    still says which queue would meet the goal)."""
    pins = search.pins
    choices = tuple(
        Choice(
            setting=s,
            value=cur.value(s),
            pinned=s in pins,
            reason="pinned in the file" if s in pins else search.reasons.get(s, ""),
        )
        for s in search.settings
    )
    pin_costs = tuple(
        _pin_cost(search.ev, cur, s, search.grids[s])
        for s in search.settings
        if s in pins and (feasible or s == "admission_queue")
    )
    return choices, pin_costs


def _start(search: _Search, admission: AdmissionSpace | None) -> Policy:
    """The most eager policy of the grids, with the file's pins (and the plan's admission queue while walking)."""
    start = {s: search.pins.get(s, search.grids[s][0]) for s in search.settings}
    if admission is not None and "admission_queue" not in search.pins:
        start["admission_queue"] = float(admission.effective(admission.planned_queue))
    return Policy(
        saturation_target=start["saturation_target"],
        queue_target=start["queue_target"],
        min_replicas=int(start["min_replicas"]),
        scale_in_wait_s=start["scale_in_wait_s"],
        admission_queue=start.get("admission_queue"),
    )


def _most_eager(search: _Search, cur: Policy, max_r: int) -> Policy:
    """Most eager first; where even that misses, another admission queue, then a larger minimum (the fleet cannot
    grow in time on its own)."""
    ev = search.ev
    cur = search.admitted_differently(cur)
    if not ev(cur).meets and "min_replicas" not in search.pins:
        first_fail = ev(cur)
        for m in range(cur.min_replicas + 1, max_r + 1):
            cur = search.admitted_differently(cur.with_("min_replicas", m))
            if ev(cur).meets:
                search.reasons["min_replicas"] = f"at {m - 1} {first_fail.describe(search.ttft_slo_s, search.goal)}"
                break
            first_fail = ev(cur)
    return cur


def _cheapest(search: _Search, cur: Policy, admission: AdmissionSpace | None) -> Policy:
    """From a policy that meets the goal, each setting walked towards cheaper values while the goal holds."""
    ev, pins, reasons = search.ev, search.pins, search.reasons
    for setting in ("saturation_target", "queue_target", "min_replicas"):
        if setting in pins:
            continue
        best = ev(cur)
        why = None
        for v in _cheaper(setting, search.grids[setting], cur.value(setting)):
            o = ev(best.policy.with_(setting, v))
            if not o.meets:
                why = f"at {_fmt(setting, v)} {o.describe(search.ttft_slo_s, search.goal)}"
                break
            if o.cost < best.cost - 1e-9:
                best = o
        cur = best.policy
        if setting not in reasons or why is not None:
            reasons[setting] = why or _no_cheaper(setting, cur, search.grids[setting], search.floor_min)
    if admission is not None and search.searched_admission:
        cur, reasons["admission_queue"] = _best_admission(ev, cur, admission, search.ttft_slo_s, search.goal)
    if "scale_in_wait_s" not in pins:
        cur, reasons["scale_in_wait_s"] = _best_wait(
            ev, cur, search.grids["scale_in_wait_s"], search.ttft_slo_s, search.goal
        )
    return cur


def _replayed_in_full(ev: _Evaluator, trace: Trace, compare: Policy) -> Outcome:
    """A comparison reports the attainment, not just that it falls short: replayed to the end."""
    ev.stop_after = len(trace)
    if (hit := ev.cache.get(compare)) is not None and hit.stopped_s is not None:
        del ev.cache[compare]
    return ev(compare)


def _best_wait(
    ev: Callable[[Policy], Outcome], cur: Policy, grid: tuple[float, ...], ttft_slo_s: float, goal: float
) -> tuple[Policy, str]:
    """The cheapest scale-in wait that meets the goal with the rest of ``cur``, and why (the floor unless a longer
    wait costs less: it keeps replicas through a lull that the floor would scale in and relaunch after)."""
    floor = cur.value("scale_in_wait_s")
    at_floor = ev(cur)
    tried = [(v, ev(cur.with_("scale_in_wait_s", v))) for v in grid if v != floor]
    best_v, best = floor, at_floor
    for v, o in tried:
        if o.meets and o.cost < best.cost - 1e-9:
            best_v, best = v, o
    if best_v == floor:
        dearer = [f"{_fmt('scale_in_wait_s', v)}: {o.cost_text()}" for v, o in tried if o.meets]
        missing = [_fmt("scale_in_wait_s", v) for v, o in tried if not o.meets]
        text = "the floor (15 min and twice the drain budget)"
        same = [_fmt("scale_in_wait_s", v) for v, o in tried if o.meets and abs(o.cost - at_floor.cost) <= 1e-9]
        if same and len(same) == len(dearer):
            text += f"; {', '.join(same)} replay at the same cost, and the floor scales in soonest"
        elif dearer:
            text += (
                f"; longer waits cost no less over the replay ({', '.join(dearer)}; the floor {at_floor.cost_text()})"
            )
        if missing:
            text += f"; {', '.join(missing)} miss the goal"
        return cur, text
    return best.policy, (
        f"at the floor {_fmt('scale_in_wait_s', floor)} the fleet scales in during lulls and relaunches after: "
        f"{at_floor.cost_text()} against {best.cost_text()} over the replay"
    )


def _pick_admission(meeting: list[tuple[float, Outcome]], planned: float) -> tuple[float, Outcome]:
    """Cost first, but within SAME_COST of the cheapest the queue that serves most in time (then the plan's): the
    queue barely moves the fleet's size, and a difference that small is when the replay's last requests end."""
    cheapest = min(o.cost for _, o in meeting)
    close = [(v, o) for v, o in meeting if o.cost <= cheapest * (1 + SAME_COST) + 1e-9]
    return min(close, key=lambda item: (item[1].missed, item[0] != planned, item[1].cost))


def _best_admission(
    ev: Callable[[Policy], Outcome],
    cur: Policy,
    space: AdmissionSpace,
    ttft_slo_s: float,
    goal: float,
) -> tuple[Policy, str]:
    """The admission queue that meets the goal at the least cost, at equal cost the most requests in time, at
    equal both the plan's; and why."""
    planned = float(space.effective(space.planned_queue))
    grid = space.grid()
    floor = space.effective(0)
    # Where a batch of max_model_len requests admits more than the TTFT target allows, that is the shortest queue.
    plan_text = (
        f"the plan's ({_fmt('admission_queue', planned)}: a batch of the longest requests is always admitted, and "
        f"that budget lets {floor} of the average length wait, more than the {space.planned_queue} the TTFT target "
        "alone allows)"
        if floor > space.planned_queue and planned == floor
        else f"the plan's ({_fmt('admission_queue', planned)} can start within the TTFT target)"
    )
    if grid == (planned,):
        return cur.with_(
            "admission_queue", planned
        ), f"{plan_text}; up to 4 times the plan's queue, every budget is that one"
    outcomes = [(v, ev(cur.with_("admission_queue", v))) for v in grid]
    meeting = [(v, o) for v, o in outcomes if o.meets]
    at_plan = ev(cur.with_("admission_queue", planned))
    if not meeting:
        return cur, f"{plan_text}; no queue searched meets the goal"

    best_v, best = _pick_admission(meeting, planned)
    others = "; ".join(
        f"at {_fmt('admission_queue', v)} {o.describe(ttft_slo_s, goal)}" + (f", {o.cost_text()}" if o.meets else "")
        for v, o in outcomes
        if v not in (best_v, planned)
    )
    if best_v == planned:
        head = plan_text
    else:
        head = (
            f"{best.attainment:.1%} in time, {best.cost_text()}; {plan_text}: {at_plan.describe(ttft_slo_s, goal)}"
            + (f", {at_plan.cost_text()}" if at_plan.meets else "")
        )
    return best.policy, f"{head}{'; ' + others if others else ''} (a 429 counts as a miss: the replay does not retry)"


def _pin_cost(ev: Callable[[Policy], Outcome], cur: Policy, setting: Setting, grid: tuple[float, ...]) -> PinCost:
    pinned = ev(cur)
    best: Outcome | None = pinned if pinned.meets else None
    if setting == "admission_queue":
        meeting = [(v, o) for v in grid if (o := ev(cur.with_(setting, v))).meets]
        return PinCost(setting=setting, pinned=pinned, best=_pick_admission(meeting, grid[0])[1] if meeting else None)
    if setting in UNORDERED:  # not ordered by cost: every other value
        for v in grid:
            o = ev(cur.with_(setting, v))
            if o.meets and (best is None or o.cost < best.cost - 1e-9):
                best = o
        return PinCost(setting=setting, pinned=pinned, best=best)
    # Cheaper values while they meet the goal; where the pin misses, dearer ones until one meets it.
    if pinned.meets:
        for v in _cheaper(setting, grid, cur.value(setting)):
            o = ev(cur.with_(setting, v))
            if not o.meets:
                break
            if best is None or o.cost < best.cost - 1e-9:
                best = o
    else:
        dearer = [v for v in grid if v not in _cheaper(setting, grid, cur.value(setting)) and v != cur.value(setting)]
        dearer.sort(reverse=setting != "min_replicas")
        for v in dearer:
            o = ev(cur.with_(setting, v))
            if o.meets:
                best = o
                break
    return PinCost(setting=setting, pinned=pinned, best=best)


def _fmt(setting: Setting, v: float) -> str:
    if setting == "admission_queue":
        return f"{int(v)} queued"
    if setting == "min_replicas":
        return f"{int(v)} replicas"
    if setting == "scale_in_wait_s":
        return f"{v / 60:g} min"
    return f"{v:g}"


def _no_cheaper(setting: Setting, cur: Policy, grid: tuple[float, ...], floor_min: int) -> str:
    if setting == "min_replicas" and cur.min_replicas == floor_min:
        return f"the floor ({floor_min} on this target)"
    if _cheaper(setting, grid, cur.value(setting)):
        return "higher values meet the goal too but cost no less over the replay; the lowest keeps the most headroom"
    return "the highest value searched, and the goal holds there"
