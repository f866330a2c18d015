"""The calibration's fit (kvfleet.sim.fit): levels simulated from a known step model are fitted back to it, and one
level a host stall spoiled does not pull the fit off."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvfleet.engines.vllm.scheduler import VllmScheduler
from kvfleet.sim.fit import MeasuredLevel, fit, predict, with_terms
from kvfleet.sim.fleet import FleetSpec, Scaling
from kvfleet.sim.replica import EngineLimits, LinearStepModel

# About what the CPU build of vLLM measures for the tests' tiny model: per step, per prefill token, per decoding
# sequence, per KV token, and per request outside the steps.
TRUTH = (0.0024, 2.3e-5, 1.07e-4, 1.2e-9, 0.0039)
BASE = FleetSpec(
    limits=EngineLimits(max_num_seqs=32, max_num_batched_tokens=512, kv_blocks=128, block_tokens=128),
    model=LinearStepModel(fixed_s=0.005, per_prefill_token_s=1e-5, per_decode_seq_s=1e-4, per_kv_token_s=1e-8),
    scheduler=VllmScheduler(),
    scaling=Scaling(kind="none", min_replicas=1, max_replicas=1, kv_cache_target=1.0, queue_target=1.0),
    initial_replicas=1,
    cold_start_s=0.0,
    usd_per_replica_hour=None,
)
UNSEEN = MeasuredLevel(
    concurrency=2, input_tokens=128, output_tokens=24, requests=16, ttft_p50_s=1, itl_mean_s=1, output_tokens_per_s=1
)


def measured(seed: int) -> list[MeasuredLevel]:
    """kvfleet bench --calibrate's design (1, 4, 16 clients x a long and a short prompt), simulated on TRUTH, with
    the scatter of a shared host."""
    truth = with_terms(BASE, TRUTH)
    rng = random.Random(seed)
    out = []
    for prompt in (256, 32):
        for c in (1, 4, 16):
            lv = replace(UNSEEN, concurrency=c, input_tokens=prompt, output_tokens=32, requests=max(8, 4 * c))
            p = predict(truth, lv)
            out.append(
                replace(
                    lv,
                    ttft_p50_s=p.ttft_p50_s * rng.uniform(0.85, 1.2),
                    itl_mean_s=p.itl_mean_s * rng.uniform(0.9, 1.1),
                    output_tokens_per_s=p.output_tokens_per_s * rng.uniform(0.9, 1.1),
                )
            )
    return out


def unseen_errors(levels: list[MeasuredLevel]) -> tuple[float, float]:
    f = fit(BASE, levels)
    terms = (f.model.fixed_s, f.model.per_prefill_token_s, f.model.per_decode_seq_s, f.model.per_kv_token_s)
    got = predict(with_terms(BASE, (*terms, f.request_overhead_s)), UNSEEN)
    want = predict(with_terms(BASE, TRUTH), UNSEEN)
    return got.ttft_p50_s / want.ttft_p50_s - 1, got.itl_mean_s / want.itl_mean_s - 1


@pytest.mark.parametrize("seed", [0, 1])
def test_the_fit_predicts_a_level_it_never_saw(seed: int) -> None:
    ttft, itl = unseen_errors(measured(seed))
    assert abs(ttft) < 0.15 and abs(itl) < 0.15, (ttft, itl)


def test_one_spoiled_level_does_not_pull_the_fit_off() -> None:
    levels = measured(3)
    levels[2] = replace(levels[2], itl_mean_s=levels[2].itl_mean_s * 4, ttft_p50_s=levels[2].ttft_p50_s * 6)
    ttft, itl = unseen_errors(levels)
    assert abs(ttft) < 0.2 and abs(itl) < 0.2, (ttft, itl)


def test_a_fit_needs_two_batch_sizes_and_two_prompt_lengths() -> None:
    one_prompt = [lv for lv in measured(0) if lv.input_tokens == 256]
    with pytest.raises(ValueError, match="two or more prompt lengths"):
        fit(BASE, one_prompt)
