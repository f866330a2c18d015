"""The release boundaries of vLLM's capacity rules (kvfleet/engines/vllm) are the ones read from its released files.

kvfleet/sizing/data/vllm_release_markers.json is the output of tools/vllm_release_markers.py: for each marker, the
first release on PyPI whose files show it and the release before it, with the line read. These tests hold every
modelled boundary (engine profile rows, RoPE rules, scheduler defaults, parallel rules, quantization rows) to it,
so that the code and the evidence cannot drift apart. They read the stored file; the tool needs the network and is
not run here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from importlib import resources
from typing import Any, TypeVar

import pytest

from kvfleet.engines.vllm.profiles import (
    BNB_FP32_ABSMAX_SINCE,
    LARGE_GPU_BYTES,
    LAYOUT_RULES,
    VLLM_BATCH_DEFAULTS,
    VLLM_PROFILES,
    VLLM_ROPE_RULES,
)
from kvfleet.engines.vllm.quantization import QUANTIZATION
from kvfleet.errors import SizingError
from kvfleet.sizing.capacity import EngineSettings, capacity
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.engines import EngineName
from kvfleet.sizing.quantization import quantization_release
from kvfleet.sizing.units import GiB
from kvfleet.versions import Version, parse_version
from tests.sizing.conftest import load_tool, make_model
from tests.sizing.test_hybrid_state import qwen3_next

T = TypeVar("T")


def _data(name: str) -> dict[str, Any]:
    text = resources.files("kvfleet.sizing").joinpath("data", name).read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


MARKERS: dict[str, dict[str, Any]] = {m["name"]: m for m in _data("vllm_release_markers.json")["markers"]}


def first(name: str) -> Version:
    return parse_version(MARKERS[name]["first_release"])


def previous(name: str) -> str:
    return str(MARKERS[name]["previous_release"])


def first_row(rows: Sequence[T], since: Callable[[T], Version], holds: Callable[[T], bool]) -> Version:
    """The release of the first row where ``holds`` does, checking it keeps holding in every later row."""
    flags = [holds(r) for r in rows]
    assert any(flags), "no row holds"
    i = flags.index(True)
    assert all(flags[i:]), "the rows turn it off again"
    return since(rows[i])


def _ratio(line: str) -> float:
    m = re.search(r"min_num_layers \* ([0-9.]+)", line)
    assert m is not None, line
    return float(m[1])


# ---- the evidence itself ---------------------------------------------------------------------------------------


def test_every_marker_is_pinned_between_two_releases() -> None:
    data = _data("vllm_release_markers.json")
    assert data["read"] and data["index"].startswith("https://pypi.org/")
    for name, m in MARKERS.items():
        assert m["line"] and m["file"].startswith("vllm/"), name
        assert m["meaning"] and m["boundary"] and m["test"], name
        prev, new = m["previous_release"], m["first_release"]
        assert prev and new, name
        assert m["checked"][new] is True and m["checked"][prev] is False, name
        if "read up to" not in m["note"]:  # a fact bounded by a later marker is not read past it
            assert m["checked"][data["newest_release"]] is True, name  # still so in the newest release read
        for version in (prev, new):
            assert version in data["artifacts"], (name, version)
        assert parse_version(prev) <= parse_version(new), name


def test_the_stored_markers_are_the_tools() -> None:
    # The tool is loaded, not run: its markers must be those the stored file was written from.
    tool = load_tool("vllm_release_markers")
    stored = {name: (m["meaning"], m["boundary"], m["test"]) for name, m in MARKERS.items()}
    assert stored == {m.name: (m.meaning, m.boundary, m.test) for m in tool.MARKERS}


# ---- engine profiles -----------------------------------------------------------------------------------------


PROFILE_FLAGS: list[tuple[str, Callable[[Any], bool]]] = [
    ("hybrid-kv-cache-manager", lambda p: p.hybrid_kv_cache),
    ("chunked-local-attention-spec", lambda p: p.hybrid_chunked_local),
    ("v1-mamba-by-default", lambda p: p.mamba_state_cache),
    ("hybrid-group-ratio", lambda p: p.hybrid_group_ratio > 1.0),
    ("hybrid-group-ratio-1.5", lambda p: p.hybrid_group_ratio >= 1.5),
    ("triton-top-k-top-p", lambda p: not p.sort_sampler),
    ("cuda-graph-memory-profiled", lambda p: p.counts_cuda_graphs),
    # 0.92 stays the default where the cache is sized from the profile, not where the extensible cache takes 1.0.
    ("gpu-memory-utilization-0.92", lambda p: p.gpu_memory_utilization == 0.92 or p.extensible_kv_cache),
    ("kv-tokens-from-concurrency", lambda p: p.hybrid_tokens_from_concurrency),
    ("sliding-window-in-flight-tokens", lambda p: p.sliding_in_flight_batches == 2),
    ("hybrid-prefix-caching-by-default", lambda p: p.mamba_align_by_default),
    ("v2-model-runner-default", lambda p: p.v2_runner == "all"),
    ("v2-cudagraph-estimate", lambda p: p.v2_counts_cuda_graphs),
    ("budget-counts-persistent-allocations", lambda p: p.persistent_buffers_counted),
    ("v2-profiling-sampler-full-params", lambda p: p.sampler_extra_bytes_per_logit > 0),
    ("kv-dtype-must-match-model", lambda p: p.kv_dtype_must_match_model),
    ("extensible-kv-cache-default", lambda p: p.extensible_kv_cache),
    ("default-block-size-64", lambda p: p.block_size == 64),
]


@pytest.mark.parametrize(("marker", "holds"), PROFILE_FLAGS, ids=[m for m, _ in PROFILE_FLAGS])
def test_profile_rows_change_where_the_release_did(marker: str, holds: Callable[[Any], bool]) -> None:
    assert first_row(VLLM_PROFILES, lambda p: p.since, holds) == first(marker)


def test_profile_values_are_the_ones_read() -> None:
    assert VLLM_PROFILES[1].since == first("v1-engine-default")  # the first V1 row
    ratios = {p.hybrid_group_ratio for p in VLLM_PROFILES if p.since >= first("hybrid-group-ratio")}
    assert min(ratios) == _ratio(MARKERS["hybrid-group-ratio"]["line"])
    assert max(ratios) == _ratio(MARKERS["hybrid-group-ratio-1.5"]["line"])
    util = re.search(r"0\.\d+", MARKERS["gpu-memory-utilization-0.92"]["line"])
    estimated = [p for p in VLLM_PROFILES if not p.extensible_kv_cache]
    assert util is not None and estimated[-1].gpu_memory_utilization == float(util[0])
    # With the extensible cache an unset gpu_memory_utilization is 1.0 (CacheConfig.resolved_gpu_memory_utilization).
    extensible = next(p for p in VLLM_PROFILES if p.extensible_kv_cache)
    assert extensible.since == first("extensible-kv-cache-default")
    assert extensible.gpu_memory_utilization == 1.0


def test_every_profile_row_starts_at_a_pinned_release() -> None:
    pinned = {first(m) for m in MARKERS}
    assert all(p.since in pinned for p in VLLM_PROFILES[1:]), [p.since for p in VLLM_PROFILES]
    assert all("approx" not in p.note for p in VLLM_PROFILES)


# ---- RoPE rules and scheduler defaults -----------------------------------------------------------------------


def test_rope_rules_change_where_the_release_did() -> None:
    since = first_row(VLLM_ROPE_RULES, lambda r: r.since, lambda r: r.rules.longrope_default_original)
    assert since == first("longrope-default-original-length")
    since = first_row(VLLM_ROPE_RULES, lambda r: r.since, lambda r: "yarn" in r.rules.no_factor_types)
    assert since == first("yarn-not-rescaled")
    row = next(r for r in VLLM_ROPE_RULES if r.since == since)
    assert not row.rules.yarn_from_original
    assert set(row.rules.no_factor_types) == set(re.findall(r'"([^"]+)"', MARKERS["yarn-not-rescaled"]["line"]))


def test_scheduler_default_rules_change_where_the_release_did() -> None:
    def since(r: Any) -> Version:
        return r.since  # type: ignore[no-any-return]

    v1 = max(first("v1-engine-default"), first("batch-large-tier"))
    assert first_row(VLLM_BATCH_DEFAULTS, since, lambda r: len(r.tiers) > 1) == v1
    assert first_row(VLLM_BATCH_DEFAULTS, since, lambda r: r.tiers[-1].max_num_seqs == 256 and len(r.tiers) > 1) == (
        first("batch-seqs-by-tier")
    )
    assert first_row(
        VLLM_BATCH_DEFAULTS, since, lambda r: any(t.min_memory_bytes == LARGE_GPU_BYTES for t in r.tiers)
    ) == first("batch-70gib-tier")
    assert first_row(VLLM_BATCH_DEFAULTS, since, lambda r: any("a100" in t.excluded_names for t in r.tiers)) == first(
        "batch-a100-excluded"
    )
    assert first_row(
        VLLM_BATCH_DEFAULTS, since, lambda r: any(t.min_memory_bytes == 160 * GiB for t in r.tiers)
    ) == first("batch-160gib-tier")
    assert first_row(
        VLLM_BATCH_DEFAULTS,
        since,
        lambda r: any(t.min_memory_bytes == LARGE_GPU_BYTES and "gb10" in t.excluded_names for t in r.tiers),
    ) == first("batch-gb10-excluded")
    pinned = {first(m) for m in MARKERS} | {v1}
    assert all(r.since in pinned for r in VLLM_BATCH_DEFAULTS[1:])


# ---- parallel rules and quantization -------------------------------------------------------------------------


def test_fp8_moe_refusal_ends_where_refinement_begins() -> None:
    rules = {r.name: r for r in LAYOUT_RULES}
    assert rules["fp8-block-moe"].until == first("fp8-moe-block-refine")
    assert rules["fp8-block-moe-refined"].since == first("fp8-moe-block-refine")


def test_bitsandbytes_absmax_release() -> None:
    assert first("bnb-fp32-absmax") == BNB_FP32_ABSMAX_SINCE


def test_quantization_rows_are_the_releases_own_lists() -> None:
    data = _data("vllm_release_markers.json")
    lists = data["quantization_lists"]
    rows = QUANTIZATION["releases"]
    quant = [name for name in MARKERS if name.startswith("quant-")]
    floor = min(lists, key=parse_version)
    assert [r["since"] for r in rows] == sorted(
        {floor, *(MARKERS[q]["first_release"] for q in quant)}, key=parse_version
    )
    for row in rows:
        assert not row.get("approx"), row["since"]
        assert row["methods"] == lists[row["since"]]["methods"], row["since"]
        assert row.get("deprecated", []) == lists[row["since"]]["deprecated"], row["since"]


@pytest.mark.parametrize(
    ("marker", "method", "arrives"),
    [
        ("quant-nvfp4", "nvfp4", True),
        ("quant-modelopt_fp4", "modelopt_fp4", True),
        ("quant-mxfp4", "mxfp4", True),
        ("quant-gguf-removed", "gguf", False),
        ("quant-bitsandbytes-removed", "bitsandbytes", False),
    ],
)
def test_methods_come_and_go_where_the_release_did(marker: str, method: str, arrives: bool) -> None:
    before = quantization_release(EngineName.VLLM, previous(marker))
    after = quantization_release(EngineName.VLLM, MARKERS[marker]["first_release"])
    assert (before.loads(method), after.loads(method)) == (not arrives, arrives)


def test_fp_quant_rows_end_where_the_release_dropped_it() -> None:
    # fp_quant is listed from 0.11.1 (so not in the oldest rows): the row after the last that lists it drops it.
    rows = QUANTIZATION["releases"]
    last = max(i for i, r in enumerate(rows) if "fp_quant" in r["methods"])
    assert rows[last + 1]["since"] == MARKERS["quant-fp_quant-removed"]["first_release"]
    assert all("fp_quant" not in r["methods"] + r.get("deprecated", []) for r in rows[last + 1 :])
    before = quantization_release(EngineName.VLLM, previous("quant-fp_quant-removed"))
    after = quantization_release(EngineName.VLLM, MARKERS["quant-fp_quant-removed"]["first_release"])
    assert "fp_quant" in before.methods and "fp_quant" not in after.methods


def test_deprecated_methods_refused_from_the_release_that_refuses_them() -> None:
    before = quantization_release(EngineName.VLLM, previous("quant-deprecated-refused"))
    after = quantization_release(EngineName.VLLM, MARKERS["quant-deprecated-refused"]["first_release"])
    assert before.loads("fbgemm_fp8") and not after.loads("fbgemm_fp8")


# ---- what the pinned rows do to a plan --------------------------------------------------------------------------


def _blocks(layer_types: list[str], version: str) -> int:
    m = make_model(num_hidden_layers=len(layer_types), layer_types=layer_types, sliding_window=4096)
    s = EngineSettings(version=version, max_model_len=32768, kv_cache_memory_bytes=8 * GiB)
    return capacity(m, gpu_memory_bytes=80 * GiB, settings=s).num_blocks


def test_hybrid_grouping_ratio_follows_the_release() -> None:
    # kv_cache_utils.py: the smallest layer count is the group size, or the largest below the ratio.
    page = 16 * 2 * 8 * 128 * 2
    twelve_ten = ["sliding_attention"] * 12 + ["full_attention"] * 10  # 1.2: pads to 12 from 0.12.0
    assert _blocks(twelve_ten, "0.11.2") == 8 * GiB // (page * 10)
    assert _blocks(twelve_ten, "0.12.0") == 8 * GiB // (page * 12)
    fourteen_ten = ["sliding_attention"] * 14 + ["full_attention"] * 10  # 1.4: pads to 14 from 0.18.0
    assert _blocks(fourteen_ten, "0.17.1") == 8 * GiB // (page * 10)
    assert _blocks(fourteen_ten, "0.18.0") == 8 * GiB // (page * 14)


def test_sliding_windows_shrink_from_the_hybrid_manager_chunks_from_their_spec() -> None:
    gemma = catalog_model("google/gemma-3-12b-it")
    s = EngineSettings(max_model_len=32768, kv_cache_memory_bytes=8 * GiB)
    old = capacity(gemma, gpu_memory_bytes=80 * GiB, settings=replace(s, version="0.9.0.1"))
    new = capacity(gemma, gpu_memory_bytes=80 * GiB, settings=replace(s, version="0.9.1"))
    assert new.max_concurrency > 2 * old.max_concurrency
    # Llama 4's chunked local layers: FullAttentionSpec until ChunkedLocalAttentionSpec came.
    scout = catalog_model("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    s = EngineSettings(max_model_len=131072, kv_cache_memory_bytes=8 * GiB, tensor_parallel_size=8)
    old = capacity(scout, gpu_memory_bytes=80 * GiB, settings=replace(s, version="0.9.2"))
    new = capacity(scout, gpu_memory_bytes=80 * GiB, settings=replace(s, version="0.10.0"))
    assert any("chunked local attention layers the full context" in n for n in old.notes)
    assert new.max_concurrency > 2 * old.max_concurrency


def test_mamba_models_sized_from_the_release_that_runs_them_on_v1() -> None:
    s = EngineSettings(max_model_len=8192, kv_cache_memory_bytes=8 * GiB)
    with pytest.raises(SizingError, match=r"0\.10\.2 or later") as err:
        capacity(qwen3_next(), gpu_memory_bytes=141 * GiB, settings=replace(s, version="0.10.1"))
    assert err.value.field == "engine_version"
    assert capacity(qwen3_next(), gpu_memory_bytes=141 * GiB, settings=replace(s, version="0.10.2")).num_blocks > 0
