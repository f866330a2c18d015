"""The longest context an engine release accepts, from a config's length and its RoPE scaling.

The expected numbers are what vLLM's ``_get_and_verify_max_len`` (vllm/config/model.py) computes: at 0.32.0,
lines 2581-2616 (types whose factor lengthens the context; "gemma3" skipped), 2627-2635 (LongRoPE's default)
and 2639-2666 (the refusal); before PR 56446 (the release rows in kvfleet.sizing.engines), YaRN's limit was
``rope_scaling["original_max_position_embeddings"] * factor``. TensorRT-LLM: tensorrt_llm/_torch/models/
modeling_utils.py ``infer_max_seq_len``.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.errors import ModelConfigError, SizingError
from kvfleet.sizing.capacity import EngineSettings, capacity
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.engines import EngineName, batch_defaults, rope_rules
from kvfleet.sizing.models import RopeScaling, context_limit, rope_scaling_from, with_rope_scaling
from kvfleet.sizing.units import GiB
from tests.sizing.conftest import make_model

# Qwen2.5's model cards: "add the following to config.json to enable YaRN" (32,768 -> 128K).
QWEN_YARN = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}


def limit(model: Any, version: str = "0.32.0", engine: EngineName = EngineName.VLLM) -> tuple[int, int]:
    lim = context_limit(model, rope_rules(engine, version))
    return lim.max_len_tokens, lim.default_len_tokens


@pytest.mark.parametrize("version", ["0.11.0", "0.32.0"])
def test_scalings_that_leave_the_length(version: str) -> None:
    # llama3 is in vLLM's list of types whose factor never lengthens the context, in every release.
    assert limit(catalog_model("meta-llama/Llama-3.1-8B"), version) == (131072, 131072)
    # Gemma 3: rope_scaling linear x8, but max_position_embeddings (131,072) is already the scaled length.
    assert limit(catalog_model("google/gemma-3-4b-it"), version) == (131072, 131072)
    # TensorRT-LLM has no Gemma 3 exception: infer_max_seq_len multiplies linear scaling's factor in.
    assert limit(catalog_model("google/gemma-3-4b-it"), "1.0.0", EngineName.TRTLLM) == (131072 * 8,) * 2
    # DeepSeek-V3 and gpt-oss ship a consistent YaRN: original x factor equals max_position_embeddings.
    assert limit(catalog_model("deepseek-ai/DeepSeek-V3"), version) == (4096 * 40, 4096 * 40)
    assert limit(catalog_model("openai/gpt-oss-20b"), version) == (4096 * 32, 4096 * 32)


@pytest.mark.parametrize(("kind", "factor"), [("linear", 4.0), ("dynamic", 2.0)])
def test_linear_and_dynamic_multiply_max_position_embeddings(kind: str, factor: float) -> None:
    m = make_model(max_position_embeddings=4096, rope_scaling={"type": kind, "factor": factor})
    for version in ("0.8.0", "0.11.0", "0.32.0"):
        assert limit(m, version) == (int(4096 * factor),) * 2
    assert limit(m, "1.0.0", EngineName.TRTLLM) == (int(4096 * factor),) * 2
    assert context_limit(m, rope_rules(EngineName.VLLM)).source == (
        f"max_position_embeddings 4,096 x rope_scaling.factor {factor:g} ({kind})"
    )


def test_yarn_added_to_config_json_stopped_lengthening_the_context() -> None:
    # Qwen2.5-7B-Instruct's config.json (max_position_embeddings 32,768) edited as its card says. Before PR 56446
    # vLLM derived original x factor = 131,072; from 0.30.0 on (first in that release's vllm/config/model.py),
    # max_position_embeddings is taken as already scaled, as transformers does, so 32,768 (the PR's TeleChat3 row:
    # 131,072 -> 32,768 the same way).
    m = make_model(max_position_embeddings=32768, rope_scaling=QWEN_YARN)
    assert limit(m, "0.11.0") == (131072, 131072)
    assert limit(m, "0.29.0") == (131072, 131072)
    assert limit(m, "0.30.0") == (32768, 32768)
    assert limit(m, "0.32.0") == (32768, 32768)
    assert limit(m, "1.0.0", EngineName.TRTLLM) == (32768, 32768)  # yarn never lengthened it there


def test_longrope_starts_at_the_original_length_when_none_is_given() -> None:
    # Phi-3-*-128k: max_position_embeddings 131,072, original_max_position_embeddings 4,096 beside rope_scaling,
    # whose legacy type "su" is LongRoPE. PR 27431: with no --max-model-len, vLLM starts at 4,096 (short factors).
    m = make_model(
        model_type="phi3",
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling={"type": "su", "long_factor": [1.0], "short_factor": [1.0]},
    )
    assert m.rope_scaling is not None and m.rope_scaling.rope_type == "longrope"
    assert limit(m, "0.11.0") == (131072, 131072)
    assert limit(m, "0.32.0") == (131072, 4096)
    s = EngineSettings(version="0.32.0")
    assert capacity(m, gpu_memory_bytes=80 * GiB, settings=s, accelerator_name="H100").max_model_len == 4096
    longer = EngineSettings(version="0.32.0", max_model_len=131072)
    assert capacity(m, gpu_memory_bytes=80 * GiB, settings=longer, accelerator_name="H100").max_model_len == 131072


def test_phi_3_5_mini_ships_longrope() -> None:
    # The catalog's Phi-3.5-mini-instruct config.json: 131,072 positions, LongRoPE over 4,096.
    m = catalog_model("microsoft/Phi-3.5-mini-instruct")
    assert limit(m, "0.32.0") == (131072, 4096)
    cap = capacity(m, gpu_memory_bytes=int(22.35 * GiB), settings=EngineSettings(), accelerator_name="A10G")
    assert (cap.max_model_len, cap.max_model_len_limit) == (4096, 131072)
    assert "longrope" in cap.max_model_len_source


def test_rope_parameters_and_nested_layer_types_are_read() -> None:
    # transformers 5 writes rope_parameters, nested per layer type for models that mix them.
    flat = make_model(max_position_embeddings=4096, rope_parameters={"rope_type": "linear", "factor": 2.0})
    assert limit(flat) == (8192, 8192)
    nested = make_model(
        max_position_embeddings=4096,
        rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0}, "sliding_attention": {}},
    )
    assert limit(nested) == (8192, 8192)


def test_refusal_names_the_limit_its_source_and_the_overrides() -> None:
    m = catalog_model("Qwen/Qwen2.5-72B-Instruct")
    s = EngineSettings(max_model_len=131072, tensor_parallel_size=4)
    with pytest.raises(SizingError) as info:
        capacity(m, gpu_memory_bytes=80 * GiB, settings=s, accelerator_name="H100")
    assert info.value.field == "max_model_len"
    text = info.value.message
    assert "131,072 exceeds vLLM's limit for Qwen/Qwen2.5-72B-Instruct, 32,768 (max_position_embeddings 32,768)" in text
    assert "--rope-scaling" in text and "model.rope_scaling" in text and "--hf-overrides" in text
    # vLLM's own escape hatch and its risk (vllm/config/model.py: "positions exceeding ... lead to nan").
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in text and "NaN" in text
    trt = EngineSettings(engine=EngineName.TRTLLM, max_model_len=131072, tensor_parallel_size=4)
    with pytest.raises(SizingError, match="TensorRT-LLM's limit") as trt_info:
        capacity(m, gpu_memory_bytes=80 * GiB, settings=trt, accelerator_name="H100")
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" not in trt_info.value.message


@pytest.mark.parametrize("version", ["0.11.0", "0.32.0"])
def test_a_yarn_override_extends_the_context_in_every_release(version: str) -> None:
    m = with_rope_scaling(catalog_model("Qwen/Qwen2.5-72B-Instruct"), RopeScaling(rope_type="yarn", factor=4.0))
    assert limit(m, version) == (131072, 131072)
    s = EngineSettings(version=version, max_model_len=131072, tensor_parallel_size=4)
    cap = capacity(m, gpu_memory_bytes=80 * GiB, settings=s, accelerator_name="H100")
    assert cap.max_model_len == cap.max_model_len_limit == 131072
    assert cap.hf_overrides is not None and '"max_position_embeddings": 131072' in cap.hf_overrides
    trt = EngineSettings(engine=EngineName.TRTLLM, max_model_len=131072, tensor_parallel_size=4)
    with pytest.raises(SizingError, match="TensorRT-LLM takes no config override") as info:
        capacity(m, gpu_memory_bytes=80 * GiB, settings=trt, accelerator_name="H100")
    assert info.value.field == "rope_scaling"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"factor": 4}, "rope_type"),
        ({"rope_type": "yarn", "factor": -1}, "factor"),
        ({"type": "yarn", "factor": True}, "factor"),
    ],
)
def test_bad_rope_scaling_names_the_field(raw: dict[str, Any], needle: str) -> None:
    with pytest.raises(ModelConfigError, match=needle) as info:
        rope_scaling_from(raw, field="rope_scaling")
    assert (info.value.field or "").startswith("rope_scaling")


# vllm/engine/arg_utils.py get_batch_defaults (lines 2923-2952 at 0.32.0), UsageContext.OPENAI_API_SERVER:
# >= 160 GiB -> 16,384 tokens / 1,024 sequences; >= 70 GiB and no "a100" in the device name -> 8,192 / 1,024;
# else 2,048 / 256. Memory is CUDA's total (an 80 GB part reports 79.2 GiB; a B200 about 179 GiB; an H200 about
# 139.8 GiB). Earlier (each release's own arg_utils.py): the 160 GiB tier from 0.28.0, A100s excluded from 0.9.0,
# the large tier by memory from 0.8.5, H100/H200 by name before, and 1,024 sequences everywhere until 0.8.4.
@pytest.mark.parametrize(
    ("name", "memory_gib", "version", "expected"),
    [
        ("A100-80GB", 79.2, "0.32.0", (2048, 256)),
        ("H100", 79.2, "0.32.0", (8192, 1024)),
        ("H200", 139.8, "0.32.0", (8192, 1024)),
        ("B200", 179.06, "0.32.0", (16384, 1024)),
        ("B200", 179.06, "0.28.0", (16384, 1024)),
        ("B200", 179.06, "0.27.1", (8192, 1024)),  # before the >= 160 GiB tier
        ("A100-80GB", 79.2, "0.8.5", (8192, 1024)),  # by memory, before A100s were excluded
        ("A100-80GB", 79.2, "0.9.0", (2048, 256)),
        ("H100", 79.2, "0.8.0", (8192, 1024)),  # by name
        ("L40S", 44.42, "0.8.0", (2048, 1024)),  # 1,024 sequences on every device
        ("L40S", 44.42, "0.8.4", (2048, 256)),
        ("A100-80GB", 79.2, "0.8.4", (2048, 256)),  # not an H100 or H200 by name
        ("L40S", 44.42, "0.32.0", (2048, 256)),
        ("", 79.2, "0.32.0", (8192, 1024)),  # a memory alone: no name to exclude
        ("H100", 79.2, "0.6.0", (2048, 256)),  # V0: one default for every device
    ],
)
def test_scheduler_defaults_by_device(name: str, memory_gib: float, version: str, expected: tuple[int, int]) -> None:
    tier = batch_defaults(EngineName.VLLM, version, gpu_memory_bytes=int(memory_gib * GiB), accelerator_name=name)
    assert (tier.max_num_batched_tokens, tier.max_num_seqs) == expected
