"""One replica under load: an engine's continuous batching, step by step, on a step-time model.

The scheduler follows vLLM V1 (vllm/v1/core/sched/scheduler.py, ``Scheduler.schedule``): chunked prefill is
always on; running requests are scheduled first, in order, each with the tokens it still has to compute (a
decode is one token) up to the step's token budget ``max_num_batched_tokens``; then waiting requests are
admitted in arrival order while the budget, ``max_num_seqs`` and free KV blocks allow, a long prompt taking
a chunk of what budget is left. When a running request needs a block and none is free, the most recently
admitted running request is preempted: its blocks are freed and it is recomputed from the start (prompt and
the tokens it had generated) when it is admitted again. A request's first token is sampled at the end of the
step that computes the last of its prompt.

Runs of pure-decode steps with an unchanged batch are computed as one leap (their step times differ only by
the KV tokens read, which grow by one per sequence per step), which keeps an hour of traffic to seconds.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


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


@dataclass(frozen=True, kw_only=True)
class EngineLimits:
    """What bounds one engine's batch: the settings the plan emits and the KV blocks its cache holds."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_blocks: int
    block_tokens: int = 16  # vLLM's default block size on GPUs
    prefix_caching: bool = True
    # The agent's token-aware admission: prompt + max output reserved per request, refused (429) past this.
    admission_tokens: int | None = None


class Request:
    """One request's progress. Plain slots: the simulator makes millions of attribute updates."""

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
        self.cached = 0
        self.computed = 0  # tokens whose KV is in the cache
        self.target = prompt  # tokens to compute before the next token is sampled
        self.generated = 0
        self.blocks = 0
        self.first_token_s = math.nan
        self.last_token_s = math.nan
        self.done_s = math.nan
        self.preemptions = 0
        self.admitted = False


class Stats:
    """What the fleet's requests saw: token gaps as (seconds, count) pairs, per-request times, counters."""

    def __init__(self) -> None:
        self.itl: list[tuple[float, int]] = []
        self.finished: list[Request] = []
        self.preemptions = 0
        self.rejected_429 = 0
        self.rejected_503 = 0
        self.aborted = 0
        self.prefix_hit_tokens = 0
        self.prompt_tokens = 0
        self.output_tokens = 0


class Replica:
    def __init__(
        self, rid: int, limits: EngineLimits, model: StepModel, stats: Stats, *, ready_s: float, leap: bool = True
    ) -> None:
        self.rid = rid
        self.leap = leap  # False: every step on its own (the reference the leaps are checked against)
        self.limits = limits
        self.model = model
        self.stats = stats
        self.ready_s = ready_s  # serving from then on (cold start)
        self.clock = ready_s  # when the next step may start
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_blocks = limits.kv_blocks
        self.reserved_tokens = 0
        self.draining = False
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
            # Recorded here for the profile; the engine's block size decides what it really reuses.
            req.cached = min(hits * self.limits.block_tokens, req.prompt - 1) if hits else 0
        self.waiting.append(req)
        self.clock = max(self.clock, now)  # an idle engine starts its next step when work arrives
        return True

    # ---- the engine ---------------------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.limits.block_tokens)

    def _finish(self, r: Request, t: float) -> None:
        r.done_s = t
        self.free_blocks += r.blocks
        r.blocks = 0
        self.reserved_tokens -= r.prompt + r.output
        self.stats.finished.append(r)
        self.stats.prompt_tokens += r.prompt
        self.stats.output_tokens += r.generated

    def _preempt(self) -> Request:
        victim = self.running.pop()
        self.free_blocks += victim.blocks
        victim.blocks = 0
        victim.computed = 0
        victim.target = victim.prompt + victim.generated  # recompute what it had, then go on
        victim.cached = 0
        victim.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def advance(self, horizon: float) -> None:
        """Run every step that starts before ``horizon``."""
        while (self.running or self.waiting) and self.clock < horizon:
            if self.leap and not self.waiting and self._all_decoding():
                self._leap(horizon)
            else:
                self._step()

    def _all_decoding(self) -> bool:
        return all(r.generated and r.target - r.computed == 1 for r in self.running)

    def _step(self) -> None:
        lim = self.limits
        budget = lim.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        prefill: list[tuple[int, int]] = []
        decodes = 0
        kv = 0
        i = 0
        preempted = False
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(r.target - r.computed, budget)
            need = self._blocks_for(r.computed + n) - r.blocks
            while need > self.free_blocks:
                preempted = True
                if self._preempt() is r:
                    break
            if i >= len(self.running):
                break  # r itself was preempted: nothing after it was left running either
            r.blocks += need
            self.free_blocks -= need
            scheduled.append((r, n))
            budget -= n
            if r.generated and n == 1:
                decodes += 1
                kv += r.computed + n
            else:
                prefill.append((n, r.computed))
            i += 1
        # vLLM admits no waiting request in a step that had to preempt (the cache is what is short).
        while not preempted and self.waiting and budget > 0 and len(self.running) < lim.max_num_seqs:
            r = self.waiting[0]
            start = r.cached if r.preemptions == 0 and r.computed == 0 else r.computed
            n = min(r.target - start, budget)
            need = self._blocks_for(start + n)
            if need > self.free_blocks:
                break
            self.waiting.popleft()
            if start > r.computed:
                self.stats.prefix_hit_tokens += start
                r.computed = start
            if self.limits.prefix_caching and r.blocks_hashes:
                for h in r.blocks_hashes:
                    self.prefix[h] = None
                    self.prefix.move_to_end(h)
                while len(self.prefix) > lim.kv_blocks:
                    self.prefix.popitem(last=False)
            r.admitted = True
            r.blocks = need
            self.free_blocks -= need
            self.running.append(r)
            scheduled.append((r, n))
            budget -= n
            prefill.append((n, r.computed))
        if not scheduled:
            if preempted:
                return  # the next step readmits from the front of the queue
            # Nothing fits (a prompt larger than the whole cache): refuse it rather than stall the engine.
            r = self.waiting.popleft()
            self.reserved_tokens -= r.prompt + r.output
            self.stats.aborted += 1
            return
        dt = self.model.step_s(prefill=prefill, decode_seqs=decodes, decode_kv_tokens=kv)
        t = self.clock + dt
        self.clock = t
        done: list[Request] = []
        gaps = 0
        for r, n in scheduled:
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

    def _leap(self, horizon: float) -> None:
        """k pure-decode steps at once: until the first request finishes, the cache would need a block it does
        not have, or the next step would start at ``horizon``."""
        run = self.running
        n = len(run)
        bt = self.limits.block_tokens
        k = min(r.output - r.generated for r in run)
        # Steps until each request's next new block: it needs one when its length crosses a block boundary.
        # Step j writes position computed + j - 1, which opens a block when it is a multiple of the block size.
        first_need = sorted((bt - r.computed % bt) % bt + 1 for r in run)
        free = self.free_blocks

        def demand(steps: int) -> int:
            # Blocks the batch allocates over `steps` steps.
            total = 0
            for f in first_need[: bisect.bisect_right(first_need, steps)]:
                total += 1 + (steps - f) // bt
            return total

        if demand(k) > free:
            lo, hi = 0, k  # the largest number of steps whose blocks fit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if demand(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
            if k == 0:
                self._step()  # the next step preempts
                return
        kv0 = sum(r.computed for r in run) + n
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
        self.free_blocks -= demand(k)
        done = []
        for r in run:
            r.blocks = self._blocks_for(r.computed + k)
            r.computed += k
            r.target = r.computed + 1
            r.generated += k
            r.last_token_s = t
            if r.generated >= r.output:
                done.append(r)
        self.stats.itl.append((total / k, n * k))
        for r in done:
            run.remove(r)
            self._finish(r, t)

    def abort_all(self, t: float) -> int:
        """The drain budget ran out: what is still running ends with an error."""
        n = 0
        for r in [*self.running, *self.waiting]:
            self.free_blocks += r.blocks
            r.blocks = 0
            self.reserved_tokens -= r.prompt + r.output
            n += 1
        self.running.clear()
        self.waiting.clear()
        self.stats.aborted += n
        return n
