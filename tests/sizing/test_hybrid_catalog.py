"""Catalog entries of hybrid linear-attention models: their parameter counts against the published totals, and a
non-empty `kvfleet capacity` answer on an H100.

The configs are the models' config.json as vendored by ai-dynamo/aiconfigurator and a fork of it (each entry's
"source"). No verbatim config.json of Nemotron Nano 2 (NVIDIA-Nemotron-Nano-9B-v2) or Nemotron-H-8B with a citable
repository, path and commit was found; Nemotron-H-56B-Base-8K's was.
"""

from __future__ import annotations

import json

import pytest

from kvfleet.cli import main
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.models import AttentionKind, StateKind
from kvfleet.sizing.precision import Part

QWEN3_NEXT = "Qwen/Qwen3-Next-80B-A3B-Thinking"
QWEN3_5 = "Qwen/Qwen3.5-397B-A17B"
NEMOTRON_H = "nvidia/Nemotron-H-56B-Base-8K"


def test_qwen3_next_matches_its_model_card() -> None:
    # Model card (huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct and -Thinking, "Model Overview"): "Number of
    # Parameters: 80B in total and 3B activated", "Number of Parameters (Non-Embedding): 79B", 48 layers laid out
    # as 12 x (3 x (Gated DeltaNet -> MoE) -> (Gated Attention -> MoE)). The MTP layer is not in the count here.
    m = catalog_model(QWEN3_NEXT)
    assert m.total_params / 1e9 == pytest.approx(80, rel=0.01)
    embeddings = sum(g.count for g in m.param_groups if g.part in (Part.EMBEDDING, Part.LM_HEAD))
    assert round((m.total_params - embeddings) / 1e9) == 79
    kinds = [lay.attention for lay in m.layers]
    assert kinds[:4] == [AttentionKind.STATE] * 3 + [AttentionKind.FULL]
    assert (m.state_layers, m.attention_layers) == (36, 12)
    assert m.state is not None and m.state.kind is StateKind.GATED_DELTA_NET


def test_qwen3_5_matches_its_model_card() -> None:
    # Model card (huggingface.co/Qwen/Qwen3.5-397B-A17B): 397B total parameters, 17B activated; 60 layers,
    # 15 x (3 x Gated DeltaNet + 1 x full attention), every one with a MoE feed-forward.
    m = catalog_model(QWEN3_5)
    assert m.model_type == "qwen3_5_moe_text"
    assert m.total_params / 1e9 == pytest.approx(397, rel=0.01)
    assert (m.state_layers, m.attention_layers) == (45, 15)
    assert m.vision_params > 0  # the vision encoder is part of the published total


def test_nemotron_h_56b_matches_its_model_card() -> None:
    # Nemotron-H (arXiv 2504.03624; huggingface.co/nvidia/Nemotron-H-56B-Base-8K): a 56B hybrid of 118 blocks with
    # 10 attention blocks; NeMo Megatron-Bridge's Nemotron-H page: "56B: 118 layers, 8192 hidden size, 8K context".
    m = catalog_model(NEMOTRON_H)
    assert m.total_params / 1e9 == pytest.approx(56, rel=0.01)
    assert (m.num_layers, m.hidden_size, m.max_position_embeddings) == (118, 8192, 8192)
    assert (m.state_layers, m.attention_layers) == (54, 10)
    assert m.state is not None and m.state.kind is StateKind.MAMBA2


@pytest.mark.parametrize(
    ("model", "args"),
    [
        # 160 GB of bf16 weights: four H100s hold them with room for the cache.
        (QWEN3_NEXT, ("--tp", "4")),
        # 794 GB of bf16 weights: eight H100s with FP8 weights (vLLM --quantization fp8).
        (QWEN3_5, ("--tp", "8", "--quantization", "fp8")),
        # 113 GB of bf16 weights: two H100s, at the model's 8K context.
        (NEMOTRON_H, ("--tp", "2", "--max-model-len", "8192")),
    ],
    ids=["qwen3-next", "qwen3.5", "nemotron-h"],
)
def test_capacity_on_an_h100(capsys: pytest.CaptureFixture[str], model: str, args: tuple[str, ...]) -> None:
    if "--max-model-len" not in args:
        args = (*args, "--max-model-len", "32768")
    code = main(["capacity", "--model", model, "--gpu", "H100", *args, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    cap = json.loads(out)
    assert cap["problems"] == []
    assert cap["kv_cache_tokens"] > 0 and cap["max_concurrency"] >= 1
    assert cap["state_layers"]["kind"] in ("gated_delta_net", "mamba2")
