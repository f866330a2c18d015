"""Model specs: the built-in catalog, local config.json files and quantization_config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet.errors import ModelConfigError
from kvfleet.sizing.catalog import all_models, catalog_entries, catalog_model, resolve_model
from kvfleet.sizing.memory import weight_bytes
from kvfleet.sizing.models import AttentionKind, load_config_file, parse_hf_config
from kvfleet.sizing.units import GiB
from tests.sizing.conftest import llama_config

FIXTURES = Path(__file__).parent.parent / "fixtures" / "hf_configs"


def test_catalog_has_the_popular_families_with_sources() -> None:
    ids = {m.model_id for m in all_models()}
    assert len(ids) >= 25
    for needle in (
        "Llama-2-7b",
        "Meta-Llama-3-8B",
        "Llama-3.1-70B",
        "Llama-3.3-70B",
        "Mistral-7B",
        "Mixtral-8x7B",
        "Qwen2-7B",
        "Qwen2.5-72B",
        "Qwen3-8B",
        "Qwen3-30B-A3B",
        "gemma-2-9b",
        "gemma-3-12b",
        "Phi-3-mini",
        "phi-4",
        "DeepSeek-V2-Lite",
        "DeepSeek-V3",
        "DeepSeek-R1",
        "gpt-oss-120b",
        "Llama-4-Scout",
    ):
        assert any(needle in i for i in ids), needle
    for e in catalog_entries():
        assert e.source.strip(), e.model_id


@pytest.mark.parametrize(
    ("model_id", "billions"),
    [
        # Published parameter counts (model cards).
        ("meta-llama/Llama-3.1-8B", 8.03),
        ("meta-llama/Llama-3.1-70B", 70.6),
        ("meta-llama/Llama-3.1-405B", 405.9),
        ("mistralai/Mixtral-8x7B-v0.1", 46.7),
        ("Qwen/Qwen3-30B-A3B", 30.5),
        ("Qwen/Qwen3-235B-A22B", 235.1),
        ("deepseek-ai/DeepSeek-V3", 671.0),
        ("openai/gpt-oss-120b", 116.8),
        ("openai/gpt-oss-20b", 20.9),
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 109.0),
    ],
)
def test_parameter_counts_match_model_cards(model_id: str, billions: float) -> None:
    assert catalog_model(model_id).total_params / 1e9 == pytest.approx(billions, rel=0.015)


def test_active_parameters_of_moe() -> None:
    # OpenAI's model card counts active parameters without the input embedding, as kvfleet does:
    # gpt-oss-120b 5.1B, gpt-oss-20b 3.6B.
    assert catalog_model("openai/gpt-oss-120b").active_params / 1e9 == pytest.approx(5.1, rel=0.02)
    assert catalog_model("openai/gpt-oss-20b").active_params / 1e9 == pytest.approx(3.6, rel=0.02)
    # Other cards include it (a few hundred million more): Qwen3-30B-A3B "3.3B", DeepSeek-V3 "37B".
    assert catalog_model("Qwen/Qwen3-30B-A3B").active_params / 1e9 == pytest.approx(3.3, rel=0.10)
    assert catalog_model("deepseek-ai/DeepSeek-V3").active_params / 1e9 == pytest.approx(37, rel=0.05)


def test_layer_kinds() -> None:
    kinds = [lay.attention for lay in catalog_model("google/gemma-3-4b-it").layers]
    assert kinds.count(AttentionKind.FULL) == 34 // 6 and kinds[5] is AttentionKind.FULL
    oss = catalog_model("openai/gpt-oss-20b")
    assert [lay.window_tokens for lay in oss.layers[:2]] == [128, None]
    scout = catalog_model("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    assert sum(lay.attention is AttentionKind.CHUNKED for lay in scout.layers) == 36
    assert all(lay.attention is AttentionKind.MLA for lay in catalog_model("deepseek-ai/DeepSeek-R1").layers)
    dense = sum(not lay.moe for lay in catalog_model("deepseek-ai/DeepSeek-V3").layers)
    assert dense == 3  # first_k_dense_replace


def test_aliases_and_paths_resolve(tmp_path: Path) -> None:
    assert resolve_model("llama-3.1-8b").model_id == "meta-llama/Llama-3.1-8B"
    (tmp_path / "config.json").write_text(json.dumps(llama_config()))
    assert resolve_model(str(tmp_path)).num_layers == 32
    assert resolve_model(str(tmp_path / "config.json")).num_kv_heads == 8
    with pytest.raises(ModelConfigError, match="unknown model 'llama-9'"):
        resolve_model("llama-9")


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda c: c.pop("num_hidden_layers"), "num_hidden_layers"),
        (lambda c: c.update(num_key_value_heads=5), "num_key_value_heads"),
        (lambda c: c.update(hidden_size="big"), "hidden_size"),
        (lambda c: c.update(vocab_size=-1), "vocab_size"),
        (lambda c: c.update(model_type="bert"), "model_type"),
        (lambda c: c.update(quantization_config={"quant_method": "hqq"}), "quant_method"),
        (lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
    ],
)
def test_malformed_configs_name_the_field(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    cfg = llama_config()
    mutate(cfg)
    with pytest.raises(ModelConfigError, match=field):
        parse_hf_config(cfg, model_id="bad")


def test_invalid_json_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "llama",\n "num_hidden_layers": }')
    with pytest.raises(ModelConfigError, match=r"not valid JSON \(line 2"):
        load_config_file(p)


# --- real quantized checkpoints (tests/fixtures/hf_configs/SOURCES.md) -------------------------------


def test_awq_llama_70b() -> None:
    m = load_config_file(FIXTURES / "Meta-Llama-3.1-70B-Instruct-AWQ-INT4")
    assert m.quantization is not None and m.native_scheme.name == "awq" and m.native_scheme.group_size == 128
    w = weight_bytes(m, tp=1, scheme=m.native_scheme).weights_bytes_per_gpu / GiB
    # ~68.5B quantized linear weights x 0.52 B + 2 x 1.05B embedding rows x 2 B: about 37 GiB (the
    # checkpoint's safetensors total 39.8 GB).
    assert 35 < w < 39


def test_gptq_fp8_bnb_mxfp4_fixtures() -> None:
    gptq = load_config_file(FIXTURES / "Mistral-Small-Instruct-2409-xMADai-INT4")
    assert gptq.native_scheme.name == "gptq" and gptq.native_scheme.weight_bits == 4
    fp8 = load_config_file(FIXTURES / "Qwen3-30B-A3B-FP8")
    assert fp8.native_scheme.name == "fp8" and fp8.quantization is not None and "128x128" in fp8.quantization.detail
    bnb = load_config_file(FIXTURES / "Kocdigital-LLM-8b-v0.1-bnb-4bit")
    assert bnb.native_scheme.name == "bnb-4bit"
    assert bnb.native_scheme.bytes_per_param(next(iter(bnb.native_scheme.quantized_parts)), unquantized_bytes=2) < 0.52
    oss = load_config_file(FIXTURES / "gpt-oss-120b")
    assert oss.native_scheme.name == "mxfp4"
    ds = load_config_file(FIXTURES / "DeepSeek-V3")
    assert ds.mla is not None and ds.native_scheme.name == "fp8"


def test_compressed_tensors_groups() -> None:
    # The RedHatAI checkpoint's quantization_config (an unsupported deepseek_v4 architecture) on a Llama body.
    raw = json.loads((FIXTURES / "DeepSeek-V4-Flash-NVFP4-FP8" / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="model type 'deepseek_v4' is not supported"):
        parse_hf_config(raw, model_id="ds4")
    m = parse_hf_config(llama_config(quantization_config=raw["quantization_config"]), model_id="ct")
    assert m.quantization is not None and m.quantization.method == "compressed-tensors"
    w8 = {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}}
    assert parse_hf_config(llama_config(quantization_config=w8), model_id="w8").native_scheme.name == "int8"
    w4 = {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}},
    }
    assert parse_hf_config(llama_config(quantization_config=w4), model_id="w4").native_scheme.name == "w4a16"
