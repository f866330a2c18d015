"""The planner's latency percentiles under load (``kvfleet.sizing.step.latency_percentiles``) against the fleet
simulator replaying the same load: Poisson arrivals at the plan's rate, the plan's replicas, its engine limits.

The closed form was shaped on five cases of Llama-3.1-8B on ml.g6e.xlarge and ml.p5.4xlarge (0.56-0.75 of a
replica's capacity, 1-3 replicas, least-outstanding routing). The cases below are held apart from those (other
models, accelerators, lengths and loads), and give: TTFT p50 -2% to 0%, p95 -21% to 0%; ITL p50 within 1%, p95 -7%
to +1%. Mistral-7B on one g5.2xlarge runs near its slots' capacity, where the slot queue dominates: TTFT p95 -2%
(5.8 s against 5.9 s), p50 +30%. That median sits on the edge of the slot wait's mass (the plan's wait probability
is 0.44; the planned p50 is 0.19 s at 1.45 requests/s and 0.53 s at 1.55), so any change to the draws moves it:
+22% before the budget queue was priced in time. Its p95 was -51% until the slot queue was priced at the full
batch's service time (arrivals wait only while every slot is busy, and a full batch turns over slower than the mean
one). Bounds: medians within 10% (35% in that busy case), p95 within 35%; the p95s lean optimistic, which the bound
lets through. Prompts too long to share a prefill step have their own, tighter check below.
"""

from __future__ import annotations

import pytest

from kvfleet.engines.vllm.scheduler import VllmScheduler
from kvfleet.sim.fleet import FleetSpec, Scaling, simulate
from kvfleet.sim.replica import EngineLimits
from kvfleet.sim.report import summarize
from kvfleet.sim.steps import RooflineSteps
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.planner import Candidate, PlanRequest, Workload, plan
from kvfleet.sizing.step import latency_percentiles, request_overhead_s
from kvfleet.targets import TARGETS
from kvfleet.workload.traces import Trace, poisson_trace

VLLM = VllmScheduler()  # the engine the plans here run

SECONDS = 1200.0  # simulated: enough arrivals for a steady p95 at these rates


def _poisson(rate: float, prompt: int, output: int) -> Trace:
    return poisson_trace(((SECONDS, rate),), input_tokens=prompt, output_tokens=output, source="poisson", seed=1)


def _simulated(c: Candidate, req: PlanRequest, rate: float) -> tuple[float, float, float, float]:
    cap = c.capacity
    steps = RooflineSteps.for_candidate(c, req.model)
    spec = FleetSpec(
        scheduler=VLLM,
        limits=EngineLimits(
            max_num_seqs=cap.max_num_seqs,
            max_num_batched_tokens=cap.max_num_batched_tokens,
            kv_blocks=cap.num_blocks,
            block_tokens=cap.block_size,
            prefix_caching=False,
        ),
        model=steps,
        # The plan's replicas, held: the question is what the planned fleet does under the planned load.
        scaling=Scaling(
            kind="target_tracking",
            min_replicas=c.replicas,
            max_replicas=c.replicas,
            kv_cache_target=0.99,
            queue_target=1e9,
        ),
        initial_replicas=c.replicas,
        cold_start_s=0.0,
        usd_per_replica_hour=None,
        router="least_outstanding",
        request_overhead_s=request_overhead_s(req.engine.value),  # the plan's TTFT carries it too
    )
    wl = req.workload
    report = summarize(simulate(_poisson(rate, wl.input_tokens, wl.output_tokens), spec), spec)
    assert report.ttft_s is not None and report.itl_s is not None
    return report.ttft_s.p50, report.ttft_s.p95, report.itl_s.p50, report.itl_s.p95


def _planned(case: tuple[str, str, int, int, int, float]) -> tuple[PlanRequest, Candidate]:
    """The plan for (model, instance, prompt, output, concurrency per replica, requests/s for the fleet)."""
    model, instance, prompt, output, concurrency, rate = case
    req = PlanRequest(
        model=catalog_model(model),
        workload=Workload(
            max_input_tokens=prompt,
            max_output_tokens=output,
            concurrency_per_replica=concurrency,
            peak_requests_per_s=rate,
        ),
        hosting=TARGETS["ec2"].hosting,  # least-outstanding routing, which the simulated router does
        instance_types=(instance,),
    )
    return req, plan(req).best


# model, instance, prompt, output, concurrency per replica, requests/s for the fleet, median bound
CHECK = [
    ("Qwen/Qwen2.5-7B", "g6.xlarge", 1000, 200, 16, 1.2, 0.10),
    ("mistralai/Mistral-7B-Instruct-v0.3", "g5.2xlarge", 600, 300, 24, 1.5, 0.35),  # 0.90 of capacity
    ("meta-llama/Llama-3.1-70B", "p5.48xlarge", 2000, 400, 32, 3.0, 0.10),
    ("Qwen/Qwen3-8B", "g6e.xlarge", 3000, 150, 16, 2.5, 0.10),
    ("meta-llama/Llama-3.2-3B", "g6.xlarge", 400, 600, 48, 2.0, 0.10),
]


@pytest.mark.parametrize("case", CHECK, ids=[f"{c[0].split('/')[1]}-{c[1]}" for c in CHECK])
def test_planned_percentiles_agree_with_the_simulated_fleet(case: tuple[str, str, int, int, int, float, float]) -> None:
    model, instance, *_, rate, median = case
    req, c = _planned(case[:6])
    assert c.planned_requests_per_s == pytest.approx(rate / c.replicas)
    q = latency_percentiles(c.planned_load)
    ttft50, ttft95, itl50, itl95 = _simulated(c, req, rate)
    label = f"{model} on {instance} x{c.replicas}"
    assert q.ttft.p50_s == pytest.approx(ttft50, rel=median), label
    assert q.ttft.p95_s == pytest.approx(ttft95, rel=0.35), label
    assert q.itl.p50_s == pytest.approx(itl50, rel=0.10), label
    assert q.itl.p95_s == pytest.approx(itl95, rel=0.35), label


# Prompts that take a prefill step to themselves: the budget is busy for the whole of those long steps, so prompts
# queue behind one another (M/D/1 in time). Priced as a share of the budget's tokens, the planned p95 was 17% and
# 34% short of the simulator's here; now 0% and -4%.
LONG = [
    ("meta-llama/Llama-3.1-70B", "p5.48xlarge", 5000, 500, 32, 2.0),
    ("Qwen/Qwen3-8B", "g6e.xlarge", 6000, 200, 16, 0.6),
]


@pytest.mark.parametrize("case", LONG, ids=[f"{c[0].split('/')[1]}-{c[2]}" for c in LONG])
def test_long_prompts_queue_for_the_budget_as_the_simulator_does(case: tuple[str, str, int, int, int, float]) -> None:
    prompt, rate = case[2], case[5]
    req, c = _planned(case)
    assert c.replicas == 1 and c.capacity.max_num_batched_tokens < 2 * prompt  # one prompt to a step
    q = latency_percentiles(c.planned_load)
    ttft50, ttft95, _, _ = _simulated(c, req, rate)
    assert q.ttft.p50_s == pytest.approx(ttft50, rel=0.05)
    assert q.ttft.p95_s == pytest.approx(ttft95, rel=0.12)


def test_percentiles_are_ordered_and_an_overloaded_replica_has_no_finite_tail() -> None:
    req = PlanRequest(
        model=catalog_model("meta-llama/Llama-3.1-8B"),
        workload=Workload(max_input_tokens=2000, max_output_tokens=500, concurrency_per_replica=16),
        hosting=TARGETS["eks"].hosting,
        instance_types=("g6e.xlarge",),
    )
    c = plan(req).best
    q = latency_percentiles(c.planned_load)  # no rate: the under-load batch, with no slot queue
    assert q.ttft.p50_s <= q.ttft.p95_s <= q.ttft.p99_s and q.itl.p50_s <= q.itl.p95_s <= q.itl.p99_s
    assert q.ttft.p50_s > c.planned_load.prefill_step_s  # at least the prompt's own step
    from dataclasses import replace

    over = latency_percentiles(replace(c.planned_load, queue_wait_s=float("inf")))
    assert over.ttft.p95_s == float("inf") and over.itl.p50_s == q.itl.p50_s
