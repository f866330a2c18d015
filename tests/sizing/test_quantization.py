"""Which weight precisions each engine release loads, and the refusals capacity and the planner give.

The release lists in each engine's quantization.py (kvfleet/engines/<name>/) are copies of the engines' own lists
(vLLM's QuantizationMethods per release, TensorRT-LLM's checkpoint readers), each with its source; these tests hold
the rule to what those sources say a release does, not to the code's restatement of itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvfleet.engines import ENGINES
from kvfleet.errors import SizingError
from kvfleet.sizing.capacity import EngineSettings, capacity, resolve_scheme
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.engines import EngineName, default_version, engine_capacity
from kvfleet.sizing.hosting import Hosting, PriceList, Routing
from kvfleet.sizing.memory import weight_bytes
from kvfleet.sizing.models import load_config_file, parse_hf_config
from kvfleet.sizing.planner import PlanRequest, Workload, plan
from kvfleet.sizing.precision import WEIGHT_SCHEMES
from kvfleet.sizing.quantization import as_loaded, quantization_release, scheme_method
from kvfleet.sizing.units import GiB
from tests.sizing.conftest import llama_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
LLAMA = "meta-llama/Llama-3.1-8B"
BNB = FIXTURES / "Kocdigital-LLM-8b-v0.1-bnb-4bit"
AWQ = FIXTURES / "Meta-Llama-3.1-70B-Instruct-AWQ-INT4"

# vLLM 0.32.0's QuantizationMethods (vllm/model_executor/layers/quantization/__init__.py) holds neither
# bitsandbytes nor gguf, and its DEPRECATED_QUANTIZATION_METHODS are fbgemm_fp8 and fp_quant. The PyPI sdists list
# gguf up to 0.23.0 and bitsandbytes up to 0.27.1 (kvfleet/sizing/data/vllm_release_markers.json).
VLLM_0_32_REFUSED = {"bitsandbytes", "gguf", "fbgemm_fp8", "fp_quant"}
# quant_method values a published checkpoint carries and kvfleet parses (models.py _quantization).
CHECKPOINT_METHODS = (
    "awq",
    "awq_marlin",
    "gptq",
    "gptq_marlin",
    "fp8",
    "fbgemm_fp8",
    "modelopt",
    "mxfp4",
    "bitsandbytes",
    "compressed-tensors",
)


def _tables() -> dict[str, Mapping[str, Any]]:
    """Each registered engine's quantization table."""
    return {name: engine_capacity(name).quantization for name in ENGINES}


def _settings(version: str | None = None, quantization: str | None = None, **kw: Any) -> EngineSettings:
    return EngineSettings(version=version, quantization=quantization, max_model_len=8192, **kw)


# ---- the table -----------------------------------------------------------------------------------


def test_every_release_row_has_a_source_and_every_scheme_a_method() -> None:
    for name, table in _tables().items():
        assert table["schemes_source"]
        assert {s.name for s in WEIGHT_SCHEMES.values() if s.is_quantized} == set(table["schemes"]), name
        for row in table["releases"]:
            assert row["source"] and row["methods"], (name, row["since"])
            # A row's lists are its release's own: 0.14.0 still deprecates tpu_int8, which it no longer lists.
            assert set(row.get("schemes", {})) <= set(table["schemes"]), (name, row["since"])


def test_vllm_0_32_refuses_what_its_source_leaves_out() -> None:
    release = quantization_release(EngineName.VLLM, "0.32.0")
    refused = {m for m in (*CHECKPOINT_METHODS, "gguf", "fp_quant") if not release.loads(m)}
    assert refused == VLLM_0_32_REFUSED
    # The online shorthands of vllm/config/quantization.py _ONLINE_SHORTHANDS are methods of that release too.
    assert {"fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "mxfp8", "online"} <= release.methods


def test_bitsandbytes_loads_before_its_removal() -> None:
    # QuantizationMethods lists bitsandbytes up to 0.27.1 and gguf up to 0.23.0 (the sdists' __init__.py).
    for version in ("0.6.0", "0.10.1", "0.22.1", "0.27.1"):
        assert quantization_release(EngineName.VLLM, version).loads("bitsandbytes"), version
    for version in ("0.28.0", "0.32.0"):
        assert not quantization_release(EngineName.VLLM, version).loads("bitsandbytes"), version
    assert quantization_release(EngineName.VLLM, "0.23.0").loads("gguf")
    assert not quantization_release(EngineName.VLLM, "0.24.0").loads("gguf")


def test_mxfp4_arrives_with_gpt_oss() -> None:
    # gpt-oss's MXFP4 experts came with 0.10.1; 0.10.0's list has no mxfp4.
    assert not quantization_release(EngineName.VLLM, "0.10.0").loads("mxfp4")
    assert quantization_release(EngineName.VLLM, "0.10.1").loads("mxfp4")


def test_nvfp4_loads_under_the_name_each_release_gives_it() -> None:
    # ModelOpt NVFP4 came in 0.8.0 as method "nvfp4"; 0.9.0 renamed it "modelopt_fp4". 0.7.3 has neither.
    nvfp4 = WEIGHT_SCHEMES["nvfp4"]
    for version, method in (("0.8.0", "nvfp4"), ("0.8.5", "nvfp4"), ("0.9.0", "modelopt_fp4")):
        release = quantization_release(EngineName.VLLM, version)
        assert scheme_method(nvfp4, release) == method, version
        assert release.loads(method), version
    assert not quantization_release(EngineName.VLLM, "0.7.3").loads("nvfp4")
    assert resolve_scheme(catalog_model(LLAMA), "nvfp4", version="0.8.0").name == "nvfp4"
    with pytest.raises(SizingError, match="does not load"):
        resolve_scheme(catalog_model(LLAMA), "nvfp4", version="0.7.3")


def test_trtllm_reads_modelopt_fp8_block_and_mxfp4_checkpoints_only() -> None:
    release = quantization_release(EngineName.TRTLLM, default_version(EngineName.TRTLLM))
    assert {m for m in CHECKPOINT_METHODS if release.loads(m)} == {"modelopt", "fp8", "mxfp4"}
    assert not release.online  # the PyTorch backend quantizes nothing at load
    assert scheme_method(WEIGHT_SCHEMES["awq"], release) == "modelopt"  # ModelOpt W4A16_AWQ


# ---- capacity ------------------------------------------------------------------------------------


def test_bnb_4bit_refused_at_0_32_with_the_nearest_scheme() -> None:
    model = catalog_model(LLAMA)
    with pytest.raises(SizingError) as err:
        capacity(model, gpu_memory_bytes=80 * GiB, settings=_settings("0.32.0", "bnb-4bit"))
    assert err.value.field == "quantization"
    msg = err.value.message
    assert "vLLM 0.32.0" in msg and "bitsandbytes" in msg and "nearest it loads: awq" in msg
    assert "\n" not in msg
    # No version means the default release's refusal.
    with pytest.raises(SizingError, match=f"vLLM {re.escape(default_version(EngineName.VLLM))}"):
        capacity(model, gpu_memory_bytes=80 * GiB, settings=_settings(None, "bnb-4bit"))


def test_bnb_4bit_accepted_at_a_release_that_had_it() -> None:
    cap = capacity(catalog_model(LLAMA), gpu_memory_bytes=80 * GiB, settings=_settings("0.27.1", "bnb-4bit"))
    assert cap.weights.scheme.name == "bnb-4bit"
    assert cap.kv_cache_tokens > 0


def test_bnb_8bit_points_at_fp8() -> None:
    with pytest.raises(SizingError, match=r"nearest it loads: fp8 \(quantized at load\)"):
        resolve_scheme(catalog_model(LLAMA), "bnb-8bit", engine=EngineName.VLLM, version="0.32.0")


def test_bitsandbytes_checkpoint_refused_for_the_release() -> None:
    model = load_config_file(BNB)
    assert model.quantization is not None and model.quantization.method == "bitsandbytes"
    with pytest.raises(SizingError) as err:
        capacity(model, gpu_memory_bytes=80 * GiB, settings=_settings("0.32.0"))
    assert err.value.field == "model"
    assert "vLLM 0.32.0" in err.value.message and "'bitsandbytes'" in err.value.message
    assert "awq (quant_method awq)" in err.value.message
    ok = capacity(model, gpu_memory_bytes=80 * GiB, settings=_settings("0.27.1"))
    assert ok.weights.scheme.name == "bnb-4bit"


def test_deprecated_checkpoint_method_refused_at_0_32() -> None:
    # A checkpoint in fbgemm_fp8 (Meta's FP8 Llama 405B format): vLLM lists it as deprecated from 0.14.0 on and
    # refuses it without --allow-deprecated-quantization (config/model.py _verify_quantization).
    cfg = llama_config(quantization_config={"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0})
    model = parse_hf_config(cfg, model_id="test/llama-fbgemm")
    with pytest.raises(SizingError, match="deprecated quant_method 'fbgemm_fp8'") as err:
        capacity(model, gpu_memory_bytes=80 * GiB, settings=_settings("0.32.0"))
    assert err.value.field == "model"
    with pytest.raises(SizingError, match="deprecated quant_method 'fbgemm_fp8'"):
        capacity(model, gpu_memory_bytes=80 * GiB, settings=_settings("0.14.0"))
    assert capacity(model, gpu_memory_bytes=80 * GiB, settings=_settings("0.13.0")).weights.scheme.name == "fp8"


def test_trtllm_refuses_a_huggingface_awq_checkpoint() -> None:
    model = load_config_file(AWQ)
    with pytest.raises(SizingError) as err:
        resolve_scheme(model, None, engine=EngineName.TRTLLM, version="1.0.0")
    assert err.value.field == "model"
    assert "TensorRT-LLM 1.0.0" in err.value.message and "quant_method modelopt" in err.value.message
    assert resolve_scheme(model, None, engine=EngineName.VLLM, version="0.32.0").name == "awq"


def test_trtllm_fp8_of_an_unquantized_model_is_sized_as_its_checkpoint() -> None:
    cap = capacity(
        catalog_model(LLAMA),
        gpu_memory_bytes=80 * GiB,
        settings=_settings("1.0.0", "fp8", engine=EngineName.TRTLLM),
    )
    assert any("quantizes no weights at load" in n and "modelopt" in n for n in cap.notes)
    with pytest.raises(SizingError, match=r"TensorRT-LLM 1\.0\.0 does not load bitsandbytes"):
        resolve_scheme(catalog_model(LLAMA), "bnb-4bit", engine=EngineName.TRTLLM, version="1.0.0")


# ---- the planner ---------------------------------------------------------------------------------

HOSTING = Hosting(price_list=PriceList.EC2, routing=Routing.LEAST_OUTSTANDING)


def _req(*precisions: str, version: str = "0.32.0", model: str | Path = LLAMA) -> PlanRequest:
    spec = load_config_file(model) if isinstance(model, Path) else catalog_model(model)
    return PlanRequest(
        model=spec,
        workload=Workload(max_input_tokens=2048, max_output_tokens=512),
        engine_version=version,
        hosting=HOSTING,
        weight_precisions=precisions,
        instance_types=("p5.4xlarge",),
    )


def test_planner_refuses_bnb_from_0_28() -> None:
    with pytest.raises(SizingError) as err:
        plan(_req("bnb-4bit"))
    assert err.value.field == "weight_precisions"
    assert "vLLM 0.32.0" in err.value.message and "awq" in err.value.message
    assert plan(_req("bnb-4bit", version="0.27.1")).best.weight_scheme.name == "bnb-4bit"


def test_planner_keeps_what_the_release_loads_and_says_why_not_the_rest() -> None:
    result = plan(_req("bnb-4bit", "awq"))
    assert {c.weight_scheme.name for c in result.candidates} == {"awq"}
    bnb = [r for r in result.rejections if r.weight_precision == "bnb-4bit"]
    assert bnb and all(r.reason.startswith("vLLM 0.32.0 does not load bitsandbytes") for r in bnb)


def test_planner_refuses_a_checkpoint_the_release_does_not_load() -> None:
    with pytest.raises(SizingError) as err:
        plan(_req(version="0.32.0", model=BNB))
    assert err.value.field == "model"
    assert plan(_req(version="0.27.1", model=BNB)).best.weight_scheme.name == "bnb-4bit"


def test_planner_says_a_trtllm_fp8_plan_needs_the_fp8_checkpoint() -> None:
    req = _req("fp8", version="1.0.0")
    best = plan(replace(req, engine=EngineName.TRTLLM)).best
    assert best.weight_scheme.name == "fp8"
    assert any(n.startswith("TensorRT-LLM 1.0.0 quantizes no weights at load") for n in best.notes)
    # vLLM quantizes to fp8 at load: no such note.
    assert not any("quantizes no weights" in n for n in plan(_req("fp8")).best.notes)


def test_vllm_holds_bitsandbytes_absmax_in_fp32_from_0_9_2() -> None:
    # bitsandbytes_loader.py dequantize_dq (PR 19742): a double-quantized absmax (uint8 per 64 plus fp32 per 256
    # blocks) is turned into one fp32 per 64 weights at load, for in-flight quantization and checkpoints alike.
    model = catalog_model("meta-llama/Llama-3.1-8B")
    old = resolve_scheme(model, "bnb-4bit", version="0.9.1")
    new = resolve_scheme(model, "bnb-4bit", version="0.9.2")
    assert old.scale_bytes == pytest.approx(1 + 4 / 256)
    assert new.scale_bytes == 4
    w_old = weight_bytes(model, tp=1, scheme=old).weights_bytes_per_gpu
    w_new = weight_bytes(model, tp=1, scheme=new).weights_bytes_per_gpu
    # 6.98e9 quantized weights x (4 - 1.016) / 64 bytes: about 0.30 GiB more for Llama-3.1-8B.
    assert (w_new - w_old) / GiB == pytest.approx(0.30, abs=0.01)
    # Other schemes and engines are held as the checkpoint lays them out.
    assert as_loaded(old, engine=EngineName.TRTLLM, version="1.0.0") is old
    assert (
        as_loaded(resolve_scheme(model, "awq", version="0.10.0"), engine=EngineName.VLLM, version="0.10.0").name
        == "awq"
    )
