"""Benchmark shapes as workloads: what people run against an endpoint, in the words `kvfleet bench` uses.

* A closed loop (``--concurrency N --requests M``): N clients all start at t = 0 and each sends its next request
  the moment its last one ends, until M have been sent. This is ``vllm bench serve --max-concurrency N`` at an
  infinite request rate (vllm/benchmarks/serve.py: every request is issued at once behind a semaphore of N),
  AIPerf's and GuideLLM's concurrency modes, and `kvfleet bench --concurrency`.
* Poisson arrivals (``--rate R --requests M``): exponential gaps of mean 1/R, independent of completions
  (``vllm bench serve --request-rate R``, burstiness 1).
* A trace: real arrival times and lengths (kvfleet.workload.traces).

Lengths follow vLLM's random dataset (vllm/benchmarks/datasets.py, RandomDataset): each request's input and output
lengths are drawn uniformly from ``[L (1 - r), L (1 + r)]`` with the range ratio r (0: every request the same).
Draws are seeded, so a prediction repeats.
"""

from __future__ import annotations

import math
import random
from array import array
from dataclasses import dataclass

from kvfleet.errors import KvfleetError
from kvfleet.workload.traces import Trace

# Past this the answer would take longer to compute than the benchmark it predicts; `kvfleet bench` sends fewer.
MAX_REQUESTS = 1_000_000


@dataclass(frozen=True, kw_only=True)
class Lengths:
    input_tokens: int
    output_tokens: int
    range_ratio: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("input_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise KvfleetError(f"must be at least 1, got {getattr(self, name)}", field=name.replace("_", "-"))
        if not 0.0 <= self.range_ratio < 1.0:
            raise KvfleetError(f"must be in [0, 1), got {self.range_ratio}", field="range-ratio")

    @property
    def max_input_tokens(self) -> int:
        return int(self.input_tokens * (1 + self.range_ratio))

    @property
    def max_output_tokens(self) -> int:
        return int(self.output_tokens * (1 + self.range_ratio))

    def draw(self, n: int) -> list[tuple[int, int]]:
        """``n`` (input, output) pairs, as the random dataset draws them."""
        r = self.range_ratio
        if r == 0:
            return [(self.input_tokens, self.output_tokens)] * n
        rng = random.Random(self.seed)

        def one(length: int) -> int:
            return max(1, rng.randint(int(length * (1 - r)), int(length * (1 + r))))

        return [(one(self.input_tokens), one(self.output_tokens)) for _ in range(n)]


def _requests(n: int) -> int:
    if not 1 <= n <= MAX_REQUESTS:
        raise KvfleetError(f"must be between 1 and {MAX_REQUESTS:,}, got {n}", field="requests")
    return n


@dataclass(frozen=True, kw_only=True)
class ClosedLoop:
    concurrency: int
    requests: int
    lengths: Lengths

    def __post_init__(self) -> None:
        _requests(self.requests)
        if self.concurrency < 1:
            raise KvfleetError(f"must be at least 1, got {self.concurrency}", field="concurrency")

    def describe(self) -> str:
        clients = f"{self.concurrency} client{'' if self.concurrency == 1 else 's'}"
        return f"closed loop: {clients}, {self.requests:,} requests, {_lengths(self.lengths)}"


@dataclass(frozen=True, kw_only=True)
class PoissonLoad:
    rate_per_s: float
    requests: int
    lengths: Lengths

    def __post_init__(self) -> None:
        _requests(self.requests)
        if not (math.isfinite(self.rate_per_s) and self.rate_per_s > 0):
            raise KvfleetError(f"must be a positive number, got {self.rate_per_s}", field="rate")

    def describe(self) -> str:
        return (
            f"Poisson arrivals at {self.rate_per_s:g} requests/s, {self.requests:,} requests, {_lengths(self.lengths)}"
        )

    def trace(self) -> Trace:
        rng = random.Random(self.lengths.seed + 1)  # its own stream: the same lengths as a closed loop's
        t = 0.0
        arrivals = array("d")
        for _ in range(self.requests):
            arrivals.append(t)
            t += rng.expovariate(self.rate_per_s)
        pairs = self.lengths.draw(self.requests)
        return Trace(
            source=self.describe(),
            fmt="poisson",
            arrival_s=arrivals,
            input_tokens=array("q", (i for i, _ in pairs)),
            output_tokens=array("q", (o for _, o in pairs)),
        )


def _lengths(ln: Lengths) -> str:
    spread = f" (+/-{ln.range_ratio:.0%})" if ln.range_ratio else ""
    return f"{ln.input_tokens:,} tokens in, {ln.output_tokens:,} out{spread}"
