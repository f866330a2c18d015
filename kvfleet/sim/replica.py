"""One replica under load: an engine's continuous batching, step by step, on a step-time model.

The engine's own scheduler decides each step (``kvfleet.engines.scheduling``: each adapter owns one; vLLM V1's
token budget with chunked prefill and recompute preemption, TensorRT-LLM's capacity and micro-batch schedulers);
this module prices the step on a ``StepModel`` and advances it: every scheduled request computes its tokens, and
a request whose target is reached samples a token at the end of the step (its first one when its prompt is done).

Runs of pure-decode steps with an unchanged batch (the scheduler says when: ``Scheduler.steady``) are computed as
one leap (their step times differ only by the KV tokens read, which grow by one per sequence per step), which keeps
an hour of traffic to seconds.

Prefix reuse is counted in tokens: a trace's block hashes come in the trace's own block size (Mooncake: 512 tokens),
the engine reuses whole blocks of its own, and the hash cache holds as many trace blocks as the engine's cache holds
tokens.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvfleet.engines.scheduling import EngineLimits, Request, Scheduler, blocks_for


class StepModel(Protocol):
    """Seconds one engine step takes for its batch: the prefill chunks as (tokens computed, tokens already in the
    cache before them), the decoding sequences and the KV tokens those read."""

    def step_s(self, *, prefill: Sequence[tuple[int, int]], decode_seqs: int, decode_kv_tokens: int) -> float: ...


@dataclass(frozen=True, kw_only=True)
class LinearStepModel:
    """fixed + per prefill token + per decoding sequence + per KV token read (a chunk reads its whole context):
    the shape of a profile measured on a real engine."""

    fixed_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_kv_token_s: float

    def step_s(self, *, prefill: Sequence[tuple[int, int]], decode_seqs: int, decode_kv_tokens: int) -> float:
        prefill_tokens = sum(n for n, _ in prefill)
        kv = decode_kv_tokens + sum(n + start for n, start in prefill)
        return (
            self.fixed_s
            + self.per_prefill_token_s * prefill_tokens
            + self.per_decode_seq_s * decode_seqs
            + self.per_kv_token_s * kv
        )


__all__ = ["EngineLimits", "LinearStepModel", "Replica", "Request", "Stats", "StepModel"]


class Stats:
    """What the fleet's requests saw: token gaps as (seconds, count) pairs, per-request times, counters."""

    def __init__(self) -> None:
        self.itl: list[tuple[float, int]] = []
        self.finished: list[Request] = []
        self.preemptions = 0
        self.rejected_429 = 0
        self.rejected_503 = 0
        self.aborted = 0  # ended with an error: refused by the engine, or cut by a scale-in (below)
        # Of those, the requests a scale-in cut: running or queued on a removed replica when its drain ended.
        self.cut_by_scale_in = 0
        self.prefix_hit_tokens = 0
        self.prompt_tokens = 0
        self.output_tokens = 0


class Replica:
    """One engine: the state its scheduler works on (``kvfleet.engines.scheduling.EngineState``) and the clock."""

    def __init__(
        self,
        rid: int,
        limits: EngineLimits,
        model: StepModel,
        stats: Stats,
        *,
        scheduler: Scheduler,
        ready_s: float,
        leap: bool = True,
        hash_block_tokens: int | None = None,
    ) -> None:
        self.rid = rid
        self.leap = leap  # False: every step on its own (the reference the leaps are checked against)
        self.limits = limits
        self.model = model
        self.scheduler = scheduler
        self.stats = stats
        self.ready_s = ready_s  # serving from then on (cold start)
        self.clock = ready_s  # when the next step may start
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_blocks = limits.kv_blocks
        # Every block ever freed: with free_blocks, how many were allocated since a moment (see preempt).
        self.freed_blocks = 0
        # A preempted request's full blocks kept in the prefix cache: (blocks, allocated then, free before them).
        self.kept: dict[Request, tuple[int, int, int]] = {}
        self.reserved_tokens = 0
        self.draining = False
        # The prefix cache as block hashes of the trace's own size, as many as the engine's cache holds in tokens.
        self.hash_block_tokens = hash_block_tokens or limits.block_tokens
        self.hash_capacity = max(1, limits.kv_blocks * limits.block_tokens // self.hash_block_tokens)
        self.prefix: OrderedDict[int, None] = OrderedDict()

    # ---- what the router and the autoscaler read ----------------------------------------------------------

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def kv_utilization(self) -> float:
        return 1.0 - self.free_blocks / self.limits.kv_blocks

    def admit(self, req: Request, now: float) -> bool:
        """The agent's admission in front of the engine: False means a 429."""
        cost = req.prompt + req.output
        budget = self.limits.admission_tokens
        if budget is not None and self.reserved_tokens + cost > budget and self.outstanding:
            return False
        self.reserved_tokens += cost
        if self.limits.prefix_caching and req.blocks_hashes:
            hits = 0
            for h in req.blocks_hashes:
                if h not in self.prefix:
                    break
                hits += 1
            # The trace's blocks in tokens, reused in whole engine blocks, and never the whole prompt (the engine
            # recomputes the last token to sample from it).
            bt = self.limits.block_tokens
            req.cached = min(hits * self.hash_block_tokens // bt * bt, req.prompt - 1) if hits else 0
        self.waiting.append(req)
        self.clock = max(self.clock, now)  # an idle engine starts its next step when work arrives
        return True

    # ---- what the engine's scheduler calls on (EngineState) ------------------------------------------------

    def preempt(self, victim: Request) -> None:
        """With prefix caching on, vLLM frees a preempted request's blocks with their hashes kept, tail blocks
        first in the eviction order (vllm/v1/core/kv_cache_manager.py ``free``, read at vllm-project/vllm 003df296:
        "We free the blocks in reverse order so that the tail blocks are evicted first when caching is enabled";
        block_pool.py: a freed block keeps its hash until ``get_new_blocks`` reuses it), so its recompute starts
        after those of its full blocks no later allocation took (``start``)."""
        self.running.remove(victim)
        before = self.free_blocks
        full = victim.computed // self.limits.block_tokens if self.limits.prefix_caching else 0
        self.free_blocks += victim.blocks
        self.freed_blocks += victim.blocks
        if full:
            self.kept[victim] = (min(full, victim.blocks), self._allocated(), before)
        victim.blocks = 0
        victim.computed = 0
        victim.target = victim.prompt + victim.generated  # recompute what it had, then go on
        victim.cached = 0
        victim.admitted = False
        victim.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(victim)

    def _allocated(self) -> int:
        return self.limits.kv_blocks + self.freed_blocks - self.free_blocks

    def start(self, req: Request) -> int:
        if req.preemptions == 0 and req.computed == 0:
            return req.cached
        kept = self.kept.get(req)
        if kept is None:
            return req.computed
        # Allocations take the blocks that were free before the victim's first (the pool is LRU), then its own.
        blocks, allocated_then, free_before = kept
        evicted = max(0, self._allocated() - allocated_then - free_before)
        return min(max(0, blocks - evicted) * self.limits.block_tokens, req.target - 1)

    def admitted(self, req: Request, start: int) -> None:
        self.kept.pop(req, None)
        if start > req.computed:
            self.stats.prefix_hit_tokens += start - req.computed
            req.computed = start
        if self.limits.prefix_caching and req.blocks_hashes:
            for h in req.blocks_hashes:
                self.prefix[h] = None
                self.prefix.move_to_end(h)
            while len(self.prefix) > self.hash_capacity:
                self.prefix.popitem(last=False)
        req.admitted = True

    # ---- the engine ---------------------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.limits.block_tokens)

    def _finish(self, r: Request, t: float) -> None:
        r.done_s = t
        self.free_blocks += r.blocks
        self.freed_blocks += r.blocks
        r.blocks = 0
        self.reserved_tokens -= r.prompt + r.output
        self.stats.finished.append(r)
        self.stats.prompt_tokens += r.prompt
        self.stats.output_tokens += r.generated

    def advance(self, horizon: float) -> None:
        """Run every step that starts before ``horizon``."""
        while (self.running or self.waiting) and self.clock < horizon:
            self.step(horizon)

    def step(self, horizon: float) -> None:
        """One step, or a leap of decode steps that ends with the step running at ``horizon``."""
        if self.leap and self.running and self.scheduler.steady(self) and self._all_decoding():
            self._leap(horizon)
        else:
            self._step()

    def _all_decoding(self) -> bool:
        return all(r.generated and r.target - r.computed == 1 for r in self.running)

    def _refuse_head(self) -> None:
        """Nothing can be scheduled (a prompt larger than the whole cache, or than the engine takes in one step
        without chunking): the engine refuses it rather than stall."""
        r = self.waiting.popleft() if self.waiting else self.running.pop(0)
        self.free_blocks += r.blocks
        self.freed_blocks += r.blocks
        self.kept.pop(r, None)
        r.blocks = 0
        self.reserved_tokens -= r.prompt + r.output
        self.stats.aborted += 1

    def _step(self) -> None:
        sched = self.scheduler.schedule(self)
        if not sched.items:
            if not sched.preempted:
                self._refuse_head()
            return  # after a preemption the next step readmits from the front of the queue
        prefill: list[tuple[int, int]] = []
        decodes = 0
        kv = 0
        for r, n in sched.items:
            if r.generated and n == 1 and r.target - r.computed == 1:
                decodes += 1
                kv += r.computed + 1
            else:
                prefill.append((n, r.computed))
        dt = self.model.step_s(prefill=prefill, decode_seqs=decodes, decode_kv_tokens=kv)
        t = self.clock + dt
        self.clock = t
        done: list[Request] = []
        gaps = 0
        for r, n in sched.items:
            was_decode = r.generated > 0 and r.target - r.computed == 1
            r.computed += n
            if r.computed >= r.target:
                if r.generated == 0:
                    r.first_token_s = t
                elif was_decode:
                    gaps += 1
                else:  # the first token after a recompute: its gap is the whole wait
                    self.stats.itl.append((t - r.last_token_s, 1))
                r.generated += 1
                r.last_token_s = t
                r.target = r.computed + 1
                if r.generated >= r.output:
                    done.append(r)
        if gaps:
            self.stats.itl.append((dt, gaps))
        for r in done:
            self.running.remove(r)
            self._finish(r, t)

    def _fitting_steps(self, k: int, free: int) -> int:
        """The most decode steps, at most ``k``, whose new blocks fit in ``free``."""
        bt = self.limits.block_tokens
        # Steps until each request's next new block: it needs one when its length crosses a block boundary.
        # Step j writes position computed + j - 1, which opens a block when it is a multiple of the block size.
        first_need = sorted((bt - r.computed % bt) % bt + 1 for r in self.running)

        def demand(steps: int) -> int:
            total = 0
            for f in first_need[: bisect.bisect_right(first_need, steps)]:
                total += 1 + (steps - f) // bt
            return total

        lo, hi = 0, k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if demand(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _leap(self, horizon: float) -> None:
        """k pure-decode steps at once: until the first request finishes, the cache would need a block it does
        not have, or the next step would start at ``horizon``."""
        run = self.running
        n = len(run)
        bt = self.limits.block_tokens
        k = run[0].output - run[0].generated
        kv0 = n
        for r in run:  # one pass: the steps to the first finish and the KV the first step reads
            left = r.output - r.generated
            if left < k:  # noqa: PLR1730 - the hot loop of a replay; min() costs a call per sequence
                k = left
            kv0 += r.computed
        free = self.free_blocks
        # Blocks the batch allocates over k steps (each holds exactly the blocks of what it computed): counted only
        # where the most it could need does not fit, and only where that count does not fit either, the search for
        # the largest number of steps whose blocks do.
        if n * (k // bt + 1) > free and sum((r.computed + k + bt - 1) // bt - r.blocks for r in run) > free:
            k = self._fitting_steps(k, free)
            if k == 0:
                self._step()  # the next step preempts
                return
        s0 = self.model.step_s(prefill=(), decode_seqs=n, decode_kv_tokens=kv0)
        s1 = self.model.step_s(prefill=(), decode_seqs=n, decode_kv_tokens=kv0 + (k - 1) * n) if k > 1 else s0
        slope = (s1 - s0) / (k - 1) if k > 1 else 0.0

        def elapsed(j: int) -> float:  # time of the first j steps
            return j * s0 + slope * j * (j - 1) / 2

        room = horizon - self.clock
        if elapsed(k - 1) >= room:  # stop with the step that is running at the horizon
            lo, hi = 1, k
            while lo < hi:
                mid = (lo + hi) // 2
                if elapsed(mid) >= room:
                    hi = mid
                else:
                    lo = mid + 1
            k = lo
        total = elapsed(k)
        t = self.clock + total
        self.clock = t
        done = []
        allocated = 0
        for r in run:
            held = (r.computed + k + bt - 1) // bt
            allocated += held - r.blocks
            r.blocks = held
            r.computed += k
            r.target = r.computed + 1
            r.generated += k
            r.last_token_s = t
            if r.generated >= r.output:
                done.append(r)
        self.free_blocks -= allocated
        self.stats.itl.append((total / k, n * k))
        for r in done:
            run.remove(r)
            self._finish(r, t)

    def abort_all(self, t: float) -> int:
        """The drain budget ran out: what is still running ends with an error."""
        n = 0
        for r in [*self.running, *self.waiting]:
            self.free_blocks += r.blocks
            self.freed_blocks += r.blocks
            r.blocks = 0
            self.reserved_tokens -= r.prompt + r.output
            n += 1
        self.running.clear()
        self.waiting.clear()
        self.kept.clear()
        self.stats.aborted += n
        return n
