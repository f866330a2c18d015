"""Benchmark shapes through a fixed fleet: the closed loop's clients, Poisson arrivals, and one engine start."""

from __future__ import annotations

import itertools
import statistics

import pytest

from kvfleet.engines.trtllm.scheduler import TrtllmScheduler
from kvfleet.engines.vllm.scheduler import VllmScheduler
from kvfleet.errors import KvfleetError
from kvfleet.sim.candidate import EngineStart, start
from kvfleet.sim.fleet import FleetSpec, Scaling
from kvfleet.sim.replica import EngineLimits, LinearStepModel
from kvfleet.sim.report import summarize
from kvfleet.sim.shapes import closed_loop, run
from kvfleet.sizing.catalog import catalog_model
from kvfleet.workload.shapes import ClosedLoop, Lengths, PoissonLoad

MODEL = LinearStepModel(fixed_s=0.008, per_prefill_token_s=6e-5, per_decode_seq_s=5e-5, per_kv_token_s=2.5e-8)


def spec(*, seqs: int = 64, blocks: int = 50_000, scheduler: object = None) -> FleetSpec:
    return FleetSpec(
        limits=EngineLimits(max_num_seqs=seqs, max_num_batched_tokens=2048, kv_blocks=blocks),
        model=MODEL,
        scheduler=scheduler or VllmScheduler(),  # type: ignore[arg-type]
        scaling=Scaling(kind="none", min_replicas=1, max_replicas=1, kv_cache_target=0.7, queue_target=2.0),
        initial_replicas=1,
        cold_start_s=0.0,
        usd_per_replica_hour=None,
    )


def test_one_client_sends_each_request_as_the_last_one_ends() -> None:
    result = closed_loop(
        spec(), ClosedLoop(concurrency=1, requests=5, lengths=Lengths(input_tokens=500, output_tokens=20))
    )
    done = sorted(result.stats.finished, key=lambda r: r.rid)
    assert [r.rid for r in done] == list(range(5))
    assert done[0].arrival_s == 0.0
    for before, after in itertools.pairwise(done):
        assert after.arrival_s == before.done_s
    # Alone on the engine, every request's first token takes its prompt's one step.
    alone = MODEL.step_s(prefill=[(500, 0)], decode_seqs=0, decode_kv_tokens=0)
    assert all(r.first_token_s - r.arrival_s == pytest.approx(alone) for r in done)


@pytest.mark.parametrize("scheduler", [VllmScheduler(), TrtllmScheduler()])
def test_n_clients_keep_n_requests_in_flight_and_start_together(scheduler: object) -> None:
    loop = ClosedLoop(
        concurrency=16, requests=200, lengths=Lengths(input_tokens=300, output_tokens=50, range_ratio=0.5)
    )
    result = closed_loop(spec(scheduler=scheduler), loop)
    done = result.stats.finished
    assert len(done) == 200 and result.requests == 200
    assert sum(1 for r in done if r.arrival_s == 0.0) == 16  # every client starts at t = 0
    ends = {r.done_s for r in done}
    assert all(r.arrival_s == 0.0 or r.arrival_s in ends for r in done)  # a later one is sent as another ends
    events = sorted([(r.arrival_s, 1) for r in done] + [(r.done_s, -1) for r in done], key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    assert peak == 16
    # Little's law over the run: clients = throughput x time in the system.
    report = summarize(result, spec())
    e2e = statistics.fmean(r.done_s - r.arrival_s for r in done)
    assert report.requests_per_s * e2e == pytest.approx(16, rel=0.1)


def test_a_burst_of_clients_queues_for_slots_and_the_queue_is_the_ttft() -> None:
    """64 clients on 8 slots: the first 8 start at once, the rest wait for a slot, so TTFT's tail is whole answers
    long; on 64 slots nobody waits for one."""
    lengths = Lengths(input_tokens=200, output_tokens=100)
    few = summarize(run(spec(seqs=8), ClosedLoop(concurrency=64, requests=256, lengths=lengths), 1), spec())
    many = summarize(run(spec(seqs=64), ClosedLoop(concurrency=64, requests=256, lengths=lengths), 1), spec())
    assert few.ttft_s is not None and many.ttft_s is not None and few.e2e_s is not None
    assert few.ttft_s.p50 > 5 * many.ttft_s.p50
    assert few.ttft_s.p90 > 0.5 * few.e2e_s.p50


def test_poisson_arrivals_have_the_rate_asked_for_and_repeat_with_their_seed() -> None:
    load = PoissonLoad(rate_per_s=4.0, requests=4000, lengths=Lengths(input_tokens=100, output_tokens=10))
    trace = load.trace()
    gaps = [b - a for a, b in itertools.pairwise(trace.arrival_s)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    assert list(load.trace().arrival_s) == list(trace.arrival_s)


def test_lengths_are_drawn_within_the_range_ratio_as_vllms_random_dataset_does() -> None:
    pairs = Lengths(input_tokens=1000, output_tokens=100, range_ratio=0.2, seed=3).draw(2000)
    assert min(i for i, _ in pairs) >= 800 and max(i for i, _ in pairs) <= 1200
    assert min(o for _, o in pairs) >= 80 and max(o for _, o in pairs) <= 120
    assert statistics.fmean(i for i, _ in pairs) == pytest.approx(1000, rel=0.02)
    assert Lengths(input_tokens=7, output_tokens=3).draw(2) == [(7, 3), (7, 3)]


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"range_ratio": 1.0}, "range-ratio"), ({"input_tokens": 0}, "input-tokens")],
)
def test_impossible_lengths_are_refused(kw: dict[str, float], field: str) -> None:
    base: dict[str, float] = {"input_tokens": 10, "output_tokens": 10}
    with pytest.raises(KvfleetError) as err:
        Lengths(**{**base, **kw})  # type: ignore[arg-type]
    assert err.value.field == field


def test_an_engine_start_on_an_instance_type_is_what_vllm_would_start() -> None:
    started = start(
        EngineStart(
            model=catalog_model("meta-llama/Llama-3.1-8B"), instance_type="p5.48xlarge", engine_version="0.11.0"
        ),
        longest_request_tokens=2000,
    )
    cap = started.capacity
    assert started.spec.limits.kv_blocks == cap.num_blocks and started.spec.limits.max_num_seqs == cap.max_num_seqs
    assert isinstance(started.spec.scheduler, VllmScheduler)
    # One GPU of eight: an eighth of the instance's price per replica.
    price = started.instance.ec2_price
    assert price is not None and started.spec.usd_per_replica_hour == pytest.approx(price.usd_per_hour / 8)
    with pytest.raises(KvfleetError, match="max_model_len"):
        start(
            EngineStart(
                model=catalog_model("meta-llama/Llama-3.1-8B"), instance_type="p5.48xlarge", max_model_len=1024
            ),
            longest_request_tokens=2000,
        )
