"""`kvfleet capacity`: the KV cache one engine start gets, every term of the budget."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from kvfleet.cli.args import (
    EXIT_USAGE,
    _console,
    _fraction,
    _positive_float,
    _positive_int,
)
from kvfleet.cli.engine_flags import (
    engine_setting_flags,
    engine_settings,
    speculative_flags,
    speculative_from,
    with_rope_flag,
)
from kvfleet.engines import ENGINES
from kvfleet.errors import KvfleetError

if TYPE_CHECKING:
    from kvfleet.sizing.capacity import Capacity


def add_parser(sub: Any) -> None:
    c = sub.add_parser("capacity", help="the KV cache one engine start gets")
    c.add_argument("--model", required=True, help="catalog id/alias, or a path to config.json or its directory")
    c.add_argument(
        "--gpu",
        help="catalog accelerator (kvfleet instances lists them), e.g. A10G, H100: its memory and the engine's "
        "defaults for that device",
    )
    c.add_argument(
        "--gpu-memory-gib",
        type=_positive_float,
        help="total memory per GPU as the engine sees it; with --gpu, replaces the catalog's figure and keeps the "
        "device (vLLM gives A100s its small scheduler defaults at any memory)",
    )
    c.add_argument(
        "--rope-scaling",
        metavar="JSON",
        help='extend the context as the engine\'s config override would, e.g. \'{"rope_type": "yarn", "factor": 4, '
        '"original_max_position_embeddings": 32768}\' (vLLM --hf-overrides)',
    )
    c.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (default 1)")
    c.add_argument("--pp", type=_positive_int, default=1, help="pipeline-parallel size (default 1); GPUs = tp x pp")
    c.add_argument(
        "--ep", action="store_true", help="expert parallelism (MoE): experts whole, spread over the tp ranks"
    )
    c.add_argument("--engine", choices=list(ENGINES), default="vllm")
    c.add_argument("--engine-version", help="engine release, e.g. 0.11.0 (default: newest modelled)")
    c.add_argument("--gpu-memory-utilization", type=_fraction, help="vLLM gpu_memory_utilization / TRT-LLM fraction")
    c.add_argument("--max-model-len", type=_positive_int)
    c.add_argument("--max-num-seqs", type=_positive_int)
    c.add_argument("--max-num-batched-tokens", type=_positive_int)
    c.add_argument("--kv-cache-dtype", default="auto", help="auto, bf16, fp16, fp8, fp8_e4m3, fp8_e5m2")
    c.add_argument("--quantization", help="weight precision: bf16, fp16, fp8, int8, awq, gptq, bnb-4bit, mxfp4, ...")
    c.add_argument("--block-size", type=_positive_int)
    c.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    c.add_argument("--kv-cache-memory-bytes", type=_positive_int, help="vLLM: fixed cache size, skips profiling")
    engine_setting_flags(c)
    speculative_flags(c)
    c.add_argument("--json", action="store_true", help="machine-readable output")


def run(a: argparse.Namespace) -> int:
    from kvfleet.sizing.capacity import EngineSettings, capacity
    from kvfleet.sizing.catalog import resolve_model
    from kvfleet.sizing.engines import EngineName
    from kvfleet.sizing.hardware import accelerator
    from kvfleet.sizing.precision import kv_dtype
    from kvfleet.sizing.units import GiB

    model = with_rope_flag(resolve_model(a.model), a.rope_scaling)
    speculative = speculative_from(a)
    if a.gpu is None and a.gpu_memory_gib is None:
        raise KvfleetError("give --gpu NAME, --gpu-memory-gib GIB, or both", field="gpu")
    acc = accelerator(a.gpu) if a.gpu else None
    acc_name = acc.name if acc is not None else ""
    if a.gpu_memory_gib is not None:  # an exact figure; the device, if named, still sets the engine's defaults
        mem = int(a.gpu_memory_gib * GiB)
    elif acc is not None and acc.memory_bytes is not None:
        mem = acc.usable_memory_bytes or acc.memory_bytes
    else:
        model_name = acc.model if acc is not None else a.gpu
        raise KvfleetError(f"the catalog has no memory figure for {model_name}; give --gpu-memory-gib", field="gpu")
    settings = EngineSettings(
        engine=EngineName(a.engine),
        version=a.engine_version,
        tensor_parallel_size=a.tp,
        pipeline_parallel_size=a.pp,
        enable_expert_parallel=a.ep,
        gpu_memory_utilization=a.gpu_memory_utilization,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        kv_cache_dtype=kv_dtype(a.kv_cache_dtype),
        quantization=a.quantization,
        block_size=a.block_size,
        enforce_eager=a.enforce_eager,
        kv_cache_memory_bytes=a.kv_cache_memory_bytes,
        **engine_settings(a),
        speculative=speculative,
    )
    cap = capacity(model, gpu_memory_bytes=mem, settings=settings, accelerator_name=acc_name)
    if a.json:
        print(json.dumps(cap.as_dict(), indent=2))
    elif not cap.problems:
        _print_capacity(cap)
    if cap.problems:
        print(f"kvfleet: error: the engine would not start: {cap.problems[0]}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _print_capacity(cap: Capacity) -> None:
    from rich.table import Table

    from kvfleet.sizing.units import GiB

    t = Table(
        title=f"{cap.model_id} on {cap.gpu_memory_bytes / GiB:.2f} GiB x {cap.gpus_per_replica} "
        f"({cap.engine.value} {cap.engine_version})",
        show_header=True,
    )
    t.add_column("term")
    t.add_column("per GPU", justify="right")
    t.add_column("how")
    _budget_rows(t, cap)
    _cache_rows(t, cap)
    console = _console()
    console.print(t)
    for n in cap.notes:
        console.print(f"  note: {n}")
    if cap.hf_overrides is not None:
        console.print(f"  note: the engine starts with --hf-overrides '{cap.hf_overrides}'")


def _budget_rows(t: Any, cap: Capacity) -> None:
    """What the engine is given and what comes off it before the cache: weights, sampler state, activations."""
    from kvfleet.engines.capacity import MemoryBudget
    from kvfleet.sizing.engines import engine_traits
    from kvfleet.sizing.units import GiB

    util = cap.gpu_memory_utilization
    t.add_row("GPU memory", f"{cap.gpu_memory_bytes / GiB:.2f} GiB", "as the engine sees it")
    if cap.extensible_kv_cache:
        how = f"x {util} gpu_memory_utilization (a cap: the cache is sized from what warm-up leaves free)"
    elif engine_traits(cap.engine).memory_budget is MemoryBudget.SHARE_OF_TOTAL:
        how = f"x {util} gpu_memory_utilization"
    else:
        how = f"fraction {util} of what is free"
    t.add_row("budget", f"{cap.requested_bytes / GiB:.2f} GiB", how)
    if cap.cuda_context_bytes:
        t.add_row("CUDA context", f"{cap.cuda_context_bytes / GiB:.2f} GiB", "resident before the engine measures")
    t.add_row("weights", f"{cap.weights_bytes_per_gpu / GiB:.2f} GiB", cap.weights.scheme.description)
    if cap.drafter is not None:
        d = cap.drafter
        t.add_row(
            "  of which drafter",
            f"{d.weights_bytes_per_gpu / GiB:.2f} GiB",
            f"{d.method.value}, {d.num_speculative_tokens} tokens per step"
            + (f"; reads the target's {' and '.join(d.shares)}" if d.shares else ""),
        )
    if cap.runner_buffer_bytes:
        t.add_row(
            "sampler state",
            f"{cap.runner_buffer_bytes / GiB:.2f} GiB",
            f"Model Runner V2's penalty buffers, {cap.max_num_seqs} sequences x the vocabulary (int32)",
        )
    t.add_row(
        "activation peak",
        f"{cap.activation_peak_bytes / GiB:.2f} GiB",
        f"profiling {cap.max_num_batched_tokens} tokens / {cap.max_num_seqs} seqs",
    )
    if cap.encoder is not None:
        e = cap.encoder
        t.add_row(
            "  vision encoder",
            f"{e.encoder_activation_bytes / GiB:.2f} GiB",
            f"{e.items} {e.modality} x {e.tokens_per_item:,} tokens (encoder budget {e.budget_tokens:,})",
        )
        t.add_row(
            "  encoder cache", f"{e.encoder_output_bytes / GiB:.2f} GiB", "outputs held through the LM's dummy run"
        )


def _cache_rows(t: Any, cap: Capacity) -> None:
    """What is left for the KV cache, and what it holds."""
    from kvfleet.sizing.units import GiB

    t.add_row("non-torch", f"{cap.non_torch_bytes / GiB:.2f} GiB", "CUDA / NCCL allocations")
    t.add_row(
        "CUDA graphs",
        f"{cap.cuda_graph_bytes / GiB:.2f} GiB",
        "subtracted" if cap.cuda_graph_counted else "not subtracted (uses the headroom)",
    )
    if cap.extensible_kv_cache:
        t.add_row(
            "transient kept free",
            f"{cap.transient_bytes / GiB:.2f} GiB",
            "the larger of the profile run's peak and the sizing step's",
        )
        t.add_row("margin", f"{cap.kv_margin_bytes / GiB:.2f} GiB", "max(1 GiB, 0.75 x transient)")
    t.add_row("KV cache", f"{cap.kv_cache_bytes_per_gpu / GiB:.2f} GiB", f"{cap.kv.kv_dtype.value} KV")
    t.add_row(
        "KV bytes / token",
        f"{cap.kv_bytes_per_token_per_gpu:,}",
        ", ".join(
            f"{g.num_layers} {g.attention.value}"
            + (f"({g.window_tokens})" if g.window_tokens else "")
            + (" drafter" if g.draft else "")
            for g in cap.kv.groups
        ),
    )
    if cap.kv.state is not None:
        st = cap.kv.state
        t.add_row(
            "state / sequence",
            f"{st.bytes_per_sequence:,}",
            f"{st.num_layers} {st.kind.value} x {st.bytes_per_layer:,} B, {cap.state_pages_per_request} page(s)",
        )
    t.add_row("blocks", f"{cap.num_blocks:,}", f"{cap.block_size} tokens each")
    t.add_row("KV cache tokens", f"{cap.kv_cache_tokens:,}", "GPU KV cache size")
    t.add_row("max concurrency", f"{cap.max_concurrency:.2f}x", f"sequences of {cap.max_model_len:,} tokens")
    t.add_row(
        "max model len",
        f"{cap.max_model_len:,}",
        f"the engine accepts up to {cap.max_model_len_limit:,}: {cap.max_model_len_source}",
    )
