"""A simulated run over time, and its picture: requests, queue, saturation and KV-cache use, and replicas on one
time axis.

The series are the fleet's own samples (one per publish interval, what the agent publishes and the autoscaler
reads) plus the trace's arrivals and the finished requests, counted per interval between two samples. An
interval ends at its sample and holds what happened before it; the last one also holds whatever came after the
last sample, so every arrival, completion and refusal of the run is counted once.

matplotlib is imported inside ``render_png`` only: ``kvfleet`` starts without it, and the rest of the simulator
stays standard library.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfleet.extras import require_extra
from kvfleet.sim.fleet import FleetResult, FleetSpec
from kvfleet.workload.traces import Trace

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# One figure size for every run: 1100 x 1000 pixels at this resolution.
FIGURE_INCHES = (11.0, 10.0)
DPI = 100


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """Per interval: its end (the sample's time) and length, counts within it, and the state sampled at its end."""

    t_s: tuple[float, ...]
    interval_s: tuple[float, ...]
    arrivals: tuple[int, ...]
    completed: tuple[int, ...]
    rejected_429: tuple[int, ...]
    rejected_503: tuple[int, ...]
    waiting: tuple[int, ...]  # queued at the serving replicas (the router holds none: no replica is a 503)
    running: tuple[int, ...]
    kv_mean: tuple[float, ...]
    kv_max: tuple[float, ...]
    saturation: tuple[float, ...]  # mean over the serving replicas: what the autoscaler holds at its target
    replicas: tuple[int, ...]  # serving
    starting: tuple[int, ...]
    draining: tuple[int, ...]
    scale_events: tuple[tuple[float, int, str], ...]  # (time, desired replicas, scale-out | scale-in)
    saturation_target: float | None  # the autoscaler's targets; None when nothing scales
    queue_target: float | None  # per serving replica


def _per_interval(sorted_times: Sequence[float], ends: Sequence[float]) -> tuple[int, ...]:
    """How many of ``sorted_times`` fall before each end and after the previous one; the last takes the rest."""
    if not ends:
        return ()
    below = [bisect_left(sorted_times, t) for t in ends[:-1]]
    cumulative = [*below, len(sorted_times)]
    return tuple(b - a for a, b in itertools.pairwise([0, *cumulative]))


def _diffs(totals: Sequence[int], final: int) -> tuple[int, ...]:
    """Running totals sampled at each interval's end -> counts per interval (the last up to ``final``)."""
    if not totals:
        return ()
    ends = [*totals[:-1], final]
    return tuple(b - a for a, b in itertools.pairwise([0, *ends]))


def timeline(result: FleetResult, trace: Trace, spec: FleetSpec) -> Timeline:
    samples = result.samples
    ends = [x.t_s for x in samples]
    starts = [0.0, *ends[:-1]]
    # The replay stops at its horizon: the requests it routed are the trace's first ``result.requests``.
    arrivals = trace.arrival_s[: result.requests]
    done = sorted(r.done_s for r in result.stats.finished if r.done_s is not None)
    scaling = spec.scaling
    scales = scaling.kind != "none"
    return Timeline(
        t_s=tuple(ends),
        interval_s=tuple(e - s for s, e in zip(starts, ends, strict=True)),
        arrivals=_per_interval(arrivals, ends),
        completed=_per_interval(done, ends),
        rejected_429=_diffs([x.rejected_429 for x in samples], result.stats.rejected_429),
        rejected_503=_diffs([x.rejected_503 for x in samples], result.stats.rejected_503),
        waiting=tuple(x.waiting for x in samples),
        running=tuple(x.outstanding - x.waiting for x in samples),
        kv_mean=tuple(x.kv_utilization for x in samples),
        kv_max=tuple(x.kv_max for x in samples),
        saturation=tuple(x.saturation for x in samples),
        replicas=tuple(x.replicas for x in samples),
        starting=tuple(x.starting for x in samples),
        draining=tuple(x.draining for x in samples),
        scale_events=tuple(result.scale_events),
        saturation_target=scaling.kv_cache_target if scales else None,  # Scaling.kv_cache_target: on saturation
        queue_target=scaling.queue_target if scales else None,
    )


def _rate(counts: Sequence[int], lengths: Sequence[float]) -> list[float]:
    return [c / dt if dt > 0 else 0.0 for c, dt in zip(counts, lengths, strict=True)]


def _marks(
    axes: Axes, minutes: Sequence[float], rates: Sequence[float], *, marker: str, color: str, label: str
) -> None:
    """Refusals as marks only where there were some, so a clean run shows none."""
    points = [(m, r) for m, r in zip(minutes, rates, strict=True) if r > 0]
    if points:
        xs, ys = zip(*points, strict=True)
        axes.scatter(xs, ys, marker=marker, color=color, s=18, zorder=3, label=label)


def _steps(
    axes: Axes, minutes: Sequence[float], values: Sequence[float], *, label: str, color: str, width: float = 2.0
) -> None:
    """A value per interval, drawn over the interval it ends (the first one from time 0).

    A panel's second line is thinner and drawn over its first, so both show where they coincide.
    """
    if values:
        axes.step([0.0, *minutes], [values[0], *values], where="pre", label=label, color=color, linewidth=width)


def render_png(tl: Timeline, path: str | Path, *, title: str) -> None:
    """Write the four panels as a PNG; ``OSError`` if the file cannot be written, ``MissingExtraError`` without
    matplotlib (the plot extra)."""
    require_extra("plot", "simulate --png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A Figure on the Agg canvas, not pyplot: no GUI backend, no global figure state.
    fig = Figure(figsize=FIGURE_INCHES, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    req, queue, kv, reps = fig.subplots(4, 1, sharex=True)
    minutes = [t / 60 for t in tl.t_s]

    _requests_panel(req, minutes, tl)
    _queue_panel(queue, minutes, tl)
    _saturation_panel(kv, minutes, tl)
    _replicas_panel(reps, minutes, tl)

    for axes in (req, queue, kv, reps):
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            # Beside the panel, where it hides no data.
            axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    queue.set_ylim(bottom=0)
    req.set_ylim(bottom=0)
    fig.suptitle(title)
    fig.savefig(path, format="png")


def _requests_panel(req: Any, minutes: list[float], tl: Timeline) -> None:
    """Arrivals and completions per second, and what was refused (429) or found no replica (503)."""
    _steps(req, minutes, _rate(tl.arrivals, tl.interval_s), label="arriving", color="tab:blue")
    _steps(req, minutes, _rate(tl.completed, tl.interval_s), label="completed", color="tab:green", width=1.0)
    _marks(req, minutes, _rate(tl.rejected_429, tl.interval_s), marker="x", color="tab:red", label="429 (refused)")
    _marks(req, minutes, _rate(tl.rejected_503, tl.interval_s), marker="v", color="black", label="503 (no replica)")
    req.set_ylabel("requests/s")
    req.set_title("requests")


def _queue_panel(queue: Any, minutes: list[float], tl: Timeline) -> None:
    """Requests waiting, over the fleet and per serving replica, against the scaling target."""
    _steps(queue, minutes, tl.waiting, label="waiting, all serving replicas", color="tab:orange")
    per_replica = [w / n if n else 0.0 for w, n in zip(tl.waiting, tl.replicas, strict=True)]
    _steps(queue, minutes, per_replica, label="waiting per serving replica", color="tab:brown", width=1.0)
    if tl.queue_target is not None:
        queue.axhline(tl.queue_target, color="tab:brown", linestyle="--", linewidth=1, label="target per replica")
    queue.set_ylabel("requests")
    queue.set_title("queue depth")


def _saturation_panel(kv: Any, minutes: list[float], tl: Timeline) -> None:
    """Saturation and KV-cache use against the autoscaler target."""
    _steps(kv, minutes, tl.saturation, label="saturation, mean of serving replicas", color="tab:purple")
    _steps(kv, minutes, tl.kv_mean, label="KV-cache use, mean", color="tab:cyan", width=1.0)
    _steps(kv, minutes, tl.kv_max, label="KV-cache use, fullest replica", color="tab:pink", width=1.0)
    if tl.saturation_target is not None:
        kv.axhline(tl.saturation_target, color="tab:purple", linestyle="--", linewidth=1, label="autoscaler target")
    kv.set_ylim(0, 1.05)
    kv.set_ylabel("fraction")
    kv.set_title("saturation (KV blocks or sequence slots) and KV-cache use")


def _replicas_panel(reps: Any, minutes: list[float], tl: Timeline) -> None:
    """Replicas in service, starting and draining, and each scale event."""
    from matplotlib.ticker import MaxNLocator

    _steps(reps, minutes, tl.replicas, label="in service", color="tab:blue")
    _steps(reps, minutes, tl.starting, label="starting", color="tab:gray", width=1.0)
    if any(tl.draining):
        _steps(reps, minutes, tl.draining, label="draining", color="tab:olive", width=1.0)
    for kind, marker, color in (("scale-out", "^", "tab:green"), ("scale-in", "v", "tab:red")):
        events = [(t / 60, n) for t, n, why in tl.scale_events if why == kind]
        if events:
            xs, ys = zip(*events, strict=True)
            reps.scatter(xs, ys, marker=marker, color=color, s=40, zorder=3, label=f"{kind} (to this many)")
    reps.yaxis.set_major_locator(MaxNLocator(integer=True))
    reps.set_ylim(bottom=0)
    reps.set_ylabel("replicas")
    reps.set_title("replicas")
    reps.set_xlabel("simulated time (min)")
