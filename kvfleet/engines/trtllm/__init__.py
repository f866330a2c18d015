"""TensorRT-LLM (trtllm-serve, PyTorch backend): its adapter (adapter.py: LLM-API options, server command, DJL's
variables, metrics), its scheduler as the simulator runs it (scheduler.py) and its capacity rules (profiles.py,
quantization.py)."""

from __future__ import annotations

from kvfleet.engines.trtllm.adapter import TensorRtLlm

ADAPTER = TensorRtLlm()

__all__ = ["ADAPTER"]
