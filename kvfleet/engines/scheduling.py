"""What every engine's scheduler model works on: a request's progress, one engine's batch and cache, a step.

Each engine adapter owns one scheduler (``EngineAdapter.scheduler``), in its engine's folder: vLLM's in
``vllm/scheduler.py``, TensorRT-LLM's in ``trtllm/scheduler.py``. The fleet simulator (``kvfleet.sim.replica``) holds
an engine's state, asks its scheduler which requests compute how many tokens in the next step, prices that step on a
step-time model and advances it; the plan's percentiles, ``kvfleet simulate``, the derived scaling thresholds and a
calibration's replay all run through it. Nothing else in the package spells an engine's scheduling rules. Standard
library only (the image carries it).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol


class Request:
    """One request's progress. Plain slots: a replay makes millions of attribute updates."""

    __slots__ = (
        "admitted",
        "arrival_s",
        "blocks",
        "blocks_hashes",
        "cached",
        "computed",
        "done_s",
        "first_token_s",
        "generated",
        "last_token_s",
        "output",
        "preemptions",
        "prompt",
        "rid",
        "target",
    )

    def __init__(
        self, rid: int, arrival_s: float, prompt: int, output: int, hashes: tuple[int, ...] | None = None
    ) -> None:
        self.rid = rid
        self.arrival_s = arrival_s
        self.prompt = prompt
        self.output = max(1, output)  # every request returns at least one token
        self.blocks_hashes = hashes
        self.cached = 0  # prompt tokens the prefix cache held when the request arrived
        self.computed = 0  # tokens whose KV is in the cache
        self.target = prompt  # tokens to compute before the next token is sampled
        self.generated = 0
        self.blocks = 0  # KV blocks allocated to it
        self.first_token_s = math.nan
        self.last_token_s = math.nan
        self.done_s = math.nan
        self.preemptions = 0
        self.admitted = False


@dataclass(frozen=True, kw_only=True)
class EngineLimits:
    """What bounds one engine's batch: the settings the plan emits and the KV blocks its cache holds."""

    max_num_seqs: int  # vLLM max_num_seqs / TensorRT-LLM max_batch_size
    max_num_batched_tokens: int  # vLLM max_num_batched_tokens / TensorRT-LLM max_num_tokens
    kv_blocks: int
    block_tokens: int = 16  # the engine's KV block (vLLM 16 on GPUs by default, TensorRT-LLM tokens_per_block 32)
    prefix_caching: bool = True
    # The agent's token-aware admission: prompt + max output reserved per request, refused (429) past this.
    admission_tokens: int | None = None


def blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens) if tokens > 0 else 0


class EngineState(Protocol):
    """One engine as its scheduler sees it: the running batch in admission order, the queue, the free blocks, and
    the engine's own bookkeeping a scheduler calls on (preemption, the prefix cache at admission)."""

    limits: EngineLimits
    running: list[Request]
    waiting: deque[Request]
    free_blocks: int

    def preempt(self, victim: Request) -> None:
        """Take ``victim`` out of the running batch: its blocks freed, recomputed from the start at the head of
        the queue when it is scheduled again."""
        ...

    def start(self, req: Request) -> int:
        """Where ``req``'s computation would start if admitted now: after its prefix-cache hits (tokens)."""
        ...

    def admitted(self, req: Request, start: int) -> None:
        """``req`` joins the batch computing from ``start``: the engine records its prefix-cache hits."""
        ...


@dataclass(frozen=True, kw_only=True)
class Scheduled:
    """One step's schedule: each request and the tokens it computes; whether the step had to preempt."""

    items: list[tuple[Request, int]]
    preempted: bool = False


class Scheduler(Protocol):
    """One engine's scheduling rules, applied to an ``EngineState`` in place."""

    def schedule(self, eng: EngineState) -> Scheduled:
        """Pick the next step's requests and tokens, allocating their blocks (and preempting where the engine
        does); admitted requests move from ``eng.waiting`` to ``eng.running``."""
        ...

    def steady(self, eng: EngineState) -> bool:
        """True when, with every running request decoding, nothing changes the batch until a request finishes or
        the cache runs out: the simulator then computes a run of decode steps at once."""
        ...
