"""TensorRT-LLM's in-flight batching as the simulator runs it: a capacity scheduler, then a micro-batch scheduler.

The rules of cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp and microBatchScheduler.cpp (NVIDIA/TensorRT-LLM,
read at commits 02a10fed and 0a949d31; the PyTorch backend of 1.0 binds the same C++ schedulers in
tensorrt_llm/_torch/pyexecutor/scheduler.py). Its defaults there: ``capacity_scheduler_policy``
GUARANTEED_NO_EVICT and ``enable_chunked_prefill`` False (tensorrt_llm/llmapi/llm_args.py, SchedulerConfig and
TorchLlmArgs), which are what a plan starts it with.

Capacity, over the active requests in order (started ones first), at most ``max_batch_size``:

* GUARANTEED_NO_EVICT: started requests always run and hold the blocks to finish (prompt + max output tokens); a
  new one starts only if the blocks nobody holds cover its whole need, and the first that does not fit stops
  admission. Nothing is ever evicted.
* MAX_UTILIZATION: a request runs if the blocks for its next step fit; if not, the most recently started request
  is paused (its blocks freed, recomputed later) and the request tried again.

Micro-batch, over the requests that fit: a generation request takes 1 token while the step has room under
``max_num_tokens``; a context request without chunking goes whole or ends the batch; with chunking, context
requests share what the generation tokens leave, a cut chunk rounded down to whole blocks (the chunk unit is
tokens_per_block).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvfleet.engines.scheduling import EngineState, Request, Scheduled, blocks_for


class CapacityPolicy(StrEnum):
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    MAX_UTILIZATION = "MAX_UTILIZATION"


@dataclass(frozen=True, kw_only=True)
class TrtllmScheduler:
    policy: CapacityPolicy = CapacityPolicy.GUARANTEED_NO_EVICT
    enable_chunked_context: bool = False

    def _reserved(self, eng: EngineState) -> int:
        bt = eng.limits.block_tokens
        return sum(blocks_for(r.prompt + r.output, bt) for r in eng.running)

    def _no_evict(self, eng: EngineState) -> list[Request]:
        """The running batch, then the waiting requests whose whole need the unreserved blocks cover."""
        lim = eng.limits
        fitting = eng.running[: lim.max_num_seqs]
        avail = lim.kv_blocks - self._reserved(eng)
        for r in eng.waiting:
            if len(fitting) >= lim.max_num_seqs:
                break
            need = blocks_for(r.prompt + r.output, lim.block_tokens)
            if need > avail:
                break
            avail -= need
            fitting.append(r)
        return fitting

    def _max_utilization(self, eng: EngineState) -> tuple[list[Request], bool]:
        """Requests whose next step's blocks fit, pausing the most recently started where they do not."""
        lim = eng.limits
        bt = lim.block_tokens
        fitting: list[Request] = []
        free = eng.free_blocks
        paused = False
        candidates = [*eng.running, *eng.waiting]
        i = 0
        while i < len(candidates) and len(fitting) < lim.max_num_seqs:
            r = candidates[i]
            start = r.computed if r.admitted else eng.start(r)
            step_need = blocks_for(start + max(1, r.target - start), bt) - r.blocks
            if step_need <= free:
                free -= step_need
                fitting.append(r)
                i += 1
                continue
            started = [x for x in candidates[i:] if x.admitted]
            if not started:
                break
            victim = started[-1]
            free += victim.blocks
            eng.preempt(victim)
            candidates.remove(victim)
            paused = True
        return fitting, paused

    def schedule(self, eng: EngineState) -> Scheduled:
        lim = eng.limits
        if self.policy is CapacityPolicy.GUARANTEED_NO_EVICT:
            fitting, paused = self._no_evict(eng), False
        else:
            fitting, paused = self._max_utilization(eng)
        tokens: list[tuple[Request, int]] = []
        used = 0
        contexts: list[Request] = []
        for r in fitting:
            start = r.computed if r.admitted else eng.start(r)
            remaining = r.target - start
            if r.generated == 0 or remaining > 1:  # a context request (a prompt, or a paused one recomputing)
                if self.enable_chunked_context:
                    contexts.append(r)
                    continue
                if used + remaining > lim.max_num_batched_tokens:
                    break
                tokens.append((r, remaining))
                used += remaining
            else:
                if used + 1 > lim.max_num_batched_tokens:
                    break
                tokens.append((r, 1))
                used += 1
        room = lim.max_num_batched_tokens - used
        for r in contexts:
            start = r.computed if r.admitted else eng.start(r)
            remaining = r.target - start
            chunk = min(remaining, room)
            if chunk != remaining:
                chunk = chunk // lim.block_tokens * lim.block_tokens
            if chunk > 0:
                tokens.append((r, chunk))
                room -= chunk
        return Scheduled(items=self._start(eng, tokens), preempted=paused)

    def _start(self, eng: EngineState, tokens: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Admit the scheduled waiting requests (in queue order) and allocate every scheduled request's blocks."""
        bt = eng.limits.block_tokens
        for r, _ in tokens:
            if not r.admitted:
                eng.waiting.remove(r)
                eng.admitted(r, eng.start(r))
                eng.running.append(r)
        for r, n in tokens:
            need = blocks_for(r.computed + n, bt) - r.blocks
            r.blocks += need
            eng.free_blocks -= need
        return tokens

    def steady(self, eng: EngineState) -> bool:
        lim = eng.limits
        if not eng.waiting or len(eng.running) >= lim.max_num_seqs:
            return True
        if self.policy is CapacityPolicy.MAX_UTILIZATION:
            return False
        # Under GUARANTEED_NO_EVICT the head of the queue waits for blocks that only a finishing request releases.
        head = eng.waiting[0]
        return blocks_for(head.prompt + head.output, lim.block_tokens) > lim.kv_blocks - self._reserved(eng)
