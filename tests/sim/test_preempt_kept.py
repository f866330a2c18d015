"""A preempted request keeps its full blocks in vLLM's prefix cache until later allocations take them.

vllm/v1/core/kv_cache_manager.py ``free`` (vllm-project/vllm 003df296) returns a request's blocks to the pool in
reverse order ("so that the tail blocks are evicted first") and block_pool.py keeps a freed block's hash until it is
reallocated, so a preempted request that is scheduled again hits its own prefix; only what was allocated since, past
the blocks that were already free, is recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfleet.engines.vllm.scheduler import VllmScheduler
from kvfleet.sim.replica import EngineLimits, LinearStepModel, Replica, Request, Stats

MODEL = LinearStepModel(fixed_s=0.008, per_prefill_token_s=6e-5, per_decode_seq_s=5e-5, per_kv_token_s=2.5e-8)


@dataclass
class Counting:
    """The step model, counting the prompt tokens every step computes."""

    prefill_tokens: int = 0
    steps: list[int] = field(default_factory=list)

    def step_s(self, *, prefill: Sequence[tuple[int, int]], decode_seqs: int, decode_kv_tokens: int) -> float:
        n = sum(t for t, _ in prefill)
        self.prefill_tokens += n
        self.steps.append(n)
        return MODEL.step_s(prefill=prefill, decode_seqs=decode_seqs, decode_kv_tokens=decode_kv_tokens)


def burst(prefix_caching: bool) -> tuple[Counting, Stats]:
    """Long prompts at once into a cache that holds about three of them, chunked by a small budget: the newest
    prompt's next chunk does not fit, so it is preempted, as in a 32k-token burst on one GPU."""
    counting = Counting()
    stats = Stats()
    lim = EngineLimits(
        max_num_seqs=64, max_num_batched_tokens=1024, kv_blocks=640, block_tokens=16, prefix_caching=prefix_caching
    )
    rep = Replica(0, lim, counting, stats, scheduler=VllmScheduler(), ready_s=0.0, leap=False)
    for i in range(8):
        assert rep.admit(Request(i, 0.0, 3000, 100), 0.0)
    rep.advance(1e9)
    assert len(stats.finished) == 8
    return counting, stats


def test_with_prefix_caching_a_preempted_prompt_waits_instead_of_recomputing_its_chunks() -> None:
    kept, kept_stats = burst(prefix_caching=True)
    lost, lost_stats = burst(prefix_caching=False)
    assert kept_stats.preemptions > 0 and lost_stats.preemptions > 0
    # Without its blocks kept, each readmission recomputes the chunks it had: far more prompt tokens in all.
    assert lost.prefill_tokens > 1.5 * 8 * 3000
    # Kept, only the blocks decoding sequences took in between are computed again.
    assert kept.prefill_tokens < 1.1 * 8 * 3000
    assert kept.prefill_tokens < lost.prefill_tokens


def test_allocations_take_the_blocks_free_before_the_victims_then_its_tail() -> None:
    lim = EngineLimits(max_num_seqs=8, max_num_batched_tokens=4096, kv_blocks=100, block_tokens=16)
    rep = Replica(0, lim, MODEL, Stats(), scheduler=VllmScheduler(), ready_s=0.0, leap=False)
    victim = Request(0, 0.0, 800, 10)
    victim.computed, victim.blocks, victim.admitted = 800, 50, True
    rep.running.append(victim)
    rep.free_blocks = 10  # 40 blocks held by others
    rep.preempt(victim)
    assert rep.free_blocks == 60
    assert rep.start(victim) == 799  # every block still there; the last token is computed again to sample
    rep.free_blocks -= 10  # the ten that were free first
    assert rep.start(victim) == 799
    rep.free_blocks -= 20  # then twenty of the victim's, from its tail
    assert rep.start(victim) == 30 * 16
    rep.free_blocks -= 30
    assert rep.start(victim) == 0


def test_without_prefix_caching_a_preempted_request_starts_over() -> None:
    lim = EngineLimits(
        max_num_seqs=8, max_num_batched_tokens=4096, kv_blocks=100, block_tokens=16, prefix_caching=False
    )
    rep = Replica(0, lim, MODEL, Stats(), scheduler=VllmScheduler(), ready_s=0.0, leap=False)
    victim = Request(0, 0.0, 800, 10)
    victim.computed, victim.blocks, victim.admitted = 800, 50, True
    rep.running.append(victim)
    rep.preempt(victim)
    assert rep.start(victim) == 0
