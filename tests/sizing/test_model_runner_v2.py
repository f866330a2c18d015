"""Model Runner V2 (vLLM 0.26 on for dense models, 0.29 on for all) as its source shows it: no CUDA-graph estimate
before 0.29, a penalty state of max_num_seqs x vocabulary int32 counted in the budget from 0.27, and a profiling
sampler of its own (data/vllm_release_markers.json: v2-cudagraph-estimate, budget-counts-persistent-allocations)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.sizing.capacity import EngineSettings, capacity
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.engines import EngineName, engine_profile, runs_v2_runner, v2_penalty_buffer_bytes
from kvfleet.sizing.units import GiB

DENSE = "Qwen/Qwen2.5-7B"
MOE = "Qwen/Qwen3-30B-A3B"
BASE = EngineSettings(max_model_len=8192, max_num_seqs=256, max_num_batched_tokens=2048)


def _cap(model_id: str, version: str, **kw: object) -> object:
    s = replace(BASE, version=version, **kw)  # type: ignore[arg-type]
    return capacity(catalog_model(model_id), gpu_memory_bytes=80 * GiB, settings=s, accelerator_name="H100")


@pytest.mark.parametrize(
    ("model_id", "version", "counted"),
    [
        (DENSE, "0.25.0", True),  # the V1 runner, graphs counted since 0.20
        (DENSE, "0.26.0", False),  # Model Runner V2's profile_cudagraph_memory returns 0
        (DENSE, "0.28.0", False),
        (DENSE, "0.29.0", True),  # _profile_cudagraph_memory
        (MOE, "0.28.0", True),  # MoE stays on the V1 runner until 0.29
        (MOE, "0.29.0", True),
    ],
)
def test_cuda_graphs_are_counted_where_the_runner_estimates_them(model_id: str, version: str, counted: bool) -> None:
    cap = _cap(model_id, version)
    assert cap.cuda_graph_counted is counted  # type: ignore[attr-defined]
    assert runs_v2_runner(engine_profile(EngineName.VLLM, version), catalog_model(model_id)) is (
        version >= "0.26.0" and (model_id == DENSE or version >= "0.29.0")
    )


def test_the_penalty_state_counts_from_0_27_on_the_last_stage_only() -> None:
    m = catalog_model(DENSE)
    per = v2_penalty_buffer_bytes(max_num_seqs=256, vocab_size=m.vocab_size)
    assert per == 256 * (m.vocab_size + -(-m.vocab_size // 32)) * 4  # int32 [256, V] and [256, V / 32]
    assert _cap(DENSE, "0.26.0").runner_buffer_bytes == 0  # type: ignore[attr-defined]  # resident, not subtracted
    cap = _cap(DENSE, "0.27.0")
    assert cap.runner_buffer_bytes == per  # type: ignore[attr-defined]
    assert _cap(MOE, "0.28.0").runner_buffer_bytes == 0  # type: ignore[attr-defined]  # the V1 runner
    # Pipeline stages: the sampler (and its state) lives on the last rank only, and so does the sampler's peak.
    pp = _cap(DENSE, "0.32.0", pipeline_parallel_size=2)
    first, last = pp.stages  # type: ignore[attr-defined]
    assert first.runner_buffer_bytes == 0 and last.runner_buffer_bytes > 0
    assert first.activation_peak_bytes <= last.activation_peak_bytes
