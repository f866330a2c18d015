"""Fit the step-time model's constants to the FIT cases of kvfleet/sizing/data/step_calibration.json.

Deterministic coordinate descent on a log scale: each round tries every fitted constant at a fixed set
of multipliers, keeps the best, and halves the step sizes when nothing improves. The objective is the
sum over FIT cases and their measured metrics of log(predicted / measured)^2. CHECK cases are never read
by the fit; they are only reported. ``--write`` stores the fitted values and the fit record in the file.

The objective also holds vllm-project/vllm#20780's batch-1 TPOT of Llama 3.1 8B without speculation (the only
small-model step among the FIT cases). Then ``draft_pass_overhead_s`` alone, on the steps above: the same table's
TPOTs with an EAGLE-3 head at K = 2, 4 and 6 (FIT); K = 3, 5 and 7 are CHECKs (tests/sizing/test_spec_speed.py
bounds them).

The cases themselves (``cases``, ``predict_case``, ``case_errors``) are read and predicted here, beside the fit;
tests/sizing/test_step.py bounds the CHECK cases through this file.

    .venv/bin/python tools/fit_step.py [--write]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path
from typing import Any

# This checkout's kvfleet (and its data file), not another one installed in the environment.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfleet.errors import SizingError
from kvfleet.sizing import step, trtllm_bench
from kvfleet.sizing.capacity import EngineSettings, capacity
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.engines import EngineName
from kvfleet.sizing.hardware import accelerator
from kvfleet.sizing.precision import KvDtype, kv_dtype, weight_scheme
from kvfleet.sizing.speculative import SpecMethod, Speculative, acceptance_data, resolve_drafter

DATA = Path(step.__file__).parent / "data" / "step_calibration.json"
# name -> (lower, upper). gemm_eff.fp8 also sets bf16 = fp8 x 2 / 1.2 (FP8 prefill measured ~1.2x bf16).
FITTED: dict[str, tuple[float, float]] = {
    "gemm_eff.fp8": (0.05, 0.95),
    "weights_bw_eff": (0.3, 0.95),
    "kv_bw_eff": (0.2, 0.95),
    "step_overhead_s": (1e-4, 0.02),
    "per_seq_overhead_s": (0.0, 2e-4),
    "prefill_step_overhead_s": (0.0, 0.05),
    "roofline_sharpness": (1.5, 16.0),
}
FP8_OVER_BF16_PREFILL = 1.2
# The head vLLM's published EAGLE-3 runs used (vllm-project/vllm PR 16937), from the catalog.
EAGLE3_HEAD = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
DRAFT_FIT_K = (2, 4, 6)
DRAFT_CHECK_K = (3, 5, 7)
MULTIPLIERS = (0.5, 0.7, 0.85, 0.95, 1.05, 1.18, 1.4, 2.0)


# ---------------------------------------------------------------------------------------------
# The calibration cases of kvfleet/sizing/data/step_calibration.json, shared with tests/sizing/test_step.py
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Case:
    cid: str
    split: str  # "fit" or "check"
    source: str
    engine: str
    accelerator: str
    model: str
    weights: str
    kv_cache_dtype: str
    tp: int
    nvlink: bool
    input_tokens: int
    output_tokens: int
    concurrency: float | None  # None: offline, every request queued at once (max throughput)
    max_num_tokens: int
    max_running: int | None  # None: from the KV cache and max_batch_size
    # The cache the case's engine had, where its source states it (a published table's saturated batch); None: what
    # capacity() predicts for these settings. A stated cache keeps the case independent of the memory model.
    kv_cache_tokens: int | None
    max_batch_size: int
    gpu_memory_fraction: float
    measured: Mapping[str, float]  # ttft_ms, itl_ms, output_tokens_per_s (any subset)


def cases() -> tuple[Case, ...]:
    out = []
    for raw in step.calibration()["cases"]:
        out.append(
            Case(
                cid=raw["id"],
                split=raw["split"],
                source=raw["source"],
                engine=raw["engine"],
                accelerator=raw["accelerator"],
                model=raw["model"],
                weights=raw["weights"],
                kv_cache_dtype=raw["kv_cache_dtype"],
                tp=int(raw["tp"]),
                nvlink=bool(raw["nvlink"]),
                input_tokens=int(raw["isl"]),
                output_tokens=int(raw["osl"]),
                concurrency=raw.get("concurrency"),
                # trtllm-bench cases get theirs from the tool's rule below; every other case states it.
                max_num_tokens=0 if raw.get("settings") == "trtllm-bench" else int(raw["max_num_tokens"]),
                max_running=raw.get("max_running"),
                kv_cache_tokens=raw.get("kv_cache_tokens"),
                max_batch_size=int(raw.get("max_batch_size", 2048)),
                gpu_memory_fraction=float(raw.get("gpu_memory_fraction", 0.9)),
                measured={k: float(v) for k, v in raw["measured"].items()},
            )
        )
        if raw.get("settings") == "trtllm-bench":
            out[-1] = _with_bench_settings(out[-1], device_memory_mib=int(raw["device_memory_mib"]))
    return tuple(out)


def _with_bench_settings(case: Case, *, device_memory_mib: int) -> Case:
    """The batch and token limits ``trtllm-bench throughput`` derived for the case's dataset (uniform lengths), where
    its source ran trtllm-bench without setting them (``trtllm_bench.engine_settings``)."""
    model = catalog_model(case.model)
    bench = trtllm_bench.engine_settings(
        param_count=model.total_params,
        weight_bytes=trtllm_bench.bytes_per_elem(case.weights),
        kv_bytes_per_elem=trtllm_bench.bytes_per_elem(case.kv_cache_dtype),
        attention_layers=model.num_layers,  # num_attention_layers defaults to num_hidden_layers
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        device_memory_bytes=device_memory_mib * 1024 * 1024,
        avg_isl=case.input_tokens,
        avg_osl=case.output_tokens,
        max_isl=case.input_tokens,
        tp=case.tp,
        kv_cache_fraction=case.gpu_memory_fraction,
    )
    return replace(case, max_num_tokens=bench.max_num_tokens, max_batch_size=bench.max_batch_size)


_RUNNING_LIMITS: dict[str, int] = {}


def case_running_limit(case: Case) -> int:
    """Sequences the case's engine runs at once: its stated limit, else what its KV cache holds.

    TRT-LLM's default GUARANTEED_NO_EVICT reserves prompt + output per request, so the cache holds
    ``kv_cache_tokens // (ISL + OSL)`` requests, capped by max_batch_size. The cache is the case's stated one
    (``Case.kv_cache_tokens``), else the one capacity() predicts."""
    if case.max_running is not None:
        return int(case.max_running)
    if case.cid in _RUNNING_LIMITS:
        return _RUNNING_LIMITS[case.cid]
    per_request = case.input_tokens + case.output_tokens
    tokens = case.kv_cache_tokens if case.kv_cache_tokens is not None else _predicted_kv_cache_tokens(case)
    limit = max(1, min(case.max_batch_size, tokens // per_request))
    _RUNNING_LIMITS[case.cid] = limit
    return limit


def _predicted_kv_cache_tokens(case: Case) -> int:
    model = catalog_model(case.model)
    acc = accelerator(case.accelerator)
    quant = None if case.weights == model.native_scheme.name else case.weights
    settings = EngineSettings(
        engine=EngineName(case.engine),
        tensor_parallel_size=case.tp,
        gpu_memory_utilization=case.gpu_memory_fraction,
        max_model_len=case.input_tokens + case.output_tokens,
        kv_cache_dtype=kv_dtype(case.kv_cache_dtype),
        quantization=quant,
        max_num_seqs=case.max_batch_size,
        max_num_batched_tokens=case.max_num_tokens,
    )
    if acc.usable_memory_bytes is None:
        raise SizingError(f"the catalog has no memory size for {acc.model}", field="gpu")
    return capacity(model, gpu_memory_bytes=acc.usable_memory_bytes, settings=settings).kv_cache_tokens


def predict_case(case: Case, constants: step.StepConstants | None = None) -> step.SteadyState:
    c = constants or step.default_constants()
    model = catalog_model(case.model)
    rep = step.replica(
        model=model,
        accelerator=accelerator(case.accelerator),
        tp=case.tp,
        nvlink=case.nvlink,
        scheme=weight_scheme(case.weights),
        kv_dtype=kv_dtype(case.kv_cache_dtype),
        constants=c,
    )
    cap = case_running_limit(case)
    conc = float(cap) if case.concurrency is None else float(case.concurrency)
    wl = step.Workload(input_tokens=case.input_tokens, output_tokens=case.output_tokens, concurrency=conc)
    return step.steady_state(
        rep, wl, limits=step.Limits(max_num_batched_tokens=case.max_num_tokens, max_running=cap), constants=c
    )


def case_errors(case: Case, constants: step.StepConstants | None = None) -> dict[str, float]:
    """Signed relative error (predicted / measured - 1) of each measured metric."""
    est = predict_case(case, constants)
    pred = {"ttft_ms": est.ttft_s * 1e3, "itl_ms": est.itl_s * 1e3, "output_tokens_per_s": est.output_tokens_per_s}
    return {k: pred[k] / v - 1.0 for k, v in case.measured.items()}


# ---------------------------------------------------------------------------------------------
# The fit
# ---------------------------------------------------------------------------------------------


def _get(raw: dict[str, Any], name: str) -> float:
    if name == "gemm_eff.fp8":
        return float(raw["gemm_eff"]["value"]["fp8"])
    return float(raw[name]["value"])


def _set(raw: dict[str, Any], name: str, value: float) -> None:
    if name == "gemm_eff.fp8":
        raw["gemm_eff"]["value"]["fp8"] = value
        raw["gemm_eff"]["value"]["bf16"] = min(0.9, value * 2 / FP8_OVER_BF16_PREFILL)
    else:
        raw[name]["value"] = value


def _errors(raw: dict[str, Any], split: str) -> list[tuple[str, str, float]]:
    consts = step.constants_from(raw)
    out = []
    for case in cases():
        if case.split != split:
            continue
        for metric, err in case_errors(case, consts).items():
            out.append((case.cid, metric, err))
    return out


def _loss(raw: dict[str, Any]) -> float:
    return sum(math.log1p(e) ** 2 for _, _, e in _errors(raw, "fit")) + math.log1p(vanilla_tpot_error(raw)) ** 2


def fit(raw: dict[str, Any], rounds: int = 12) -> dict[str, Any]:
    best = _loss(raw)
    spread = 1.0
    for _ in range(rounds):
        improved = False
        for name, (lo, hi) in FITTED.items():
            base = _get(raw, name)
            for m in MULTIPLIERS:
                trial = min(hi, max(lo, base * m**spread)) if base > 0 else lo + (hi - lo) * 0.05 * m
                _set(raw, name, trial)
                loss = _loss(raw)
                if loss < best - 1e-12:
                    best, base, improved = loss, trial, True
            _set(raw, name, base)
        if not improved:
            spread /= 2
    return raw


def eagle3_replica(k: int, tau: float, acc: str = "H100") -> step.Replica:
    """Llama 3.1 8B on one GPU with its EAGLE-3 head drafting ``k`` tokens at acceptance length ``tau``."""
    m = catalog_model("meta-llama/Llama-3.1-8B-Instruct")
    target = step.replica(model=m, accelerator=accelerator(acc), tp=1, nvlink=True, scheme=m.native_scheme)
    d = resolve_drafter(
        m,  # type: ignore[arg-type]
        Speculative(method=SpecMethod.EAGLE3, draft_model=EAGLE3_HEAD, num_speculative_tokens=k),
        tp=1,
        kv_dtype=KvDtype.AUTO,
        target_scheme=m.native_scheme,  # type: ignore[attr-defined]
        max_num_batched_tokens=8192,
    )
    return step.speculative_replica(
        target,
        target=m,  # type: ignore[arg-type]
        target_scheme=m.native_scheme,  # type: ignore[attr-defined]
        drafter=d,
        accelerator=accelerator(acc),
        nvlink=True,
        kv_dtype=KvDtype.AUTO,
        acceptance_length=tau,
        acceptance_source="vllm-project/vllm#20780",
    )


def _bs1_tpot_ms(rep: step.Replica, raw: dict[str, Any]) -> float:
    """The model's TPOT of one request alone on MT-bench-like lengths (about 100 in, 256 out), as vllm#20780 ran."""
    wl = step.Workload(input_tokens=100, output_tokens=256, concurrency=1)
    lim = step.Limits(max_num_batched_tokens=8192, max_running=1)
    return step.steady_state(rep, wl, limits=lim, constants=step.constants_from(raw)).itl_s * 1e3


def eagle3_tpot_errors(raw: dict[str, Any], ks: tuple[int, ...]) -> dict[int, float]:
    """Predicted / measured - 1 of vllm#20780's batch-1 TPOT with EAGLE-3 at each K."""
    data = acceptance_data()
    measured = data["checks"]["vllm_20780_bs1"]["tpot_ms"]
    taus = data["defaults"]["eagle3"]["by_num_speculative_tokens"]
    return {k: _bs1_tpot_ms(eagle3_replica(k, float(taus[str(k)])), raw) / measured[f"eagle3_k{k}"] - 1 for k in ks}


def vanilla_tpot_error(raw: dict[str, Any]) -> float:
    """The same table's TPOT without speculation (7.07 ms): the one small-model, batch-1 step among the FIT cases,
    so the per-step overhead is not left to the 70B cases alone."""
    measured = acceptance_data()["checks"]["vllm_20780_bs1"]["tpot_ms"]["vanilla"]
    m = catalog_model("meta-llama/Llama-3.1-8B-Instruct")
    rep = step.replica(model=m, accelerator=accelerator("H100"), tp=1, nvlink=True, scheme=m.native_scheme)
    return float(_bs1_tpot_ms(rep, raw) / measured - 1)


def fit_draft_pass(raw: dict[str, Any]) -> dict[str, Any]:
    """``draft_pass_overhead_s`` by golden-section search of the log error over the FIT K's (convex in it)."""

    def loss(x: float) -> float:
        raw["draft_pass_overhead_s"]["value"] = x
        return sum(math.log1p(e) ** 2 for e in eagle3_tpot_errors(raw, DRAFT_FIT_K).values())

    lo, hi = 0.0, 0.005
    g = (math.sqrt(5) - 1) / 2
    for _ in range(40):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if loss(a) < loss(b):
            hi = b
        else:
            lo = a
    raw["draft_pass_overhead_s"]["value"] = round((lo + hi) / 2, 6)
    return raw


def report(raw: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for split in ("fit", "check"):
        errs = _errors(raw, split)
        out[split] = {}
        for metric in ("itl_ms", "ttft_ms", "output_tokens_per_s"):
            xs = [e for _, m, e in errs if m == metric]
            if xs:
                out[split][metric] = {
                    "n": len(xs),
                    "median_abs": round(statistics.median(abs(x) for x in xs), 3),
                    "worst_abs": round(max(abs(x) for x in xs), 3),
                    "median_signed": round(statistics.median(xs), 3),
                }
    out["fit"]["vanilla_tpot_ms"] = {"vllm_20780_bs1": round(vanilla_tpot_error(raw), 3)}
    for split, ks in (("fit", DRAFT_FIT_K), ("check", DRAFT_CHECK_K)):
        out[split]["eagle3_tpot_ms"] = {f"k{k}": round(e, 3) for k, e in eagle3_tpot_errors(raw, ks).items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="store the fitted constants in the data file")
    ap.add_argument(
        "--evaluate",
        metavar="WHY",
        help="no fit: report the stored constants' errors under the model as it is now, and with --write store them "
        "beside the fit they came from, with WHY (a change to the model that was not refitted, and the reason)",
    )
    args = ap.parse_args()
    data = json.loads(DATA.read_text(encoding="utf-8"))
    raw = data["constants"]
    if args.evaluate:
        summary = report(raw)
        print(json.dumps(summary, indent=1))
        if args.write:
            data["fit"]["evaluated"] = {"date": date.today().isoformat(), "why": args.evaluate, "errors": summary}
            DATA.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
            print(f"wrote {DATA}", file=sys.stderr)
        return 0
    # Restart the descent from its own result until it stops moving: the loss has a flat valley (per-step and
    # prefill-step overheads trade against each other), and one descent from the stored values can end short of it.
    for _ in range(20):
        before = _loss(raw)
        raw = fit(raw)
        if before - _loss(raw) < 1e-9:
            break
    raw = fit_draft_pass(raw)
    summary = report(raw)
    for name in (*FITTED, "draft_pass_overhead_s"):
        print(f"{name:26} {_get(raw, name):.6g}")
    print(json.dumps(summary, indent=1))
    if args.write:
        data["constants"] = raw
        data["fit"] = {
            "date": date.today().isoformat(),
            "fitted": sorted((*FITTED, "draft_pass_overhead_s")),
            "procedure": "tools/fit_step.py: coordinate descent on log scale over the fitted constants, "
            f"multipliers {list(MULTIPLIERS)}, step halved when a round does not improve",
            "objective": "sum over FIT cases and metrics, and vllm#20780's plain batch-1 TPOT, of "
            "log(predicted / measured)^2; then draft_pass_overhead_s "
            f"alone on vllm#20780's EAGLE-3 TPOTs at K = {list(DRAFT_FIT_K)} (K = {list(DRAFT_CHECK_K)} checked)",
            "errors": summary,
        }
        DATA.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {DATA}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
