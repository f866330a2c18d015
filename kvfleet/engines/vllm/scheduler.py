"""vLLM V1's scheduler as the simulator runs it.

The rules of ``Scheduler.schedule`` in vllm/v1/core/sched/scheduler.py (vllm-project/vllm, read at commit 00024d31;
the V1 engine's rules since v0.8, unchanged in what is modelled here through 0.34):

* There is no prefill or decode phase: each request has tokens computed and tokens to compute, and a step gives
  each what it can under one token budget, ``max_num_batched_tokens`` (chunked prefill is always on in V1).
* RUNNING requests first, in admission order: each gets ``min(num_tokens - computed,
  long_prefill_token_threshold, budget)`` tokens (a decode gets 1, a partly prefilled prompt its next chunk), so
  sequences admitted earlier are served before later prompts' chunks.
* When a running request's new blocks do not fit, the LAST running request is preempted (FCFS:
  ``self.running.pop()``), its blocks freed and its tokens recomputed from the start when it is scheduled again
  (it goes back to the head of WAITING); if it was the request itself, nothing more is scheduled this step.
* WAITING requests only when nothing was preempted this step, while ``len(running) < max_num_seqs`` and budget
  remains, in arrival order; a prompt takes a chunk of what budget is left, starting after its prefix-cache hits;
  the first that cannot get its blocks stops admission.

Not modelled: async scheduling's one-step lookahead (it hides the scheduler's CPU time, which the step model's
per-step overhead carries), the priority policy, encoder budgets, and KV connectors.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.engines.scheduling import EngineState, Scheduled, blocks_for


@dataclass(frozen=True, kw_only=True)
class VllmScheduler:
    long_prefill_token_threshold: int = 0  # 0: off (vLLM's default)

    def _chunk(self, want: int, budget: int) -> int:
        if 0 < self.long_prefill_token_threshold < want:
            want = self.long_prefill_token_threshold
        return min(want, budget)

    def schedule(self, eng: EngineState) -> Scheduled:
        lim = eng.limits
        bt = lim.block_tokens
        budget = lim.max_num_batched_tokens
        cap = self.long_prefill_token_threshold
        items = []
        running = eng.running
        preempted = False
        i = 0
        # The hot loop of every replay: blocks counted inline (-(-x // bt) is ceil(x / bt)).
        while i < len(running) and budget > 0:
            r = running[i]
            n = r.target - r.computed
            if 0 < cap < n:
                n = cap
            n = min(n, budget)
            need = -(-(r.computed + n) // bt) - r.blocks
            while need > eng.free_blocks:
                preempted = True
                victim = running[-1]
                eng.preempt(victim)
                if victim is r:
                    break
            if i >= len(running):
                break  # r itself was preempted: nothing after it was left running either
            r.blocks += need
            eng.free_blocks -= need
            items.append((r, n))
            budget -= n
            i += 1
        # vLLM admits no waiting request in a step that had to preempt (the cache is what is short).
        waiting = eng.waiting
        while not preempted and waiting and budget > 0 and len(running) < lim.max_num_seqs:
            r = waiting[0]
            start = eng.start(r)
            n = self._chunk(r.target - start, budget)
            need = blocks_for(start + n, bt)
            if need > eng.free_blocks:
                break
            waiting.popleft()
            eng.admitted(r, start)
            r.blocks = need
            eng.free_blocks -= need
            running.append(r)
            items.append((r, n))
            budget -= n
        return Scheduled(items=items, preempted=preempted)

    def steady(self, eng: EngineState) -> bool:
        # Waiting requests change the batch only where a slot and budget are free for them.
        lim = eng.limits
        return not eng.waiting or len(eng.running) >= lim.max_num_seqs or len(eng.running) >= lim.max_num_batched_tokens
