"""The replica's scheduler against vLLM V1's rules, and the leaps against step-by-step simulation."""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest

from kvfleet.engines.scheduling import Scheduler
from kvfleet.engines.trtllm.scheduler import TrtllmScheduler
from kvfleet.engines.vllm.scheduler import VllmScheduler
from kvfleet.sim.fleet import FleetSpec, Scaling, simulate
from kvfleet.sim.replica import EngineLimits, LinearStepModel, Replica, Request, Stats
from kvfleet.sim.report import summarize
from kvfleet.workload.traces import Trace, read_trace

VLLM = VllmScheduler()  # the engine the plans here run

REPO = Path(__file__).resolve().parents[2]
CONV = REPO / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
MODEL = LinearStepModel(fixed_s=0.008, per_prefill_token_s=6e-5, per_decode_seq_s=5e-5, per_kv_token_s=2.5e-8)


def limits(**kw: int) -> EngineLimits:
    base: dict[str, int] = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "kv_blocks": 4096}
    return EngineLimits(**{**base, **kw})  # type: ignore[arg-type]


def replica(lim: EngineLimits, *, leap: bool = True) -> tuple[Replica, Stats]:
    stats = Stats()
    return Replica(0, lim, MODEL, stats, scheduler=VLLM, ready_s=0.0, leap=leap), stats


def run_one(prompt: int, output: int, lim: EngineLimits, *, leap: bool = True) -> Request:
    r, stats = replica(lim, leap=leap)
    req = Request(0, 0.0, prompt, output)
    assert r.admit(req, 0.0)
    r.advance(1e9)
    assert stats.finished == [req]
    return req


def test_one_request_alone_matches_the_step_model_by_hand() -> None:
    req = run_one(1000, 50, limits())
    ttft = MODEL.step_s(prefill=[(1000, 0)], decode_seqs=0, decode_kv_tokens=0)
    assert req.first_token_s == pytest.approx(ttft)
    # Each later step decodes one sequence whose context grows by one token.
    decode = sum(MODEL.step_s(prefill=[], decode_seqs=1, decode_kv_tokens=1000 + j) for j in range(1, 50))
    assert req.done_s == pytest.approx(ttft + decode)
    assert req.generated == 50


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    req = run_one(5000, 1, limits(max_num_batched_tokens=2048))
    chunks = [(2048, 0), (2048, 2048), (904, 4096)]  # (tokens computed, tokens already cached)
    assert req.first_token_s == pytest.approx(
        sum(MODEL.step_s(prefill=[c], decode_seqs=0, decode_kv_tokens=0) for c in chunks)
    )


def test_decodes_are_scheduled_first_and_prefill_gets_what_budget_is_left() -> None:
    r, _ = replica(limits(max_num_batched_tokens=100))
    a = Request(0, 0.0, 10, 1000)
    assert r.admit(a, 0.0)
    r.advance(1e-9)  # a's prefill step
    b = Request(1, r.clock, 500, 1)
    assert r.admit(b, r.clock)
    start = r.clock
    r.advance(start + 1e-9)  # one step: a decodes, b gets 99 tokens
    assert b.computed == 99
    assert r.clock - start == pytest.approx(MODEL.step_s(prefill=[(99, 0)], decode_seqs=1, decode_kv_tokens=11))


def test_max_num_seqs_bounds_the_running_batch() -> None:
    r, _ = replica(limits(max_num_seqs=4))
    for i in range(10):
        r.admit(Request(i, 0.0, 10, 100), 0.0)
    r.advance(0.05)
    assert len(r.running) == 4 and len(r.waiting) == 6


def test_preemption_when_blocks_run_out_recomputes_the_newest_and_everything_finishes() -> None:
    r, stats = replica(limits(kv_blocks=40, block_tokens=16, max_num_seqs=8))
    reqs = [Request(i, 0.0, 100, 200) for i in range(6)]
    for q in reqs:
        r.admit(q, 0.0)
    r.advance(1e9)
    assert stats.preemptions > 0
    assert sorted(stats.finished, key=lambda q: q.rid) == reqs
    assert all(q.generated == 200 for q in reqs)
    assert r.free_blocks == 40  # every block came back
    assert reqs[0].preemptions == 0  # the oldest is never the victim while others run


def test_a_request_larger_than_the_cache_is_aborted_not_stalled() -> None:
    r, stats = replica(limits(kv_blocks=10, block_tokens=16))
    r.admit(Request(0, 0.0, 1000, 10), 0.0)
    r.advance(1e9)
    assert stats.aborted == 1 and not r.outstanding


def test_admission_refuses_past_the_token_budget() -> None:
    r, _ = replica(limits(admission_tokens=1000))
    assert r.admit(Request(0, 0.0, 500, 300), 0.0)
    assert not r.admit(Request(1, 0.0, 300, 300), 0.0)  # 800 + 600 > 1000
    assert r.admit(Request(2, 0.0, 100, 100), 0.0)


# Plenty of cache; and three times the rate on so few blocks that requests are preempted.
@pytest.mark.parametrize(("kv_blocks", "rate_scale"), [(50_000, 1.0), (1_500, 3.0)])
def test_leaps_give_the_same_answers_as_single_steps(kv_blocks: int, rate_scale: float) -> None:
    trace = read_trace(CONV, duration_s=180, rate_scale=rate_scale)
    lim = limits(kv_blocks=kv_blocks, max_num_seqs=128, max_num_batched_tokens=4096)
    scaling = Scaling(kind="none", min_replicas=2, max_replicas=2, kv_cache_target=0.75, queue_target=2.0)
    reports = []
    for exact in (False, True):
        spec = FleetSpec(
            scheduler=VLLM,
            limits=lim,
            model=MODEL,
            scaling=scaling,
            initial_replicas=2,
            cold_start_s=0,
            usd_per_replica_hour=1.0,
            exact_steps=exact,
        )
        reports.append(summarize(simulate(trace, spec), spec))
    leap, exact = reports
    assert leap.completed == exact.completed == len(trace)
    assert leap.preemptions == exact.preemptions
    if kv_blocks < 10_000:
        assert exact.preemptions > 0
    for name in ("ttft_s", "e2e_s", "itl_s", "tpot_s"):
        a, b = getattr(leap, name), getattr(exact, name)
        for q in ("p50", "p95", "p99"):
            # Leaps stop at the step running when a request arrives, as single steps do; within a leap the token
            # times are interpolated, so gaps agree to the step, not the bit.
            assert getattr(a, q) == pytest.approx(getattr(b, q), rel=0.02, abs=1e-3), (name, q)


def test_blocks_return_and_no_counter_goes_negative_after_a_busy_hour() -> None:
    trace = read_trace(CONV, duration_s=1200, rate_scale=4.0)
    lim = limits(kv_blocks=3_000, max_num_seqs=128, max_num_batched_tokens=4096, admission_tokens=3_000 * 16 * 2)
    spec = FleetSpec(
        scheduler=VLLM,
        limits=lim,
        model=MODEL,
        initial_replicas=1,
        cold_start_s=60,
        usd_per_replica_hour=2.0,
        scaling=Scaling(kind="target_tracking", min_replicas=1, max_replicas=6, kv_cache_target=0.6, queue_target=2.0),
    )
    result = simulate(trace, spec)
    s = result.stats
    assert len(s.finished) + s.rejected_429 + s.rejected_503 + s.aborted == len(trace)
    assert s.preemptions >= 0 and all(x.kv_utilization <= 1.0 for x in result.samples)
    assert max(x.replicas for x in result.samples) > 1  # four times the rate on one replica scales out
    assert all(q.done_s >= q.first_token_s >= q.arrival_s for q in s.finished)


def test_empty_arrays_are_not_a_trace() -> None:
    t = Trace(
        source="x",
        fmt="azure",
        arrival_s=array("d", [0.0]),
        input_tokens=array("q", [5]),
        output_tokens=array("q", [5]),
    )
    spec = FleetSpec(
        scheduler=VLLM,
        limits=limits(),
        model=MODEL,
        initial_replicas=1,
        cold_start_s=0,
        usd_per_replica_hour=None,
        scaling=Scaling(kind="none", min_replicas=1, max_replicas=1, kv_cache_target=0.75, queue_target=2.0),
    )
    rep = summarize(simulate(t, spec), spec)
    assert rep.completed == 1 and rep.usd is None


def _fixed_fleet(lim: EngineLimits, scheduler: Scheduler) -> FleetSpec:
    return FleetSpec(
        scheduler=scheduler,
        limits=lim,
        model=MODEL,
        initial_replicas=1,
        cold_start_s=0,
        usd_per_replica_hour=None,
        scaling=Scaling(kind="none", min_replicas=1, max_replicas=1, kv_cache_target=0.75, queue_target=2.0),
    )


def test_prefix_hits_are_counted_in_tokens_of_the_traces_own_blocks() -> None:
    """Mooncake hashes prompts in 512-token blocks. A second request sharing two of them reuses 1,024 tokens (in the
    engine's 16-token blocks), not 2 x 16; and the hash cache holds as many 512-token blocks as the engine's cache
    holds tokens (4,096 blocks x 16 = 128 of them), not 4,096."""
    trace = Trace(
        source="x",
        fmt="mooncake",
        arrival_s=array("d", [0.0, 10.0]),
        input_tokens=array("q", [1500, 1500]),
        output_tokens=array("q", [4, 4]),
        prefix_blocks=((1, 2, 3), (1, 2, 9)),
        block_tokens=512,
    )
    fleet = _fixed_fleet(limits(kv_blocks=4096), VLLM)
    result = simulate(trace, fleet)
    assert result.stats.prefix_hit_tokens == 1024
    second = max(result.stats.finished, key=lambda r: r.rid)
    first = min(result.stats.finished, key=lambda r: r.rid)
    assert second.first_token_s - second.arrival_s < first.first_token_s - first.arrival_s
    r = Replica(0, limits(kv_blocks=4096), MODEL, Stats(), scheduler=VLLM, ready_s=0.0, hash_block_tokens=512)
    assert r.hash_capacity == 128


@pytest.mark.parametrize("scheduler", [VLLM, TrtllmScheduler()])
def test_each_engines_rules_replay_a_busy_trace_to_the_end(scheduler: Scheduler) -> None:
    trace = read_trace(CONV, duration_s=120, rate_scale=3.0)
    lim = limits(kv_blocks=1_500, max_num_seqs=64, max_num_batched_tokens=8192, block_tokens=32)
    result = simulate(trace, _fixed_fleet(lim, scheduler))
    s = result.stats
    assert len(s.finished) + s.aborted == len(trace)
    if isinstance(scheduler, TrtllmScheduler):
        # GUARANTEED_NO_EVICT reserves each request's whole length up front: never a preemption.
        assert s.preemptions == 0
    else:
        assert s.preemptions > 0  # vLLM admits on what the prompt needs now and recomputes when blocks run out


def test_trtllm_without_chunking_refuses_a_prompt_past_max_num_tokens() -> None:
    r = Replica(0, limits(max_num_batched_tokens=1000), MODEL, Stats(), scheduler=TrtllmScheduler(), ready_s=0.0)
    assert r.admit(Request(0, 0.0, 5000, 10), 0.0)
    assert r.admit(Request(1, 0.0, 500, 10), 0.0)
    r.advance(1e9)
    assert r.stats.aborted == 1 and [q.rid for q in r.stats.finished] == [1]
