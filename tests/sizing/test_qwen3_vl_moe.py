"""Qwen3-VL-MoE (model_type qwen3_vl_moe): Qwen3-VL's vision tower in front of a Qwen3-MoE language model.

Totals are the checkpoints' own (a public model report that sums the safetensors tensors of Qwen3-VL-30B-A3B-Instruct
and Qwen3-VL-235B-A22B-Instruct); shapes are vLLM 0.32.0's (vllm/model_executor/models/qwen3_vl_moe.py builds
Qwen3_VisionTransformer from qwen3_vl.py and Qwen3MoeDecoderLayer from qwen3_moe.py: GateLinear router, FusedMoE
experts of moe_intermediate_size, no shared expert; lm_head untied, as the outer config's tie_word_embeddings false
is copied to the text config by VllmConfig.with_hf_config).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet.errors import ModelConfigError
from kvfleet.sizing.catalog import catalog_entries, catalog_model
from kvfleet.sizing.engines import encoder_profile
from kvfleet.sizing.memory import weight_bytes
from kvfleet.sizing.models import parse_hf_config
from kvfleet.sizing.parallel import Layout, layout_problems
from kvfleet.sizing.planner import PlanRequest, Workload, enumerate_candidates
from kvfleet.sizing.precision import Part
from kvfleet.targets import TARGETS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
VL30 = "Qwen/Qwen3-VL-30B-A3B-Instruct"
VL235 = "Qwen/Qwen3-VL-235B-A22B-Instruct"


def _raw(model_id: str) -> dict[str, object]:
    return next(e.config for e in catalog_entries() if e.model_id == model_id)


@pytest.mark.parametrize(
    ("model_id", "published_total", "card_active_b"),
    [
        # Model report of Qwen3-VL-30B-A3B-Instruct: "参数总量: 31,070,754,032" over 882 tensors (57.87 GiB of bf16);
        # the model card: 30B-A3B, about 3B active.
        (VL30, 31_070_754_032, 3.0),
        # Model report of Qwen3-VL-235B-A22B-Instruct: "参数总量: 235,670,022,896" over 1,388 tensors; card: A22B.
        (VL235, 235_670_022_896, 22.0),
    ],
)
def test_totals_match_the_checkpoints(model_id: str, published_total: int, card_active_b: float) -> None:
    m = catalog_model(model_id)
    assert m.model_type == "qwen3_vl_moe"
    assert m.total_params == published_total
    assert m.active_params / 1e9 == pytest.approx(card_active_b, rel=0.05)


def test_parsed_as_qwen3_vl_tower_and_qwen3_moe_text() -> None:
    m = catalog_model(VL30)
    assert m.moe is not None and (m.moe.num_experts, m.moe.experts_per_token) == (128, 8)
    assert m.moe.expert_intermediate_size == 768 and m.moe.num_shared_experts == 0  # no shared expert in qwen3_moe
    assert all(layer.moe for layer in m.layers) and not m.tie_word_embeddings
    v = m.vision
    # vLLM's Qwen3VLMoeForConditionalGeneration builds the Qwen3-VL tower (kind qwen3_vl): the merger and three
    # deepstack mergers hand over 1 + 3 LM-width vectors per token.
    assert v is not None and v.kind == "qwen3_vl" and v.embeds_per_token == 4
    # The report's tensors under model.visual.*: patch embed, pos embed, 27 blocks, merger, 3 deepstack mergers.
    visual = (
        1152 * 3 * 2 * 16 * 16 + 1152 + 2304 * 1152
        + 27 * (4 * 1152 + 3456 * 1152 + 3456 + 1152 * 1152 + 1152 + 2 * 4304 * 1152 + 4304 + 1152)
        + 2 * 1152 + 4608 * 4608 + 4608 + 2048 * 4608 + 2048
        + 3 * (2 * 4608 + 4608 * 4608 + 4608 + 2048 * 4608 + 2048)
    )  # fmt: skip
    assert m.vision_params == visual


def test_no_longer_refused() -> None:
    raw = _raw(VL30)
    assert parse_hf_config(raw, model_id="local").model_type == "qwen3_vl_moe"  # a local copy of the config.json
    text = raw["text_config"]
    assert isinstance(text, dict)
    with pytest.raises(ModelConfigError) as err:
        parse_hf_config({**raw, "text_config": {**text, "model_type": "qwen9_vl_moe_text"}}, model_id="x")
    assert "qwen3_vl_moe" in str(err.value)  # listed among the supported types


def test_weights_per_rank_follow_vllms_shapes() -> None:
    m = catalog_model(VL30)
    bf16 = m.native_scheme
    # One GPU holds the whole bf16 checkpoint: 2 bytes x 31,070,754,032 (vocab 151,936 needs no padding).
    assert weight_bytes(m, tp=1, scheme=bf16).weights_bytes_per_gpu == 2 * 31_070_754_032
    ep = dict(weight_bytes(m, tp=4, scheme=bf16, ep=True).bytes_by_part)
    # FusedMoE under expert parallelism: 128 / 4 = 32 whole experts per rank, w13 [32, 2 x 768, 2048] and
    # w2 [32, 2048, 768] in each of the 48 layers; GateLinear [128, 2048] replicated on every rank.
    assert ep[Part.EXPERTS] == 2 * 48 * 32 * 3 * 2048 * 768
    assert ep[Part.ROUTER] == 2 * 48 * 128 * 2048
    tp = dict(weight_bytes(m, tp=4, scheme=bf16).bytes_by_part)
    assert tp[Part.EXPERTS] == ep[Part.EXPERTS]  # 768 / 4 = 192 columns of all 128 experts: the same bytes


def test_expert_parallel_layouts_start() -> None:
    m = catalog_model(VL235)
    for layout in (Layout(tp=8), Layout(tp=8, ep=True), Layout(tp=4, pp=2)):
        problems, _ = layout_problems(m, layout, engine="vllm", version="0.32.0", scheme=m.native_scheme)
        assert problems == (), layout.label()
    # TP 3 does not divide the 64 attention heads.
    problems, _ = layout_problems(m, Layout(tp=3), engine="vllm", version="0.32.0", scheme=m.native_scheme)
    assert problems


def _fp8_variant() -> dict[str, object]:
    """A constructed FP8 config: the catalog's Qwen3-VL-30B-A3B-Instruct config.json with the quantization_config of
    the real Qwen/Qwen3-30B-A3B-FP8 checkpoint (tests/fixtures/hf_configs/Qwen3-30B-A3B-FP8: fp8, e4m3, block
    128 x 128, dynamic activations), the same language model's block-FP8 recipe. No verbatim config.json of a
    Qwen3-VL-*-FP8 checkpoint was at hand; only the block size and method are read from it here."""
    raw = _raw(VL30)
    q = json.loads((FIXTURES / "Qwen3-30B-A3B-FP8" / "config.json").read_text())["quantization_config"]
    return {**raw, "quantization_config": q}


def test_fp8_variant_quantizes_the_language_model_only() -> None:
    m = parse_hf_config(_fp8_variant(), model_id="Qwen3-VL-30B-A3B-FP8 (constructed)")
    assert m.quantization is not None and m.quantization.weight_block_size == (128, 128)
    bf16 = dict(weight_bytes(m, tp=1, scheme=catalog_model(VL30).native_scheme).bytes_by_part)
    fp8 = dict(weight_bytes(m, tp=1, scheme=m.native_scheme).bytes_by_part)
    # Experts and attention projections in FP8 (plus their 128 x 128 block scales); the vision tower, router,
    # embeddings and lm_head stay 16-bit, as the Qwen FP8 checkpoints leave them out of the conversion.
    assert fp8[Part.EXPERTS] < 0.52 * bf16[Part.EXPERTS]
    for part in (Part.VISION, Part.ROUTER, Part.EMBEDDING, Part.LM_HEAD):
        assert fp8[part] == bf16[part], part


def test_fp8_variant_expert_blocks_at_tp4() -> None:
    m = parse_hf_config(_fp8_variant(), model_id="fp8")
    # 768 / 4 = 192 per rank, not whole 128-wide blocks: vLLM 0.8.5 refused (validate_fp8_block_shape_moe); 0.32.0
    # refines the scales to gcd(128, 128, 192, 2048) = 64 (refine_fp8_moe_block_shape); experts kept whole start.
    old, _ = layout_problems(m, Layout(tp=4), engine="vllm", version="0.8.5", scheme=m.native_scheme)
    assert any("192" in p for p in old)
    new, notes = layout_problems(m, Layout(tp=4), engine="vllm", version="0.32.0", scheme=m.native_scheme)
    assert new == () and any("64x64" in n for n in notes)
    ep, _ = layout_problems(m, Layout(tp=4, ep=True), engine="vllm", version="0.8.5", scheme=m.native_scheme)
    assert ep == ()


def test_encoder_profiled_like_qwen3_vl() -> None:
    m = catalog_model(VL30)
    # Qwen3VLMoeProcessingInfo subclasses Qwen3VLProcessingInfo: the same dummy image of 16,384 tokens; the model keeps
    # one max_num_batched_tokens x 2048 buffer per deepstack level.
    p = encoder_profile(m, tp=2, max_model_len=32768, max_num_batched_tokens=8192, max_num_seqs=64, limits={})
    assert p is not None and (p.modality, p.tokens_per_item) == ("image", 16384)
    assert p.buffer_bytes == 3 * 8192 * 2048 * 2
    # supports_encoder_tp_data is inherited from Qwen3VLForConditionalGeneration.
    data = encoder_profile(
        m, tp=2, max_model_len=32768, max_num_batched_tokens=8192, max_num_seqs=64, limits={}, encoder_tp_mode="data"
    )
    assert data is not None and data.data_parallel


def test_plans_on_one_h100_and_on_eight() -> None:
    m = catalog_model(VL30)
    wl = Workload(max_input_tokens=16384, max_output_tokens=1024, concurrency_per_replica=4)
    one = enumerate_candidates(
        PlanRequest(model=m, workload=wl, hosting=TARGETS["ec2"].hosting, instance_types=("p5.4xlarge",))
    )
    assert [c.tensor_parallel_size for c in one.candidates] == [1]  # 57.9 GiB of weights on one 80 GB H100
    eight = enumerate_candidates(
        PlanRequest(model=m, workload=wl, hosting=TARGETS["ec2"].hosting, instance_types=("p5.48xlarge",))
    )
    layouts = {(c.tensor_parallel_size, c.capacity.expert_parallel) for c in eight.candidates}
    assert (8, True) in layouts and (8, False) in layouts
