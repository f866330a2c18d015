"""``kvfleet``: capacity, plans and catalogs, as tables for people or JSON for machines.

Errors a user can cause print one line on stderr and exit 2. Heavy imports (rich, pydantic, YAML)
happen only in the commands that need them, so ``kvfleet`` starts about as fast as Python does.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvfleet import contract
from kvfleet.engines import ENGINES
from kvfleet.errors import KvfleetError
from kvfleet.targets import TARGETS

if TYPE_CHECKING:
    from kvfleet.bench.client import KvCapacity, LevelSpec
    from kvfleet.calibration import Calibration, FitResidual, FittedSteps
    from kvfleet.config.loader import LoadedEnvironment
    from kvfleet.deployments import DeploymentRequest, ResolvedDeployment
    from kvfleet.sim.policy import Outcome
    from kvfleet.sim.report import SimReport
    from kvfleet.sizing.capacity import Capacity
    from kvfleet.sizing.models import ModelSpec
    from kvfleet.sizing.planner import Candidate, Measured, Plan, PlanRequest, Workload
    from kvfleet.sizing.speculative import Speculative

from kvfleet.cli.args import (
    EXIT_USAGE,
    _console,
    _float_list,
    _fraction,
    _int_list,
    _mm_limits,
    _Parser,
    _positive_float,
    _positive_int,
    printable,
)
from kvfleet.cli.simulate import add_simulate_parser, cmd_simulate


def _engine_setting_flags(p: argparse.ArgumentParser) -> None:
    """The engine settings kvfleet capacity and kvfleet plan both take (an environment file's `engine:` section has
    them by the same names)."""
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM prefix caching (default: the release's); for Mamba hybrids it sets mamba_cache_mode",
    )
    for flag, what in (("--mamba-cache-dtype", "conv and SSM state"), ("--mamba-ssm-cache-dtype", "SSM state")):
        p.add_argument(
            flag,
            default="auto",
            choices=("auto", "float32", "bfloat16", "float16"),
            help=f"vLLM: the {what}'s dtype in linear-attention / Mamba layers",
        )
    p.add_argument(
        "--limit-mm-per-prompt",
        type=_mm_limits,
        default=(),
        help="vLLM, vision-language models: items per prompt, e.g. image=4,video=0 (image=0,video=0: text only)",
    )
    p.add_argument(
        "--mm-encoder-tp-mode", choices=["weights", "data"], default="weights", help="vLLM: vision encoder sharding"
    )
    p.add_argument(
        "--mm-max-pixels", type=_positive_int, help="vLLM --mm-processor-kwargs max_pixels: Qwen-VL's largest image"
    )


def _engine_settings(a: argparse.Namespace) -> dict[str, Any]:
    """The flags' engine settings, by the names EngineSettings and PlanRequest give them."""
    return {
        "enable_prefix_caching": a.prefix_caching,
        "mamba_cache_dtype": a.mamba_cache_dtype,
        "mamba_ssm_cache_dtype": a.mamba_ssm_cache_dtype,
        "limit_mm_per_prompt": a.limit_mm_per_prompt,
        "mm_encoder_tp_mode": a.mm_encoder_tp_mode,
        "mm_max_pixels": a.mm_max_pixels,
    }


def _speculative_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        metavar="METHOD",
        help="speculative decoding: eagle, eagle3 or draft_model (with --draft-model), mtp (the model's own MTP "
        "layers), ngram",
    )
    p.add_argument("--draft-model", help="the EAGLE head or draft model: catalog id/alias, or a path to config.json")
    p.add_argument("--num-speculative-tokens", type=_positive_int, help="tokens drafted per step (mtp: its layers)")
    p.add_argument(
        "--acceptance-length",
        type=float,
        metavar="TAU",
        help="mean tokens accepted per step, bonus token included (1 to K+1): what the speed model credits "
        "(default: a published measurement for eagle/eagle3 K 2-7 and mtp with one layer; else 1, no gain)",
    )


def _speculative(a: argparse.Namespace) -> Speculative | None:
    from kvfleet.sizing.speculative import Speculative, parse_method

    if a.speculative is None:
        if a.draft_model is not None or a.num_speculative_tokens is not None or a.acceptance_length is not None:
            raise KvfleetError(
                "--draft-model, --num-speculative-tokens and --acceptance-length need --speculative METHOD",
                field="speculative",
            )
        return None
    return Speculative(
        method=parse_method(a.speculative, field="speculative"),
        draft_model=a.draft_model,
        num_speculative_tokens=a.num_speculative_tokens,
        acceptance_length=a.acceptance_length,
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvfleet", description="Size, plan and deploy LLM serving on AWS.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

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
    _engine_setting_flags(c)
    _speculative_flags(c)
    c.add_argument("--json", action="store_true", help="machine-readable output")

    di = sub.add_parser(
        "diff",
        help="what a release changes in the plan (instance type, count, engine flags, KV tokens, $/h, scaling): "
        "each side an environment file, planned now, or the JSON of kvfleet plan --json",
    )
    di.add_argument("old", help="the plan before: an environment file, or a saved kvfleet plan --json")
    di.add_argument("new", help="the plan after")
    di.add_argument("--markdown", action="store_true", help="a Markdown table per deployment (a job summary)")
    di.add_argument("--exit-code", action="store_true", help="exit 1 when the plan changed (as git diff does)")
    pl = sub.add_parser("plan", help="ranked deployment candidates, from flags or an environment file")
    pl.add_argument("environment", nargs="?", help="environments/<name>.yaml: plan every deployment in it")
    pl.add_argument("--model", help="catalog id/alias, or a path to config.json")
    pl.add_argument(
        "--rope-scaling",
        metavar="JSON",
        help="extend the model's context with a RoPE scaling, as kvfleet capacity --rope-scaling (vLLM --hf-overrides)",
    )
    pl.add_argument("--engine", choices=list(ENGINES), default="vllm")
    pl.add_argument("--engine-version")
    pl.add_argument("--platform", choices=list(TARGETS), default="sagemaker", help="deployment target")
    pl.add_argument("--max-input-tokens", type=_positive_int)
    pl.add_argument("--max-output-tokens", type=_positive_int)
    pl.add_argument("--concurrency", type=_positive_int, help="target concurrent sequences per replica")
    pl.add_argument("--peak-rps", type=_positive_float, help="peak requests per second across the fleet")
    pl.add_argument("--avg-input-tokens", type=_positive_int)
    pl.add_argument("--avg-output-tokens", type=_positive_int)
    pl.add_argument("--ttft-ms", type=_positive_float, help="time-to-first-token target")
    pl.add_argument("--itl-ms", type=_positive_float, help="inter-token latency target")
    pl.add_argument("--buffered", action="store_true", help="clients wait for whole answers (no streaming)")
    pl.add_argument("--precision", action="append", default=[], help="allowed weight precision (repeatable)")
    pl.add_argument("--kv-cache-dtype", action="append", default=[], help="allowed KV dtype (repeatable)")
    pl.add_argument("--family", action="append", default=[], help="allowed instance family (repeatable)")
    pl.add_argument("--instance-type", action="append", default=[], help="only this instance type (repeatable)")
    pl.add_argument("--region")
    pl.add_argument("--max-usd-per-hour", type=_positive_float, help="fleet price ceiling")
    _speculative_flags(pl)  # without an environment file (a deployment's speculative section there)
    _engine_setting_flags(pl)  # without an environment file (a deployment's engine section there)
    pl.add_argument("--top", type=_positive_int, default=5, help="candidates to show (default 5)")
    pl.add_argument("--rejections", action="store_true", help="list every rejected candidate")
    pl.add_argument(
        "--calibration",
        metavar="FILE",
        help="a file kvfleet bench --calibrate wrote: candidates of its instance type, tensor parallelism, model "
        "and engine release are priced with its measured KV cache and step times",
    )
    pl.add_argument(
        "--derive",
        action="store_true",
        help="derive the scaling thresholds on the workload even where the file has scaling.derive false, and say "
        "what the file's values cost against them",
    )
    pl.add_argument(
        "--standby",
        action="store_true",
        help="compare a warm minimum, an EC2 warm pool and scale to zero on the workload's replay (shown anyway "
        "where the file scales to zero or has a warm pool, or its trace has idle spells longer than the wait)",
    )
    pl.add_argument("--json", action="store_true")

    sy = sub.add_parser(
        "synth",
        help="check and plan an environment file (exit 2 with file:line for each problem), then run cdk synth",
    )
    sy.add_argument("environment", nargs="?", default="dev", help="environments/<name>.yaml or a path (default dev)")
    sy.add_argument("cdk_args", nargs="*", help="for cdk synth, after --: e.g. -- --quiet -o out")
    sy.add_argument("--cdk", help="the CDK CLI (default: node_modules/.bin/cdk here, else cdk on PATH)")
    sy.add_argument(
        "--pipeline",
        metavar="FILE",
        help="synthesize the release pipeline of this file (pipeline.yaml) and its stages instead of one environment",
    )

    be = sub.add_parser(
        "bench",
        help="load-test a live OpenAI-compatible endpoint (the agent, vLLM, trtllm-serve, a load balancer) with "
        "streaming timing: TTFT, ITL, TPOT, throughput per concurrency",
    )
    be.add_argument(
        "url",
        nargs="?",
        help="the endpoint's base URL (http://127.0.0.1:8080), or sagemaker:<endpoint name> for a SageMaker endpoint "
        "(InvokeEndpointWithResponseStream with the usual AWS credentials); default, with --env: where the "
        "deployment's stack says it is",
    )
    be.add_argument("--region", help="the SageMaker endpoint's region (default: the AWS configuration's)")
    be.add_argument("--endpoint-url", help="SageMaker runtime URL (a VPC endpoint)")
    be.add_argument("--model", help="model id to request (default: the first /v1/models lists)")
    be.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (default: $KVFLEET_BENCH_API_KEY)")
    be.add_argument("--header", action="append", default=[], help="extra request header NAME:VALUE (repeatable)")
    be.add_argument("--concurrency", type=_int_list, default=[1, 4, 16], help="comma-separated levels (default 1,4,16)")
    be.add_argument(
        "--rate",
        type=_float_list,
        help="open loop instead: Poisson arrivals at each of these comma-separated requests/s (a rate sweep)",
    )
    be.add_argument(
        "--trace", help="open loop instead: replay a request trace's arrivals and lengths (the workload formats)"
    )
    be.add_argument(
        "--planned-load",
        action="store_true",
        help="open loop instead, with --env: the plan's own load (Poisson at workload.peak_requests_per_s, the "
        "average lengths) against its TTFT target",
    )
    be.add_argument("--trace-format", choices=["azure", "mooncake", "burstgpt", "kvfleet"])
    be.add_argument("--start-s", type=float, default=0.0, help="skip this many seconds of the trace")
    be.add_argument("--duration-s", type=_positive_float, help="trace window length")
    be.add_argument("--rate-scale", type=_positive_float, default=1.0, help="replay the trace this many times faster")
    be.add_argument(
        "--ttft-ms", type=_positive_float, help="TTFT target: report attainment and the best rate meeting it"
    )
    be.add_argument(
        "--slo-attainment", type=_fraction, default=0.95, help="share of requests within --ttft-ms (default 0.95)"
    )
    be.add_argument(
        "--limits",
        action="store_true",
        help="test the limits together: --max-input-tokens + --max-output-tokens at --max-concurrency, then at twice "
        "it (or the plan's, with --env); passes when nothing fails or is preempted at the planned concurrency and "
        "what fails above it is refused with 429",
    )
    be.add_argument("--max-input-tokens", type=_positive_int)
    be.add_argument("--max-output-tokens", type=_positive_int)
    be.add_argument("--max-concurrency", type=_positive_int)
    be.add_argument("--requests", type=_positive_int, default=32, help="requests per level (default 32)")
    be.add_argument("--input-tokens", type=_positive_int, default=512, help="prompt length in tokens (default 512)")
    be.add_argument("--output-tokens", type=_positive_int, default=128, help="tokens to generate (default 128)")
    be.add_argument("--timeout-s", type=_positive_float, default=600.0, help="per request (default 600)")
    be.add_argument(
        "--expect-kv-tokens",
        type=_positive_int,
        help="KV-cache tokens per replica the plan expects; fail when the endpoint reports fewer (past --tolerance)",
    )
    be.add_argument("--env", help="take --expect-kv-tokens from this environment file's plan (with --deployment)")
    be.add_argument("--deployment", help="the deployment of --env")
    be.add_argument(
        "--tolerance",
        type=_fraction,
        default=contract.KV_SHORTFALL_TOLERANCE,
        help=f"allowed shortfall of the KV cache (default {contract.KV_SHORTFALL_TOLERANCE})",
    )
    be.add_argument(
        "--speed-tolerance",
        type=_fraction,
        default=0.25,
        help="with --env: how much slower than the plan's step model ITL and output tokens/s may be (default 0.25)",
    )
    be.add_argument("--html", help="also write a self-contained HTML report (distributions, levels, checks) here")
    be.add_argument(
        "--predict",
        action="store_true",
        help="simulate each level beside what it measured, on one replica of the plan (--env) or of a calibration "
        "(--calibration), and print both with the error",
    )
    be.add_argument(
        "--calibration",
        help="with --predict: a file kvfleet bench --calibrate wrote (its fitted steps, KV cache and engine limits)",
    )
    be.add_argument(
        "--calibrate",
        help="with --env: write what was measured (the engine's KV cache, step times against the plan's at each "
        "closed-loop level) as a calibration file for kvfleet plan and simulate --calibration",
    )
    be.add_argument("--json", action="store_true")

    ck = sub.add_parser(
        "check",
        help="live checks of a deployed environment, as a release pipeline runs them after each stage: each "
        "deployment healthy, one generation streamed, and (where a replica's /metrics is reachable) its KV cache "
        "against the plan; exit 1 when one fails",
    )
    ck.add_argument("environment", help="environments/<name>.yaml or a path")
    ck.add_argument("--deployment", help="check this deployment only")
    ck.add_argument("--role-arn", help="assume this role first (a pipeline stage's live-check role)")
    ck.add_argument("--no-generation", action="store_true", help="health only: send no generation")
    ck.add_argument(
        "--kv-tolerance",
        type=_fraction,
        default=contract.KV_SHORTFALL_TOLERANCE,
        help=f"allowed shortfall of the KV cache (default {contract.KV_SHORTFALL_TOLERANCE})",
    )

    ct = sub.add_parser(
        "ci-template",
        help="a GitHub Actions workflow for the pipeline file's stages: tests and plan diffs on pull requests, "
        "deploys in order through GitHub environments with OIDC roles on a push",
    )
    ct.add_argument("pipeline", nargs="?", default="pipeline.yaml", help="the pipeline file (default pipeline.yaml)")
    ct.add_argument("-o", "--output", help="write it here (e.g. .github/workflows/release.yml) instead of stdout")

    sc = sub.add_parser("schema", help="JSON Schema of environment files (committed as environments/schema.json)")
    sc.add_argument("--output", "-o", help="write to this file instead of stdout")

    m = sub.add_parser("models", help="the model catalog")
    m.add_argument("--json", action="store_true")
    w = sub.add_parser("workload", help="the profile of a request trace: lengths, arrival rate, bursts, prefix reuse")
    w.add_argument("trace", help="an Azure or BurstGPT CSV, Mooncake JSON lines, or the agent's request log")
    w.add_argument("--format", dest="trace_format", choices=["azure", "mooncake", "burstgpt", "kvfleet"])
    w.add_argument("--start-s", type=float, default=0.0, help="skip this many seconds of the trace")
    w.add_argument("--duration-s", type=_positive_float, help="keep this many seconds (default: the rest)")
    w.add_argument("--rate-scale", type=_positive_float, default=1.0, help="replay at this multiple of the rate")
    w.add_argument("--json", action="store_true")
    add_simulate_parser(sub)
    i = sub.add_parser("instances", help="the accelerator and instance catalog")
    i.add_argument("--platform", choices=list(TARGETS))
    i.add_argument("--json", action="store_true")
    return p


# ---- capacity ------------------------------------------------------------------------------------


def cmd_capacity(a: argparse.Namespace) -> int:
    from kvfleet.sizing.capacity import EngineSettings, capacity
    from kvfleet.sizing.catalog import resolve_model
    from kvfleet.sizing.engines import EngineName
    from kvfleet.sizing.hardware import accelerator
    from kvfleet.sizing.precision import kv_dtype
    from kvfleet.sizing.units import GiB

    model = _with_rope_flag(resolve_model(a.model), a.rope_scaling)
    speculative = _speculative(a)
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
        **_engine_settings(a),
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


def _with_rope_flag(model: ModelSpec, text: str | None) -> ModelSpec:
    """``model`` under a --rope-scaling override (a JSON object), as the engine would load it."""
    if text is None:
        return model
    from kvfleet.sizing.models import rope_scaling_from, with_rope_scaling

    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise KvfleetError(
            f'not JSON ({err.msg}); e.g. \'{{"rope_type": "yarn", "factor": 4}}\'', field="rope_scaling"
        ) from None
    if not isinstance(raw, dict):
        raise KvfleetError('must be a JSON object, e.g. {"rope_type": "yarn", "factor": 4}', field="rope_scaling")
    return with_rope_scaling(model, rope_scaling_from(raw, field="rope_scaling"))


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
    util = cap.gpu_memory_utilization
    t.add_row("GPU memory", f"{cap.gpu_memory_bytes / GiB:.2f} GiB", "as the engine sees it")
    if cap.extensible_kv_cache:
        how = f"x {util} gpu_memory_utilization (a cap: the cache is sized from what warm-up leaves free)"
    elif cap.engine.value == "vllm":
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
    console = _console()
    console.print(t)
    for n in cap.notes:
        console.print(f"  note: {n}")
    if cap.hf_overrides is not None:
        console.print(f"  note: the engine starts with --hf-overrides '{cap.hf_overrides}'")


# ---- plan ----------------------------------------------------------------------------------------


def _request_from_flags(a: argparse.Namespace) -> PlanRequest:
    from kvfleet.deployments import workload
    from kvfleet.sizing.catalog import resolve_model
    from kvfleet.sizing.engines import EngineName
    from kvfleet.sizing.planner import PlanRequest
    from kvfleet.sizing.precision import KvDtype, kv_dtype

    missing = [
        f
        for f, v in (
            ("--model", a.model),
            ("--max-input-tokens", a.max_input_tokens),
            ("--max-output-tokens", a.max_output_tokens),
        )
        if v is None
    ]
    if missing:
        raise KvfleetError(f"plan needs an environment file or {', '.join(missing)}")
    wl = workload(
        max_input_tokens=a.max_input_tokens,
        max_output_tokens=a.max_output_tokens,
        concurrency_per_replica=a.concurrency,
        peak_requests_per_s=a.peak_rps,
        avg_input_tokens=a.avg_input_tokens,
        avg_output_tokens=a.avg_output_tokens,
        ttft_ms=a.ttft_ms,
        itl_ms=a.itl_ms,
        streaming=not a.buffered,
    )
    kvs = tuple(kv_dtype(k) for k in a.kv_cache_dtype) or (KvDtype.AUTO,)
    return PlanRequest(
        model=_with_rope_flag(resolve_model(a.model), a.rope_scaling),
        workload=wl,
        engine=EngineName(a.engine),
        engine_version=a.engine_version,
        hosting=TARGETS[a.platform].hosting,
        weight_precisions=tuple(a.precision),
        kv_cache_dtypes=kvs,
        families=tuple(a.family),
        instance_types=tuple(a.instance_type),
        region=a.region,
        max_fleet_usd_per_hour=a.max_usd_per_hour,
        speculative=_speculative(a),
        **_engine_settings(a),
    )


def _plan_environment(
    environment: str, *, measured: tuple[Measured, ...] = (), derive: bool = False, standby: bool = False
) -> tuple[list[tuple[str, str, Plan]], list[dict[str, Any] | None]]:
    """Every deployment of an environment file planned, with its scaling section (and standby comparison)."""
    from kvfleet.config.loader import environment_path, load_located
    from kvfleet.deployments import config_error, plan_requests
    from kvfleet.sizing.planner import plan

    loaded = load_located(environment_path(environment))
    try:
        drs = plan_requests(loaded.environment)
    except KvfleetError as err:
        raise loaded.problem(err) from None
    if measured:
        drs = tuple(replace(dr, request=replace(dr.request, measured=measured)) for dr in drs)
    results: list[tuple[str, str, Plan]] = []
    scalings: list[dict[str, Any] | None] = []
    for dr in drs:
        try:
            results.append((dr.deployment.name, dr.deployment.target.platform, plan(dr.request)))
            section = _scaling_section(loaded, dr, derive=derive)
            waiting = _standby_section(loaded, dr, force=standby)
            if waiting is not None:
                section = section or {"lines": []}
                section["standby"] = waiting
                section["lines"] = [*section["lines"], *waiting["lines"]]
            scalings.append(section)
        except KvfleetError as err:
            # The file's line and key path of what to change, not the planner's own field names.
            raise loaded.problem(config_error(err, dr.index)) from None
    return results, scalings


def cmd_check(a: argparse.Namespace) -> int:
    """Live checks of every deployment of a deployed environment (kvfleet.bench.live)."""
    from kvfleet.bench.live import assumed_session, check_deployment
    from kvfleet.config.loader import environment_path, load_located
    from kvfleet.deployments import config_error, plan_requests, resolve

    loaded = load_located(environment_path(a.environment))
    env = loaded.environment
    if env.region is None:
        raise loaded.problem(KvfleetError("name the region the stacks are deployed in; set region", field="region"))
    drs = plan_requests(env)
    if a.deployment is not None:
        names = [dr.deployment.name for dr in drs]
        drs = tuple(dr for dr in drs if dr.deployment.name == a.deployment)
        if not drs:
            raise KvfleetError(
                f"no deployment {a.deployment!r} in {loaded.source}; it has {', '.join(names)}", field="deployment"
            )
    resolved = []
    for dr in drs:
        try:
            resolved.append(resolve(env, dr))
        except KvfleetError as err:
            raise loaded.problem(config_error(err, dr.index)) from None
    session = assumed_session(a.role_arn, env.region)
    failed = 0
    for r in resolved:
        check = check_deployment(r, session=session, generation=not a.no_generation, kv_tolerance=a.kv_tolerance)
        print(f"{r.deployment_id} ({r.deployment.target.platform}, stack {r.stack_name}):")
        for line in check.lines:
            print(f"  {line}")
        failed += not check.passed
    print(
        f"{len(resolved) - failed} of {len(resolved)} deployment(s) passed"
        + ("" if not failed else "; promotion stops")
    )
    return 1 if failed else 0


def cmd_ci_template(a: argparse.Namespace) -> int:
    from pathlib import Path

    from kvfleet.citemplate import render
    from kvfleet.config.pipeline import load_pipeline

    text = render(load_pipeline(a.pipeline))
    if a.output is None:
        print(text, end="")
        return 0
    try:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(text, encoding="utf-8")
    except OSError as err:
        raise KvfleetError(f"cannot write {a.output}: {err.strerror}", field="output") from None
    return 0


def cmd_diff(a: argparse.Namespace) -> int:
    """What a release changes in the plan: each side an environment file (planned now) or `kvfleet plan --json`."""
    from kvfleet.plandiff import describe, diff_plans, markdown

    sides = []
    for src in (a.old, a.new):
        if src.endswith(".json"):
            try:
                with open(src, encoding="utf-8") as f:
                    rows = json.load(f)
            except OSError as err:
                raise KvfleetError(f"cannot read {src}: {err.strerror or err}", field="plan") from None
            except (ValueError, UnicodeDecodeError) as err:
                raise KvfleetError(f"{src}: not JSON ({err})", field="plan") from None
        else:
            results, scalings = _plan_environment(src)
            rows = [
                {**_plan_json(name, target, p, 1), **({"scaling": sc} if sc else {})}
                for (name, target, p), sc in zip(results, scalings, strict=True)
            ]
        sides.append((src, rows))
    changes = diff_plans(sides[0][1], sides[1][1], old_source=sides[0][0], new_source=sides[1][0])
    print(markdown(changes, sides[0][0], sides[1][0]) if a.markdown else describe(changes))
    return 1 if a.exit_code and any(c.lines for c in changes) else 0


def cmd_plan(a: argparse.Namespace) -> int:
    from kvfleet.sizing.planner import plan

    measured: tuple[Measured, ...] = ()
    if a.calibration:
        from kvfleet.calibration import read_calibration

        measured = (read_calibration(a.calibration).measured(a.calibration),)
    scalings: list[dict[str, Any] | None]
    if a.environment and a.speculative is not None:
        raise KvfleetError("set speculative in the environment file's deployment", field="speculative")
    if a.environment:
        given = [k for k, v in _engine_settings(a).items() if v not in (None, (), "auto", "weights")]
        if given:
            raise KvfleetError("set it under the deployment's engine section of the environment file", field=given[0])
        results, scalings = _plan_environment(a.environment, measured=measured, derive=a.derive, standby=a.standby)
    else:
        results = [("plan", a.platform, plan(replace(_request_from_flags(a), measured=measured)))]
        scalings = [None]
    if measured and not any(c.measured for _, _, p in results for c in p.candidates):
        m = measured[0]
        print(
            f"calibration {a.calibration}: it applies to no candidate planned ({m.instance_type} tp="
            f"{m.tensor_parallel_size}, {m.model_id}, {m.engine.value} {m.engine_version}); the plan is the model's",
            file=sys.stderr,
        )
    if a.json:
        rows = []
        for (name, target, p), scaling in zip(results, scalings, strict=True):
            rows.append({**_plan_json(name, target, p, a.top), **({"scaling": scaling} if scaling else {})})
        print(json.dumps(rows, indent=2))
    else:
        for (name, target, p), scaling in zip(results, scalings, strict=True):
            _print_plan(name, target, p, a.top, a.rejections)
            if scaling:
                for line in scaling["lines"]:
                    print(line)  # whole lines: a reason is one sentence, and tests and pipelines grep them
    return 0


def _setting_names() -> dict[str, str]:
    """The search's setting names -> the environment file's."""
    from kvfleet.tuning import SETTINGS_BY_FIELD

    return {v: k for k, v in SETTINGS_BY_FIELD.items()}


def _outcome_json(o: Outcome) -> dict[str, Any]:
    return {
        "saturation_target": o.policy.saturation_target,
        "queue_depth_target": o.policy.queue_target,
        "min_replicas": o.policy.min_replicas,
        "scale_in_after_s": None if o.policy.scale_in_wait_s is None else int(o.policy.scale_in_wait_s),
        "admission_queue": None if o.policy.admission_queue is None else int(o.policy.admission_queue),
        "meets_goal": o.meets,
        "ttft_attainment": round(o.attainment, 4),
        "stopped_at_s": o.stopped_s,
        "cost": round(o.cost, 2),
        "cost_unit": "usd" if o.priced else "replica_hours",
    }


def _scaling_section(loaded: LoadedEnvironment, dr: DeploymentRequest, *, derive: bool) -> dict[str, Any] | None:
    """The thresholds the deployment scales on, and with scaling.derive (or --derive) how the replay chose them."""
    from kvfleet.deployments import resolve
    from kvfleet.sim.policy import INTEGER_SETTINGS
    from kvfleet.tuning import decide, derivation

    d = dr.deployment
    s = d.scaling
    w = d.workload
    values = (
        f"saturation_target {s.saturation_target:g}, queue_depth_target {s.queue_depth_target:g}, "
        + (f"min_replicas {s.min_replicas}, scale_in_after_s {s.scale_in_wait_s}")
        + ("" if s.admission_queue is None else f", admission_queue {s.admission_queue}")
    )
    if not s.derive and not derive:
        return {
            "derived": False,
            "lines": [
                f"scaling: {values} as the file sets them (or their defaults); scaling.derive: true derives them on "
                "the workload (kvfleet plan --derive shows what that would choose)"
            ],
        }
    if w.ttft_ms is None or w.peak_requests_per_s is None:
        return {
            "derived": False,
            "lines": [f"scaling: {values}; nothing to derive them on without workload.ttft_ms and an arrival rate"],
        }
    r = resolve(loaded.environment, dr)
    trace = loaded.traces.get(dr.index)
    if s.derive:
        decision = decide(r, trace)
        assert decision.derivation is not None
        found, replay = decision.derivation, decision.replay or ""
        head = "scaling (derived, deployed by synth)"
    else:
        found, replay = derivation(r, trace, pin_all=True)
        head = "scaling (the file's values; --derive: what each costs against the best value alone)"
    goal = found.goal
    slo = found.ttft_slo_s
    names = _setting_names()
    lines = [f"{head}: replaying {replay}, goal TTFT <= {slo:g} s for {goal:.0%} of requests"]
    for c in found.choices:
        name = names[c.setting]
        value = f"{int(c.value)}" if c.setting in INTEGER_SETTINGS else f"{c.value:g}"
        reason = c.reason
        if c.pinned:
            reason = "set in the file" if name in s.pinned else "the default (the file does not set it)"
        lines.append(f"  {name} {value}: {reason}")
    for pc in found.pin_costs:
        name = names[pc.setting]
        if pc.best is None:
            lines.append(f"  {name}: no value of it alone meets the goal; raise max_replicas or re-plan")
        elif pc.best.policy == pc.pinned.policy:
            lines.append(f"  {name}: no other value of it alone costs less over the replay")
        elif not pc.pinned.meets:
            lines.append(
                f"  {name}: the file's value misses the goal ({pc.pinned.describe(slo, goal)}); "
                f"{pc.best.policy.value(pc.setting):g} meets it at {pc.best.cost_text()}"
            )
        else:
            delta = pc.pinned.cost - pc.best.cost
            unit = f"${delta:,.2f}" if pc.best.priced else f"{delta:,.2f} replica-hours"
            lines.append(
                f"  {name}: the file's value costs {unit} more over the replay than "
                f"{pc.best.policy.value(pc.setting):g} ({pc.best.attainment:.1%} in time there)"
            )
    o = found.outcome
    verdict = "meets the goal" if found.feasible else "no policy within max_replicas meets the goal"
    lines.append(
        f"  replay: TTFT within {slo:g} s for {o.attainment:.1%} of {o.offered:,} requests, {o.cost_text()} "
        f"({verdict}; {found.evaluated} replays)"
    )
    return {
        "derived": bool(s.derive),
        "replay": replay,
        "ttft_target_s": slo,
        "goal": goal,
        "feasible": found.feasible,
        "policy": _outcome_json(o),
        "reasons": {names[c.setting]: {"pinned": c.pinned, "reason": c.reason} for c in found.choices},
        "pins": [
            {"setting": names[pc.setting], "pinned": _outcome_json(pc.pinned)}
            | ({"best": _outcome_json(pc.best)} if pc.best else {})
            for pc in found.pin_costs
        ],
        "lines": lines,
    }


def _standby_section(loaded: LoadedEnvironment, dr: DeploymentRequest, *, force: bool) -> dict[str, Any] | None:
    """A warm minimum, a warm pool and scale to zero replayed with the deployment's thresholds: where asked
    (--standby), where the file scales to zero or keeps a pool, or where its trace idles longer than the wait."""
    from kvfleet.deployments import resolve
    from kvfleet.tuning import idle_gaps, standby_comparison

    d = dr.deployment
    pool = getattr(d.target, "warm_pool", None)
    trace = loaded.traces.get(dr.index)
    r = None
    wanted = force or d.scaling.min_replicas == 0 or (pool is not None and pool.enabled)
    if not wanted and trace is not None:
        r = resolve(loaded.environment, dr)
        wanted = idle_gaps(trace, float(r.idle_to_zero_s)).count > 0
    if not wanted:
        return None
    if d.workload.ttft_ms is None or (trace is None and d.workload.peak_requests_per_s is None):
        return {"lines": ["standby: nothing to compare on without workload.ttft_ms and an arrival rate or a trace"]}
    r = r or resolve(loaded.environment, dr)
    cmp = standby_comparison(r, trace)
    lines = [
        f"standby: replaying {cmp.replay} with the thresholds above, goal TTFT <= {cmp.ttft_slo_s:g} s for "
        f"{cmp.goal:.0%} of requests"
    ]
    rows = []
    for o in cmp.options:
        extra = f"cold start {o.cold_start_s / 60:.1f} min"
        if o.standby_usd_per_hour:
            extra += f", pool ${o.standby_usd_per_hour:,.3f}/h"
        tag = " (as configured)" if o.configured else ""
        verdict = "meets the goal" if o.outcome.meets else "misses the goal"
        lines.append(
            f"  {o.label}{tag}: TTFT in time for {o.outcome.attainment:.1%}, {o.outcome.cost_text()} ({verdict}; "
            f"{extra})"
        )
        rows.append(
            {
                "min_replicas": o.min_replicas,
                "warm_pool": None if o.pool == "none" else {"state": o.pool, "min_size": o.pool_size},
                "configured": o.configured,
                "cold_start_s": round(o.cold_start_s, 1),
                "standby_usd_per_hour": round(o.standby_usd_per_hour, 4),
                "meets_goal": o.outcome.meets,
                "ttft_attainment": round(o.outcome.attainment, 4),
                "cost": round(o.outcome.cost, 2),
                "cost_unit": "usd" if o.outcome.priced else "replica_hours",
            }
        )
    best = cmp.best
    lines.append(
        f"  cheapest that meets the goal: {best.label}" if best else "  no option meets the goal on this replay"
    )
    warm = [o for o in cmp.options if o.min_replicas > 0]
    for o in cmp.options:
        if o.ceiling is None or o.exposed is None or not warm or not cmp.gaps.count:
            continue
        # The break-even: what scale to zero saves against the cheapest warm option, and the attainment it can
        # never pass here, so the goal it pays off under.
        ref = min(warm, key=lambda w: w.outcome.cost)
        saved = ref.outcome.cost - o.outcome.cost
        unit = f"${abs(saved):,.2f}" if o.outcome.priced else f"{abs(saved):,.2f} replica-hours"
        lines.append(
            f"  {o.label}: {'saves' if saved >= 0 else 'costs'} {unit} {'against' if saved >= 0 else 'more than'} "
            f"{ref.label} over the replay; {o.exposed:,} of "
            f"{o.outcome.offered:,} requests arrive between an idle spell's end and the woken replica serving "
            f"({(o.wake_s + o.cold_start_s) / 60:.1f} min), so it can never serve more than {o.ceiling:.1%} in "
            "time: it pays off for a goal at or below that"
        )
        rows[cmp.options.index(o)]["attainment_ceiling"] = round(o.ceiling, 4)
    g = cmp.gaps
    wait = f"{g.wait_s / 60:.0f} min"
    lines.append(
        f"  idle: {g.count} spell{'s' if g.count != 1 else ''} without a request longer than the {wait} wait, "
        f"{g.idle_s / 3600:.1f} h past it (what a fleet at zero stops paying for; each spell's end costs the "
        "requests of one cold start)"
        if g.count
        else f"  idle: no spell without a request longer than the {wait} wait, so scale to zero would never act"
    )
    lines += [f"  not available: {u}" for u in cmp.unavailable]
    return {
        "replay": cmp.replay,
        "options": rows,
        "best": rows[cmp.options.index(best)] if best else None,
        "idle_spells": g.count,
        "idle_hours_past_wait": round(g.idle_s / 3600, 2),
        "idle_wait_s": g.wait_s,
        "unavailable": list(cmp.unavailable),
        "lines": lines,
    }


def _engine_line(c: Candidate) -> tuple[str, dict[str, Any]]:
    from kvfleet.deployments import engine_args

    a = ENGINES[c.capacity.engine.value]
    args = engine_args(c)
    return a.describe(args), a.settings_json(args)


def _candidate_json(c: Candidate, wl: Workload) -> dict[str, Any]:
    from kvfleet.sizing.planner import admission, binding

    adm = admission(c, wl)
    bound = binding(c, wl)
    return {
        "instance_type": c.name,
        "tensor_parallel_size": c.tensor_parallel_size,
        "pipeline_parallel_size": c.pipeline_parallel_size,
        "expert_parallel": c.expert_parallel,
        "weight_precision": c.weight_scheme.name,
        "kv_cache_dtype": c.kv_cache_dtype.value,
        "concurrency_per_replica": c.concurrency_per_replica,
        "cache_concurrency": c.cache_concurrency,
        "limited_by": c.limited_by,
        "replicas": c.replicas,
        "engines_per_instance": c.engines_per_instance,
        "instance_count": c.instance_count,
        "usd_per_hour_per_instance": c.usd_per_hour_per_instance,
        "fleet_usd_per_hour": round(c.fleet_usd_per_hour, 4),
        "usd_per_million_output_tokens": round(c.usd_per_million_output_tokens, 4),
        "price_as_of": c.price_as_of,
        "price_source": c.price_source,
        # Under load: the batch step model with concurrency_per_replica sequences running (what the targets are
        # checked against); alone: one request on an idle replica.
        "ttft_s": round(c.under_load.ttft_s, 4),
        "itl_s": round(c.under_load.itl_s, 5),
        "under_load": {
            "running": round(c.under_load.running, 2),
            "ttft_s": round(c.under_load.ttft_s, 4),
            "itl_s": round(c.under_load.itl_s, 5),
            "decode_step_s": round(c.under_load.decode_step_s, 5),
            "prefill_step_s": round(c.under_load.prefill_step_s, 5),
            "output_tokens_per_s": round(c.under_load.output_tokens_per_s, 1),
        },
        "alone": {"ttft_s": round(c.alone.ttft_s, 4), "itl_s": round(c.alone.itl_s, 5)},
        # The planned load: Poisson arrivals at peak_requests_per_s spread over the replicas as the target routes
        # them (else the under_load batch), with queueing; percentiles of the step model (`kvfleet simulate` checks).
        "planned_load": _planned_json(c),
        "binding": {
            "limit": bound.limit,
            "kv_at_full_slots": round(bound.kv_at_full_slots, 4),
            "kv_ceiling": round(bound.kv_ceiling, 4),
            "reason": bound.reason,
        },
        "admission": {
            "tokens": adm.tokens,
            "running": adm.running,
            "queued": adm.queued,
            "request_tokens": adm.request_tokens,
            "reason": adm.reason,
        },
        "decode_bound": c.perf.bound,
        "requests_per_s_per_replica": round(c.requests_per_s_per_replica, 3),
        "output_tokens_per_s_per_replica": round(c.output_tokens_per_s_per_replica, 1),
        "memory": c.capacity.as_dict(),
        "engine_settings": _engine_line(c)[1],
        "notes": list(c.notes),
    }


def _planned_json(c: Candidate) -> dict[str, Any]:
    from kvfleet.sizing.step import latency_percentiles

    q = latency_percentiles(c.planned_load)

    def finite(d: dict[str, float]) -> dict[str, float | None]:
        return {k: (v if math.isfinite(v) else None) for k, v in d.items()}  # JSON has no Infinity

    return {
        "requests_per_s_per_replica": None if c.planned_requests_per_s is None else round(c.planned_requests_per_s, 4),
        "routing": c.hosting.routing.value,
        "running": round(c.planned_load.running, 2),
        "ttft_s": finite(q.ttft.as_dict()),
        "itl_s": finite(q.itl.as_dict(5)),
    }


def _simulated_load(p: Plan) -> tuple[SimReport, str]:
    """The chosen candidate's planned load run through the simulator (its replicas and routing, the engine's own
    scheduler): the percentiles the plan prints beside its closed form, and the load's description."""
    from kvfleet.sim.candidate import planned_fleet
    from kvfleet.sim.report import summarize
    from kvfleet.sim.shapes import run

    spec, shape = planned_fleet(p.best, p.request.model, p.request.workload)
    return summarize(run(spec, shape, spec.initial_replicas), spec), shape.describe()


def _simulated_json(p: Plan) -> dict[str, Any]:
    from kvfleet.cli.predict import SIMULATED_KEYS

    r, load = _simulated_load(p)
    report = r.as_dict()
    return {"candidate": p.best.label(), "load": load, **{k: report[k] for k in SIMULATED_KEYS}}


def _ms(v: float, digits: int = 0) -> str:
    return f"{v * 1e3:,.{digits}f}" if math.isfinite(v) else "inf"


def _plan_json(name: str, target: str, p: Plan, top: int) -> dict[str, Any]:
    return {
        "deployment": name,
        "model": p.request.model.model_id,
        "platform": target,
        "candidates": [_candidate_json(c, p.request.workload) for c in p.candidates[:top]],
        **({"simulated": _simulated_json(p)} if p.candidates else {}),
        "rejections": [
            {
                "instance_type": r.instance_type,
                "tensor_parallel_size": r.tensor_parallel_size,
                "pipeline_parallel_size": r.pipeline_parallel_size,
                "expert_parallel": r.expert_parallel,
                "weight_precision": r.weight_precision,
                "kv_cache_dtype": r.kv_cache_dtype,
                "reason": r.reason,
            }
            for r in p.rejections
        ],
    }


def _print_plan(name: str, target: str, p: Plan, top: int, all_rejections: bool) -> None:
    from rich.table import Table

    from kvfleet.sizing.planner import admission, binding
    from kvfleet.sizing.step import latency_percentiles
    from kvfleet.sizing.units import GiB

    console = _console()
    wl = p.request.workload
    t = Table(
        title=f"{name}: {p.request.model.model_id} on {target} ({wl.max_input_tokens}+{wl.max_output_tokens} tokens)"
    )
    for col in (
        "#",
        "instance",
        "tp",
        "weights",
        "kv",
        "seqs",
        "limited by",
        "replicas",
        "instances",
        "$/h fleet",
        "$/M tok",
        "TTFT p50/90/99 ms",
        "ITL p50/90/99 ms",
        "wts GiB",
        "KV GiB",
    ):
        t.add_column(col, justify="right" if col not in ("instance", "limited by") else "left")
    for n, c in enumerate(p.candidates[:top], 1):
        cap = c.capacity
        q = latency_percentiles(c.planned_load)
        t.add_row(
            str(n),
            c.name,
            c.layout.label().removeprefix("tp="),
            c.weight_scheme.name,
            c.kv_cache_dtype.value,
            str(c.concurrency_per_replica),
            c.limited_by,
            str(c.replicas),
            str(c.instance_count),
            f"{c.fleet_usd_per_hour:.2f}",
            f"{c.usd_per_million_output_tokens:.3f}",
            f"{_ms(q.ttft.p50_s)}/{_ms(q.ttft.p90_s)}/{_ms(q.ttft.p99_s)}",
            f"{_ms(q.itl.p50_s, 1)}/{_ms(q.itl.p90_s, 1)}/{_ms(q.itl.p99_s, 1)}",
            f"{cap.weights_bytes_per_gpu / GiB:.2f}",
            f"{cap.kv_cache_bytes_per_gpu / GiB:.2f}",
        )
    console.print(t)
    best = p.best
    console.print(
        f"chosen: {best.label()} - {best.capacity.kv_cache_tokens:,} KV tokens per replica, "
        f"{best.cache_concurrency} sequences of {best.capacity.max_model_len} fit, running "
        f"{best.concurrency_per_replica}; price ${best.usd_per_hour_per_instance}/h as of {best.price_as_of}"
    )
    u = best.under_load
    console.print(
        f"speed with {best.concurrency_per_replica} running (batch step model): TTFT {u.ttft_s * 1e3:,.0f} ms, "
        f"ITL {u.itl_s * 1e3:.1f} ms, {u.output_tokens_per_s:,.0f} output tokens/s per replica; one request alone: "
        f"TTFT {best.alone.ttft_s * 1e3:,.0f} ms, ITL {best.alone.itl_s * 1e3:.1f} ms",
        markup=False,
    )
    q = latency_percentiles(best.planned_load)
    if best.planned_requests_per_s is not None:
        load = (
            f"{wl.peak_requests_per_s:g} requests/s (Poisson) over {best.replicas} replica(s), "
            f"{best.hosting.routing.value.replace('_', ' ')} routing"
        )
    else:
        load = f"{best.concurrency_per_replica} sequences running per replica"
    console.print(
        f"under the planned load ({load}; average lengths): TTFT p50 {_ms(q.ttft.p50_s)} / p90 {_ms(q.ttft.p90_s)} / "
        f"p95 {_ms(q.ttft.p95_s)} / p99 {_ms(q.ttft.p99_s)} ms, ITL p50 {_ms(q.itl.p50_s, 1)} / p90 "
        f"{_ms(q.itl.p90_s, 1)} / p99 {_ms(q.itl.p99_s, 1)} ms "
        "(`kvfleet simulate` replays it)",
        markup=False,
    )
    sim, shape = _simulated_load(p)
    if sim.ttft_s is not None and sim.itl_s is not None:
        console.print(
            f"simulated ({shape}, the engine's own scheduler): TTFT p50 {_ms(sim.ttft_s.p50)} / p90 "
            f"{_ms(sim.ttft_s.p90)} / p99 {_ms(sim.ttft_s.p99)} ms, ITL p50 {_ms(sim.itl_s.p50, 1)} / p90 "
            f"{_ms(sim.itl_s.p90, 1)} / p99 {_ms(sim.itl_s.p99, 1)} ms, {sim.output_tokens_per_s:,.0f} output tokens/s",
            markup=False,
        )
    bound = binding(best, wl)
    console.print(f"binding limit at the planned load: {bound.limit} ({bound.reason})", markup=False)
    adm = admission(best, wl)
    console.print(
        f"admission: {adm.tokens:,} tokens per replica, prompt + generation limit reserved per request ({adm.reason}); "
        "past it the agent answers 429 with Retry-After",
        markup=False,
    )
    console.print(_engine_line(best)[0], markup=False)
    for note in best.notes:
        console.print(f"  note: {note}", markup=False)
    if all_rejections:
        shown = list(p.rejections)
    else:  # one per family, for a spread of reasons
        seen: set[str] = set()
        shown = []
        for r in p.rejections:
            family = r.instance_type.split(".")[0]
            if family not in seen:
                seen.add(family)
                shown.append(r)
    more = "" if all_rejections else " (one per family; --rejections for all)"
    console.print(f"rejected {len(p.rejections)} candidates{more}:")
    for r in shown:
        console.print(f"  - {r.describe()}", markup=False)


# ---- catalogs ------------------------------------------------------------------------------------


def cmd_models(a: argparse.Namespace) -> int:
    from kvfleet.sizing.catalog import all_models
    from kvfleet.sizing.engines import EngineName, rope_rules
    from kvfleet.sizing.memory import kv_layout
    from kvfleet.sizing.models import context_limit
    from kvfleet.sizing.precision import KvDtype

    rows = []
    for m in all_models():
        kv = kv_layout(m, tp=1, kv_dtype=KvDtype.AUTO)
        limit = context_limit(m, rope_rules(EngineName.VLLM))  # the newest modelled vLLM's
        rows.append(
            {
                "id": m.model_id,
                "family": m.family,
                "model_type": m.model_type,
                "params_b": round(m.total_params / 1e9, 2),
                "active_params_b": round(m.active_params / 1e9, 2),
                "layers": m.num_layers,
                "kv_heads": m.num_kv_heads,
                "head_dim": m.head_dim,
                "kv_bytes_per_token": kv.kv_bytes_per_token_per_gpu,
                "max_position_embeddings": m.max_position_embeddings,
                "max_model_len_limit": limit.max_len_tokens,
                "max_model_len_source": limit.source,
                "precision": m.native_scheme.name,
                "attention": m.summary(),
                "aliases": list(m.aliases),
                "source": m.source,
            }
        )
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.table import Table

    t = Table(title=f"{len(rows)} models")
    for col in ("id", "params (B)", "active (B)", "layers", "KV heads", "KV B/token", "context", "precision"):
        t.add_column(col, justify="left" if col == "id" else "right")
    for r in rows:
        t.add_row(
            str(r["id"]),
            str(r["params_b"]),
            str(r["active_params_b"]),
            str(r["layers"]),
            str(r["kv_heads"]),
            f"{r['kv_bytes_per_token']:,}",
            f"{r['max_model_len_limit']:,}",
            str(r["precision"]),
        )
    _console().print(t)
    return 0


def cmd_instances(a: argparse.Namespace) -> int:
    from kvfleet.sizing.hardware import instances

    rows = []
    for it in instances().values():
        if a.platform == "sagemaker" and not it.sagemaker_endpoint:
            continue
        acc = it.accelerator
        price = it.price(a.platform or "ec2")
        rows.append(
            {
                "instance_type": it.sagemaker_name if a.platform == "sagemaker" else it.name,
                "accelerator": acc.name,
                "kind": acc.kind.value,
                "count": it.accelerator_count,
                "gpu_fraction": it.gpu_fraction,
                "gpu_memory_gib": None if it.gpu_memory_gib is None else round(it.gpu_memory_gib, 3),
                "hbm_bandwidth_gbs": None
                if acc.hbm_bandwidth_bytes_per_s is None
                else acc.hbm_bandwidth_bytes_per_s / 1e9,
                "bf16_tflops": None if acc.bf16_flops is None else acc.bf16_flops / 1e12,
                "fp8_tflops": None if acc.fp8_flops is None else acc.fp8_flops / 1e12,
                "fp8_support": acc.fp8_support,
                "vcpus": it.vcpus,
                "ram_gib": it.ram_gib,
                "sagemaker_endpoint": it.sagemaker_endpoint,
                "usd_per_hour": None if price is None else price.usd_per_hour,
                "price_as_of": None if price is None else price.as_of,
                "price_source": None if price is None else price.source,
            }
        )
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.table import Table

    t = Table(title=f"{len(rows)} instance types" + (f" ({a.platform})" if a.platform else ""))
    for col in (
        "type",
        "accelerator",
        "n",
        "GiB/GPU",
        "GB/s",
        "bf16 TF",
        "fp8",
        "vCPU",
        "$/h",
        "as of",
        "SageMaker",
    ):
        t.add_column(col, justify="left" if col in ("type", "accelerator") else "right")

    def fmt(v: object) -> str:
        return "-" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))

    for r in rows:
        t.add_row(
            str(r["instance_type"]),
            str(r["accelerator"]),
            fmt(r["count"]),
            fmt(r["gpu_memory_gib"]),
            fmt(r["hbm_bandwidth_gbs"]),
            fmt(r["bf16_tflops"]),
            "yes" if r["fp8_support"] else "no",
            fmt(r["vcpus"]),
            fmt(r["usd_per_hour"]),
            fmt(r["price_as_of"]),
            "yes" if r["sagemaker_endpoint"] else "no",
        )
    _console().print(t)
    return 0


def cmd_synth(a: argparse.Namespace) -> int:
    """The supported way to synthesize: the CDK CLI exits 1 for every failure of its app, so a bad file is found
    here first (exit 2), and a problem only the stacks find (exit 2 from the app) is read back from the status
    file the app writes, instead of the CLI's 1."""
    import os
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from kvfleet.config.loader import environment_path, load_located
    from kvfleet.deployments import resolve_environment
    from kvfleet.errors import SYNTH_STATUS_ENV

    if a.pipeline is not None:
        from kvfleet.config.pipeline import load_pipeline

        for stage_env in load_pipeline(a.pipeline).environments:
            try:
                resolve_environment(stage_env.environment)
            except KvfleetError as err:
                raise stage_env.problem(err) from None
        context = f"pipeline={a.pipeline}"
    else:
        loaded = load_located(environment_path(a.environment))
        try:
            resolve_environment(loaded.environment)
        except KvfleetError as err:
            raise loaded.problem(err) from None
        context = f"env={a.environment}"
    local = Path("node_modules") / ".bin" / "cdk"
    cdk = a.cdk or (str(local) if local.exists() else shutil.which("cdk"))
    if cdk is None:
        raise KvfleetError("no CDK CLI: run `npm ci` here (package.json pins it) or give --cdk", field="cdk")
    with tempfile.TemporaryDirectory(prefix="kvfleet-synth-") as tmp:
        status = Path(tmp) / "status"
        env = {**os.environ, SYNTH_STATUS_ENV: str(status)}
        try:
            rc = subprocess.run([cdk, "synth", "-c", context, *a.cdk_args], env=env, check=False)
        except OSError as err:
            raise KvfleetError(f"cannot run {cdk}: {err.strerror}", field="cdk") from None
        app_status = status.read_text(encoding="utf-8").strip() if status.exists() else ""
    return int(app_status) if app_status.isdigit() else rc.returncode


def cmd_bench(a: argparse.Namespace) -> int:
    import asyncio
    import os
    import re
    from pathlib import Path
    from urllib.parse import urlsplit

    from kvfleet.bench.client import Endpoint, kv_drift, poisson_level, run_levels, run_levels_sagemaker, summarize

    planned = _planned(a.env, a.deployment) if a.env is not None else None
    if a.url is None:
        if planned is None:
            raise KvfleetError("give the endpoint's URL, or --env FILE [--deployment NAME] to read it", field="url")
        a.url = _deployed_url(planned)
    sagemaker = None
    if a.url.startswith("sagemaker:"):
        from kvfleet.bench.sagemaker import SageMakerTarget

        name = a.url.removeprefix("sagemaker:")
        # SageMaker's EndpointName pattern (CreateEndpoint API reference).
        if not re.fullmatch(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}", name):
            raise KvfleetError(
                f"{name!r} is not a SageMaker endpoint name (letters, digits, '-', 63 at most)", field="url"
            )
        region = a.region or (planned.environment.region if planned is not None else None)
        sagemaker = SageMakerTarget(endpoint_name=name, region=region, endpoint_url=a.endpoint_url)
    else:
        parts = urlsplit(a.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise KvfleetError(
                f"{a.url!r} is not an http(s) URL or sagemaker:<endpoint name>; e.g. http://127.0.0.1:8080", field="url"
            )
    headers = []
    for h in a.header:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise KvfleetError(f"{h!r} is not NAME:VALUE", field="header")
        headers.append((name.strip(), value.strip()))
    ep = Endpoint(
        url=a.url,
        model=a.model,
        api_key=a.api_key or os.environ.get("KVFLEET_BENCH_API_KEY"),
        headers=tuple(headers),
    )
    expected = a.expect_kv_tokens
    # Asked for (--expect-kv-tokens), the KV check fails where the endpoint reports no cache; implied by --env, it
    # is skipped with a note there (a load balancer and SageMaker expose no /metrics).
    kv_required = expected is not None
    if planned is not None:
        expected = expected or planned.candidate.capacity.kv_cache_tokens
    elif a.deployment is not None:
        raise KvfleetError("--deployment names a deployment of --env; give --env FILE too", field="deployment")
    limits = _limits(a, planned) if a.limits else None
    if a.trace is not None and a.rate is not None:
        raise KvfleetError("--trace replays the trace's own arrivals; drop --rate (or use --rate-scale)", field="rate")
    if limits is not None and (a.trace is not None or a.rate is not None):
        raise KvfleetError("--limits runs its own two levels; drop --trace and --rate", field="limits")
    if a.planned_load:
        if planned is None:
            raise KvfleetError("--planned-load replays the plan of --env; give --env FILE", field="planned_load")
        if a.trace is not None or a.rate is not None or limits is not None:
            raise KvfleetError(
                "--planned-load is its own level; drop --trace, --rate and --limits", field="planned_load"
            )
        w = planned.deployment.workload
        if w.peak_requests_per_s is None:
            raise KvfleetError(
                "the plan has no arrival rate; set workload.peak_requests_per_s (or workload.trace)",
                field="planned_load",
            )
        specs = [
            poisson_level(
                w.peak_requests_per_s,
                requests=a.requests,
                prompt_tokens=w.avg_input_tokens or w.max_input_tokens,
                output_tokens=w.avg_output_tokens or w.max_output_tokens,
            )
        ]
    else:
        specs = _limits_levels(*limits) if limits is not None else _bench_levels(a)
    if a.calibrate and planned is None:
        raise KvfleetError(
            "--calibrate measures a planned deployment; give --env FILE [--deployment NAME]", field="calibrate"
        )
    for out_file in (a.calibrate,):
        if out_file:
            folder = Path(out_file).parent
            if Path(out_file).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
                raise KvfleetError(f"cannot write {out_file}: no writable directory {folder}", field="calibrate")
    if a.html:  # before the run, which may take long: a report that cannot be written should not cost it
        folder = Path(a.html).parent
        if Path(a.html).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise KvfleetError(f"cannot write {a.html}: no writable directory {folder} to put it in", field="html")
    progress = _progress_line() if not a.json and sys.stderr.isatty() else None
    if sagemaker is not None:
        run = run_levels_sagemaker(sagemaker, specs, model=a.model, timeout_s=a.timeout_s, progress=progress)
    else:
        run = run_levels(ep, specs, timeout_s=a.timeout_s, progress=progress)
    model, levels, capacity = asyncio.run(run)
    if progress is not None:
        print("\r\033[K", end="", file=sys.stderr)  # clear the live line before the report
    ttft_ms = a.ttft_ms or (planned.deployment.workload.ttft_ms if planned is not None else None)
    slo = ttft_ms / 1000 if ttft_ms else None
    rows = [summarize(level, ttft_slo_s=slo) for level in levels]
    speed_drift: list[str] = []
    if planned is not None:
        for row, spec in zip(rows, specs, strict=True):
            if spec.concurrency is not None and len(set(spec.lengths)) == 1:
                (n_in, n_out) = spec.lengths[0]
                row["planned"] = _predicted_speed(planned, n_in, n_out, spec.concurrency)
                row["input_tokens"], row["output_tokens_each"] = n_in, n_out
                speed_drift += _speed_drift(row, a.speed_tolerance)
    prediction_source = _predict_levels(a, planned, specs, rows) if a.predict else None
    failed = sum(r["requests"] - r["completed"] for r in rows)
    kv_note = None
    if capacity is None and expected is not None and not kv_required:
        kv_note = (
            "note: KV check skipped: the endpoint reports no KV-cache size on its /metrics (a load balancer or "
            f"SageMaker hides it); run it against a replica's agent, or pass --expect-kv-tokens {expected} to "
            "require it"
        )
        print(kv_note, file=sys.stderr)
        expected = None
    drift = kv_drift(capacity, expected, a.tolerance)
    meeting = [r for r in rows if r["ttft_attainment"] is not None and r["ttft_attainment"] >= a.slo_attainment]
    best_rate = max((r["rate_per_s"] or 0.0 for r in meeting if r["rate_per_s"]), default=None)
    slo_miss = None
    verdict = _limits_verdict(rows, a.slo_attainment) if limits is not None else None
    if verdict is not None and limits is not None:
        verdict["lines"].append(_limits_fill(limits, capacity))
    if limits is not None:
        slo = None  # --limits judges the planned level alone (below), not every level
    if slo is not None and not meeting:
        slo_miss = (
            f"no level got {a.slo_attainment:.0%} of its requests a first token within {ttft_ms:g} ms "
            f"(best {max(r['ttft_attainment'] or 0.0 for r in rows):.1%})"
        )
    report: dict[str, Any] = {
        "url": a.url,
        "model": model,
        "input_tokens": a.input_tokens,
        "output_tokens": a.output_tokens,
        "levels": rows,
        "kv_cache": None
        if capacity is None
        else {"blocks": capacity.blocks, "block_tokens": capacity.block_tokens, "tokens": capacity.tokens},
        "expected_kv_tokens": expected,
        "drift": drift,
        "ttft_target_s": slo,
        "best_rate_per_s": best_rate,
        "slo_miss": slo_miss,
        "limits": verdict,
        "speed_drift": speed_drift,
    }
    if a.html:
        from kvfleet.bench.report import render_html

        try:
            Path(a.html).write_text(render_html(report, levels), encoding="utf-8")
        except OSError as err:  # checked before the run; a disk that filled since still gets one line
            print(f"kvfleet: cannot write {a.html}: {err.strerror or err}", file=sys.stderr)
    if a.calibrate and planned is not None:
        _write_calibration(a.calibrate, planned, rows, capacity)
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        _print_bench(a.url, model, _what_ran(a, limits, specs), rows)
        if capacity is not None:
            print(
                f"engine KV cache: {capacity.blocks:,} blocks of {capacity.block_tokens} tokens = "
                f"{capacity.tokens:,} tokens per replica ({capacity.source})"
            )
        for row in rows:
            if p := row.get("planned"):
                itl = row["itl_s"]
                measured = f"{itl['mean'] * 1e3:.1f} ms" if itl else "-"
                print(
                    f"plan ({p['instance_type']}, one replica) at {row['level']}: ITL {p['itl_s'] * 1e3:.1f} ms "
                    f"(measured {measured}), {p['output_tokens_per_s']:,.0f} output tokens/s (measured "
                    f"{row['output_tokens_per_s']:,.0f}), TTFT {p['ttft_s'] * 1e3:,.0f} ms"
                )
        if prediction_source is not None:
            from kvfleet.cli.predict import prediction_lines

            print("\n".join(prediction_lines(rows, prediction_source)))
        if best_rate is not None:
            top = max(a.rate or [0.0])
            if a.rate and best_rate >= top:  # the sweep never found where it stops
                print(
                    f"every rate up to {top:g} req/s got {a.slo_attainment:.0%} of first tokens within {ttft_ms:g} "
                    f"ms: the limit lies above {top:g} req/s (add higher rates to find it)"
                )
            else:
                print(
                    f"highest rate with {a.slo_attainment:.0%} of first tokens within {ttft_ms:g} ms: "
                    f"{best_rate:g} req/s"
                )
        if expected is not None and drift is None:
            print(f"plan check: {expected:,} KV tokens expected; the engine has them (tolerance {a.tolerance:.0%})")
    if drift is not None:
        print(f"kvfleet: plan check: {drift}", file=sys.stderr)
    for line in speed_drift:
        print(f"kvfleet: plan check: {line}", file=sys.stderr)
    if speed_drift:
        drift = drift or speed_drift[0]
    if slo_miss is not None:
        print(f"kvfleet: TTFT target: {slo_miss}", file=sys.stderr)
    if verdict is not None:
        for line in verdict["lines"]:
            if line.startswith("kvfleet: "):
                print(line, file=sys.stderr)
            elif not a.json:
                print(line)
        return 0 if verdict["passed"] and drift is None else 1
    return 1 if failed or drift is not None or slo_miss is not None else 0


def _predicted_speed(r: ResolvedDeployment, n_in: int, n_out: int, concurrency: int) -> dict[str, Any]:
    """What the plan's step model predicts for one replica at this level: ``concurrency`` clients in a closed loop
    sending ``n_in`` + ``n_out`` tokens, as many running as max_num_seqs lets."""
    from kvfleet.sim.steps import RooflineSteps
    from kvfleet.sizing.step import Limits, Workload, steady_state

    c = r.candidate
    rep = RooflineSteps.for_candidate(c, r.model).replica  # the replica the planner and the simulator price
    seqs = r.engine_args.max_num_seqs or c.capacity.max_num_seqs
    st = steady_state(
        rep,
        Workload(input_tokens=n_in, output_tokens=n_out, concurrency=concurrency),
        limits=Limits(max_num_batched_tokens=c.capacity.max_num_batched_tokens, max_running=min(concurrency, seqs)),
    )
    return {
        "itl_s": st.itl_s,
        "ttft_s": st.ttft_service_s + st.queue_wait_s,
        "output_tokens_per_s": st.output_tokens_per_s,
        "instance_type": c.name,
    }


def _speed_drift(row: dict[str, Any], tolerance: float) -> list[str]:
    """A level slower than the plan predicts (faster passes: the plan is a floor, and a fleet behind a load
    balancer serves more than one replica's tokens)."""
    p = row["planned"]
    out = []
    itl = row["itl_s"]
    if itl is not None and itl["mean"] > p["itl_s"] * (1 + tolerance):
        out.append(
            f"{row['level']}: mean ITL {itl['mean'] * 1e3:.1f} ms against the plan's {p['itl_s'] * 1e3:.1f} ms on "
            f"{p['instance_type']} ({itl['mean'] / p['itl_s']:.2f}x, tolerance {tolerance:.0%})"
        )
    tps = row["output_tokens_per_s"]
    if row["completed"] and tps < p["output_tokens_per_s"] * (1 - tolerance):
        out.append(
            f"{row['level']}: {tps:,.0f} output tokens/s against the plan's {p['output_tokens_per_s']:,.0f} "
            f"({tps / p['output_tokens_per_s']:.2f}x, tolerance {tolerance:.0%})"
        )
    return out


def _limits(a: argparse.Namespace, planned: ResolvedDeployment | None) -> tuple[int, int, int]:
    """(max input, max output, planned concurrency) for --limits: the flags, else the plan's."""
    w = planned.deployment.workload if planned is not None else None
    n_in = a.max_input_tokens or (w.max_input_tokens if w else None)
    n_out = a.max_output_tokens or (w.max_output_tokens if w else None)
    c = a.max_concurrency or (planned.engine_args.max_num_seqs if planned is not None else None)
    missing = [
        f for f, v in (("--max-input-tokens", n_in), ("--max-output-tokens", n_out), ("--max-concurrency", c)) if not v
    ]
    if missing:
        raise KvfleetError(f"--limits needs {', '.join(missing)} (or --env with the plan)", field="limits")
    assert n_in and n_out and c
    return n_in, n_out, c


def _limits_levels(n_in: int, n_out: int, c: int) -> list[LevelSpec]:
    from kvfleet.bench.client import LevelSpec

    return [
        LevelSpec(label=f"limits at {c}", concurrency=c, lengths=((n_in, n_out),) * (2 * c)),
        LevelSpec(label=f"above, at {2 * c}", concurrency=2 * c, lengths=((n_in, n_out),) * (4 * c)),
    ]


def _limits_verdict(rows: list[dict[str, Any]], goal: float) -> dict[str, Any]:
    at, above = rows
    problems = []
    if at["failed"]:
        problems.append(f"{sum(at['failed'].values())} requests failed ({_failures(at)})")
    if at["preemptions"]:
        problems.append(f"the engine preempted {at['preemptions']:g} times (the cache ran short)")
    if at["ttft_attainment"] is not None and at["ttft_attainment"] < goal:
        problems.append(f"TTFT target met by {at['ttft_attainment']:.1%} < {goal:.0%} (--slo-attainment)")
    others = {k: n for k, n in above["failed"].items() if k != "429"}
    lines = []
    if problems:
        lines.append(f"kvfleet: limits: at the planned concurrency {at['level']}: " + "; ".join(problems))
    else:
        unknown = " (no preemption counter on this endpoint)" if at["preemptions"] is None else ""
        lines.append(f"limits: {at['level']}: every request completed, none preempted{unknown}")
    if others:
        lines.append(
            f"kvfleet: limits: {above['level']}: {sum(others.values())} failed otherwise than 429 "
            f"({_failures(above)}): the endpoint falls over above its plan instead of refusing what it cannot admit"
        )
    elif above["failed"]:
        lines.append(f"limits: {above['level']}: {above['failed']['429']} refused with 429 (admission), none failed")
    else:
        lines.append(f"limits: {above['level']}: every request completed (admission let them queue)")
    return {"passed": not problems and not others, "lines": lines}


def _limits_fill(limits: tuple[int, int, int], capacity: KvCapacity | None) -> str:
    """Whether the levels could have filled the cache the engine reports: a test that could not says nothing of
    what the engine does when its cache is full."""
    n_in, n_out, c = limits
    most = 2 * c * (n_in + n_out)  # the level above the plan, every request at its longest
    if capacity is None:
        return "limits: the endpoint reports no KV cache: whether the test could fill it is unknown"
    if most < capacity.tokens:
        return (
            f"limits: note: the test holds at most {most:,} tokens at once and the engine's cache has "
            f"{capacity.tokens:,}: it could not have filled the cache (raise --max-concurrency or the lengths to "
            "test a full one)"
        )
    return f"limits: the test holds up to {most:,} tokens at once, past the engine's cache of {capacity.tokens:,}"


def _failures(row: dict[str, Any]) -> str:
    return ", ".join(f"{n} x {k}" for k, n in sorted(row["failed"].items()))


def _predict_levels(
    a: argparse.Namespace, planned: ResolvedDeployment | None, specs: list[LevelSpec], rows: list[dict[str, Any]]
) -> str:
    """Each level simulated beside what it measured (row["predicted"]); returns where the prediction came from."""
    from kvfleet.cli.predict import predict_level, prediction_fleet

    fleet, source = prediction_fleet(a, planned)
    for row, spec in zip(rows, specs, strict=True):
        row["predicted"] = predict_level(fleet, spec)
    return source


def _bench_levels(a: argparse.Namespace) -> list[LevelSpec]:
    from kvfleet.bench.client import LevelSpec, concurrency_levels, poisson_level

    if a.trace is not None:
        from kvfleet.workload.traces import read_trace

        t = read_trace(a.trace, fmt=a.trace_format, start_s=a.start_s, duration_s=a.duration_s, rate_scale=a.rate_scale)
        return [
            LevelSpec(
                label=f"trace x{a.rate_scale:g}",
                arrivals_s=tuple(t.arrival_s),
                lengths=tuple(zip(t.input_tokens, (max(1, o) for o in t.output_tokens), strict=True)),
                rate_per_s=len(t) / t.duration_s if t.duration_s > 0 else None,
            )
        ]
    if a.rate is not None:
        return [
            poisson_level(r, requests=a.requests, prompt_tokens=a.input_tokens, output_tokens=a.output_tokens)
            for r in a.rate
        ]
    levels = concurrency_levels(
        a.concurrency, requests=a.requests, prompt_tokens=a.input_tokens, output_tokens=a.output_tokens
    )
    if a.calibrate:
        # Enough levels to fit each term of the step model: the batch sizes asked for (and one request alone), each
        # with the prompt asked for and a short one (per prefill token against per step and per request).
        short = max(16, a.input_tokens // 8)
        sizes = sorted({1, *a.concurrency})
        levels = [
            *concurrency_levels(
                sizes, requests=a.requests, prompt_tokens=a.input_tokens, output_tokens=a.output_tokens
            ),
            *concurrency_levels(sizes, requests=a.requests, prompt_tokens=short, output_tokens=a.output_tokens),
        ]
        levels = [replace(lv, label=f"{lv.label}, {lv.lengths[0][0]} in") for lv in levels]
    return levels


def _write_calibration(
    path: str, r: ResolvedDeployment, rows: list[dict[str, Any]], capacity: KvCapacity | None
) -> None:
    from datetime import UTC, datetime
    from pathlib import Path

    from kvfleet.calibration import Calibration, Point

    measured = [row for row in rows if row.get("planned") and row["itl_s"] is not None and row["completed"]]
    points = tuple(
        Point(
            concurrency=row["concurrency"],
            input_tokens=row["input_tokens"],
            output_tokens=row["output_tokens_each"],
            itl_s=row["itl_s"]["mean"],
            predicted_itl_s=row["planned"]["itl_s"],
            output_tokens_per_s=row["output_tokens_per_s"],
            predicted_output_tokens_per_s=row["planned"]["output_tokens_per_s"],
        )
        for row in measured
    )
    from kvfleet.calibration import EngineLimitsRecord
    from kvfleet.tuning import fleet_spec

    kv_tokens = capacity.tokens if capacity is not None else None
    steps, residuals = _fit_steps(r, measured, kv_tokens)
    lim = fleet_spec(r).limits
    cal = Calibration(
        measured_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        instance_type=r.candidate.name,
        engine=r.engine,
        engine_version=r.deployment.engine.version,
        model=r.model_id,
        tensor_parallel_size=r.candidate.tensor_parallel_size,
        kv_cache_tokens=kv_tokens,
        points=points,
        steps=steps,
        residuals=residuals,
        engine_limits=EngineLimitsRecord(
            max_num_seqs=lim.max_num_seqs,
            max_num_batched_tokens=lim.max_num_batched_tokens,
            block_tokens=lim.block_tokens,
        ),
    )
    try:
        Path(path).write_text(cal.to_json(), encoding="utf-8")
    except OSError as err:
        print(f"kvfleet: cannot write {path}: {err.strerror or err}", file=sys.stderr)
        return
    kv = f"{cal.kv_cache_tokens:,} KV tokens" if cal.kv_cache_tokens else "no KV size (the endpoint hides /metrics)"
    print(f"calibration written to {path}: steps x{cal.step_time_scale:.2f} the plan's, {kv}", file=sys.stderr)
    for line in _fit_lines(cal):
        print(line, file=sys.stderr)


def _fit_steps(
    r: ResolvedDeployment, rows: list[dict[str, Any]], kv_tokens: int | None
) -> tuple[FittedSteps | None, tuple[FitResidual, ...]]:
    """The step model fitted on the measured closed-loop levels (kvfleet.sim.fit), with each level's residual;
    (None, ()) where the levels do not hold two batch sizes and two prompt lengths."""
    from dataclasses import replace as with_fields

    from kvfleet.calibration import FitResidual, FittedSteps
    from kvfleet.sim.fit import MeasuredLevel, fit
    from kvfleet.tuning import fleet_spec

    levels = [
        MeasuredLevel(
            concurrency=row["concurrency"],
            input_tokens=row["input_tokens"],
            output_tokens=row["output_tokens_each"],
            requests=row["completed"],
            ttft_p50_s=row["ttft_s"]["p50"] if row["ttft_s"] else 0.0,
            itl_mean_s=row["tpot_s"]["mean"] if row["tpot_s"] else 0.0,
            output_tokens_per_s=row["output_tokens_per_s"],
        )
        for row in rows
    ]
    spec = fleet_spec(r)
    if kv_tokens is not None:  # the cache the engine allocated, as the simulator will replay it
        spec = with_fields(
            spec, limits=with_fields(spec.limits, kv_blocks=max(1, kv_tokens // spec.limits.block_tokens))
        )
    try:
        result = fit(spec, levels)
    except ValueError:
        return None, ()
    steps = FittedSteps(**result.terms())
    residuals = tuple(
        FitResidual(
            concurrency=lf.level.concurrency,
            input_tokens=lf.level.input_tokens,
            output_tokens=lf.level.output_tokens,
            ttft_p50_s=lf.level.ttft_p50_s,
            predicted_ttft_p50_s=lf.ttft_p50_s,
            itl_s=lf.level.itl_mean_s,
            predicted_itl_s=lf.itl_mean_s,
            output_tokens_per_s=lf.level.output_tokens_per_s,
            predicted_output_tokens_per_s=lf.output_tokens_per_s,
        )
        for lf in result.levels
    )
    return steps, residuals


def _fit_lines(cal: Calibration) -> list[str]:
    """The fitted terms and each level's residual, for the person who ran the calibration."""
    s = cal.steps
    if s is None:
        return ["no step model fitted: that needs closed-loop levels at two batch sizes and two prompt lengths"]
    out = [
        f"fitted step model: {s.fixed_s * 1e3:.3f} ms per step + {s.per_prefill_token_s * 1e6:.3f} us per prefill "
        f"token + {s.per_decode_seq_s * 1e6:.2f} us per decoding sequence + {s.per_kv_token_s * 1e9:.3f} ns per KV "
        f"token read; {s.request_overhead_s * 1e3:.2f} ms per request outside the steps"
    ]
    for x in cal.residuals:
        out.append(
            f"  concurrency {x.concurrency}, {x.input_tokens} in: "
            f"TTFT p50 {_pct(x.predicted_ttft_p50_s, x.ttft_p50_s)}, "
            f"ITL {_pct(x.predicted_itl_s, x.itl_s)}, output tokens/s "
            f"{_pct(x.predicted_output_tokens_per_s, x.output_tokens_per_s)} (fitted against measured)"
        )
    return out


def _pct(predicted: float, measured: float) -> str:
    return f"{(predicted / measured - 1) * 100:+.0f}%" if measured > 0 else "n/a"


def _progress_line() -> Callable[[LevelSpec, list[Any]], None]:
    """A live line on the terminal (stderr) for long runs: the level, requests done, failed, tokens so far."""
    import time

    last = [0.0]

    def show(spec: LevelSpec, results: list[Any]) -> None:
        now = time.monotonic()
        if now - last[0] < 0.25 and len(results) < len(spec.lengths):  # a few redraws a second at most
            return
        last[0] = now
        failed = sum(1 for r in results if not r.ok)
        tokens = sum(r.output_tokens for r in results)
        print(
            f"\r\033[K{spec.label}: {len(results)}/{len(spec.lengths)} requests, {failed} failed, {tokens:,} tokens",
            end="",
            file=sys.stderr,
            flush=True,
        )

    return show


def _deployed_url(r: ResolvedDeployment) -> str:
    """Where the deployment's stack says clients reach it (its CloudFormation outputs)."""
    from kvfleet.bench.aws import stack_outputs

    key = TARGETS[r.deployment.target.platform].address_output
    if key is None:
        raise KvfleetError(
            f"deployment {r.deployment.name} runs behind a ClusterIP Service with no address outside the cluster; "
            "port-forward to it (kubectl port-forward) and give http://127.0.0.1:<port>",
            field="url",
        )
    region = r.environment.region
    if region is None:
        raise KvfleetError("the environment file names no region to find its stacks in; set region", field="region")
    outputs = stack_outputs(r.stack_name, region)
    if key not in outputs:
        raise KvfleetError(f"stack {r.stack_name} has no output {key}; redeploy it with this kvfleet", field="env")
    if r.deployment.target.platform == "sagemaker":
        return f"sagemaker:{outputs[key]}"
    lb = getattr(r.deployment.target, "load_balancer", None)
    return f"{'https' if lb is not None and lb.certificate_arn else 'http'}://{outputs[key]}"


def _planned(env_file: str, deployment: str | None) -> ResolvedDeployment:
    """A deployment of an environment file as planned."""
    from kvfleet.config.loader import environment_path, load_located
    from kvfleet.deployments import config_error, plan_requests, resolve

    loaded = load_located(environment_path(env_file))
    try:
        drs = plan_requests(loaded.environment)
    except KvfleetError as err:
        raise loaded.problem(err) from None
    names = [dr.deployment.name for dr in drs]
    if deployment is None and len(drs) == 1:
        deployment = names[0]
    matching = [dr for dr in drs if dr.deployment.name == deployment]
    if not matching:
        raise KvfleetError(
            f"no deployment {deployment!r} in {loaded.source}; it has {', '.join(names)}", field="deployment"
        )
    try:
        return resolve(loaded.environment, matching[0])
    except KvfleetError as err:
        raise loaded.problem(config_error(err, matching[0].index)) from None


def _what_ran(a: argparse.Namespace, limits: tuple[int, int, int] | None, specs: list[LevelSpec]) -> str:
    """The table's title: what the levels sent."""
    if a.trace is not None:
        return f"the trace {a.trace} (its own lengths and arrivals, x{a.rate_scale:g} the rate)"
    if limits is not None:
        n_in, n_out, c = limits
        return f"the limits: {n_in} prompt + {n_out} generated tokens per request at {c} and {2 * c} clients"
    lengths = sorted({n for s in specs for n in s.lengths})
    each = ", ".join(f"{i} prompt + {o} generated" for i, o in lengths)
    if a.planned_load:
        return f"the plan's load: Poisson arrivals, {each} tokens per request"
    return f"{each} tokens per request"


def _print_bench(url: str, model: str, what: str, rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    def ms(p: dict[str, float] | None, key: str, digits: int = 0) -> str:
        return "-" if p is None else f"{p[key] * 1e3:,.{digits}f}"

    slo = any(r["ttft_attainment"] is not None for r in rows)
    t = Table(title=f"{url}: {model}, {what}")
    cols = ["level", "ok", "failed", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "TPOT p50 ms", "req/s", "out tok/s"]
    cols += ["TTFT in time"] if slo else []
    gauges = any(r.get("over_time") for r in rows)
    cols += ["KV peak", "queue peak"] if gauges else []
    cols += ["client lag p99 ms"]
    for col in cols:
        t.add_column(col, justify="left" if col == "level" else "right")
    for r in rows:
        failed = ", ".join(f"{n} x {k}" for k, n in sorted(r["failed"].items())) or "0"
        cells = [
            r["level"],
            str(r["completed"]),
            failed,
            f"{ms(r['ttft_s'], 'p50')}/{ms(r['ttft_s'], 'p90')}/{ms(r['ttft_s'], 'p99')}",
            f"{ms(r['itl_s'], 'p50', 1)}/{ms(r['itl_s'], 'p90', 1)}/{ms(r['itl_s'], 'p99', 1)}",
            ms(r["tpot_s"], "p50", 1),
            f"{r['requests_per_s']:.2f}",
            f"{r['output_tokens_per_s']:,.0f}",
        ]
        if slo:
            cells.append("-" if r["ttft_attainment"] is None else f"{r['ttft_attainment']:.1%}")
        if gauges:
            ot = r.get("over_time") or {}
            kv, q = ot.get("kv_cache_utilization_max"), ot.get("requests_waiting_max")
            cells += ["-" if kv is None else f"{kv:.0%}", "-" if q is None else f"{q:g}"]
        cells.append(f"{r['client_loop_lag_p99_s'] * 1e3:.1f}")
        t.add_row(*cells)
    console = _console()
    console.print(t)
    worst = max(r["client_loop_lag_p99_s"] for r in rows)
    late = max(r["late_send_max_s"] for r in rows)
    if worst > 0.005 or late > 0.05:
        console.print(
            f"note: the client's event loop lagged {worst * 1e3:.1f} ms (p99) and sent a request up to "
            f"{late * 1e3:.0f} ms after its time: timings include the client's own delay; run it from a machine "
            "with more CPU or fewer concurrent streams",
            markup=False,
        )
    for r in rows:
        for e in r["first_errors"]:
            console.print(f"error at {r['level']}: {e}", markup=False)


def cmd_schema(a: argparse.Namespace) -> int:
    from kvfleet.config.loader import environment_schema_json

    text = environment_schema_json()
    if a.output:
        try:
            with open(a.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as err:
            raise KvfleetError(f"cannot write {a.output}: {err.strerror}", field="output") from None
    else:
        sys.stdout.write(text)
    return 0


def cmd_workload(a: argparse.Namespace) -> int:
    from kvfleet.workload.profile import profile, render
    from kvfleet.workload.traces import read_trace

    trace = read_trace(a.trace, fmt=a.trace_format, start_s=a.start_s, duration_s=a.duration_s, rate_scale=a.rate_scale)
    p = profile(trace)
    if a.json:
        print(json.dumps(p.as_dict(), indent=2))
    else:
        print(render(p))
    return 0


COMMANDS = {
    "bench": cmd_bench,
    "simulate": cmd_simulate,
    "workload": cmd_workload,
    "capacity": cmd_capacity,
    "plan": cmd_plan,
    "diff": cmd_diff,
    "check": cmd_check,
    "ci-template": cmd_ci_template,
    "synth": cmd_synth,
    "schema": cmd_schema,
    "models": cmd_models,
    "instances": cmd_instances,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KvfleetError as err:
        print(f"kvfleet: error: {printable(str(err))}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
