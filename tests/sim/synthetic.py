"""A step model and an evenly spaced trace the simulator's tests share."""

from __future__ import annotations

from array import array

from kvfleet.sim.replica import LinearStepModel
from kvfleet.workload.traces import Trace

MODEL = LinearStepModel(fixed_s=0.01, per_prefill_token_s=5e-5, per_decode_seq_s=1e-4, per_kv_token_s=1e-8)


def steady(rate_per_s: float, seconds: float, *, prompt: int = 500, output: int = 200) -> Trace:
    n = int(rate_per_s * seconds)
    return Trace(
        source="steady",
        fmt="azure",
        arrival_s=array("d", [i / rate_per_s for i in range(n)]),
        input_tokens=array("q", [prompt] * n),
        output_tokens=array("q", [output] * n),
    )
