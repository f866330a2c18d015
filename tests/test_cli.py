"""The ``kvfleet`` command line: output shapes, and one stderr line with exit 2 for every user error.

Commands run in-process through ``kvfleet.cli.main`` (fast); one test runs the real executable to
prove the exit status and stderr a shell sees.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvfleet.cli import main
from kvfleet.sizing.hardware import accelerator
from kvfleet.sizing.units import GiB

REPO = Path(__file__).resolve().parents[1]
LLAMA_8B = "meta-llama/Llama-3.1-8B"

# The project brief's example architecture: 32 layers x 8 KV heads x head dim 128 x (K + V) x 2 bytes.
BRIEF_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
BRIEF_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout, stderr of one in-process invocation (argparse errors raise SystemExit)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code: int, err: str, *needles: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{err}"
    line = lines[0]
    assert line.startswith("kvfleet: error:"), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    assert err == ""
    return json.loads(out)


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    d = tmp_path / "brief-8b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(BRIEF_CONFIG), encoding="utf-8")
    return d


def write_config(tmp_path: Path, name: str, text: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(text, encoding="utf-8")
    return d


# ---- capacity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
def test_capacity_json_llama_8b_on_h100(capsys: pytest.CaptureFixture[str], version: str) -> None:
    cap = run_json(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--engine-version", version)
    assert cap["model"] == LLAMA_8B
    assert cap["kv_bytes_per_token_per_gpu"] == 131072
    assert cap["gpu_memory_gib"] == 79.22  # what CUDA reports on an H100 80GB
    assert cap["weight_precision"] == "bf16"
    assert 14.5 < cap["weights_gib_per_gpu"] < 15.5  # 8.03e9 parameters x 2 bytes
    assert 0 < cap["activation_peak_gib"] < 10
    assert 0 < cap["kv_cache_gib_per_gpu"] < cap["gpu_memory_gib"]
    assert cap["kv_cache_tokens"] > 0
    assert cap["kv_cache_tokens"] == cap["num_blocks"] * cap["block_size"]
    # The tokens fit in the bytes the cache was given, to within one block.
    kv_bytes = cap["kv_cache_gib_per_gpu"] * GiB
    assert cap["kv_cache_tokens"] * 131072 <= kv_bytes + 0.001 * GiB
    assert kv_bytes - cap["kv_cache_tokens"] * 131072 < cap["block_size"] * 131072 + 0.001 * GiB
    assert cap["max_concurrency"] == pytest.approx(cap["kv_cache_tokens"] / cap["max_model_len"], abs=0.01)
    assert cap["max_model_len"] == 131072  # the model's max_position_embeddings by default
    assert 1 < cap["max_concurrency"] < 10
    # H100: CUDA reports 79.22 GiB of the 80 GiB AWS lists (vllm PR 10511's log); the engine budgets that.
    assert cap["gpu_memory_gib"] == pytest.approx(79.22, abs=0.001)
    assert cap["requested_gib"] == pytest.approx(79.22 * cap["gpu_memory_utilization"], abs=0.001)
    if version == "0.32.0":
        # Every term of the budget adds up to what vLLM requested (utilization x total).
        assert not cap["extensible_kv_cache"] and cap["gpu_memory_utilization"] == 0.92
        terms = ("weights_gib_per_gpu", "runner_buffer_gib", "activation_peak_gib", "non_torch_gib")
        total = sum(cap[t] for t in terms) + cap["kv_cache_gib_per_gpu"]
        total += cap["cuda_graph_gib"] if cap["cuda_graph_counted"] else 0
        assert total == pytest.approx(cap["requested_gib"], abs=0.005)
    else:
        # The extensible cache: every term adds up to the device's memory, the CUDA context, the margin and the
        # transient kept free included; utilization 1.0 is only a cap.
        assert cap["extensible_kv_cache"] and cap["gpu_memory_utilization"] == 1.0 and cap["block_size"] == 64
        terms = ("weights_gib_per_gpu", "runner_buffer_gib", "non_torch_gib", "cuda_graph_gib", "cuda_context_gib")
        total = sum(cap[t] for t in terms) + cap["kv_margin_gib"] + cap["transient_gib"] + cap["kv_cache_gib_per_gpu"]
        assert total == pytest.approx(cap["gpu_memory_gib"], abs=0.005)
        assert cap["transient_gib"] >= cap["activation_peak_gib"]
        assert cap["kv_margin_gib"] == pytest.approx(max(1.0, 0.75 * cap["transient_gib"]), abs=0.002)
    assert cap["problems"] == []


def test_capacity_gpu_memory_gib_equals_catalog_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert accelerator("H100").memory_bytes == 80 * GiB  # as AWS reports it
    assert accelerator("H100").usable_memory_bytes == round(79.22 * GiB)  # as CUDA reports it
    by_name = run_json(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100")
    by_size = run_json(capsys, "capacity", "--model", LLAMA_8B, "--gpu-memory-gib", "79.22")
    assert by_size == by_name
    # Without a log figure the AWS figure is used: A10G.
    a10g = run_json(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "A10G", "--max-model-len", "4096")
    assert a10g["gpu_memory_gib"] == pytest.approx(22.352, abs=0.001)


def test_capacity_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    cap = run_json(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100")
    code, out, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100")
    assert code == 0, err
    assert err == ""
    assert "KV cache tokens" in out
    assert "131,072" in out  # KV bytes / token
    assert f"{cap['kv_cache_tokens']:,}" in out
    assert f"{cap['num_blocks']:,}" in out


@pytest.mark.parametrize("as_file", [False, True], ids=["directory", "config.json"])
def test_capacity_from_local_config(capsys: pytest.CaptureFixture[str], config_dir: Path, as_file: bool) -> None:
    ref = config_dir / "config.json" if as_file else config_dir
    cap = run_json(capsys, "capacity", "--model", str(ref), "--gpu", "H100")
    assert cap["kv_bytes_per_token_per_gpu"] == BRIEF_KV_BYTES_PER_TOKEN == 131072
    assert cap["max_model_len"] == 8192  # the config's max_position_embeddings
    assert cap["weight_precision"] == "bf16"
    assert cap["kv_cache_tokens"] > 8192
    assert cap["kv_groups"] == [
        {"attention": "full", "window_tokens": None, "layers": 32, "bytes_per_token_per_layer": 4096}
    ]


def test_local_config_matches_catalog_llama(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Llama 3.1's length and rope scaling too: vLLM's RoPE cache (131,072 positions) is part of the model's memory.
    llama31 = {
        **BRIEF_CONFIG,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    config_dir = write_config(tmp_path, "brief-3.1-8b", json.dumps(llama31))
    local = run_json(capsys, "capacity", "--model", str(config_dir), "--gpu", "H100", "--max-model-len", "8192")
    catalog = run_json(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--max-model-len", "8192")
    for key in ("kv_bytes_per_token_per_gpu", "weights_gib_per_gpu", "kv_cache_tokens", "num_blocks"):
        assert local[key] == catalog[key], key


def test_capacity_tp2_halves_kv_bytes_per_token(capsys: pytest.CaptureFixture[str]) -> None:
    cap = run_json(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--tp", "2")
    assert cap["tensor_parallel_size"] == 2
    assert cap["kv_bytes_per_token_per_gpu"] == 65536


def test_capacity_fp8_kv_halves_kv_bytes_per_token(capsys: pytest.CaptureFixture[str]) -> None:
    cap = run_json(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--kv-cache-dtype", "fp8")
    assert cap["kv_bytes_per_token_per_gpu"] == 65536
    assert cap["kv_cache_dtype"].startswith("fp8")


# ---- capacity: bad input -------------------------------------------------------------------------


def test_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--model", "no/such-model", "--gpu", "H100")
    one_error_line(code, err, "unknown model", "'no/such-model'", "model")


def test_unknown_model_suggests_near_names(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--model", "meta-llama/Llama-3.1-8", "--gpu", "H100")
    one_error_line(code, err, "unknown model", "did you mean", LLAMA_8B)


def test_impossible_tensor_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--tp", "3")
    line = one_error_line(code, err, "tensor_parallel_size", "3", "32 attention heads")
    assert "1, 2, 4, 8" in line  # the divisors to choose from


@pytest.mark.parametrize("flag", ["--max-model-len", "--max-num-seqs", "--tp", "--block-size"])
def test_negative_lengths_rejected_by_argparse(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    code, out, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", flag, "-5")
    one_error_line(code, err, f"argument {flag}", "must be positive, got -5")
    assert out == ""


def test_non_numeric_length(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--max-model-len", "lots")
    one_error_line(code, err, "argument --max-model-len", "expected a whole number, got 'lots'")


def test_malformed_config_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    d = write_config(tmp_path, "broken", "{not json")
    code, _, err = run(capsys, "capacity", "--model", str(d), "--gpu", "H100")
    one_error_line(code, err, "model", "not valid JSON", "line 1", str(d / "config.json"))


def test_config_kv_heads_must_divide_heads(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    d = write_config(tmp_path, "kv5", json.dumps({**BRIEF_CONFIG, "num_key_value_heads": 5}))
    code, _, err = run(capsys, "capacity", "--model", str(d), "--gpu", "H100")
    one_error_line(code, err, "num_key_value_heads", "5", "32")


def test_config_missing_num_hidden_layers(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = {k: v for k, v in BRIEF_CONFIG.items() if k != "num_hidden_layers"}
    d = write_config(tmp_path, "nolayers", json.dumps(cfg))
    code, _, err = run(capsys, "capacity", "--model", str(d), "--gpu", "H100")
    one_error_line(code, err, "num_hidden_layers", "missing")


def test_config_directory_without_config_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "capacity", "--model", str(tmp_path), "--gpu", "H100")
    one_error_line(code, err, "model", "no config.json", str(tmp_path))


def test_unknown_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H900")
    one_error_line(code, err, "gpu:", "unknown accelerator 'H900'", "H100", "--gpu-memory-gib")


def test_an_exact_memory_keeps_the_device_and_its_engine_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    # vllm/engine/arg_utils.py get_batch_defaults (0.32.0): 2,048 tokens / 256 sequences for an A100 at any memory,
    # 8,192 / 1,024 for another device of >= 70 GiB. 79.2 GiB: what CUDA reports for an 80 GB A100 or H100.
    def knobs(*gpu: str) -> tuple[float, int, int]:
        code, out, err = run(capsys, "capacity", "--model", LLAMA_8B, *gpu, "--json")
        assert code == 0, err
        d = json.loads(out)
        return d["gpu_memory_gib"], d["max_num_batched_tokens"], d["max_num_seqs"]

    assert knobs("--gpu", "A100-80GB", "--gpu-memory-gib", "79.2") == (79.2, 2048, 256)
    assert knobs("--gpu-memory-gib", "79.2") == (79.2, 8192, 1024)  # no device named: memory alone decides
    assert knobs("--gpu", "H100", "--gpu-memory-gib", "79.2") == (79.2, 8192, 1024)


def test_capacity_needs_a_device_or_a_memory(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--model", LLAMA_8B)
    one_error_line(code, err, "gpu:", "--gpu NAME", "--gpu-memory-gib")


def test_rope_scaling_flag_extends_the_context(capsys: pytest.CaptureFixture[str]) -> None:
    # Qwen2.5-72B-Instruct's model card: add rope_scaling yarn factor 4 over 32,768 for 128K.
    qwen = (
        "capacity",
        "--model",
        "Qwen/Qwen2.5-72B-Instruct",
        "--gpu",
        "H100",
        "--tp",
        "4",
        "--max-model-len",
        "131072",
    )
    code, _, err = run(capsys, *qwen)
    one_error_line(code, err, "max_model_len:", "32,768", "--rope-scaling", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    rope = '{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}'
    code, out, err = run(capsys, *qwen, "--rope-scaling", rope, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["max_model_len"] == d["max_model_len_limit"] == 131072
    assert d["hf_overrides"]["max_position_embeddings"] == 131072
    assert d["hf_overrides"]["rope_scaling"]["rope_type"] == "yarn"


def test_plan_with_rope_scaling_starts_vllm_with_the_override(capsys: pytest.CaptureFixture[str]) -> None:
    plan = ("plan", "--model", "Qwen/Qwen2.5-1.5B-Instruct", "--max-input-tokens", "100000", "--max-output-tokens")
    rope = '{"rope_type": "yarn", "factor": 4}'
    code, out, err = run(capsys, *plan, "1000", "--concurrency", "2", "--rope-scaling", rope, "--json")
    assert code == 0, err

    def commands(node: Any) -> list[str]:
        if isinstance(node, dict):
            found = [node["command"]] if isinstance(node.get("command"), str) else []
            return found + [c for v in node.values() for c in commands(v)]
        return [c for v in node for c in commands(v)] if isinstance(node, list) else []

    best = commands(json.loads(out))[0]
    assert "--max-model-len 101000" in best
    assert "--hf-overrides '{" in best  # quoted: the line pastes into a shell


@pytest.mark.parametrize(
    ("value", "needle"), [("{yarn", "not JSON"), ("[1]", "JSON object"), ('{"factor": 4}', "rope_type")]
)
def test_bad_rope_scaling_flag(capsys: pytest.CaptureFixture[str], value: str, needle: str) -> None:
    code, _, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--rope-scaling", value)
    one_error_line(code, err, "rope_scaling", needle)


def test_unknown_kv_cache_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--kv-cache-dtype", "int3")
    one_error_line(code, err, "kv_cache_dtype", "'int3'", "fp8")


@pytest.mark.parametrize("value", ["1.5", "0", "-0.2", "nan"])
def test_gpu_memory_utilization_out_of_range(capsys: pytest.CaptureFixture[str], value: str) -> None:
    code, _, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--gpu-memory-utilization", value)
    one_error_line(code, err, "argument --gpu-memory-utilization", value)


def test_max_model_len_above_max_position_embeddings(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--max-model-len", "131073")
    # Llama 3.1's llama3 scaling leaves max_position_embeddings as is (vllm/config/model.py, 0.32.0).
    one_error_line(code, err, "max_model_len", "131,073", "max_position_embeddings 131,072", "at most 131,072")


def test_an_absurd_position_count_is_named_as_the_rope_cache(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # vLLM builds its RoPE cos/sin cache for every position the config declares, on every rank: a config claiming
    # 10^12 positions cannot start on any layout, and the hint says why instead of suggesting more parallelism.
    cfg = write_config(tmp_path, "absurd", json.dumps({**BRIEF_CONFIG, "max_position_embeddings": 10**12}))
    code, _, err = run(capsys, "capacity", "--model", str(cfg), "--gpu", "H100", "--max-model-len", "8192")
    line = one_error_line(code, err, "RoPE cache alone takes", "1,000,000,000,000 positions", "max_position_embeddings")
    assert "tensor_parallel_size" not in line
    # A linear scaling factor lengthens the cache the same way (LinearScalingRotaryEmbedding: positions x factor).
    scaled = {**BRIEF_CONFIG, "rope_scaling": {"rope_type": "linear", "factor": 1e6}}
    cfg = write_config(tmp_path, "scaled", json.dumps(scaled))
    code, _, err = run(capsys, "capacity", "--model", str(cfg), "--gpu", "H100", "--max-model-len", "8192")
    one_error_line(code, err, "RoPE cache alone takes", "8,192,000,000 positions", "max_position_embeddings 8,192")


def test_max_model_len_above_local_config_limit(capsys: pytest.CaptureFixture[str], config_dir: Path) -> None:
    code, _, err = run(capsys, "capacity", "--model", str(config_dir), "--gpu", "H100", "--max-model-len", "8193")
    one_error_line(code, err, "max_model_len", "8,192 (max_position_embeddings 8,192)")


def test_model_that_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "capacity", "--model", "meta-llama/Llama-3.1-70B", "--gpu", "A10G", "--json")
    one_error_line(code, err, "the engine would not start", "no memory left for the KV cache", "GiB")
    cap = json.loads(out)  # the breakdown still goes to stdout
    assert cap["kv_cache_gib_per_gpu"] == 0
    assert cap["kv_cache_tokens"] == 0
    assert cap["weights_gib_per_gpu"] > cap["requested_gib"]
    assert len(cap["problems"]) == 1


def test_unknown_quantization(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--quantization", "int3")
    one_error_line(code, err, "quantization", "'int3'", "awq")


def test_quantized_checkpoint_rejects_other_precision(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--model", "openai/gpt-oss-120b", "--gpu", "H100", "--quantization", "bf16")
    one_error_line(code, err, "quantization", "already quantized as mxfp4")


def test_bad_engine_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--engine-version", "banana")
    one_error_line(code, err, "engine_version", "'banana'")


def test_infinite_gpu_memory_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu-memory-gib", "inf")
    one_error_line(code, err, "--gpu-memory-gib")


# ---- plan ----------------------------------------------------------------------------------------

PLAN_8B = (
    "plan",
    "--model",
    LLAMA_8B,
    "--max-input-tokens",
    "2048",
    "--max-output-tokens",
    "512",
    "--concurrency",
    "8",
)


def test_plan_from_flags_json(capsys: pytest.CaptureFixture[str]) -> None:
    plans = run_json(capsys, *PLAN_8B)
    assert len(plans) == 1
    p = plans[0]
    assert p["deployment"] == "plan"
    assert p["model"] == LLAMA_8B
    assert p["platform"] == "sagemaker"
    cands = p["candidates"]
    assert len(cands) == 5  # --top default
    prices = [c["fleet_usd_per_hour"] for c in cands]
    assert prices == sorted(prices)
    assert prices[0] > 0
    for c in cands:
        assert c["instance_type"].startswith("ml.")
        assert c["concurrency_per_replica"] == 8
        assert c["limited_by"] == "concurrency-target"
        assert c["cache_concurrency"] >= 8
        args = c["engine_settings"]["settings"]
        assert c["engine_settings"]["engine"] == "vllm"
        assert args["max-num-seqs"] == c["concurrency_per_replica"]
        assert args["max-model-len"] == 2560
        assert args["tensor-parallel-size"] == c["tensor_parallel_size"]
        assert c["memory"]["max_num_seqs"] == 8
        assert c["memory"]["kv_bytes_per_token_per_gpu"] == 131072 // c["tensor_parallel_size"]
        assert c["fleet_usd_per_hour"] == pytest.approx(c["instance_count"] * c["usd_per_hour_per_instance"], abs=1e-3)
        cli = c["engine_settings"]["command"].split()
        assert cli[:2] == ["vllm", "serve"]
        assert cli[cli.index("--max-num-seqs") + 1] == "8"
    rej = p["rejections"]
    assert len(rej) > 10
    assert all(r["reason"] for r in rej)
    assert all(
        set(r)
        == {
            "instance_type",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "expert_parallel",
            "weight_precision",
            "kv_cache_dtype",
            "reason",
        }
        for r in rej
    )
    reasons = " | ".join(r["reason"] for r in rej)
    assert "Neuron" in reasons
    assert "no memory left for the KV cache" in reasons
    g4dn = next(r for r in rej if r["instance_type"] == "g4dn.xlarge")
    assert g4dn["tensor_parallel_size"] == 1
    assert "GiB" in g4dn["reason"]


def test_plan_top_and_price_ceiling(capsys: pytest.CaptureFixture[str]) -> None:
    plans = run_json(capsys, *PLAN_8B, "--top", "2", "--max-usd-per-hour", "1.3")
    cands = plans[0]["candidates"]
    assert 1 <= len(cands) <= 2
    assert all(c["fleet_usd_per_hour"] <= 1.3 for c in cands)
    assert any("ceiling" in r["reason"] for r in plans[0]["rejections"])


def test_plan_pinned_instance_and_ec2(capsys: pytest.CaptureFixture[str]) -> None:
    plans = run_json(capsys, *PLAN_8B, "--platform", "ec2", "--instance-type", "g5.xlarge")
    assert plans[0]["platform"] == "ec2"
    assert [c["instance_type"] for c in plans[0]["candidates"]] == ["g5.xlarge"]


def test_plan_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *PLAN_8B)
    assert code == 0, err
    assert err == ""
    assert "chosen: ml." in out
    assert "vllm serve <model> --tensor-parallel-size 1" in out
    assert "--max-num-seqs 8" in out
    assert "rejected" in out


def test_plan_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys,
        "plan",
        "--model",
        "meta-llama/Llama-3.1-405B",
        "--family",
        "g5",
        "--max-input-tokens",
        "100000",
        "--max-output-tokens",
        "8000",
        "--concurrency",
        "64",
    )
    one_error_line(code, err, "no candidate fits", "Llama-3.1-405B", "108000-token", "needs", "GiB", "would fit with")
    assert out == ""


def test_plan_needs_model_or_environment(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", "--max-input-tokens", "10")
    one_error_line(code, err, "--model", "--max-output-tokens")


def test_plan_unknown_family_names_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, *PLAN_8B, "--family", "zz")
    one_error_line(code, err, "allowed families (zz)", "any instance family")


def test_plan_unknown_precision(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, *PLAN_8B, "--precision", "fp3")
    one_error_line(code, err, "weight_precisions", "'fp3'")


def test_plan_infinite_peak_rps_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, *PLAN_8B, "--peak-rps", "inf")
    one_error_line(code, err, "--peak-rps")


@pytest.mark.parametrize(
    ("env", "deployment", "model"),
    [
        ("dev", "chat", LLAMA_8B),
        ("staging", "assistant", "Qwen/Qwen2.5-32B"),
        ("prod", "chat-70b", "meta-llama/Llama-3.3-70B-Instruct"),
        ("platform", "coder", "Qwen/Qwen2.5-7B"),
    ],
)
def test_plan_environment_files(capsys: pytest.CaptureFixture[str], env: str, deployment: str, model: str) -> None:
    plans = run_json(capsys, "plan", str(REPO / "environments" / f"{env}.yaml"))
    assert [p["deployment"] for p in plans] == [deployment]
    assert plans[0]["model"] == model
    cands = plans[0]["candidates"]
    assert cands
    prices = [c["fleet_usd_per_hour"] for c in cands]
    assert prices == sorted(prices)
    for c in cands:
        # SageMaker names its instance types ml.*; the EC2 and EKS examples use EC2 names.
        assert c["instance_type"].startswith("ml.") == (env in ("dev", "prod"))
        assert c["replicas"] >= 1
        assert c["engine_settings"]["settings"]["max-num-seqs"] == c["concurrency_per_replica"]
    if env == "prod":
        assert all(c["fleet_usd_per_hour"] <= 500 for c in cands)
        families = {"p4d", "p4de", "p5", "p5e", "p5en", "g6e"}
        assert all(c["instance_type"].split(".")[1] in families for c in cands)
        assert all(c["engine_settings"]["settings"]["max-model-len"] == 16384 + 2048 for c in cands)


def test_plan_missing_environment_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", str(REPO / "environments" / "nope.yaml"))
    # The error lists the environments that do exist, so a typo is one look away from the fix.
    found = ", ".join(sorted(p.stem for p in (REPO / "environments").glob("*.yaml")))
    assert "dev" in found
    one_error_line(code, err, "environment", "no environment file", "nope.yaml", f"found: {found}")


def test_plan_invalid_environment_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    text = (REPO / "environments" / "dev.yaml").read_text(encoding="utf-8")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("      itl_ms: 60\n", "      itl_ms: 60\n      bogus: 1\n"), encoding="utf-8")
    code, out, err = run(capsys, "plan", str(bad))
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    first = err.splitlines()[0]
    line = text.splitlines().index("      itl_ms: 60") + 2  # the inserted key's line, 1-based
    assert (
        first
        == f"kvfleet: error: {bad}:{line}: deployments[0].workload.bogus: unknown key; remove it or check its spelling"
    )


# ---- catalogs ------------------------------------------------------------------------------------

REQUIRED_MODELS = {
    "meta-llama/Llama-2-7b-chat-hf",
    "meta-llama/Meta-Llama-3-8B",
    "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-3.3-70B-Instruct",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "mistralai/Mistral-7B-Instruct-v0.3",
    "mistralai/Mixtral-8x7B-v0.1",
    "Qwen/Qwen2-7B-Instruct",
    "Qwen/Qwen2.5-7B",
    "Qwen/Qwen3-8B",
    "Qwen/Qwen3-30B-A3B",
    "google/gemma-2-9b",
    "google/gemma-3-12b-it",
    "microsoft/Phi-3-mini-4k-instruct",
    "microsoft/phi-4",
    "deepseek-ai/DeepSeek-V2-Lite",
    "deepseek-ai/DeepSeek-V3",
    "deepseek-ai/DeepSeek-R1",
    "openai/gpt-oss-120b",
}


def test_models_json(capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_json(capsys, "models")
    assert len(rows) >= 25
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows)  # ids are unique
    assert sorted(REQUIRED_MODELS - by_id.keys()) == []
    llama = by_id[LLAMA_8B]
    assert (llama["layers"], llama["kv_heads"], llama["head_dim"]) == (32, 8, 128)
    assert llama["kv_bytes_per_token"] == 131072
    assert llama["max_position_embeddings"] == 131072
    assert llama["params_b"] == pytest.approx(8.03, abs=0.05)
    for moe in ("Qwen/Qwen3-30B-A3B", "mistralai/Mixtral-8x7B-v0.1", "deepseek-ai/DeepSeek-V3", "openai/gpt-oss-120b"):
        assert by_id[moe]["active_params_b"] < by_id[moe]["params_b"], moe
    for moe in ("Qwen/Qwen3-30B-A3B", "deepseek-ai/DeepSeek-V3", "meta-llama/Llama-4-Scout-17B-16E-Instruct"):
        assert by_id[moe]["active_params_b"] < 0.2 * by_id[moe]["params_b"], moe
    for dense in ("Qwen/Qwen3-8B", "Qwen/Qwen2.5-7B", "microsoft/phi-4", "google/gemma-2-9b"):
        assert 0.85 * by_id[dense]["params_b"] <= by_id[dense]["active_params_b"] <= by_id[dense]["params_b"], dense
    # Untied input embedding (128256 x 4096, a lookup) is not an active parameter.
    assert llama["params_b"] - llama["active_params_b"] == pytest.approx(128256 * 4096 / 1e9, abs=0.011)
    assert by_id["openai/gpt-oss-120b"]["precision"] == "mxfp4"
    assert all(r["kv_bytes_per_token"] > 0 and r["source"] for r in rows)


def test_models_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "models")
    assert code == 0, err
    assert "131,072" in out
    assert "Llama-3.1-8B" in out


def test_instances_json(capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_json(capsys, "instances")
    by_name = {r["instance_type"]: r for r in rows}
    g5 = by_name["g5.xlarge"]
    assert g5["gpu_memory_gib"] == 22.352
    assert g5["accelerator"] == "A10G"
    assert g5["kind"] == "gpu"
    assert g5["count"] == 1
    inf2 = [r for n, r in by_name.items() if n.startswith("inf2.")]
    assert inf2
    assert all(r["kind"] == "neuron" for r in inf2)
    assert not any(n.startswith("ml.") for n in by_name)


def test_instances_sagemaker_json(capsys: pytest.CaptureFixture[str]) -> None:
    everything = run_json(capsys, "instances")
    rows = run_json(capsys, "instances", "--platform", "sagemaker")
    assert rows
    assert len(rows) < len(everything)
    assert all(r["instance_type"].startswith("ml.") for r in rows)
    assert all(r["sagemaker_endpoint"] is True for r in rows)
    assert "ml.g5.xlarge" in {r["instance_type"] for r in rows}


def test_instances_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "instances", "--platform", "ec2")
    assert code == 0, err
    assert "g5.xlarge" in out
    assert "(ec2)" in out


# ---- usage ---------------------------------------------------------------------------------------


def test_no_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys)
    one_error_line(code, err, "required", "command")
    assert out == ""


def test_unknown_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "bogus")
    one_error_line(code, err, "invalid choice: 'bogus'", "capacity", "plan")
    assert out == ""


def test_subcommand_error_points_at_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--gpu", "H100")
    one_error_line(code, err, "--model", "(see kvfleet capacity --help)")


def test_top_level_error_points_at_kvfleet_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "bogus")
    line = one_error_line(code, err)
    assert "kvfleet kvfleet" not in line


def _kvfleet_command() -> list[str]:
    script = Path(sys.executable).parent / "kvfleet"
    if script.is_file():
        return [str(script)]
    found = shutil.which("kvfleet")
    return [found] if found else [sys.executable, "-m", "kvfleet.cli"]


def test_executable_exit_status_and_stderr() -> None:
    proc = subprocess.run(
        [*_kvfleet_command(), "capacity", "--model", "no/such-model", "--gpu", "H100"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvfleet: error: model: unknown model 'no/such-model'")


# ---- planning errors name the file's line and key ---------------------------------------------------


def _dev_with(tmp_path: Path, old: str, new: str) -> tuple[Path, str]:
    text = (REPO / "environments" / "dev.yaml").read_text(encoding="utf-8")
    assert old in text, old
    text = text.replace(old, new, 1)
    f = tmp_path / "e.yaml"
    f.write_text(text, encoding="utf-8")
    return f, text


def _line_of(text: str, needle: str) -> int:
    [n] = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    return n


@pytest.mark.parametrize(
    ("old", "new", "needle", "field"),
    [
        # The planner calls these instance_type and weight_precisions; the file's keys are under sizing.
        (
            "      kv_cache_dtypes: [auto, fp8]",
            "      instance_type: ml.nope.xlarge",
            "instance_type:",
            "sizing.instance_type",
        ),
        (
            "      kv_cache_dtypes: [auto, fp8]",
            "      weight_precisions: [bogus]",
            "weight_precisions:",
            "sizing.weight_precisions",
        ),
        ("id: meta-llama/Llama-3.1-8B", "id: no/such-model", "id: no/such-model", "model.id"),
    ],
    ids=["instance-type", "precision", "model"],
)
def test_plan_error_names_the_files_line_and_key(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, *, old: str, new: str, needle: str, field: str
) -> None:
    f, text = _dev_with(tmp_path, old, new)
    code, _, err = run(capsys, "plan", str(f))
    line = one_error_line(code, err)
    assert line.startswith(f"kvfleet: error: {f}:{_line_of(text, needle)}: deployments[0].{field}: "), line


def test_nothing_fits_speaks_of_what_the_file_says(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Too long for the model at any size: the planner halves the context to say what would fit, and used to fail
    # on its own halved max_input_tokens with "avg_input_tokens 300000 exceeds max_input_tokens (200000)".
    f, text = _dev_with(tmp_path, "max_input_tokens: 4096", "max_input_tokens: 400000")
    f.write_text(text.replace("avg_input_tokens: 1500", "avg_input_tokens: 300000"), encoding="utf-8")
    code, _, err = run(capsys, "plan", str(f))
    line = one_error_line(code, err, "no candidate fits", "max_position_embeddings")
    assert line.startswith(f"kvfleet: error: {f}:{_line_of(text, '- name: chat')}: deployments[0]: "), line
    assert "exceeds max_input_tokens" not in line


def test_plan_shows_percentiles_under_the_planned_load(capsys: pytest.CaptureFixture[str]) -> None:
    """With a peak rate: Poisson arrivals over the planned replicas, queued as the target routes them."""
    for platform, routing in (("sagemaker", "least_outstanding"), ("eks", "random")):
        plans = run_json(capsys, *PLAN_8B, "--platform", platform, "--peak-rps", "3")
        for c in plans[0]["candidates"]:
            load = c["planned_load"]
            assert load["routing"] == routing
            assert load["requests_per_s_per_replica"] == pytest.approx(3 / c["replicas"], rel=1e-3)
            ttft, itl = load["ttft_s"], load["itl_s"]
            assert ttft["p50"] <= ttft["p95"] <= ttft["p99"] and itl["p50"] <= itl["p95"] <= itl["p99"]
            assert ttft["p50"] >= c["alone"]["ttft_s"] * 0.9  # never better than a request alone
    code, out, _ = run(capsys, *PLAN_8B, "--peak-rps", "3")
    assert code == 0 and "under the planned load (3 requests/s (Poisson) over" in out and "p95" in out
    # Without a rate: the batch the plan runs, and the percentiles of that.
    plans = run_json(capsys, *PLAN_8B)
    assert plans[0]["candidates"][0]["planned_load"]["requests_per_s_per_replica"] is None


def test_plan_states_the_binding_limit(capsys: pytest.CaptureFixture[str]) -> None:
    """Which limit fills first on a full replica (what saturation reaches 1 on): here the sequence slots, the cache
    holding far more than max_num_seqs sequences of the average lengths."""
    plans = run_json(capsys, *PLAN_8B)
    for c in plans[0]["candidates"]:
        b = c["binding"]
        assert 0 < b["kv_at_full_slots"] <= b["kv_ceiling"] <= 1
        assert b["limit"] == ("sequence slots" if b["kv_at_full_slots"] < 1 else "KV cache")
        ceiling = c["concurrency_per_replica"] * c["memory"]["max_model_len"] / c["memory"]["kv_cache_tokens"]
        assert b["kv_ceiling"] == pytest.approx(min(1.0, ceiling), abs=1e-4)
    code, out, _ = run(capsys, *PLAN_8B)
    assert code == 0 and "binding limit at the planned load: " in out


def test_capacity_of_a_gated_delta_net_hybrid(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tests.sizing.test_hybrid_state import qwen3_next_config

    (tmp_path / "config.json").write_text(json.dumps(qwen3_next_config()), encoding="utf-8")
    base = ("capacity", "--model", str(tmp_path), "--gpu", "H200", "--tp", "4", "--max-model-len", "32768")
    d = run_json(capsys, *base, "--engine-version", "0.32.0")
    # vllm/platforms/interface.py _align_hybrid_block_size at TP4: 16 x cdiv(274,432, 16 x 1,024) = 272 tokens.
    assert d["block_size"] == 272
    # 0.34.0 starts from 64-token blocks (its align-mode checkpoint alignment, 64 for FlashInfer's GDN prefill
    # in vllm/v1/attention/backends/gdn_attn.py, changes nothing): 64 x cdiv(274,432, 64 x 1,024) = 320 tokens.
    assert run_json(capsys, *base, "--engine-version", "0.34.0")["block_size"] == 320
    d = run_json(capsys, *base)
    assert d["state_layers"]["pages_per_request"] == 2  # prefix caching on by default: mamba_cache_mode align
    off = run_json(capsys, *base, "--no-prefix-caching", "--mamba-ssm-cache-dtype", "float32")
    assert off["state_layers"]["pages_per_request"] == 1
    assert off["state_layers"]["bytes_per_layer"] == 3 * 2048 * 2 + 8 * 128 * 128 * 4


def test_capacity_speculative_mtp(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("capacity", "--model", "deepseek-ai/DeepSeek-V3", "--gpu", "H200", "--tp", "8")
    plain = run_json(capsys, *argv)
    cap = run_json(capsys, *argv, "--speculative", "mtp")
    assert plain["speculative"] is None
    spec = cap["speculative"]
    assert (spec["method"], spec["num_speculative_tokens"], spec["kv_layers"]) == ("mtp", 1, 1)
    assert cap["kv_bytes_per_token_per_gpu"] == plain["kv_bytes_per_token_per_gpu"] + 1152  # one more MLA latent
    assert cap["kv_cache_tokens"] < plain["kv_cache_tokens"]
    assert cap["kv_groups"][-1]["draft"] is True


def test_capacity_speculative_bad_input_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--speculative", "eagle3")
    assert code == 2 and err.count("\n") == 1 and "num_speculative_tokens" in err
    code, _, err = run(capsys, "capacity", "--model", LLAMA_8B, "--gpu", "H100", "--draft-model", LLAMA_8B)
    assert code == 2 and "--speculative METHOD" in err


def test_plan_flags_carry_the_drafter_to_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    out = json.dumps(
        run_json(
            capsys,
            *("plan", "--model", LLAMA_8B, "--max-input-tokens", "4096", "--max-output-tokens", "1024"),
            *("--concurrency", "16", "--platform", "ec2", "--top", "1", "--json"),
            *("--speculative", "ngram", "--num-speculative-tokens", "3", "--acceptance-length", "1.5"),
        )
    )
    assert '"speculative-config": "{\\"method\\":\\"ngram\\",\\"num_speculative_tokens\\":3}"' in out
    # The plan says what the speed was credited with: tau and where it came from.
    assert "speed assumes 1.5 tokens accepted per step (given)" in out


def test_plan_without_an_acceptance_length_for_ngram_credits_none_and_names_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(
        capsys,
        *("plan", "--model", LLAMA_8B, "--max-input-tokens", "4096", "--max-output-tokens", "1024"),
        *("--concurrency", "16", "--platform", "ec2", "--top", "1"),
        *("--speculative", "ngram", "--num-speculative-tokens", "3"),
    )
    assert code == 0
    flat = " ".join(out.split())
    assert "speed assumes 1 tokens accepted per step (no published acceptance length for ngram" in flat
    assert "mean acceptance length" in flat


def test_precision_the_release_does_not_load_names_the_files_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # vLLM registers no bitsandbytes method from 0.28.0 (kvfleet/engines/vllm/quantization.py): the plan names the key
    # to change.
    f, text = _dev_with(tmp_path, "      kv_cache_dtypes: [auto, fp8]", "      weight_precisions: [bnb-4bit]")
    text = text.replace('version: "0.30.0"', 'version: "0.32.0"', 1)
    f.write_text(text, encoding="utf-8")
    code, _, err = run(capsys, "plan", str(f))
    line = one_error_line(code, err, "vLLM 0.32.0", "bitsandbytes", "nearest it loads: awq")
    where = f"kvfleet: error: {f}:{_line_of(text, 'weight_precisions:')}: deployments[0].sizing.weight_precisions: "
    assert line.startswith(where), line
    # A release before the removal still loads it (the file's own 0.30.0 does not).
    f.write_text(text.replace('version: "0.32.0"', 'version: "0.27.1"', 1), encoding="utf-8")
    code, _, err = run(capsys, "plan", str(f))
    assert code == 0, err


def test_capacity_refuses_a_bitsandbytes_checkpoint_at_0_32(capsys: pytest.CaptureFixture[str]) -> None:
    bnb = str(REPO / "tests" / "fixtures" / "hf_configs" / "Kocdigital-LLM-8b-v0.1-bnb-4bit")
    code, _, err = run(capsys, "capacity", "--model", bnb, "--gpu", "H100", "--engine-version", "0.32.0")
    one_error_line(code, err, "model: vLLM 0.32.0 does not load this checkpoint's quant_method 'bitsandbytes'")
    code, _, err = run(capsys, "capacity", "--model", bnb, "--gpu", "H100", "--engine-version", "0.27.1", "--json")
    assert code == 0, err


def test_plan_flags_carry_the_engine_settings_to_plan_and_engine(capsys: pytest.CaptureFixture[str]) -> None:
    base = ("plan", "--model", "Qwen/Qwen2.5-VL-7B-Instruct", "--max-input-tokens", "120000")
    base += ("--max-output-tokens", "8000", "--concurrency", "1", "--instance-type", "g6e.xlarge", "--top", "1")
    base += ("--engine-version", "0.32.0")
    video = run_json(capsys, *base)
    image = run_json(capsys, *base, "--limit-mm-per-prompt", "image=1,video=0", "--no-prefix-caching")

    b0, b1 = video[0]["candidates"][0], image[0]["candidates"][0]
    # vLLM's dummy video at 128,000 tokens (114,688 encoder tokens) against one 16,384-token image.
    assert (b0["memory"]["encoder"]["modality"], b0["memory"]["encoder"]["budget_tokens"]) == ("video", 114688)
    assert (b1["memory"]["encoder"]["modality"], b1["memory"]["encoder"]["budget_tokens"]) == ("image", 16384)
    assert b1["memory"]["kv_cache_tokens"] > b0["memory"]["kv_cache_tokens"]
    settings = b1["engine_settings"]["settings"]
    assert settings["limit-mm-per-prompt"] == '{"image": 1, "video": 0}' and settings["no-enable-prefix-caching"]
    assert '--limit-mm-per-prompt \'{"image": 1, "video": 0}\'' in b1["engine_settings"]["command"]
    assert "limit-mm-per-prompt" not in b0["engine_settings"]["settings"]


def test_plan_engine_flags_with_an_environment_file_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", "environments/dev.yaml", "--no-prefix-caching")
    one_error_line(code, err, "enable_prefix_caching", "engine section")


@pytest.mark.parametrize(
    ("version", "flags", "written"),
    [
        ("0.32.0", (), "0.92"),  # estimate-based sizing: the default is written as sized
        ("0.34.0", (), None),  # the extensible cache: an explicit value would cap it below what it measures
    ],
)
def test_plan_writes_gpu_memory_utilization_only_where_it_sizes_the_cache(
    capsys: pytest.CaptureFixture[str], version: str, flags: tuple[str, ...], written: str | None
) -> None:
    # A utilization the environment file gives is kept as the cap it is: tests/sizing/test_vllm_033_034.py.
    argv = ("plan", "--model", LLAMA_8B, "--max-input-tokens", "4096", "--max-output-tokens", "512")
    argv += ("--concurrency", "8", "--instance-type", "g6e.xlarge", "--top", "1", "--engine-version", version)
    best = run_json(capsys, *argv, *flags)[0]["candidates"][0]
    settings = best["engine_settings"]["settings"]
    if written is None:
        assert "gpu-memory-utilization" not in settings
        assert "--gpu-memory-utilization" not in best["engine_settings"]["command"]
    else:
        assert str(settings["gpu-memory-utilization"]) == written


def test_version_names_the_installed_release(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvfleet {version('kvfleet')}"


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_covers_every_command_and_its_flags(capsys: pytest.CaptureFixture[str], shell: str) -> None:
    from kvfleet.cli import COMMANDS

    assert main(["completion", shell]) == 0
    script = capsys.readouterr().out
    for command in COMMANDS:
        assert command in script
    assert "--max-num-batched-tokens" in script and "--concurrency" in script


def test_the_bash_completion_completes_in_bash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The script, sourced by a real bash, completes `kvfleet pla` to plan and a flag of plan."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    assert main(["completion", "bash"]) == 0
    script = tmp_path / "kvfleet.bash"
    script.write_text(capsys.readouterr().out, encoding="utf-8")
    probe = f"""
source {script}
complete -p kvfleet >/dev/null || exit 3
fn=$(complete -p kvfleet | sed -E 's/.*-F ([^ ]+).*/\\1/')
COMP_WORDS=(kvfleet pla); COMP_CWORD=1; COMP_LINE="kvfleet pla"; COMP_POINT=${{#COMP_LINE}}
$fn kvfleet pla kvfleet; echo "${{COMPREPLY[@]}}"
COMP_WORDS=(kvfleet plan --max-in); COMP_CWORD=2; COMP_LINE="kvfleet plan --max-in"; COMP_POINT=${{#COMP_LINE}}
$fn kvfleet --max-in plan; echo "${{COMPREPLY[@]}}"
"""
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=False, timeout=30)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()[:2]
    assert first.split() == ["plan"]
    assert "--max-input-tokens" in second.split()


@pytest.mark.parametrize(
    "command",
    [
        "capacity",
        "plan",
        "simulate",
        "bench",
        "synth",
        "check",
        "diff",
        "ci-template",
        "workload",
        "models",
        "instances",
        "schema",
    ],
)
def test_every_command_takes_json(command: str) -> None:
    from kvfleet.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    parser = sub.choices[command]  # type: ignore[index]
    assert any("--json" in a.option_strings for a in parser._actions), command


@pytest.mark.parametrize("subject", [["dev"], ["--pipeline", "pipeline.yaml"]])
def test_synth_gives_cdk_everything_after_the_double_dash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], subject: list[str]
) -> None:
    """Whatever sits before `--` (a positional, --pipeline, --json), what follows reaches cdk synth whole, and --json
    reports the stacks of the assembly the CDK wrote there."""
    out = tmp_path / "out"
    seen = tmp_path / "argv"
    fake = tmp_path / "cdk"
    manifest = {"artifacts": {"s1": {"type": "aws:cloudformation:stack", "properties": {"templateFile": "s1.json"}}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    script = f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {seen}\nmkdir -p {out}\ncp {tmp_path}/manifest.json {out}/\n"
    fake.write_text(script, encoding="utf-8")
    fake.chmod(0o755)
    repo = Path(__file__).resolve().parents[1]
    import os

    cwd = os.getcwd()
    os.chdir(repo)
    try:
        code = main(["synth", *subject, "--cdk", str(fake), "--json", "--", "--quiet", "-o", str(out)])
    finally:
        os.chdir(cwd)
    assert code == 0
    argv = seen.read_text(encoding="utf-8").split()
    assert argv[:2] == ["synth", "-c"] and argv[-3:] == ["--quiet", "-o", str(out)]
    # The app runs under the interpreter running kvfleet, not cdk.json's .venv/bin/python.
    assert argv[3] == "--app" and argv[4].startswith(sys.executable)
    doc = json.loads(capsys.readouterr().out)
    assert doc["stacks"] == [{"stack": "s1", "template": str(out / "s1.json")}] and doc["output_dir"] == str(out)


def test_a_command_that_runs_no_tool_refuses_a_double_dash(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["models", "--", "--quiet"])
    assert done.value.code == 2
    assert "takes nothing after --" in capsys.readouterr().err


def test_synth_outside_a_clone_runs_the_app_with_kvfleets_own_python(tmp_path: Path) -> None:
    """A directory with an environment file and cdk.json but no .venv (an installed kvfleet, or a clone not set up by
    make): cdk.json's `.venv/bin/python app.py` would fail with a raw shell error; synth runs the app itself."""
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "environments").mkdir()
    shutil.copy(repo / "environments" / "dev.yaml", tmp_path / "environments" / "dev.yaml")
    shutil.copy(repo / "cdk.json", tmp_path / "cdk.json")
    cdk = repo / "node_modules" / ".bin" / "cdk"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "kvfleet"), "synth", "dev", "--cdk", str(cdk), "--json", "--", "-o", "out"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    stacks = {s["stack"] for s in json.loads(done.stdout)["stacks"]}
    assert stacks == {"kvfleet-dev-alerts", "kvfleet-dev-chat"}
    assert (tmp_path / "out" / "kvfleet-dev-chat.template.json").is_file()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["environments/dev.yaml", "--model", "Qwen/Qwen3-8B"], "--model plans from flags"),
        (["environments/dev.yaml", "--platform", "ec2"], "--platform plans from flags"),
        (["environments/dev.yaml", "--max-input-tokens", "100"], "--max-input-tokens plans from flags"),
        (["environments/dev.yaml", "--family", "g6e"], "--family plans from flags"),
        (["environments/dev.yaml", "--speculative", "ngram"], "--speculative plans from flags"),
        (["environments/dev.yaml", "--mm-max-pixels", "1000"], "mm_max_pixels: set it under the deployment's engine"),
        (["--model", "Qwen/Qwen3-8B", "--max-input-tokens", "9", "--max-output-tokens", "9", "--derive"], "--derive"),
        (["--model", "Qwen/Qwen3-8B", "--max-input-tokens", "9", "--max-output-tokens", "9", "--standby"], "--standby"),
    ],
)
def test_plan_refuses_a_flag_it_would_ignore(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    repo = Path(__file__).resolve().parents[1]
    argv = [str(repo / a) if a.endswith(".yaml") else a for a in args]
    assert main(["plan", *argv]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert expected in line
