"""Model Runner V2 (vLLM 0.26 on for dense models, 0.29 on for all) as its source shows it: no CUDA-graph estimate
before 0.29, a penalty state of max_num_seqs x vocabulary int32 counted in the budget from 0.27, and a profiling
sampler of its own (data/vllm_release_markers.json: v2-cudagraph-estimate, budget-counts-persistent-allocations)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.sizing.capacity import Capacity, EngineSettings, capacity
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.engines import EngineName, engine_profile, runs_v2_runner, v2_penalty_buffer_bytes
from kvfleet.sizing.units import GiB

DENSE = "Qwen/Qwen2.5-7B"
MOE = "Qwen/Qwen3-30B-A3B"
BASE = EngineSettings(max_model_len=8192, max_num_seqs=256, max_num_batched_tokens=2048)


def _cap(model_id: str, version: str, pipeline_parallel_size: int = 1) -> Capacity:
    s = replace(BASE, version=version, pipeline_parallel_size=pipeline_parallel_size)
    return capacity(catalog_model(model_id), gpu_memory_bytes=80 * GiB, settings=s, accelerator_name="H100")


@pytest.mark.parametrize(
    ("model_id", "version", "v2", "counted"),
    [
        (DENSE, "0.25.0", False, True),  # the V1 runner, graphs counted since 0.20
        (DENSE, "0.26.0", True, False),  # Model Runner V2's profile_cudagraph_memory returns 0
        (DENSE, "0.28.0", True, False),
        (DENSE, "0.29.0", True, True),  # _profile_cudagraph_memory
        (MOE, "0.28.0", False, True),  # MoE stays on the V1 runner until 0.29
        (MOE, "0.29.0", True, True),
    ],
)
def test_cuda_graphs_are_counted_where_the_runner_estimates_them(
    model_id: str, version: str, v2: bool, counted: bool
) -> None:
    assert runs_v2_runner(engine_profile(EngineName.VLLM, version), catalog_model(model_id)) is v2
    assert _cap(model_id, version).cuda_graph_counted is counted


def test_the_penalty_state_counts_from_0_27_on_the_last_stage_only() -> None:
    m = catalog_model(DENSE)
    per = v2_penalty_buffer_bytes(max_num_seqs=256, vocab_size=m.vocab_size)
    # Qwen2.5-7B: int32 [256, 152,064] and [256, 4,752].
    assert per == 256 * (152064 + 4752) * 4 and m.vocab_size == 152064
    assert _cap(DENSE, "0.26.0").runner_buffer_bytes == 0  # resident, but 0.26 does not subtract it
    assert _cap(DENSE, "0.27.0").runner_buffer_bytes == per
    assert _cap(MOE, "0.28.0").runner_buffer_bytes == 0  # the V1 runner
    # Pipeline stages: the sampler (and its state) lives on the last rank only, and so does the sampler's peak.
    pp = _cap(DENSE, "0.32.0", pipeline_parallel_size=2)
    first, last = pp.stages
    assert first.runner_buffer_bytes == 0 and last.runner_buffer_bytes > 0
    assert first.activation_peak_bytes <= last.activation_peak_bytes
