"""Each engine's scheduler against its engine's own rules (the sources are in each scheduler's docstring), on a
bare engine state: no simulator, no step model."""

from __future__ import annotations

from collections import deque

from kvfleet.engines import adapter
from kvfleet.engines.base import EngineArgs
from kvfleet.engines.scheduling import EngineLimits, Request, blocks_for
from kvfleet.engines.trtllm.scheduler import CapacityPolicy, TrtllmScheduler
from kvfleet.engines.vllm.scheduler import VllmScheduler


class Engine:
    """The state a scheduler works on (kvfleet.engines.scheduling.EngineState), with nothing cached."""

    def __init__(self, limits: EngineLimits, running: list[Request], waiting: list[Request]) -> None:
        self.limits = limits
        self.running = running
        self.waiting = deque(waiting)
        self.free_blocks = limits.kv_blocks - sum(r.blocks for r in running)
        self.preempted: list[int] = []

    def preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.free_blocks += victim.blocks
        victim.blocks = 0
        victim.computed = 0
        victim.target = victim.prompt + victim.generated
        victim.admitted = False
        self.preempted.append(victim.rid)
        self.waiting.appendleft(victim)

    def start(self, req: Request) -> int:
        return req.computed

    def admitted(self, req: Request, start: int) -> None:
        req.computed = start
        req.admitted = True


def req(
    rid: int, prompt: int, *, out: int = 0, computed: int | None = None, max_out: int = 100, bt: int = 16
) -> Request:
    """A request that has generated ``out`` tokens (decoding: its KV is all in but the last token's), or a prompt
    with ``computed`` of its tokens in the cache; running when it has any."""
    r = Request(rid, 0.0, prompt, max_out)
    r.generated = out
    r.computed = prompt + out - 1 if out and computed is None else (computed or 0)
    r.target = prompt + out if out else prompt
    r.admitted = bool(r.computed)
    r.blocks = blocks_for(r.computed, bt)
    return r


def tokens(items: list[tuple[Request, int]]) -> dict[int, int]:
    return {r.rid: n for r, n in items}


def lim(seqs: int, batched: int, blocks: int, bt: int = 16) -> EngineLimits:
    return EngineLimits(max_num_seqs=seqs, max_num_batched_tokens=batched, kv_blocks=blocks, block_tokens=bt)


def test_each_adapter_gives_its_engines_scheduler() -> None:
    assert isinstance(adapter("vllm").scheduler(EngineArgs()), VllmScheduler)
    trt = adapter("trtllm").scheduler(EngineArgs())
    assert isinstance(trt, TrtllmScheduler)
    # trtllm-serve's defaults (llm_args.py): GUARANTEED_NO_EVICT, chunked prefill off.
    assert trt.policy is CapacityPolicy.GUARANTEED_NO_EVICT and not trt.enable_chunked_context


# ---- vLLM ------------------------------------------------------------------------------------------


def test_vllm_decodes_first_then_chunks_fill_the_budget() -> None:
    eng = Engine(lim(8, 512, 10_000), [req(0, 100, out=5), req(1, 100, out=3)], [req(2, 1000), req(3, 50)])
    out = VllmScheduler().schedule(eng)
    assert tokens(out.items) == {0: 1, 1: 1, 2: 510}  # 2 is chunked to the 510 left; 3 gets nothing
    assert [r.rid for r in eng.running] == [0, 1, 2] and [r.rid for r in eng.waiting] == [3]


def test_vllm_continues_a_chunked_prompt_and_respects_max_num_seqs() -> None:
    eng = Engine(lim(2, 512, 10_000), [req(0, 100, out=5), req(2, 1000, computed=510)], [req(3, 10)])
    out = VllmScheduler().schedule(eng)
    assert tokens(out.items) == {0: 1, 2: 490}  # 3 waits: running is at max_num_seqs


def test_vllm_preempts_the_last_running_request_by_recompute() -> None:
    # 0 and 1 each hold 2 blocks (32 tokens computed) and need a third for their next token; 5 blocks in all.
    a, b = req(0, 30, out=3), req(1, 30, out=3)
    eng = Engine(lim(8, 512, 5), [a, b], [req(2, 16)])
    out = VllmScheduler().schedule(eng)
    assert out.preempted and eng.preempted == [1]
    assert tokens(out.items) == {0: 1}
    assert [r.rid for r in eng.waiting] == [1, 2]  # back at the head, nothing admitted after a preemption
    assert b.computed == 0 and b.target == 33  # recomputes its prompt and its 3 tokens


def test_vllm_admission_stops_when_blocks_run_out() -> None:
    eng = Engine(lim(8, 8192, 5), [], [req(0, 64), req(1, 64)])
    out = VllmScheduler().schedule(eng)
    assert tokens(out.items) == {0: 64} and [r.rid for r in eng.waiting] == [1]


def test_vllm_long_prefill_threshold_caps_a_chunk() -> None:
    eng = Engine(lim(8, 8192, 10_000), [], [req(0, 5000)])
    out = VllmScheduler(long_prefill_token_threshold=1024).schedule(eng)
    assert tokens(out.items) == {0: 1024}


def test_vllm_is_steady_only_when_the_queue_cannot_enter() -> None:
    s = VllmScheduler()
    running = [req(i, 100, out=2) for i in range(2)]
    assert s.steady(Engine(lim(8, 512, 10_000), running, []))
    assert not s.steady(Engine(lim(8, 512, 10_000), running, [req(9, 10)]))  # a slot and budget are free
    assert s.steady(Engine(lim(2, 512, 10_000), running, [req(9, 10)]))  # every slot taken


# ---- TensorRT-LLM ----------------------------------------------------------------------------------


def test_trtllm_guaranteed_no_evict_reserves_whole_requests() -> None:
    a = req(0, 64, out=1, max_out=64, bt=32)  # reserves (64 + 64) / 32 = 4 blocks
    eng = Engine(lim(2048, 8192, 9, bt=32), [a], [req(1, 64, max_out=64, bt=32), req(2, 32, max_out=32, bt=32)])
    out = TrtllmScheduler().schedule(eng)
    assert tokens(out.items) == {0: 1, 1: 64}  # 2 needs 2 more blocks; only 1 is unreserved
    assert not out.preempted and [r.rid for r in eng.waiting] == [2]
    # The head of the queue cannot start before a request finishes: a run of decodes changes nothing.
    assert TrtllmScheduler().steady(eng)
    assert not TrtllmScheduler().steady(Engine(lim(2048, 8192, 100, bt=32), [a], [req(2, 32, max_out=32, bt=32)]))


def test_trtllm_max_utilization_pauses_the_latest_started() -> None:
    a, b = req(0, 64, out=1, max_out=64, bt=32), req(1, 64, out=1, max_out=64, bt=32)
    a.computed = b.computed = 64  # each holds 2 blocks and needs a third
    eng = Engine(lim(2048, 8192, 5, bt=32), [a, b], [])
    out = TrtllmScheduler(policy=CapacityPolicy.MAX_UTILIZATION).schedule(eng)
    assert eng.preempted == [1] and tokens(out.items) == {0: 1}


def test_trtllm_chunked_context_takes_what_decodes_leave_in_block_multiples() -> None:
    def engine() -> Engine:
        return Engine(lim(2048, 1000, 100_000, bt=32), [req(0, 64, out=2, bt=32)], [req(1, 5000, bt=32)])

    out = TrtllmScheduler(enable_chunked_context=True).schedule(engine())
    assert tokens(out.items) == {0: 1, 1: 992}  # 999 left, rounded down to 31 blocks of 32
    unchunked = TrtllmScheduler(enable_chunked_context=False).schedule(engine())
    assert tokens(unchunked.items) == {0: 1}  # a whole 5000-token context does not fit: the batch stops
