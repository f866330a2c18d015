"""EngineArgs (the settings the stacks hand the agent as JSON), the registry, and metric tables per release."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvfleet import contract
from kvfleet.engines import ENGINES, KV_CACHE_DTYPES, EngineArgs, adapter
from kvfleet.versions import parse_version

FULL = EngineArgs(
    tensor_parallel_size=2,
    pipeline_parallel_size=2,
    enable_expert_parallel=True,
    data_parallel_size=2,
    max_model_len=8192,
    max_num_seqs=64,
    max_num_batched_tokens=8192,
    gpu_memory_utilization=0.9,
    kv_cache_dtype="fp8",
    quantization="fp8",
    enable_prefix_caching=False,
    enforce_eager=True,
    kv_cache_memory_bytes=4 << 30,
    served_model_name="chat",
    limit_mm_per_prompt=(("image", 2), ("video", 0)),
    mm_encoder_tp_mode="data",
    mm_max_pixels=1003520,
    mamba_cache_dtype="bfloat16",
    mamba_ssm_cache_dtype="float32",
    speculative_method="eagle3",
    speculative_model="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
    num_speculative_tokens=3,
    hf_overrides='{"max_position_embeddings": 131072}',
)


@pytest.mark.parametrize(
    "args",
    [EngineArgs(), FULL, EngineArgs(max_model_len=1024, gpu_memory_utilization=1), EngineArgs(kv_cache_dtype="auto")],
)
def test_json_round_trip(args: EngineArgs) -> None:
    assert EngineArgs.from_json(args.to_json()) == args


def test_json_is_compact_sorted_and_leaves_defaults_out() -> None:
    assert EngineArgs().to_json() == "{}"
    text = EngineArgs(max_num_seqs=32, max_model_len=1024, enable_prefix_caching=True).to_json()
    assert text == '{"max_model_len": 1024, "max_num_seqs": 32}'
    # Every field travels when set: a new field cannot be forgotten by the JSON.
    assert set(json.loads(FULL.to_json())) == {f.name for f in dataclasses.fields(EngineArgs)}


def test_the_stacks_snake_case_keys() -> None:
    args = EngineArgs.from_json(
        '{"max_model_len": 1024, "max_num_seqs": 32, "enforce_eager": true,'
        ' "kv_cache_memory_bytes": 4194304, "served_model_name": "tiny"}'
    )
    assert args == EngineArgs(
        max_model_len=1024, max_num_seqs=32, enforce_eager=True, kv_cache_memory_bytes=4194304, served_model_name="tiny"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{nope", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('"max_model_len"', "must be a JSON object"),
        ("[" * 100_000, "not JSON"),
        ('{"max-model-len": 1024}', "unknown setting 'max-model-len'; known: "),
        ('{"max_model_len": 1024, "swap_space": 4}', "unknown setting 'swap_space'"),
        ('{"max_model_len": "1024"}', "max_model_len: must be a positive integer"),
        ('{"max_model_len": 0}', "max_model_len: must be a positive integer"),
        ('{"max_model_len": 1024.0}', "max_model_len: must be a positive integer"),
        ('{"max_num_seqs": true}', "max_num_seqs: must be a positive integer"),
        ('{"tensor_parallel_size": -2}', "tensor_parallel_size: must be a positive integer"),
        ('{"kv_cache_memory_bytes": true}', "kv_cache_memory_bytes: must be a positive integer"),
        ('{"kv_cache_memory_bytes": 1.5}', "kv_cache_memory_bytes: must be a positive integer"),
        ('{"gpu_memory_utilization": 1.5}', "gpu_memory_utilization: must be in (0, 1]"),
        ('{"gpu_memory_utilization": 0}', "gpu_memory_utilization: must be in (0, 1]"),
        ('{"gpu_memory_utilization": "0.9"}', "gpu_memory_utilization: must be in (0, 1]"),
        ('{"gpu_memory_utilization": true}', "gpu_memory_utilization: must be in (0, 1]"),
        ('{"gpu_memory_utilization": NaN}', "gpu_memory_utilization: must be"),
        ('{"gpu_memory_utilization": Infinity}', "gpu_memory_utilization: must be"),
        ('{"kv_cache_dtype": "int4"}', "kv_cache_dtype: must be one of"),
        ('{"enforce_eager": 1}', "enforce_eager: must be true or false"),
        ('{"enable_prefix_caching": null}', "enable_prefix_caching: must be true or false"),
        ('{"quantization": ""}', "quantization: must be a non-empty string"),
        ('{"served_model_name": 7}', "served_model_name: must be a non-empty string"),
        ('{"mamba_ssm_cache_dtype": "fp8"}', "mamba_ssm_cache_dtype: must be one of auto, float32"),
        ('{"mamba_cache_dtype": 4}', "mamba_cache_dtype: must be one of"),
    ],
)
def test_unknown_keys_and_bad_types_are_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        EngineArgs.from_json(text)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_constructor_checks_too() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineArgs(max_num_batched_tokens=0)
    assert EngineArgs(kv_cache_dtype=KV_CACHE_DTYPES[0]).kv_cache_dtype == "auto"


def test_registry() -> None:
    assert list(ENGINES) == ["vllm", "trtllm"]
    assert all(adapter(name).name == name for name in ENGINES)
    with pytest.raises(ValueError, match="unknown engine 'sglang'; known: vllm, trtllm"):
        adapter("sglang")


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_adapter_is_complete(name: str) -> None:
    a = ENGINES[name]
    assert a.title and a.metrics_path.startswith("/") and a.health_path.startswith("/")
    assert a.default_base_image
    # Rows from 0.0.0 up, ascending, onto the contract's engine signals (the agent keeps the other counters).
    since = [parse_version(v) for v, _ in a.metric_rows]
    assert since[0] == (0, 0, 0) and since == sorted(set(since))
    # The agent keeps its own counters and derives saturation: no engine metric maps onto those.
    engine_signals = {s.name for s in contract.SIGNALS} - {
        contract.REQUESTS_SHED.name,
        contract.SERVER_ERRORS.name,
        contract.REPLICA_SATURATION.name,
    }
    for _, names in a.metric_rows:
        assert set(names) <= engine_signals and all(names.values())
        # What both scaling signals are made of, in every release: saturation from KV use and running sequences.
        inputs = {contract.KV_CACHE_UTILIZATION.name, contract.REQUESTS_RUNNING.name, contract.REQUESTS_WAITING.name}
        assert inputs <= set(names)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("0.30.0", (0, 30, 0)),
        ("v0.11", (0, 11, 0)),
        ("0.10.1+cu128", (0, 10, 1)),
        ("1.2.0rc3", (1, 2, 0)),
        ("0.11.0.post1", (0, 11, 0)),
        (" 1.0.0-cu128 ", (1, 0, 0)),
    ],
)
def test_metric_names_read_engine_release_strings(text: str, parsed: tuple[int, int, int]) -> None:
    # The one version parser (kvfleet.versions) decides the row; an exact row start picks that row.
    assert parse_version(text) == parsed
    for a in ENGINES.values():
        since, names = a.metric_names(text)
        expected = [row for row in a.metric_rows if parse_version(row[0]) <= parsed][-1]
        assert (since, names) == (parse_version(expected[0]), expected[1])


@pytest.mark.parametrize("text", ["latest", "", "1", "nightly-2025", "0.x.1", "٠.١١.٠"])
def test_metric_names_refuse_what_is_not_a_release(text: str) -> None:
    for a in ENGINES.values():
        with pytest.raises(ValueError, match="expected a release"):
            a.metric_names(text)


def test_the_first_and_last_rows() -> None:
    for a in ENGINES.values():
        first, last = a.metric_rows[0], a.metric_rows[-1]
        assert a.metric_names("0.0.1") == ((0, 0, 0), first[1])
        assert a.metric_names("999.0.0") == (parse_version(last[0]), last[1])
