"""Engine adapters: one module per serving engine, and the registry every layer reads engine names from.

A new engine is one module here (an ``EngineAdapter``) and one line in ``ENGINES``; its memory semantics go
into ``kvfleet.sizing.engines`` so the planner can size it. Standard library only (the image carries it).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvfleet.engines.base import KV_CACHE_DTYPES, EngineAdapter, EngineArgs
from kvfleet.engines.trtllm import TensorRtLlm
from kvfleet.engines.vllm import Vllm

ENGINES: Mapping[str, EngineAdapter] = {a.name: a for a in (Vllm(), TensorRtLlm())}


def adapter(name: str) -> EngineAdapter:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None


__all__ = ["ENGINES", "KV_CACHE_DTYPES", "EngineAdapter", "EngineArgs", "adapter"]
