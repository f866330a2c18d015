"""Fit a step model to what a benchmark measured: the terms of ``LinearStepModel`` and the per-request overhead.

A calibration (`kvfleet bench --calibrate`) runs closed-loop levels of several batch sizes and prompt lengths against
one replica. Each level is simulated here exactly as it ran (its clients, its requests, its lengths, the engine's
scheduler and limits), and the five terms are chosen to bring the simulated levels to the measured ones:

    step = fixed + per prefill token x tokens + per decoding sequence x sequences + per KV token read x KV tokens
    TTFT and end to end also carry a per-request overhead outside the engine's steps (the API server, tokenizing,
    the first event's way back), which the simulator adds on the client's side

What is matched per level: median TTFT (prefill and the overhead), mean ITL (the step at that batch and context)
and output tokens/s (both together), each as a log error under a Cauchy loss, so one level a host stall spoiled
does not drag the others (least squares let one such level move an unseen level's prediction by 42%). The fit is a
Nelder-Mead search on the logarithms of the terms, started from the plan's own step model probed at the levels'
sizes; its residuals are returned with it, so a user sees which level the model could not follow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvfleet.sim.fleet import FleetSpec
from kvfleet.sim.replica import LinearStepModel, StepModel
from kvfleet.sim.report import summarize
from kvfleet.sim.shapes import closed_loop
from kvfleet.workload.shapes import ClosedLoop, Lengths

# Requests simulated per level: enough for the closed loop to leave its first wave (the clients start together)
# and few enough that a fit of a few hundred evaluations takes seconds.
SIM_REQUESTS_PER_CLIENT = 4
SIM_REQUESTS_MIN = 24
ROBUST_SCALE = 0.3  # log-errors well inside this count as least squares; far outside it, about logarithmically
TERMS = ("fixed_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s", "request_overhead_s")


@dataclass(frozen=True, kw_only=True)
class MeasuredLevel:
    """One closed-loop level as a benchmark client saw it."""

    concurrency: int
    input_tokens: int
    output_tokens: int
    requests: int
    ttft_p50_s: float
    itl_mean_s: float
    output_tokens_per_s: float


@dataclass(frozen=True, kw_only=True)
class LevelFit:
    level: MeasuredLevel
    ttft_p50_s: float
    itl_mean_s: float
    output_tokens_per_s: float

    def errors(self) -> dict[str, float]:
        """Predicted over measured, minus one, per figure."""
        m = self.level
        return {
            "ttft_p50": self.ttft_p50_s / m.ttft_p50_s - 1,
            "itl_mean": self.itl_mean_s / m.itl_mean_s - 1,
            "output_tokens_per_s": self.output_tokens_per_s / m.output_tokens_per_s - 1,
        }


@dataclass(frozen=True, kw_only=True)
class StepFit:
    model: LinearStepModel
    request_overhead_s: float
    levels: tuple[LevelFit, ...]

    def terms(self) -> dict[str, float]:
        """The five fitted terms by name (``TERMS``, the fields of a calibration file's ``steps``)."""
        m = self.model
        values = (m.fixed_s, m.per_prefill_token_s, m.per_decode_seq_s, m.per_kv_token_s, self.request_overhead_s)
        return dict(zip(TERMS, values, strict=True))

    def worst_error(self) -> float:
        return max((abs(e) for lf in self.levels for e in lf.errors().values()), default=0.0)


def predict(spec: FleetSpec, level: MeasuredLevel) -> LevelFit:
    """One level simulated on ``spec`` (one replica), as the benchmark ran it."""
    requests = min(level.requests, max(SIM_REQUESTS_MIN, SIM_REQUESTS_PER_CLIENT * level.concurrency))
    loop = ClosedLoop(
        concurrency=level.concurrency,
        requests=requests,
        lengths=Lengths(input_tokens=level.input_tokens, output_tokens=level.output_tokens),
    )
    report = summarize(closed_loop(spec, loop), spec)
    itl = report.tpot_s.mean if report.tpot_s is not None else 0.0  # a request's mean gap, as the client times it
    return LevelFit(
        level=level,
        ttft_p50_s=report.ttft_s.p50 if report.ttft_s is not None else math.inf,
        itl_mean_s=itl,
        output_tokens_per_s=report.output_tokens_per_s,
    )


def _start(spec: FleetSpec, levels: Sequence[MeasuredLevel]) -> list[float]:
    """The plan's step model probed at the levels' sizes, as linear terms (the search starts there)."""
    m: StepModel = spec.model
    c = max(lv.concurrency for lv in levels)
    ctx = max(lv.input_tokens + lv.output_tokens for lv in levels)
    one = m.step_s(prefill=(), decode_seqs=1, decode_kv_tokens=1)
    many = m.step_s(prefill=(), decode_seqs=c, decode_kv_tokens=c) if c > 1 else one * 1.1
    long = m.step_s(prefill=(), decode_seqs=c, decode_kv_tokens=c * ctx)
    n = max(lv.input_tokens for lv in levels)
    prefill = m.step_s(prefill=((n, 0),), decode_seqs=0, decode_kv_tokens=0)
    per_seq = max(1e-9, (many - one) / max(1, c - 1))
    per_kv = max(1e-12, (long - many) / max(1, c * (ctx - 1)))
    per_token = max(1e-9, (prefill - one) / n)
    return [max(1e-6, one - per_seq), per_token, per_seq, per_kv, max(1e-4, 0.1 * one)]


def _objective(spec: FleetSpec, levels: Sequence[MeasuredLevel]) -> Callable[[list[float]], float]:
    def loss(logs: list[float]) -> float:
        fitted = with_terms(spec, [math.exp(x) for x in logs])
        total = 0.0
        for lv in levels:
            p = predict(fitted, lv)
            for pred, meas in (
                (p.ttft_p50_s, lv.ttft_p50_s),
                (p.itl_mean_s, lv.itl_mean_s),
                (p.output_tokens_per_s, lv.output_tokens_per_s),
            ):
                if not math.isfinite(pred):
                    return math.inf
                # A Cauchy loss on the log error: a level a host stall spoiled pulls the fit far less than it would
                # under least squares.
                total += math.log1p((math.log(max(pred, 1e-12) / meas) / ROBUST_SCALE) ** 2)
        return total

    return loss


def linear_model(terms: Mapping[str, float]) -> LinearStepModel:
    """The step model of fitted terms given by name (``TERMS``; a calibration file's ``steps`` has these fields)."""
    return LinearStepModel(
        fixed_s=float(terms["fixed_s"]),
        per_prefill_token_s=float(terms["per_prefill_token_s"]),
        per_decode_seq_s=float(terms["per_decode_seq_s"]),
        per_kv_token_s=float(terms["per_kv_token_s"]),
    )


def with_terms(spec: FleetSpec, terms: Sequence[float]) -> FleetSpec:
    """``spec`` stepping on the five terms, in ``TERMS`` order."""
    named = dict(zip(TERMS, terms, strict=True))
    return replace(spec, model=linear_model(named), request_overhead_s=named["request_overhead_s"])


def fit(spec: FleetSpec, levels: Sequence[MeasuredLevel], *, evaluations: int = 400) -> StepFit:
    """The five terms that bring ``levels``, simulated on ``spec``'s engine limits and scheduler, to what was
    measured. ``levels`` must hold at least two batch sizes and two prompt lengths."""
    usable = [lv for lv in levels if lv.ttft_p50_s > 0 and lv.itl_mean_s > 0 and lv.output_tokens_per_s > 0]
    if len({lv.concurrency for lv in usable}) < 2 or len({lv.input_tokens for lv in usable}) < 2:
        raise ValueError("a fit needs levels at two or more concurrencies and two or more prompt lengths")
    start = [math.log(x) for x in _start(spec, usable)]
    best = nelder_mead(_objective(spec, usable), start, step=0.7, evaluations=evaluations)
    terms = [math.exp(x) for x in best]
    fitted = with_terms(spec, terms)
    assert isinstance(fitted.model, LinearStepModel)
    return StepFit(
        model=fitted.model,
        request_overhead_s=terms[4],
        levels=tuple(predict(fitted, lv) for lv in usable),
    )


def nelder_mead(f: Callable[[list[float]], float], x0: list[float], *, step: float, evaluations: int) -> list[float]:
    """Minimise ``f`` from ``x0`` (Nelder and Mead 1965, standard coefficients 1, 2, 0.5, 0.5)."""
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(p) for p in simplex]
    used = len(values)
    while used < evaluations:
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < 1e-10:
            break
        centroid = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]

        def toward(t: float, centroid: list[float] = centroid, worst: list[float] = worst) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centroid, worst, strict=True)]

        xr = toward(-1.0)
        fr = f(xr)
        used += 1
        if fr < values[0]:
            xe = toward(-2.0)
            fe = f(xe)
            used += 1
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = toward(0.5)
            fc = f(xc)
            used += 1
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:  # shrink toward the best point
                for i in range(1, n + 1):
                    simplex[i] = [b + 0.5 * (x - b) for b, x in zip(simplex[0], simplex[i], strict=True)]
                    values[i] = f(simplex[i])
                used += n
    return simplex[min(range(n + 1), key=values.__getitem__)]
