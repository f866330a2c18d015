"""The planner: enumeration, rejections with reasons, fleet sizing, ranking, and nothing-fits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.errors import NothingFitsError
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.planner import PlanRequest, Workload, enumerate_candidates, plan
from kvfleet.sizing.precision import KvDtype
from kvfleet.targets import TARGETS

LLAMA8 = catalog_model("meta-llama/Llama-3.1-8B")
WL = Workload(max_input_tokens=2048, max_output_tokens=512, concurrency_per_replica=16)


def _req(**kw: object) -> PlanRequest:
    base = PlanRequest(model=LLAMA8, workload=WL, hosting=TARGETS["ec2"].hosting)
    return replace(base, **kw)  # type: ignore[arg-type]


def test_ranked_by_fleet_cost_then_token_cost() -> None:
    p = plan(_req())
    costs = [(c.fleet_usd_per_hour, c.usd_per_million_output_tokens) for c in p.candidates]
    assert costs == sorted(costs)
    best = p.best
    assert best.concurrency_per_replica == 16 and best.cache_concurrency >= 16
    assert best.price_as_of and best.price_source


def test_every_rejection_has_a_reason() -> None:
    p = enumerate_candidates(_req(hosting=TARGETS["sagemaker"].hosting))
    reasons = {r.instance_type: r.reason for r in p.rejections}
    assert "Neuron" in reasons["inf2.xlarge"]
    assert "fractional GPU" in reasons["g6f.large"]
    assert "do not accept" in reasons["gr6.4xlarge"]  # not a SageMaker endpoint type
    assert all(r.reason for r in p.rejections)


def test_small_gpu_rejected_with_cache_numbers() -> None:
    p = enumerate_candidates(_req(instance_types=("g5.xlarge",), workload=replace(WL, concurrency_per_replica=64)))
    assert not p.candidates
    (r,) = p.rejections
    assert "the cache holds" in r.reason and "target is 64" in r.reason
    assert r.needed_gib is not None and r.available_gib is not None and r.needed_gib > r.available_gib


def test_replicas_follow_the_peak_load() -> None:
    low = plan(_req(instance_types=("g6e.xlarge",), workload=replace(WL, peak_requests_per_s=0.5))).best
    high = plan(_req(instance_types=("g6e.xlarge",), workload=replace(WL, peak_requests_per_s=20))).best
    assert high.replicas > low.replicas >= 1
    assert high.replicas * high.requests_per_s_per_replica >= 20
    assert high.fleet_usd_per_hour == pytest.approx(high.instance_count * high.usd_per_hour_per_instance)


def test_a_peak_that_needs_more_replicas_than_max_replicas_is_refused() -> None:
    # max_replicas bounds the plan's count too: the peak's requests alone needing more is a rejection, not a plan
    # that autoscaling could never deploy (it returned the count unchecked when the first count met the target).
    wl = replace(WL, peak_requests_per_s=20)
    unbounded = plan(_req(instance_types=("g6e.xlarge",), workload=wl)).best
    assert unbounded.replicas > 3
    p = enumerate_candidates(_req(instance_types=("g6e.xlarge",), workload=wl, max_replicas=3))
    assert not p.candidates
    assert any("max_replicas is 3" in r.reason and "replicas for 20" in r.reason for r in p.rejections), p.rejections


def test_multi_gpu_instances_pack_engines_on_eks_not_sagemaker_or_ec2() -> None:
    eks = [
        c
        for c in enumerate_candidates(_req(hosting=TARGETS["eks"].hosting, instance_types=("g6e.12xlarge",))).candidates
        if c.tensor_parallel_size == 1
    ]
    assert eks and eks[0].engines_per_instance == 4
    # An EC2 fleet runs one serving container per instance, with all its GPUs.
    ec2 = enumerate_candidates(_req(hosting=TARGETS["ec2"].hosting, instance_types=("g6e.12xlarge",)))
    assert ec2.candidates and all(c.engines_per_instance == 1 for c in ec2.candidates)
    sm = enumerate_candidates(_req(hosting=TARGETS["sagemaker"].hosting, instance_types=("ml.g6e.12xlarge",)))
    assert all(c.tensor_parallel_size == 4 for c in sm.candidates)
    assert any("one engine per instance" in r.reason for r in sm.rejections)


def test_itl_target_limits_the_batch() -> None:
    free = plan(_req(instance_types=("g6e.xlarge",), workload=replace(WL, concurrency_per_replica=None))).best
    tight = plan(
        _req(instance_types=("g6e.xlarge",), workload=replace(WL, concurrency_per_replica=None, itl_target_s=0.03))
    ).best
    assert tight.limited_by == "itl-target"
    assert tight.concurrency_per_replica < free.concurrency_per_replica
    assert tight.under_load.itl_s <= 0.03


def test_unreachable_latency_is_a_rejection() -> None:
    p = enumerate_candidates(_req(instance_types=("g6e.xlarge",), workload=replace(WL, itl_target_s=0.001)))
    assert not p.candidates and "even for one sequence" in p.rejections[0].reason


def test_price_ceiling_and_families() -> None:
    p = enumerate_candidates(_req(max_fleet_usd_per_hour=2.0, families=("g6e", "p5")))
    assert all(c.fleet_usd_per_hour <= 2.0 for c in p.candidates)
    assert all(c.instance.family in ("g6e", "p5") for c in p.candidates)
    assert any("ceiling" in r.reason for r in p.rejections)


def test_fp8_kv_admits_more_sequences() -> None:
    req = _req(
        instance_types=("g6e.xlarge",), workload=replace(WL, concurrency_per_replica=None, max_input_tokens=16384)
    )
    by_kv = {
        c.kv_cache_dtype: c
        for c in enumerate_candidates(replace(req, kv_cache_dtypes=(KvDtype.AUTO, KvDtype.FP8))).candidates
    }
    assert by_kv[KvDtype.FP8].cache_concurrency >= 2 * by_kv[KvDtype.AUTO].cache_concurrency - 1


def test_nothing_fits_names_the_nearest_and_the_fix() -> None:
    req = PlanRequest(
        model=catalog_model("meta-llama/Llama-3.1-70B"),
        workload=Workload(max_input_tokens=30000, max_output_tokens=2000, concurrency_per_replica=8),
        hosting=TARGETS["sagemaker"].hosting,
        families=("g5", "g6"),
    )
    with pytest.raises(NothingFitsError) as exc:
        plan(req)
    msg = str(exc.value)
    assert "\n" not in msg
    assert "needs" in msg and "GiB per GPU" in msg and "available" in msg
    assert "would fit with:" in msg and "any instance family" in msg


def test_nothing_fits_suggests_fp8_kv_when_that_is_enough() -> None:
    # 8 sequences of 28k tokens of Llama-3.1-8B on one L40S: too much bf16 KV, enough in fp8.
    req = _req(
        instance_types=("g6e.xlarge",),
        workload=Workload(max_input_tokens=26000, max_output_tokens=2000, concurrency_per_replica=8),
    )
    with pytest.raises(
        NothingFitsError, match=r"fp8 KV cache \(kv_cache_dtypes: \[fp8\]\) -> g6e.xlarge tp=1 bf16 kv=fp8"
    ):
        plan(req)


def test_region_list_rejects_where_known() -> None:
    p = enumerate_candidates(_req(region="eu-west-3", instance_types=("p5.48xlarge",)))
    assert not p.candidates and "not offered in eu-west-3" in p.rejections[0].reason


# ---- answers a buffered SageMaker invocation cannot wait for -------------------------------------------------

LONG = Workload(max_input_tokens=2048, max_output_tokens=4096, concurrency_per_replica=16)


def test_buffered_answers_longer_than_the_invocation_timeout_are_refused() -> None:
    # InvokeEndpoint gives a container 60 s; 4096 tokens at any ITL above ~15 ms take longer.
    sm = TARGETS["sagemaker"].hosting
    assert sm.buffered_response_limit_s == 60
    req = _req(hosting=sm, workload=replace(LONG, streaming=False), instance_types=("ml.g6e.xlarge",))
    p = enumerate_candidates(req)
    assert not p.candidates
    [r] = p.rejections
    assert "a buffered invocation on this target times out at 60 s" in r.reason
    assert "workload.streaming: true" in r.reason and "lower max_output_tokens to" in r.reason
    fits = int(r.reason.rsplit(" ", 1)[1])
    shorter = enumerate_candidates(replace(req, workload=replace(req.workload, max_output_tokens=fits)))
    assert shorter.candidates  # the suggested length does fit
    with pytest.raises(NothingFitsError, match=r"streamed answers \(workload.streaming: true\) ->"):
        plan(req)


def test_streamed_long_answers_plan_with_a_note() -> None:
    req = _req(hosting=TARGETS["sagemaker"].hosting, workload=LONG, instance_types=("ml.g6e.xlarge",))
    best = plan(req).best
    assert any("stream it (InvokeEndpointWithResponseStream)" in n for n in best.notes)
    # Targets without that limit plan the buffered workload as it is.
    assert plan(_req(workload=replace(LONG, streaming=False), instance_types=("g6e.xlarge",))).candidates


def test_fp8_kv_cache_off_hopper_is_noted_not_refused() -> None:
    a100 = plan(_req(kv_cache_dtypes=(KvDtype.FP8,), instance_types=("p4d.24xlarge",))).best
    assert any("without its FlashAttention backend" in n for n in a100.notes)
    h100 = plan(_req(kv_cache_dtypes=(KvDtype.FP8,), instance_types=("p5.48xlarge",))).best
    assert not any("FlashAttention" in n for n in h100.notes)
    bf16 = plan(_req(instance_types=("p4d.24xlarge",))).best
    assert not any("FlashAttention" in n for n in bf16.notes)


def test_latency_targets_are_held_to_the_batch_that_runs_not_a_request_alone() -> None:
    # Long prompts at high concurrency: every decode step also carries prefill chunks of the requests that
    # replace finished ones, so ITL and TTFT under load exceed what one request alone sees.
    wl = replace(WL, max_input_tokens=8192, max_output_tokens=256, concurrency_per_replica=48)
    best = plan(_req(instance_types=("p5.4xlarge",), workload=wl)).best
    assert best.under_load.itl_s > best.alone.itl_s
    assert best.under_load.ttft_s > best.alone.ttft_s
    # A TTFT target between the two: met by a request alone, missed at the planned concurrency.
    target = (best.alone.ttft_s + best.under_load.ttft_s) / 2
    p = enumerate_candidates(_req(instance_types=("p5.4xlarge",), workload=replace(wl, ttft_target_s=target)))
    assert not p.candidates
    assert any("sequences running" in r.reason and "time to first token" in r.reason for r in p.rejections)
    # The replica count comes from the same model: its throughput with the batch full.
    assert best.requests_per_s_per_replica == pytest.approx(best.under_load.requests_per_s)
