from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvfleet.sizing.models import ModelSpec, parse_hf_config

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str) -> ModuleType:
    """A script of tools/ as a module: they run as files, not as part of the package."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the tool look their module up by name
    spec.loader.exec_module(module)
    return module


def llama_config(**overrides: Any) -> dict[str, Any]:
    """The brief's example architecture: 32 layers, 8 KV heads, head dim 128 (Llama-3.1-8B shape)."""
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    return cfg


def make_model(**overrides: Any) -> ModelSpec:
    return parse_hf_config(llama_config(**overrides), model_id="test/llama")


@pytest.fixture
def example_model() -> ModelSpec:
    return make_model()
