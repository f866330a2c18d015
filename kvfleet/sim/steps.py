"""The sizing core's batch step-time model (kvfleet.sizing.step) as the simulator's StepModel."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvfleet.sizing.models import ModelSpec
from kvfleet.sizing.planner import Candidate
from kvfleet.sizing.step import PrefillChunk, Replica, StepBatch, StepConstants, replica, step_time


class RooflineSteps:
    """Step times of one engine on its hardware, priced by ``kvfleet.sizing.step.step_time``."""

    @classmethod
    def for_candidate(cls, c: Candidate, model: ModelSpec) -> RooflineSteps:
        """The step times of a plan's candidate: its accelerator, tensor parallelism and precisions."""
        rep = replica(
            model=model,
            accelerator=c.instance.accelerator,
            tp=c.tensor_parallel_size,
            nvlink=c.instance.nvlink,
            scheme=c.weight_scheme,
            kv_dtype=c.kv_cache_dtype,
            dp=c.data_parallel_size,
        )
        # A candidate priced with a calibration steps at the measured speed here too.
        return cls(replace(rep, time_scale=c.measured.step_time_scale) if c.measured else rep)

    def __init__(self, replica: Replica, constants: StepConstants | None = None) -> None:
        self.replica = replica
        self.constants = constants
        self._decode: dict[tuple[int, int], float] = {}

    def step_s(self, *, prefill: Sequence[tuple[int, int]], decode_seqs: int, decode_kv_tokens: int) -> float:
        if self.replica.dp > 1:
            # A data-parallel replica's engine cores step together (their MoE layers exchange tokens every step), each
            # with its share of the batch the server balanced to it: the step lasts as long as the fullest core's.
            prefill = _fullest_share(prefill, self.replica.dp)
            decode_seqs = -(-decode_seqs // self.replica.dp)
            decode_kv_tokens = -(-decode_kv_tokens // self.replica.dp)
        if not prefill:
            # Pure-decode steps repeat with the same batch: priced once per 64 KV tokens read, at the middle of
            # the 64 (one step adds one token per sequence, and a step time moves by well under 1% across 64 tokens
            # of context). Priced at a fixed point, not at the first value seen, so a replay's result never
            # depends on what was replayed before it with the same model.
            key = (decode_seqs, decode_kv_tokens >> 6)
            hit = self._decode.get(key)
            if hit is not None:
                return hit
            decode_kv_tokens = (key[1] << 6) + 32
        batch = StepBatch(
            prefill=tuple(PrefillChunk(tokens=n, start=s) for n, s in prefill),
            decode_seqs=decode_seqs,
            decode_kv_tokens=decode_kv_tokens,
        )
        value = step_time(self.replica, batch, self.constants).step_s
        if not prefill:
            self._decode[(decode_seqs, decode_kv_tokens >> 6)] = value
        return value


def _fullest_share(prefill: Sequence[tuple[int, int]], cores: int) -> list[tuple[int, int]]:
    """The prompt chunks of the core given the most tokens when the chunks are dealt out largest first to the core
    with the fewest so far (the server sends each request to one core, and each core schedules its own)."""
    shares: list[list[tuple[int, int]]] = [[] for _ in range(cores)]
    loads = [0] * cores
    for chunk in sorted(prefill, key=lambda x: -x[0]):
        i = loads.index(min(loads))
        shares[i].append(chunk)
        loads[i] += chunk[0]
    return shares[loads.index(max(loads))]
