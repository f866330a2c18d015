"""vLLM: its adapter (adapter.py: flags, server command, the AWS image's variables, metrics), its scheduler as the
simulator runs it (scheduler.py) and its capacity rules (profiles.py, quantization.py)."""

from __future__ import annotations

from kvfleet.engines.vllm.adapter import Vllm

ADAPTER = Vllm()

__all__ = ["ADAPTER"]
