"""Data-parallel attention with expert parallelism (vLLM --data-parallel-size with --enable-expert-parallel)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.deployments import engine_args
from kvfleet.engines import ENGINES, EngineArgs
from kvfleet.errors import SizingError
from kvfleet.sizing.capacity import FUSED_MOE_CHUNK_TOKENS, Capacity, EngineSettings, all_to_all_bytes, capacity
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.engines import EngineName, engine_capacity
from kvfleet.sizing.hardware import instance
from kvfleet.sizing.models import ModelSpec
from kvfleet.sizing.parallel import Layout
from kvfleet.sizing.planner import PlanRequest, Workload, enumerate_candidates
from kvfleet.sizing.precision import Part
from kvfleet.sizing.step import PrefillChunk, StepBatch, replica, step_time
from kvfleet.targets import TARGETS

P5EN = instance("p5en.48xlarge")


def _v3() -> ModelSpec:
    return catalog_model("deepseek-ai/DeepSeek-V3")


def _cap(model: ModelSpec, **settings: object) -> Capacity:
    assert P5EN.usable_gpu_memory_bytes is not None
    return capacity(
        model,
        gpu_memory_bytes=P5EN.usable_gpu_memory_bytes,
        settings=EngineSettings(max_model_len=32768, **settings),  # type: ignore[arg-type]
        accelerator_name=P5EN.accelerator.name,
    )


def _experts(cap: Capacity) -> int:
    return sum(b for p, b in cap.weights.bytes_by_part if p is Part.EXPERTS)


def test_deepseek_v3_dp8_ep_on_p5en_holds_the_latent_once_per_rank_and_an_eighth_of_the_experts() -> None:
    dp8 = _cap(_v3(), data_parallel_size=8, enable_expert_parallel=True)
    tp8 = _cap(_v3(), tensor_parallel_size=8, enable_expert_parallel=True)
    assert not dp8.problems and not tp8.problems
    assert dp8.gpus_per_replica == tp8.gpus_per_replica == 8
    # The MLA latent is one 576-wide row per layer whichever the layout: 61 x 576 x 2 bytes per token per GPU.
    assert dp8.kv_bytes_per_token_per_gpu == tp8.kv_bytes_per_token_per_gpu == 61 * 576 * 2
    # 256 experts over 8 ranks: 32 each, the same share TP8 + EP gives; the rest is whole on every DP rank.
    assert _experts(dp8) == pytest.approx(_experts(tp8), rel=1e-6)
    assert dp8.weights_bytes_per_gpu > tp8.weights_bytes_per_gpu
    # Each rank logs its own cache; the replica holds eight of them, several times TP8's single one.
    assert dp8.replica_kv_cache_tokens == 8 * dp8.kv_cache_tokens
    assert dp8.replica_kv_cache_tokens > 4 * tp8.replica_kv_cache_tokens
    # The target: 64 sequences of 32k on one p5en, which TP8 cannot hold.
    assert tp8.concurrent_sequences < 64 <= dp8.concurrent_sequences
    assert dp8.concurrent_sequences % 8 == 0  # each rank's scheduler admits its own
    assert dp8.as_dict()["data_parallel_size"] == 8
    assert any("8 engine cores" in n for n in dp8.notes)


def test_the_all_to_all_buffers_join_each_ranks_activation_peak() -> None:
    m = _v3()
    assert all_to_all_bytes(m, tp=1, dp=1, max_num_batched_tokens=8192) == 0
    assert (
        all_to_all_bytes(catalog_model("meta-llama/Llama-3.1-8B-Instruct"), tp=1, dp=8, max_num_batched_tokens=8192)
        == 0
    )
    got = all_to_all_bytes(m, tp=1, dp=8, max_num_batched_tokens=8192)
    assert m.moe is not None
    gathered = 8 * 8192 * m.hidden_size * 2
    per_token = m.moe.experts_per_token * (max(2 * 2048, m.hidden_size) + 2048) * 2
    assert got == gathered + (FUSED_MOE_CHUNK_TOKENS - 8192) * per_token
    dp8 = _cap(m, data_parallel_size=8, enable_expert_parallel=True)
    dp1 = _cap(m, tensor_parallel_size=8, enable_expert_parallel=True)
    assert dp8.activation_peak_bytes > dp1.activation_peak_bytes


@pytest.mark.parametrize(
    ("model_id", "settings", "why", "starts"),
    [
        ("deepseek-ai/DeepSeek-V3", {"data_parallel_size": 8}, "expert parallelism", "tp=1 dp=8 ep"),
        ("meta-llama/Llama-3.1-8B-Instruct", {"data_parallel_size": 2}, "mixture-of-experts", "tp=2"),
        (
            "deepseek-ai/DeepSeek-V3",
            {"data_parallel_size": 4, "pipeline_parallel_size": 2, "enable_expert_parallel": True},
            "pipeline",
            "tp=8 ep",
        ),
    ],
)
def test_a_data_parallel_layout_kvfleet_does_not_size_is_refused_naming_one_that_starts(
    model_id: str, settings: dict[str, object], why: str, starts: str
) -> None:
    with pytest.raises(SizingError, match=why) as err:
        _cap(catalog_model(model_id), **settings)
    assert err.value.field == "data_parallel_size"
    assert starts in str(err.value)


def test_data_parallel_attention_is_vllm_only_and_from_the_release_whose_source_was_read() -> None:
    rule = next(r for r in engine_capacity(EngineName.VLLM).layout_rules if r.name == "data-parallel-attention")
    assert "vllm/config/parallel.py" in rule.source and rule.since == (0, 34, 0)
    with pytest.raises(SizingError, match=r"not modelled for vLLM 0\.28"):
        _cap(_v3(), version="0.28.0", data_parallel_size=8, enable_expert_parallel=True)
    with pytest.raises(SizingError, match="data-parallel attention is not modelled"):
        _cap(_v3(), engine=EngineName.TRTLLM, data_parallel_size=8, enable_expert_parallel=True)


def test_a_layout_counts_every_data_parallel_ranks_gpus() -> None:
    lay = Layout(tp=2, dp=4, ep=True)
    assert lay.gpus == 8 and lay.expert_ranks == 8 and lay.label() == "tp=2 dp=4 ep"


def test_vllm_renders_the_data_parallel_flag_and_trtllm_refuses_it() -> None:
    args = EngineArgs(tensor_parallel_size=1, data_parallel_size=8, enable_expert_parallel=True)
    flags = ENGINES["vllm"].server_command(args, model="m", port=8080, python="python", options_file=None)
    i = flags.index("--data-parallel-size")
    assert flags[i + 1] == "8" and "--enable-expert-parallel" in flags
    assert args.gpus == 8
    assert EngineArgs.from_json(args.to_json()) == args
    assert (
        ENGINES["vllm"].dlc_environment(args, model="m", max_input_tokens=1, max_output_tokens=1)[
            "SM_VLLM_DATA_PARALLEL_SIZE"
        ]
        == "8"
    )
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineArgs(data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size"):
        ENGINES["trtllm"].settings(args)


def _v3_request(**kw: object) -> PlanRequest:
    base = PlanRequest(
        model=_v3(),
        workload=Workload(max_input_tokens=30000, max_output_tokens=2000, concurrency_per_replica=64),
        hosting=TARGETS["ec2"].hosting,
        instance_types=("p5en.48xlarge",),
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def test_deepseek_v3_is_planned_on_one_p5en_with_dp8_and_expert_parallelism() -> None:
    p = enumerate_candidates(_v3_request())
    dp8 = next(c for c in p.candidates if c.layout == Layout(tp=1, dp=8, ep=True))
    assert dp8.gpus_per_replica == 8 and dp8.instance_count == 1 and dp8.engines_per_instance == 1
    assert dp8.concurrency_per_replica == 64 and dp8.cache_concurrency >= 64
    # Each engine core schedules its share: the engine starts with max_num_seqs 64 / 8.
    assert dp8.settings.max_num_seqs == 8 and dp8.settings.data_parallel_size == 8
    # The replica's rate is eight cores', the latency one core's.
    assert dp8.requests_per_s_per_replica > dp8.alone.requests_per_s
    # TP8 cannot hold the target on the same instance: the "41 sequences, target 64".
    tp8 = [r for r in p.rejections if r.tensor_parallel_size == 8 and r.data_parallel_size == 1]
    assert tp8 and all("target is 64" in r.reason for r in tp8)
    args = engine_args(dp8)
    assert args.data_parallel_size == 8 and args.max_num_seqs == 8 and args.gpus == 8
    flags = ENGINES["vllm"].server_command(args, model="m", port=8080, python="python", options_file=None)
    assert flags[flags.index("--data-parallel-size") + 1] == "8" and "--enable-expert-parallel" in flags
    assert flags[flags.index("--max-num-seqs") + 1] == "8"


def test_data_parallel_layouts_are_planned_only_where_the_engine_release_sizes_them() -> None:
    older = enumerate_candidates(_v3_request(engine_version="0.28.0"))
    # TP8 (all that is left before the rule's release) holds 22 of the 64 sequences: nothing fits.
    assert not older.candidates and older.rejections
    assert all(r.data_parallel_size == 1 for r in older.rejections)
    dense = enumerate_candidates(
        replace(_v3_request(), model=catalog_model("meta-llama/Llama-3.1-8B-Instruct"), instance_types=("p5.48xlarge",))
    )
    assert all(c.data_parallel_size == 1 for c in dense.candidates)
    assert all(r.data_parallel_size == 1 for r in dense.rejections)


def test_a_rank_of_a_data_parallel_replica_reads_its_share_of_the_experts_and_pays_the_exchange() -> None:
    m = _v3()
    acc = P5EN.accelerator
    one = replica(model=m, accelerator=acc, tp=1, nvlink=P5EN.nvlink, scheme=m.native_scheme)
    dp8 = replica(model=m, accelerator=acc, tp=1, nvlink=P5EN.nvlink, scheme=m.native_scheme, dp=8)
    assert dp8.expert_weight_bytes == pytest.approx(one.expert_weight_bytes / 8)
    assert dp8.dense_weight_bytes == one.dense_weight_bytes and dp8.moe_layers == 58
    batch = StepBatch(prefill=(PrefillChunk(tokens=2048, start=0),))
    assert step_time(one, batch).allreduce_s == 0.0 < step_time(dp8, batch).allreduce_s


def test_the_simulator_runs_a_data_parallel_replica_as_its_engine_cores() -> None:
    # The plan prints the simulator's percentiles beside its closed form: a DP8 replica is eight engine cores with
    # their caches, stepping together with one core's share of the batch each (kvfleet.sim.steps), not one core
    # holding every expert and every sequence.
    from kvfleet.sim.candidate import planned_fleet
    from kvfleet.sim.report import summarize
    from kvfleet.sim.shapes import run

    p = enumerate_candidates(_v3_request())
    dp8 = next(c for c in p.candidates if c.layout == Layout(tp=1, dp=8, ep=True))
    spec, shape = planned_fleet(dp8, p.request.model, p.request.workload)
    assert spec.limits.kv_blocks == dp8.capacity.num_blocks * 8
    assert spec.limits.max_num_seqs == dp8.concurrency_per_replica == 64
    report = summarize(run(spec, shape, spec.initial_replicas), spec).as_dict()
    # Within a factor of the closed form's steady state under the same load: a step is one core's share (priced as
    # one core holding every expert and all 64 sequences, the median gap was 3.3 times the closed form's).
    planned_itl = dp8.planned_load.itl_s
    assert 0.4 * planned_itl < report["itl_s"]["p50"] < 2.0 * planned_itl, (report["itl_s"], planned_itl)
