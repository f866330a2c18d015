"""The fleet: each autoscaler's documented timing, draining on scale-in, the routers, and `kvfleet simulate`."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from kvfleet.cli import main
from kvfleet.engines.vllm.scheduler import VllmScheduler
from kvfleet.scaling.autoscalers import OUT_DATAPOINTS, PERIOD_S
from kvfleet.sim.fleet import FleetResult, FleetSpec, Scaling, saturation, simulate
from kvfleet.sim.replica import EngineLimits, Replica, Request, Stats
from kvfleet.sizing.hosting import Routing
from tests.sim.synthetic import MODEL, steady

VLLM = VllmScheduler()  # the engine the plans here run

REPO = Path(__file__).resolve().parents[2]


def spec(kind: str, *, initial: int, kv_blocks: int = 2_000, **scaling: float) -> FleetSpec:
    s = {"min_replicas": 1, "max_replicas": 8, "kv_cache_target": 0.5, "queue_target": 2.0, **scaling}
    return FleetSpec(
        scheduler=VLLM,
        limits=EngineLimits(max_num_seqs=64, max_num_batched_tokens=4096, kv_blocks=kv_blocks),
        model=MODEL,
        scaling=Scaling(kind=kind, **s),  # type: ignore[arg-type]
        initial_replicas=initial,
        cold_start_s=120,
        usd_per_replica_hour=3.6,
    )


def test_target_tracking_scales_out_after_three_breaching_minutes_and_new_replicas_serve_after_cold_start() -> None:
    result = simulate(steady(12, 900), spec("target_tracking", initial=1))
    first = result.scale_events[0]
    assert first[2] == "scale-out" and first[0] == OUT_DATAPOINTS * PERIOD_S
    serving = [x for x in result.samples if x.replicas > 1]
    assert serving and serving[0].t_s >= first[0] + 120  # the cold start


def test_ec2_scales_in_one_at_a_time_only_when_one_fewer_would_stay_under_target() -> None:
    light = simulate(steady(0.5, 3600), spec("ec2", initial=4, scale_in_cooldown_s=600))
    ins = [e for e in light.scale_events if e[2] == "scale-in"]
    assert [e[1] for e in ins] == [3, 2, 1]
    assert all(b[0] - a[0] >= 600 for a, b in itertools.pairwise(ins))
    # A load that one replica fewer could not hold under the targets keeps all of them.
    busy = simulate(steady(12, 1800), spec("ec2", initial=2, max_replicas=2, scale_in_cooldown_s=600))
    assert not [e for e in busy.scale_events if e[2] == "scale-in"]


def test_hpa_scale_down_waits_for_its_stabilization_window() -> None:
    result = simulate(steady(0.5, 1800), spec("hpa", initial=4, stabilization_s=300))
    ins = [e for e in result.scale_events if e[2] == "scale-in"]
    assert ins and ins[0][0] >= 300


@pytest.mark.parametrize(("budget", "aborted"), [(3600.0, False), (0.0, True)])
def test_scale_in_drains_in_flight_generations_within_the_budget(budget: float, aborted: bool) -> None:
    long = steady(0.1, 900, prompt=200, output=3000)
    result = simulate(long, spec("ec2", initial=3, scale_in_cooldown_s=300, drain_budget_s=budget))
    assert [e for e in result.scale_events if e[2] == "scale-in"]
    assert (result.stats.aborted > 0) is aborted
    if not aborted:
        assert len(result.stats.finished) == len(long)


def test_saturation_is_the_larger_of_kv_use_and_sequence_slots() -> None:
    # 4 slots and a cache for far more: two running sequences hold a sliver of the cache and half the slots.
    slots = Replica(
        0,
        EngineLimits(max_num_seqs=4, max_num_batched_tokens=4096, kv_blocks=10_000),
        MODEL,
        Stats(),
        scheduler=VLLM,
        ready_s=0,
    )
    for i in range(2):
        slots.admit(Request(i, 0.0, 500, 200), 0.0)
    slots.advance(0.05)  # one step: both prompts prefilled, both running
    assert len(slots.running) == 2
    assert slots.kv_utilization < 0.01
    assert saturation(slots) == 0.5
    # A small cache: its blocks bind first.
    cache = Replica(
        1,
        EngineLimits(max_num_seqs=64, max_num_batched_tokens=4096, kv_blocks=40),
        MODEL,
        Stats(),
        scheduler=VLLM,
        ready_s=0,
    )
    cache.admit(Request(0, 0.0, 500, 200), 0.0)
    cache.advance(0.05)
    assert saturation(cache) == cache.kv_utilization > len(cache.running) / 64


@pytest.mark.parametrize("kind", ["target_tracking", "ec2", "hpa"])
def test_a_cache_larger_than_max_num_seqs_runs_scales_out_on_saturation(kind: str) -> None:
    """8 sequence slots and a cache for about 450 such sequences: raw KV use tops out near 0.02, far under the 0.5
    target, so a fleet scaled on it would never grow however long its queue. Saturation reaches 1 when every slot
    is taken. The queue target is out of reach here, so only saturation can ask for replicas."""
    busy = FleetSpec(
        scheduler=VLLM,
        limits=EngineLimits(max_num_seqs=8, max_num_batched_tokens=4096, kv_blocks=20_000),
        model=MODEL,
        scaling=Scaling(kind=kind, min_replicas=1, max_replicas=4, kv_cache_target=0.5, queue_target=1e9),  # type: ignore[arg-type]
        initial_replicas=1,
        cold_start_s=120,
        usd_per_replica_hour=None,
    )
    result = simulate(steady(6, 900), busy)  # about 3.6 requests/s fill 8 slots on MODEL at 500 + 200 tokens
    before = [x for x in result.samples if x.t_s < (result.scale_events[0][0] if result.scale_events else math.inf)]
    # On the old signal nothing would breach: KV use stays far under the target the whole run.
    assert max(x.kv_max for x in result.samples) < 0.1 < busy.scaling.kv_cache_target
    # Saturation does: every slot taken on the one replica.
    assert max(x.saturation for x in before) == 1.0
    outs = [e for e in result.scale_events if e[2] == "scale-out"]
    assert outs and outs[0][1] >= 2
    assert max(x.replicas for x in result.samples) > 1
    assert all(x.kv_utilization <= x.saturation <= 1.0 for x in result.samples)


def test_every_targets_autoscaler_is_one_the_simulator_runs() -> None:
    from kvfleet.scaling import AutoscalerKind
    from kvfleet.targets import TARGETS

    for t in TARGETS.values():
        assert t.autoscaler != AutoscalerKind.NONE
        assert Scaling(
            kind=t.autoscaler, min_replicas=1, max_replicas=2, kv_cache_target=0.5, queue_target=2.0
        ).autoscaler()


def routed(router: Routing) -> FleetResult:
    """Four fixed replicas of 4 slots (about 1.8 requests/s each on MODEL at 500 + 200 tokens) at 6 requests/s:
    about 80% of the fleet's slots busy."""
    fixed = FleetSpec(
        scheduler=VLLM,
        limits=EngineLimits(max_num_seqs=4, max_num_batched_tokens=4096, kv_blocks=2_000),
        model=MODEL,
        scaling=Scaling(kind="none", min_replicas=4, max_replicas=4, kv_cache_target=0.5, queue_target=2.0),
        initial_replicas=4,
        cold_start_s=0,
        usd_per_replica_hour=None,
        router=router,
    )
    return simulate(steady(6, 300), fixed)


def p95_ttft_s(result: FleetResult) -> float:
    ttft = sorted(r.first_token_s - r.arrival_s for r in result.stats.finished)
    return ttft[int(0.95 * len(ttft))]


def test_random_routing_queues_where_least_outstanding_does_not() -> None:
    # The same arrivals: least outstanding sends each to a free slot while the fleet has one (pooled servers);
    # random leaves each replica an independent queue, so some queue while others have slots free.
    pooled, random = routed(Routing.LEAST_OUTSTANDING), routed(Routing.RANDOM)
    assert len(pooled.stats.finished) == len(random.stats.finished) == 1800
    # Requests queued at the replicas, sampled every publish interval: none pooled, more than one on average random.
    assert sum(s.waiting for s in pooled.samples) == 0
    assert sum(s.waiting for s in random.samples) > len(random.samples)
    assert p95_ttft_s(random) > 10 * p95_ttft_s(pooled)
    # Seeded: a replay repeats.
    again = routed(Routing.RANDOM)
    assert [s.waiting for s in again.samples] == [s.waiting for s in random.samples]


def test_kvfleet_simulate_replays_a_trace_slice(capsys: pytest.CaptureFixture[str]) -> None:
    trace = REPO / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
    assert main(["simulate", "dev", "--trace", str(trace), "--duration-s", "600", "--json"]) == 0
    [report] = json.loads(capsys.readouterr().out)
    assert report["deployment"] == "chat"
    assert (
        report["requests"] == report["completed"] + report["rejected_429"] + report["rejected_503"] + report["aborted"]
    )
    assert report["ttft_s"]["p50"] > 0 and report["usd"] > 0


@pytest.mark.parametrize(
    ("env", "router", "autoscaler"),
    [
        ("dev", "least_outstanding", "target_tracking"),
        ("staging", "least_outstanding", "ec2"),
        ("platform", "random", "hpa"),
    ],
)
def test_kvfleet_simulate_routes_and_scales_as_the_target_does(
    capsys: pytest.CaptureFixture[str], env: str, router: str, autoscaler: str
) -> None:
    """The deployed router and autoscaler by default (kvfleet.targets); --router replays another."""
    trace = REPO / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
    args = ["simulate", env, "--trace", str(trace), "--duration-s", "120", "--json"]
    assert main(args) == 0
    reports = json.loads(capsys.readouterr().out)
    assert reports and all(r["router"] == router and r["autoscaler"] == autoscaler for r in reports)
    assert main([*args, "--router", "round_robin"]) == 0
    assert all(r["router"] == "round_robin" for r in json.loads(capsys.readouterr().out))


def test_kvfleet_simulate_without_a_trace_uses_the_workload(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "dev"]) == 0
    out = capsys.readouterr().out
    assert "Poisson arrivals at 2/s" in out and "TTFT" in out


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--deployment", "nope"], "no deployment 'nope'"),
        (["--trace", "/nonexistent.csv"], "cannot read the trace"),
        (["--trace", str(REPO / "README.md")], "not a trace kvfleet reads"),
    ],
)
def test_kvfleet_simulate_bad_input_is_one_line(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "dev", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "\n" not in err
