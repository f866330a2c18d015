"""Normalizes an LLM engine's Prometheus metrics to kvfleet's scaling signals, and publishes them.

The agent scrapes the engine every few seconds and hands each scrape's text to ``SignalCollector.update``,
which returns that interval's ``Sample`` in the contract's terms (``kvfleet.contract``): gauges as read,
counters as increases since the previous scrape, histograms as the interval's observations. Three ways
out, all from the same ``Sample``:

* ``emf_line``: CloudWatch Embedded Metric Format, one JSON line for stdout (the default path: no network);
* ``CloudWatchPublisher``: PutMetricData, for when EMF log ingestion is not available;
* ``SignalCollector.prometheus_text``: a Prometheus re-export under the contract's names (Kubernetes).

Engines rename their metrics between releases, so each engine adapter has a table of candidate names per
release (``kvfleet.engines``, ``metric_rows``); the autoscalers only ever see the contract's names.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import itertools
import json
import logging
import math
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Final, Protocol

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvfleet import contract
from kvfleet.agent import aws
from kvfleet.contract import Kind, Signal
from kvfleet.engines import adapter
from kvfleet.engines.base import SignalNames
from kvfleet.versions import Version, parse_version

_log = logging.getLogger(__name__)

# CloudWatch drops an EMF metric, and rejects a PutMetricData datum, with more distinct values than this.
MAX_DISTRIBUTION_VALUES: Final = 100
# PutMetricData limits: 1000 data per call and a 1 MB request. The byte budget is an estimate of the
# largest (query-protocol) encoding, kept at half the limit so the estimate may be off without harm.
MAX_METRIC_DATA_PER_CALL: Final = 1000
MAX_REQUEST_BYTES: Final = 512_000

# Counters the agent itself keeps (admission, proxy); every other signal comes from the engine.
AGENT_SIGNALS: Final[tuple[Signal, ...]] = (contract.REQUESTS_SHED, contract.SERVER_ERRORS, contract.CLIENT_CANCELLED)
_AGENT_SIGNAL_NAMES: Final = frozenset(s.name for s in AGENT_SIGNALS)
# Signals the agent derives from others in the same scrape, never read from the engine.
DERIVED_SIGNALS: Final[tuple[Signal, ...]] = (contract.REPLICA_SATURATION,)
_ENGINE_SIGNAL_NAMES: Final = (
    frozenset(s.name for s in contract.PUBLISHED_SIGNALS) - _AGENT_SIGNAL_NAMES - {s.name for s in DERIVED_SIGNALS}
)

Distribution = tuple[tuple[float, ...], tuple[float, ...]]  # (values, counts), CloudWatch's "values and counts"

# --------------------------------------------------------------------------------------------------
# Name mapping: engine metric names per kvfleet signal, from the engine's adapter.
# --------------------------------------------------------------------------------------------------

# vLLM labels each engine core's series engine=<index> (vllm/v1/metrics/loggers.py make_per_engine): with
# data-parallel attention one server runs data_parallel_size cores, each with its own scheduler and KV cache.
ENGINE_CORE_LABEL: Final = "engine"
_Labels = tuple[tuple[str, str], ...]


def _sum_series(series: Sequence[tuple[_Labels, float]]) -> float:
    return math.fsum(v for _, v in series)


def _kv_use(series: Sequence[tuple[_Labels, float]]) -> float:
    """KV-cache use of the replica. Within one engine core the cache is as full as its fullest part (several
    model_name series); across a data-parallel replica's cores it is used over the replica's cache, their sum:
    the cores' mean, since they are one engine start's equal shares (vLLM exposes only the sum of their
    blocks, in cache_config_info). One core: its value, as before data parallelism was read."""
    by_core: dict[str, float] = {}
    for labels, v in series:
        core = dict(labels).get(ENGINE_CORE_LABEL, "")
        by_core[core] = max(v, by_core.get(core, v))
    return math.fsum(by_core.values()) / len(by_core)


# When one engine exposes several series of a gauge: KV use as _kv_use reads it, while request counts add up
# (over model_name labels and over engine cores alike). Counters and histogram buckets always add up.
_GAUGE_COMBINE: Final[Mapping[str, Callable[[Sequence[tuple[_Labels, float]]], float]]] = {
    contract.KV_CACHE_UTILIZATION.name: _kv_use,
}


@dataclass(frozen=True, kw_only=True)
class MetricMap:
    """For one engine and version range: each signal's candidate engine metric names, first present wins."""

    engine: str
    since: Version
    candidates: Mapping[str, tuple[str, ...]]

    def names(self, signal_name: str) -> tuple[str, ...]:
        return self.candidates.get(signal_name, ())


def check_metric_rows(engine: str, rows: Sequence[tuple[str, SignalNames]]) -> None:
    """An adapter's ``metric_rows`` as the collector needs them: releases from 0.0.0 up, ascending; only the
    contract's engine signals (never the agent's own counters), each with at least one name."""
    since = [parse_version(v) for v, _ in rows]
    if not since or since[0] != (0, 0, 0) or any(a >= b for a, b in itertools.pairwise(since)):
        raise ValueError(f"{engine}: metric rows must start at 0.0.0 and ascend")
    for version, names in rows:
        for name, candidates in names.items():
            if name not in _ENGINE_SIGNAL_NAMES or not candidates:
                raise ValueError(f"{engine} {version}: {name} cannot map to engine metrics {candidates}")


@functools.cache
def _checked(engine: str) -> None:
    check_metric_rows(engine, adapter(engine).metric_rows)


def metric_map(engine: str, version: str) -> MetricMap:
    """The name table for ``engine`` (a ``kvfleet.engines`` name) at ``version``; ValueError for anything else."""
    _checked(engine)
    try:
        since, names = adapter(engine).metric_names(version)
    except ValueError as err:
        raise ValueError(f"{engine} version: {err}") from None
    return MetricMap(engine=engine, since=since, candidates=MappingProxyType(dict(names)))


# --------------------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------------------


def _check_signal(name: str, kind: Kind) -> Signal:
    try:
        sig = contract.signal(name)
    except KeyError as exc:
        raise ValueError(str(exc)) from None
    if sig.kind is not kind:
        raise ValueError(f"{name} is a {sig.kind.value} signal, not a {kind.value}")
    return sig


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One interval's signal values, keyed by contract name. Absent key: the signal had no data.

    ``distributions`` values are in the contract's unit (milliseconds); ``problem`` says why the engine's
    scrape could not be read, in which case only the agent's own counters are present.
    """

    gauges: dict[str, float] = field(default_factory=dict)
    deltas: dict[str, float] = field(default_factory=dict)
    distributions: dict[str, Distribution] = field(default_factory=dict)
    problem: str | None = None

    def __post_init__(self) -> None:
        # Checked here so that every publication path can trust names, kinds and CloudWatch's value limits.
        for name, value in self.gauges.items():
            _check_signal(name, Kind.GAUGE)
            if not math.isfinite(value):
                raise ValueError(f"{name}: non-finite gauge {value}")
        for name, value in self.deltas.items():
            _check_signal(name, Kind.DELTA)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: a delta must be finite and >= 0, got {value}")
        for name, (values, counts) in self.distributions.items():
            _check_signal(name, Kind.DISTRIBUTION)
            if not 0 < len(values) == len(counts) <= MAX_DISTRIBUTION_VALUES:
                raise ValueError(f"{name}: need 1..{MAX_DISTRIBUTION_VALUES} values with one count each")
            if not all(math.isfinite(v) for v in values) or not all(math.isfinite(c) and c > 0 for c in counts):
                raise ValueError(f"{name}: values must be finite and counts finite and > 0")


def _items(sample: Sample) -> Iterator[tuple[Signal, float | Distribution]]:
    """The sample's signals in contract order (stable output for logs and tests)."""
    for sig in contract.PUBLISHED_SIGNALS:
        if sig.name in sample.gauges:
            yield sig, sample.gauges[sig.name]
        elif sig.name in sample.deltas:
            yield sig, sample.deltas[sig.name]
        elif sig.name in sample.distributions:
            yield sig, sample.distributions[sig.name]


@dataclass(frozen=True, kw_only=True)
class HistogramTotals:
    """Running totals of one distribution signal since the agent started, for the Prometheus re-export."""

    buckets: tuple[tuple[float, float], ...]  # (upper bound in seconds, cumulative count), ascending, ends at +Inf
    sum_seconds: float
    count: float


# --------------------------------------------------------------------------------------------------
# Parsing one scrape
# --------------------------------------------------------------------------------------------------

_SeriesKey = tuple[str, _Labels]  # (engine metric name, labels): a renamed metric is a new series


@dataclass(frozen=True)
class _Histogram:
    """One histogram series as scraped: cumulative bucket counts."""

    bounds: tuple[float, ...]  # ascending upper bounds, seconds
    cumulative: tuple[float, ...]
    sum: float


_SAMPLE_LINE: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*[{ ]")


class _Scrape:
    """One scrape's samples by sample name, then label set."""

    def __init__(self, text: str, wanted: frozenset[str] | None = None) -> None:
        """``wanted``: the sample names read later; other lines are dropped before the parser sees them (an
        engine exposes hundreds of series and parsing them all held the event loop for tens of milliseconds)."""
        self._by_name: dict[str, dict[_Labels, float]] = {}
        if wanted is not None:
            # Comment lines go too: only sample names, labels and values are read, never the families' types.
            kept = []
            for line in text.splitlines():
                if not line or line[0] == "#":
                    continue
                if line.split("{", 1)[0].split(" ", 1)[0] in wanted:
                    kept.append(line)
                elif not _SAMPLE_LINE.match(line):  # an error page, say: not exposition text at all
                    raise ValueError(f"not a Prometheus sample line: {line[:60]!r}")
            text = "\n".join(kept) + "\n"
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted(sample.labels.items()))
                self._by_name.setdefault(sample.name, {})[labels] = float(sample.value)

    def label_sets(self, name: str) -> list[dict[str, str]]:
        return [dict(labels) for labels in self._by_name.get(name, {})]

    def gauge(self, names: Sequence[str], combine: Callable[[Sequence[tuple[_Labels, float]]], float]) -> float | None:
        for name in names:
            series = [(labels, v) for labels, v in self._by_name.get(name, {}).items() if math.isfinite(v)]
            if series:
                return combine(series)
        return None

    def counter(self, names: Sequence[str]) -> dict[_SeriesKey, float] | None:
        for name in names:
            series = {
                (name, labels): v for labels, v in self._by_name.get(name, {}).items() if math.isfinite(v) and v >= 0
            }
            if series:
                return series
        return None

    def histogram(self, names: Sequence[str]) -> dict[_SeriesKey, _Histogram] | None:
        for name in names:
            buckets = self._by_name.get(f"{name}_bucket")
            if not buckets:
                continue
            grouped: dict[_Labels, dict[float, float]] = {}
            for labels, value in buckets.items():
                le = dict(labels).get("le")
                if le is None:
                    raise ValueError(f"{name}_bucket series without an le label")
                rest = tuple((k, v) for k, v in labels if k != "le")
                grouped.setdefault(rest, {})[float(le)] = value
            sums = self._by_name.get(f"{name}_sum", {})
            result: dict[_SeriesKey, _Histogram] = {}
            for labels, by_bound in grouped.items():
                bounds = tuple(sorted(by_bound))
                cumulative = tuple(by_bound[b] for b in bounds)
                if any(math.isnan(c) or c < 0 for c in cumulative):
                    raise ValueError(f"{name}: invalid bucket count")
                total = sums.get(labels, 0.0)
                result[(name, labels)] = _Histogram(bounds, cumulative, total if math.isfinite(total) else 0.0)
            return result
        return None


def _increase(previous: float | None, current: float, *, primed: bool) -> float:
    if not primed:
        return 0.0  # first scrape: the counter's history before the agent is not this interval's
    if previous is None:
        return current  # a series born since the previous scrape counted from 0
    if current < previous:
        return current  # the engine restarted: its counter started again from 0
    return current - previous


def _histogram_increase(previous: _Histogram | None, current: _Histogram, *, primed: bool) -> _Histogram | None:
    """The series' observations since the previous scrape, still cumulative; None on the first scrape."""
    if not primed:
        return None
    if (
        previous is None
        or previous.bounds != current.bounds
        or any(c < p for c, p in zip(current.cumulative, previous.cumulative, strict=True))
    ):
        return current  # new series, or the engine restarted (possibly with other buckets)
    return _Histogram(
        current.bounds,
        tuple(c - p for c, p in zip(current.cumulative, previous.cumulative, strict=True)),
        max(0.0, current.sum - previous.sum),
    )


def _observations(delta: _Histogram) -> Iterator[tuple[float, float]]:
    """(value in ms, count) per bucket with observations: the bucket's midpoint, the +Inf bucket its lower
    bound (the engine recorded nothing finer)."""
    lower = 0.0
    previous_cumulative = 0.0
    for i, (upper, cumulative) in enumerate(zip(delta.bounds, delta.cumulative, strict=True)):
        count = cumulative - previous_cumulative
        previous_cumulative = max(previous_cumulative, cumulative)
        if count > 0:
            if upper == math.inf:
                # A histogram with only the +Inf bucket has no bounds at all: its mean is all there is.
                seconds = lower if i > 0 else delta.sum / count
            elif i == 0 and upper <= 0:
                seconds = upper
            else:
                seconds = (lower + upper) / 2
            if math.isfinite(seconds):  # a -Inf bound, nonsensical for a latency, yields nothing
                yield round(seconds * 1000.0, 6), count
        lower = upper


def _coarsen(pairs: list[tuple[float, float]], limit: int = MAX_DISTRIBUTION_VALUES) -> list[tuple[float, float]]:
    """At most ``limit`` values: neighbouring values merge into their count-weighted mean."""
    if len(pairs) <= limit:
        return pairs
    merged = []
    for i in range(limit):
        chunk = pairs[i * len(pairs) // limit : (i + 1) * len(pairs) // limit]
        count = math.fsum(c for _, c in chunk)
        merged.append((round(math.fsum(v * c for v, c in chunk) / count, 6), count))
    return merged


def _step(buckets: Sequence[tuple[float, float]], bound: float) -> float:
    """Cumulative count at ``bound`` of a histogram that may lack that bound: the count at the nearest bound
    below (those observations are certainly <= ``bound``)."""
    i = bisect.bisect_right([b for b, _ in buckets], bound)
    return buckets[i - 1][1] if i else 0.0


def _add_buckets(
    total: Sequence[tuple[float, float]], delta: Sequence[tuple[float, float]]
) -> tuple[tuple[float, float], ...]:
    bounds = sorted({b for b, _ in total} | {b for b, _ in delta} | {math.inf})
    return tuple((b, _step(total, b) + _step(delta, b)) for b in bounds)


# --------------------------------------------------------------------------------------------------
# The collector
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IterationStats:
    """What a read of TensorRT-LLM's iteration statistics (its /metrics JSON) says, by contract signal name."""

    gauges: dict[str, float]
    capacity: tuple[int, int] | None  # (blocks, tokens per block) of the engine's KV cache


def iteration_gauges(text: str) -> IterationStats | None:
    """KV-cache use, waiting and running requests, and the allocated cache from the newest of the iteration
    statistics trtllm-serve keeps since the last read (a JSON list; kvCacheStats.usedNumBlocks / maxNumBlocks,
    numQueuedRequests, numActiveRequests). An empty list means no iteration ran in the interval: nothing running or
    waiting. None where the text is not that list (the engine's statistics are off, or it answered something else)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, list):
        return None
    entries = [e for e in data if isinstance(e, dict)]
    if not entries:
        return IterationStats(
            gauges={
                contract.KV_CACHE_UTILIZATION.name: 0.0,
                contract.REQUESTS_WAITING.name: 0.0,
                contract.REQUESTS_RUNNING.name: 0.0,
            },
            capacity=None,
        )
    last = entries[-1]

    def number(v: object) -> float | None:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        return float(v) if ok else None  # type: ignore[arg-type]

    gauges: dict[str, float] = {}
    kv = last.get("kvCacheStats")
    capacity = None
    if isinstance(kv, dict):
        used, most, size = (
            number(kv.get("usedNumBlocks")),
            number(kv.get("maxNumBlocks")),
            number(kv.get("tokensPerBlock")),
        )
        if used is not None and most:
            gauges[contract.KV_CACHE_UTILIZATION.name] = min(1.0, used / most)
        if most and size:
            capacity = (int(most), int(size))
    for key, sig in (
        ("numQueuedRequests", contract.REQUESTS_WAITING),
        ("numActiveRequests", contract.REQUESTS_RUNNING),
    ):
        v = number(last.get(key))
        if v is not None:
            gauges[sig.name] = v
    return IterationStats(gauges=gauges, capacity=capacity)


class SignalCollector:
    """Turns successive engine scrapes into per-interval Samples and keeps running totals.

    Not thread-safe: ``update``, ``record`` and ``prometheus_text`` are meant for one event loop.
    """

    def __init__(
        self,
        *,
        engine: str,
        engine_version: str,
        counters_from_zero: bool = False,
        max_num_seqs: int | None = None,
        data_parallel_size: int = 1,
    ) -> None:
        """``counters_from_zero``: the engine process is the agent's own child, so its counters started at 0
        with it and everything counted before the first successful scrape belongs to the first interval.
        Otherwise (an engine that was already running) the first scrape is only the baseline.
        ``max_num_seqs``: the engine's limit on running sequences (TensorRT-LLM: max_batch_size), for the
        saturation signal; None where it was left to the engine (saturation is then the KV-cache use alone).
        ``data_parallel_size``: the engine cores of one data-parallel replica; max_num_seqs is each core's
        (vLLM's --max-num-seqs sizes every core's scheduler), so the replica has this many times the slots."""
        if max_num_seqs is not None and max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        if data_parallel_size <= 0:
            raise ValueError(f"data_parallel_size must be positive, got {data_parallel_size}")
        self._slots = None if max_num_seqs is None else max_num_seqs * data_parallel_size
        self._map = metric_map(engine, engine_version)
        # Every sample name a scrape is read for: the gauges' and counters' names, the histograms' series.
        self._wanted = frozenset(
            f"{n}{suffix}"
            for names in self._map.candidates.values()
            for n in names
            for suffix in ("", "_bucket", "_sum", "_count")
        )
        self._capacity_metric = adapter(engine).capacity_metric
        if self._capacity_metric is not None:
            self._wanted |= {self._capacity_metric[0]}
        # (blocks, tokens per block) of the engine's KV cache, once a scrape has reported them.
        self.kv_capacity: tuple[int, int] | None = None
        self._primed = counters_from_zero  # else set by the first scrape with engine metrics: the baseline
        self._counters: dict[str, dict[_SeriesKey, float]] = {}
        self._histograms: dict[str, dict[_SeriesKey, _Histogram]] = {}
        # ClientCancelled appears from its first count on; the others are always published.
        always = (contract.REQUESTS_SHED, contract.SERVER_ERRORS)
        self._pending: dict[str, float] = {s.name: 0.0 for s in always}
        self._totals: dict[str, float] = {s.name: 0.0 for s in always}
        self._histogram_totals: dict[str, HistogramTotals] = {}
        self._latest: Sample | None = None

    @property
    def latest(self) -> Sample | None:
        """The Sample the last ``update`` returned."""
        return self._latest

    @property
    def totals(self) -> dict[str, float]:
        """Running total of every DELTA signal seen since the agent started (a copy)."""
        return dict(self._totals)

    def record(self, name: str, increase: float = 1.0) -> None:
        """Counts one of the agent's own events (``RequestsShed``, ``ServerErrors``) into the next Sample."""
        if name not in _AGENT_SIGNAL_NAMES:
            raise ValueError(f"{name!r} is not an agent counter; known: {', '.join(sorted(_AGENT_SIGNAL_NAMES))}")
        if not math.isfinite(increase) or increase < 0:
            raise ValueError(f"{name}: increase must be finite and >= 0, got {increase}")
        self._pending[name] = self._pending.get(name, 0.0) + increase
        self._totals[name] = (
            self._totals.get(name, 0.0) + increase
        )  # visible to Prometheus at once, not only after the next scrape

    def update(self, text: str, iteration_stats: str | None = None) -> Sample:
        """The interval's Sample from the engine's latest scrape text (and, where the engine keeps them, its
        iteration statistics: gauges the text lacks and the allocated cache). Never raises on bad text."""
        agent = dict(self._pending)
        self._pending = dict.fromkeys(self._pending, 0.0)
        try:
            stats = iteration_gauges(iteration_stats) if iteration_stats is not None else None
            found, gauges, deltas, distributions = self._read(_Scrape(text, self._wanted), stats)
            problem = None if found else f"no {self._map.engine} metrics in the scrape"
            sample = Sample(gauges=gauges, deltas={**deltas, **agent}, distributions=distributions, problem=problem)
        except Exception as exc:
            # Malformed exposition text surfaces from the parser as ValueError, IndexError and the like;
            # the state is then untouched, so the next good scrape reports the increase over both intervals.
            sample = Sample(deltas=agent, problem=f"unreadable engine metrics: {type(exc).__name__}: {exc}")
        self._latest = sample
        return sample

    def _read(
        self, scrape: _Scrape, stats: IterationStats | None = None
    ) -> tuple[bool, dict[str, float], dict[str, float], dict[str, Distribution]]:
        """Reads every mapped signal, then commits the new state; raises (changing nothing) on bad data."""
        gauges, counters, histograms = self._collect(scrape)
        capacity = self._capacity(scrape)
        if stats is not None:
            # The engine's own gauges win where it has them; the iteration statistics fill what it lacks.
            gauges = {**stats.gauges, **gauges}
            capacity = capacity or stats.capacity
        saturation = self._saturation(gauges)
        if saturation is not None:
            gauges[contract.REPLICA_SATURATION.name] = saturation
        primed = self._primed

        deltas: dict[str, float] = {}
        for name, series in counters.items():
            previous = self._counters.get(name, {})
            deltas[name] = math.fsum(_increase(previous.get(k), v, primed=primed) for k, v in series.items())

        distributions, histogram_totals = self._distributions(histograms, primed=primed)

        # Commit. Signals absent from this scrape keep their last state for when they come back.
        for name, series in counters.items():
            self._counters[name] = series
            self._totals[name] = self._totals.get(name, 0.0) + deltas[name]
        for name, hists in histograms.items():
            self._histograms[name] = hists
        self._histogram_totals = histogram_totals
        if capacity is not None:
            self.kv_capacity = capacity
        found = bool(gauges or counters or histograms)
        self._primed = self._primed or found
        return found, gauges, deltas, distributions

    def _collect(
        self, scrape: _Scrape
    ) -> tuple[dict[str, float], dict[str, dict[_SeriesKey, float]], dict[str, dict[_SeriesKey, _Histogram]]]:
        """Every mapped signal this scrape has: gauges combined, counters and histograms per series."""
        gauges: dict[str, float] = {}
        counters: dict[str, dict[_SeriesKey, float]] = {}
        histograms: dict[str, dict[_SeriesKey, _Histogram]] = {}
        for sig in contract.PUBLISHED_SIGNALS:
            names = self._map.names(sig.name)
            if not names:
                continue
            if sig.kind is Kind.GAUGE:
                value = scrape.gauge(names, _GAUGE_COMBINE.get(sig.name, _sum_series))
                if value is not None:
                    gauges[sig.name] = value
            elif sig.kind is Kind.DELTA:
                series = scrape.counter(names)
                if series is not None:
                    counters[sig.name] = series
            else:
                hist = scrape.histogram(names)
                if hist is not None:
                    histograms[sig.name] = hist
        return gauges, counters, histograms

    def _distributions(
        self, histograms: dict[str, dict[_SeriesKey, _Histogram]], *, primed: bool
    ) -> tuple[dict[str, Distribution], dict[str, HistogramTotals]]:
        """Each histogram's observations since the last scrape, and its running totals (not committed here)."""
        distributions: dict[str, Distribution] = {}
        histogram_totals = dict(self._histogram_totals)
        for name, hists in histograms.items():
            previous_hists = self._histograms.get(name, {})
            by_value: dict[float, float] = {}
            running = histogram_totals.get(name, HistogramTotals(buckets=((math.inf, 0.0),), sum_seconds=0, count=0))
            for key, current in hists.items():
                delta = _histogram_increase(previous_hists.get(key), current, primed=primed)
                if delta is None:
                    continue
                for value, count in _observations(delta):
                    by_value[value] = by_value.get(value, 0.0) + count
                buckets = _add_buckets(running.buckets, tuple(zip(delta.bounds, delta.cumulative, strict=True)))
                running = HistogramTotals(
                    buckets=buckets, sum_seconds=running.sum_seconds + delta.sum, count=buckets[-1][1]
                )
            histogram_totals[name] = running
            pairs = _coarsen(sorted(by_value.items()))
            if pairs:
                distributions[name] = (tuple(v for v, _ in pairs), tuple(c for _, c in pairs))
        return distributions, histogram_totals

    def _capacity(self, scrape: _Scrape) -> tuple[int, int] | None:
        """The replica's KV cache from its engine's info metric's labels. vLLM labels one series per engine core,
        each with the front end's cache config, whose num_gpu_blocks is already the sum over the data-parallel
        cores (vllm/v1/engine/utils.py wait_for_engine_startup: "Sum values from all engines in DP case";
        vllm/v1/metrics/loggers.py log_metrics_info): every series carries the replica's total, so they are
        never added up (that would count it once per core); the smallest is taken should they ever differ."""
        if self._capacity_metric is None:
            return None
        name, blocks_label, size_label = self._capacity_metric
        found = []
        for labels in scrape.label_sets(name):
            try:
                blocks, size = int(labels[blocks_label]), int(labels[size_label])
            except (KeyError, ValueError):  # "None" before the engine has profiled memory
                continue
            if blocks > 0 and size > 0:
                found.append((blocks, size))
        return min(found, key=lambda c: c[0] * c[1]) if found else None

    def _saturation(self, gauges: Mapping[str, float]) -> float | None:
        """The larger of KV-cache use and running sequences over the replica's slots (contract.REPLICA_SATURATION):
        the engine's cache-usage figure counts only running sequences' blocks, so where max_num_seqs binds first
        it stays low however loaded the replica is. Running sequences are summed over a data-parallel replica's
        cores, so they are read against every core's slots."""
        kv = gauges.get(contract.KV_CACHE_UTILIZATION.name)
        running = gauges.get(contract.REQUESTS_RUNNING.name)
        parts = [] if kv is None else [kv]
        if running is not None and self._slots is not None:
            parts.append(running / self._slots)
        return min(1.0, max(0.0, *parts)) if parts else None

    def prometheus_text(self, *, deployment: str) -> str:
        """The Prometheus re-export of the latest Sample's gauges and the running totals."""
        return prometheus_text(
            self._latest,
            totals=self._totals,
            deployment=deployment,
            histograms=self._histogram_totals,
            kv_capacity=self.kv_capacity,
        )


# --------------------------------------------------------------------------------------------------
# Publication formats
# --------------------------------------------------------------------------------------------------


def _distribution_json(distribution: Distribution) -> dict[str, Any]:
    values, counts = distribution
    # Min/Max/Count/Sum alongside Values/Counts as the AWS EMF libraries write histograms; taken from the
    # values themselves so the statistic set is consistent with them.
    return {
        "Values": list(values),
        "Counts": list(counts),
        "Min": min(values),
        "Max": max(values),
        "Count": math.fsum(counts),
        "Sum": math.fsum(v * c for v, c in zip(values, counts, strict=True)),
    }


def emf_record(sample: Sample, *, namespace: str, deployment: str, replica: str, timestamp_ms: int) -> dict[str, Any]:
    """The sample as one CloudWatch Embedded Metric Format document (60 s storage resolution)."""
    declared: list[dict[str, str]] = []
    values: dict[str, Any] = {}
    for sig, value in _items(sample):
        declared.append({"Name": sig.name, "Unit": sig.unit})
        values[sig.name] = _distribution_json(value) if isinstance(value, tuple) else value
    record: dict[str, Any] = {
        "_aws": {
            "Timestamp": timestamp_ms,
            "CloudWatchMetrics": [
                {
                    "Namespace": namespace,
                    "Dimensions": [list(dimensions) for dimensions in contract.DIMENSION_SETS],
                    "Metrics": declared,
                }
            ],
        },
        contract.DEPLOYMENT_DIMENSION: deployment,
        contract.REPLICA_DIMENSION: replica,
        **values,
    }
    if sample.problem is not None:
        record["ScrapeProblem"] = sample.problem  # a log property, not a metric: searchable in Logs Insights
    return record


def emf_line(sample: Sample, *, namespace: str, deployment: str, replica: str, timestamp_ms: int) -> str:
    """``emf_record`` as one compact JSON line (no trailing newline)."""
    record = emf_record(sample, namespace=namespace, deployment=deployment, replica=replica, timestamp_ms=timestamp_ms)
    return json.dumps(record, separators=(",", ":"), allow_nan=False)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def prometheus_text(
    latest: Sample | None,
    *,
    totals: Mapping[str, float],
    deployment: str,
    histograms: Mapping[str, HistogramTotals] | None = None,
    kv_capacity: tuple[int, int] | None = None,
) -> str:
    """Prometheus text exposition under the contract's ``prometheus_name``s, each series labelled ``deployment``.

    Gauges come from ``latest`` (none when the last scrape failed: a stale gauge would mislead a scaler);
    DELTA signals are counters holding ``totals``; ``histograms`` become cumulative histograms in seconds.
    """
    for name in totals:
        _check_signal(name, Kind.DELTA)
    histograms = histograms or {}
    for name in histograms:
        _check_signal(name, Kind.DISTRIBUTION)
    families: list[Metric] = []
    for sig in contract.PUBLISHED_SIGNALS:
        if sig.kind is Kind.GAUGE and latest is not None and sig.name in latest.gauges:
            gauge = GaugeMetricFamily(sig.prometheus_name, sig.description, labels=["deployment"])
            gauge.add_metric([deployment], latest.gauges[sig.name])
            families.append(gauge)
        elif sig.kind is Kind.DELTA and sig.name in totals:
            counter = CounterMetricFamily(sig.prometheus_name, sig.description, labels=["deployment"])
            counter.add_metric([deployment], totals[sig.name])
            families.append(counter)
        elif sig.kind is Kind.DISTRIBUTION and sig.name in histograms:
            totals_h = histograms[sig.name]
            buckets = [(repr(b), c) for b, c in totals_h.buckets if not math.isinf(b)]
            buckets.append(("+Inf", max(totals_h.count, totals_h.buckets[-1][1] if totals_h.buckets else 0.0)))
            histogram = HistogramMetricFamily(sig.prometheus_name, sig.description, labels=["deployment"])
            histogram.add_metric([deployment], buckets, totals_h.sum_seconds)
            families.append(histogram)
    if kv_capacity is not None:
        for prom, value, doc in (
            (contract.PROM_ENGINE_KV_BLOCKS, kv_capacity[0], "KV-cache blocks the engine allocated"),
            (contract.PROM_ENGINE_KV_BLOCK_TOKENS, kv_capacity[1], "Tokens per KV-cache block"),
        ):
            g = GaugeMetricFamily(prom, doc, labels=["deployment"])
            g.add_metric([deployment], value)
            families.append(g)
    return generate_latest(_Families(families)).decode("utf-8")


# --------------------------------------------------------------------------------------------------
# PutMetricData
# --------------------------------------------------------------------------------------------------

# PutMetricData: six tries within a few seconds, inside one publish interval.
PUT_RETRY: Final = aws.Retry(attempts=6, base_s=0.2, cap_s=5.0)


class PutMetricDataClient(Protocol):
    """The part of a boto3 CloudWatch client the publisher uses."""

    def put_metric_data(self, **kwargs: Any) -> object: ...


def _encoded_size(value: object, prefix: str) -> int:
    """Bytes of ``value`` in the query protocol's ``a.member.1.b=v&`` form, the most verbose encoding."""
    if isinstance(value, dict):
        return sum(_encoded_size(v, f"{prefix}.{k}") for k, v in value.items())
    if isinstance(value, list):
        return sum(_encoded_size(v, f"{prefix}.member.{i + 1}") for i, v in enumerate(value))
    return len(prefix) + len(str(value)) + 2


class CloudWatchPublisher:
    """Publishes Samples with PutMetricData, retrying throttling; ``publish`` never raises."""

    def __init__(
        self,
        *,
        client: PutMetricDataClient,
        namespace: str,
        deployment: str,
        replica: str,
        retry: aws.Retry = PUT_RETRY,
        sleep: aws.Sleep = asyncio.sleep,
        max_data_per_call: int = MAX_METRIC_DATA_PER_CALL,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        rng: random.Random | None = None,
    ) -> None:
        if not 1 <= max_data_per_call <= MAX_METRIC_DATA_PER_CALL or max_request_bytes <= 0:
            raise ValueError(f"max_data_per_call must be 1..{MAX_METRIC_DATA_PER_CALL}, max_request_bytes > 0")
        self._client = client
        self._namespace = namespace
        self._deployment = deployment
        self._replica = replica
        self._retry = retry
        self._sleep = sleep
        self._max_data = max_data_per_call
        self._max_bytes = max_request_bytes
        self._rng = rng or random.Random()

    def metric_data(self, sample: Sample, *, timestamp: datetime) -> list[dict[str, Any]]:
        """The sample's MetricData: every signal once per dimension set of the contract."""
        dimension_values = {contract.DEPLOYMENT_DIMENSION: self._deployment, contract.REPLICA_DIMENSION: self._replica}
        data: list[dict[str, Any]] = []
        for dimension_set in contract.DIMENSION_SETS:
            dimensions = [{"Name": name, "Value": dimension_values[name]} for name in dimension_set]
            for sig, value in _items(sample):
                datum: dict[str, Any] = {
                    "MetricName": sig.name,
                    "Dimensions": dimensions,
                    "Timestamp": timestamp,
                    "Unit": sig.unit,
                }
                if isinstance(value, tuple):
                    datum["Values"], datum["Counts"] = list(value[0]), list(value[1])
                else:
                    datum["Value"] = value
                data.append(datum)
        return data

    def batches(self, data: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """``data`` split into calls within the count limit and the request byte budget."""
        overhead = _encoded_size({"Action": "PutMetricData", "Version": "2010-08-01", "Namespace": self._namespace}, "")
        widest = f"MetricData.member.{self._max_data}"
        batches: list[list[dict[str, Any]]] = []
        current: list[dict[str, Any]] = []
        size = overhead
        for datum in data:
            datum_size = _encoded_size({k: str(v) if isinstance(v, datetime) else v for k, v in datum.items()}, widest)
            if current and (len(current) >= self._max_data or size + datum_size > self._max_bytes):
                batches.append(current)
                current, size = [], overhead
            current.append(datum)
            size += datum_size
        if current:
            batches.append(current)
        return batches

    async def publish(self, sample: Sample) -> bool:
        """True when every datum was accepted. Stops at the first call that fails for good, so one publication
        takes a bounded time within the publish interval."""
        try:
            data = self.metric_data(sample, timestamp=datetime.now(UTC))
            for batch in self.batches(data):
                if not await self._put(batch):
                    return False
            return True
        except Exception:
            _log.warning("PutMetricData publication failed", exc_info=True)
            return False

    async def _put(self, batch: list[dict[str, Any]]) -> bool:
        try:
            await aws.call(
                functools.partial(self._client.put_metric_data, Namespace=self._namespace, MetricData=batch),
                what="PutMetricData",
                retry=self._retry,
                log=_log,
                sleep=self._sleep,
                rng=self._rng,
            )
        except aws.CallFailed as err:
            _log.warning("%s", err)  # this interval's signals are lost; the next publication tries again
            return False
        return True
