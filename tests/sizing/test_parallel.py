"""Parallel layouts: the engine's divisibility rules, expert placement, pipeline stages and their KV blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.engines import ENGINES
from kvfleet.errors import SizingError
from kvfleet.sizing.capacity import EngineSettings, capacity
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.memory import weight_bytes
from kvfleet.sizing.parallel import Layout, check_layout, experts_per_rank, pp_partition
from kvfleet.sizing.planner import PlanRequest, Workload, enumerate_candidates
from kvfleet.sizing.precision import Part
from kvfleet.sizing.units import GiB
from kvfleet.targets import TARGETS

QWEN235_FP8 = catalog_model("Qwen/Qwen3-235B-A22B-FP8")
H200 = int(139.8 * GiB)


def _cap(model: object, version: str, *, tp: int, pp: int = 1, ep: bool = False, gpu: int = H200) -> object:
    return capacity(
        model,  # type: ignore[arg-type]
        gpu_memory_bytes=gpu,
        settings=EngineSettings(
            version=version,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            enable_expert_parallel=ep,
            max_model_len=32768,
        ),
    )


def test_every_rule_names_its_source() -> None:
    for name, engine in ENGINES.items():
        for r in engine.capacity.layout_rules:
            assert r.source and r.what, (name, r.name)
            assert r.until is None or r.since < r.until


def test_block_fp8_checkpoint_keeps_its_block_size() -> None:
    q = QWEN235_FP8.quantization
    assert q is not None and q.weight_block_size == (128, 128)  # config.json quantization_config.weight_block_size


def test_qwen3_235b_fp8_tp8_refused_where_vllm_refused_it() -> None:
    # vllm-project/vllm issue 17569 (vLLM 0.8.5): "The output_size of gate's and up's weight = 192 is not
    # divisible by weight quantization block_n = 128" at --tensor-parallel-size 8.
    with pytest.raises(SizingError) as err:
        _cap(QWEN235_FP8, "0.8.5", tp=8)
    text = str(err.value)
    assert "1536 / 8 = 192" in text and "128x128" in text
    assert "tp=8 ep" in text  # the layout on the same GPUs that starts
    assert err.value.field == "tensor_parallel_size"


def test_qwen3_235b_fp8_tp4_and_expert_parallel_tp8_start() -> None:
    _cap(QWEN235_FP8, "0.8.5", tp=4)  # 1536 / 4 = 384, three blocks
    # Expert parallelism keeps each 1536-wide expert whole on one rank (vLLM FusedMoEParallelConfig.make: the MoE
    # tp_size becomes 1), so no expert is split and the block rule holds.
    ep = _cap(QWEN235_FP8, "0.8.5", tp=8, ep=True)
    assert ep.expert_parallel  # type: ignore[attr-defined]


def test_qwen3_235b_fp8_tp8_refined_in_current_vllm() -> None:
    # vLLM 0.32.0 refine_fp8_moe_block_shape: gcd(128, 128, 192, 4096) = 64 >= 32, so the scales are refined.
    cap = _cap(QWEN235_FP8, "0.32.0", tp=8)
    assert any("64x64" in n and "Triton" in n for n in cap.notes)  # type: ignore[attr-defined]


def test_expert_placement_follows_vllm() -> None:
    # determine_expert_map: num_experts // ep each, the first num_experts % ep ranks one more.
    assert experts_per_rank(128, 8) == 16
    assert experts_per_rank(60, 8) == 8  # 4 ranks of 8, 4 of 7: memory follows the fullest
    # Whole experts: the same bytes as splitting them when the count divides (128 / 8).
    tp = weight_bytes(QWEN235_FP8, tp=8, scheme=QWEN235_FP8.native_scheme)
    ep = weight_bytes(QWEN235_FP8, tp=8, scheme=QWEN235_FP8.native_scheme, ep=True)
    experts = {p: b for p, b in tp.bytes_by_part}[Part.EXPERTS]
    assert {p: b for p, b in ep.bytes_by_part}[Part.EXPERTS] == experts


def test_uneven_expert_parallelism_sizes_the_fullest_rank() -> None:
    m = catalog_model("Qwen/Qwen3-30B-A3B")  # 128 experts: at EP 3 the fullest rank holds 43
    tp3 = weight_bytes(m, tp=1, scheme=m.native_scheme)
    ep3 = weight_bytes(m, tp=1, scheme=m.native_scheme, ep=True)
    assert {p: b for p, b in ep3.bytes_by_part}[Part.EXPERTS] == {p: b for p, b in tp3.bytes_by_part}[Part.EXPERTS]
    assert experts_per_rank(128, 3) == 43


@pytest.mark.parametrize(
    ("layers", "pp", "split"),
    [
        # vllm/distributed/utils.py get_pp_indices: the remainder goes one each to the stages before the last,
        # from the second-to-last backwards.
        (32, 2, (16, 16)),
        (94, 4, (23, 24, 24, 23)),
        (80, 3, (27, 27, 26)),
        (61, 8, (7, 7, 8, 8, 8, 8, 8, 7)),
    ],
)
def test_pipeline_layers_split_as_vllm_splits_them(layers: int, pp: int, split: tuple[int, ...]) -> None:
    assert pp_partition(layers, pp) == split
    assert sum(split) == layers


def test_pipeline_stage_without_layers_is_refused() -> None:
    with pytest.raises(SizingError, match="pipeline_parallel_size"):
        pp_partition(4, 8)


def test_pipeline_kv_is_the_fewest_blocks_of_any_stage() -> None:
    # Qwen2.5-0.5B ties its embeddings: vLLM's Qwen2Model builds embed_tokens on the first stage and, tied, on
    # the last too (vllm/model_executor/models/qwen2.py), so the last stage also holds the lm_head's rows and has
    # less room. get_kv_cache_configs gives every stage the smallest count.
    m = catalog_model("Qwen/Qwen2.5-0.5B")
    cap = _cap(m, "0.32.0", tp=1, pp=2, gpu=24 * GiB)
    blocks = cap.stage_num_blocks  # type: ignore[attr-defined]
    assert len(blocks) == 2 and cap.num_blocks == min(blocks)  # type: ignore[attr-defined]
    # Each stage holds half the layers: about twice the blocks of one GPU holding them all.
    one = _cap(m, "0.32.0", tp=1, gpu=24 * GiB)
    assert cap.num_blocks > 1.8 * one.num_blocks  # type: ignore[attr-defined]
    assert cap.gpus_per_replica == 2  # type: ignore[attr-defined]


def test_pipeline_stage_weights_hold_embedding_first_and_lm_head_last() -> None:
    m = catalog_model("meta-llama/Llama-3.1-70B")
    cap = _cap(m, "0.32.0", tp=4, pp=2)
    parts = {p for p, _ in cap.weights.bytes_by_part}  # type: ignore[attr-defined]
    # One stage of an untied model holds the embedding or the lm_head, never both.
    assert (Part.EMBEDDING in parts) != (Part.LM_HEAD in parts)


def test_group_quantized_row_shards_must_be_whole_groups() -> None:
    # vLLM 0.32.0 MarlinLinearKernel.can_implement: in_features per partition divisible by group_size.
    from kvfleet.sizing.models import Quantization
    from kvfleet.sizing.precision import weight_scheme

    base = catalog_model("Qwen/Qwen2-72B-Instruct")  # intermediate 29568 = 231 groups of 128
    awq = replace(base, quantization=Quantization(method="awq", scheme=weight_scheme("awq")))
    check_layout(awq, Layout(tp=1), engine="vllm", version="0.32.0", scheme=awq.native_scheme)
    with pytest.raises(SizingError, match="whole groups of 128"):
        check_layout(awq, Layout(tp=2), engine="vllm", version="0.32.0", scheme=awq.native_scheme)


def test_planner_rejects_the_refused_layout_with_its_rule_and_plans_expert_parallel() -> None:
    req = PlanRequest(
        model=QWEN235_FP8,
        workload=Workload(max_input_tokens=4096, max_output_tokens=1024),
        hosting=TARGETS["sagemaker"].hosting,
        engine_version="0.8.5",
        instance_types=("p5en.48xlarge",),
    )
    p = enumerate_candidates(req)
    refused = [r for r in p.rejections if r.tensor_parallel_size == 8 and not r.expert_parallel]
    assert refused and "192" in refused[0].reason and "tp=8 ep" in refused[0].reason
    assert any(c.tensor_parallel_size == 8 and c.expert_parallel for c in p.candidates)
    assert all(c.gpus_per_replica == 8 for c in p.candidates)  # one engine per SageMaker instance


def test_planner_plans_pipeline_where_tensor_parallelism_cannot_fill_the_instance() -> None:
    m = catalog_model("Qwen/Qwen2.5-7B")  # 28 heads: TP 8 is no degree, tp=4 x pp=2 fills 8 GPUs
    req = PlanRequest(
        model=m,
        workload=Workload(max_input_tokens=2048, max_output_tokens=512),
        hosting=TARGETS["sagemaker"].hosting,
        instance_types=("p5.48xlarge",),
    )
    p = enumerate_candidates(req)
    assert any(c.tensor_parallel_size == 4 and c.pipeline_parallel_size == 2 for c in p.candidates)
    assert not any(r.pipeline_parallel_size > 1 for r in p.rejections if "idle" in r.reason)
    # Where TP fills the instance, no pipeline layout is planned (it would only be slower in the step model).
    llama = replace(req, model=catalog_model("meta-llama/Llama-3.1-8B"))
    assert all(c.pipeline_parallel_size == 1 for c in enumerate_candidates(llama).candidates)


def test_deepseek_v3_block_fp8_at_tp8_is_not_refused() -> None:
    # DeepSeek-V3 (weight_block_size [128, 128]) is served at TP 8 on one H200 node: 18432 / 8 dense, 2048 / 8
    # routed and shared expert shards are all whole 128-blocks.
    m = catalog_model("deepseek-ai/DeepSeek-V3")
    assert m.quantization is not None and m.quantization.weight_block_size == (128, 128)
    assert check_layout(m, Layout(tp=8), engine="vllm", version="0.8.5", scheme=m.native_scheme) == ()


def test_trtllm_splits_stages_first_heavy_and_needs_even_experts() -> None:
    # tensorrt_llm/mapping.py Mapping.pp_layers: torch.tensor_split, the first num_layers % pp stages one more.
    assert pp_partition(94, 4, engine="trtllm") == (24, 24, 23, 23)
    m = catalog_model("mistralai/Mixtral-8x7B-v0.1")  # 8 experts over 16 ranks: ep_experts gives each 8 // 16 = 0
    with pytest.raises(SizingError, match="leaves some out"):
        check_layout(m, Layout(tp=16, ep=True), engine="trtllm", version="1.0.0", scheme=m.native_scheme)
    check_layout(m, Layout(tp=8, ep=True), engine="trtllm", version="1.0.0", scheme=m.native_scheme)
