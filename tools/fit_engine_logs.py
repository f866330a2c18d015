"""Fit vLLM's profiling-sampler bytes per logit to the FIT records of tests/sizing/data/engine_logs.json.

Each FIT record whose activation peak is known (printed, or what is left of the requested memory after the
printed weights, the printed cache and the modelled non-torch and CUDA-graph terms) says something of the bytes per
logit the profiling run's sampler holds, (peak - workspace) / (rows x vocabulary): where the peak is the sampler's
(the modelled forward pass is smaller) that is a value; where it is not, the sampler held no more than that, an
upper bound. There are three sampler paths: the V1 runner sorting the vocabulary (``EngineProfile.sort_sampler``),
the V1 runner without the sort, and Model Runner V2 (``engines.runs_v2_runner``). The two V1 paths' constants are
the mean of their values, rounded to 0.5 B, capped by the smallest of their bounds (rounded down to 0.5 B); a path
with neither keeps the constant read from the source. Model Runner V2's constant is the source's (the bf16 logits):
its FIT records are reported, not fitted, because a first boot without vLLM's compile cache charges the compiler's
temporaries to the same peak (a public 0.27.1 pair: 1.18 GiB cold, 0.19 GiB warm), which no per-logit constant
describes. CHECK records are never read by the fit; they are only reported.

The report gives every logged term's error (weights, activation peak, non-torch, CUDA-graph estimate, the
available KV cache and its tokens) on FIT and CHECK apart, with the constants before this recalibration and
with the fitted ones, per release bucket (the release row of kvfleet/engines/<engine>/profiles.py the record falls
in).

    .venv/bin/python tools/fit_engine_logs.py [--write]

``--write`` stores the fit and the error table under "fit" in the data file.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

# This checkout's kvfleet, not another one installed in the environment.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfleet.sizing import capacity as capacity_module
from kvfleet.sizing.capacity import Capacity, EngineSettings, capacity
from kvfleet.sizing.catalog import _index, catalog_model
from kvfleet.sizing.engines import (
    ACTIVATIONS,
    ActivationModel,
    EngineName,
    activation_peak_bytes,
    cuda_graph_bytes,
    engine_profile,
    non_torch_bytes,
    runs_v2_runner,
    sampler_bytes_per_logit,
)
from kvfleet.sizing.memory import kv_layout, rope_cache_bytes, weight_bytes
from kvfleet.sizing.models import ModelSpec, parse_hf_config
from kvfleet.sizing.precision import KvDtype
from kvfleet.sizing.quantization import as_loaded
from kvfleet.sizing.units import GiB

DATA = Path(__file__).resolve().parent.parent / "tests" / "sizing" / "data" / "engine_logs.json"
# The constants as they stood before the sampler paths were told apart: one 27 B per logit for every release.
BEFORE = replace(
    ACTIVATIONS, sampler_sort_bytes_per_logit=27.0, sampler_bytes_per_logit=27.0, v2_sampler_bytes_per_logit=27.0
)
# The sampler paths and the ActivationModel constant of each; FITTED those the fit sets.
FITTED = ("sort", "v1")
PATHS = {
    "sort": "sampler_sort_bytes_per_logit",
    "v1": "sampler_bytes_per_logit",
    "v2": "v2_sampler_bytes_per_logit",
}
TERMS = (
    "weights_gib",
    "activation_peak_gib",
    "non_torch_gib",
    "cuda_graph_estimate_gib",
    "available_kv_cache_gib",
    "kv_cache_tokens",
    "tokens_from_logged_cache",
    "allocated_kv_cache_gib",
)


def load() -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = json.loads(DATA.read_text())["records"]
    return records


def model_of(rec: dict[str, Any]) -> ModelSpec:
    spec = rec["model"]
    if "quantization_config" not in spec and "overrides" not in spec:
        return catalog_model(spec["catalog"])
    cfg = dict(_index()[spec["catalog"].lower()].config)
    cfg.update(spec.get("overrides", {}))
    if "quantization_config" in spec:
        cfg["quantization_config"] = spec["quantization_config"]
    return parse_hf_config(cfg, model_id=rec["id"])


def settings_of(rec: dict[str, Any]) -> EngineSettings:
    """The record's settings; TensorRT-LLM records use the LLM API's names (free_gpu_memory_fraction, max_seq_len,
    max_batch_size, max_num_tokens), mapped onto the shared fields. A custom pipeline split (vLLM's
    VLLM_PP_LAYER_PARTITION) is not modelled: such a record is refused rather than predicted with the even split."""
    s = rec["settings"]
    if "VLLM_PP_LAYER_PARTITION" in s:
        raise ValueError(f"{rec['id']}: a custom pipeline split (VLLM_PP_LAYER_PARTITION) is not modelled")
    return EngineSettings(
        engine=EngineName(rec["engine"]),
        version=rec["release"],
        tensor_parallel_size=s.get("tensor_parallel_size", 1),
        pipeline_parallel_size=s.get("pipeline_parallel_size", 1),
        enable_expert_parallel=s.get("enable_expert_parallel", False),
        gpu_memory_utilization=s.get("gpu_memory_utilization", s.get("free_gpu_memory_fraction")),
        max_model_len=s.get("max_model_len", s.get("max_seq_len")),
        max_num_seqs=s.get("max_num_seqs", s.get("max_batch_size")),
        max_num_batched_tokens=s.get("max_num_batched_tokens", s.get("max_num_tokens")),
        max_tokens=s.get("max_tokens"),
        kv_cache_dtype=KvDtype(s.get("kv_cache_dtype", "auto")),
    )


def bucket(rec: dict[str, Any]) -> str:
    if rec["release"] is None:
        return "unknown"
    engine = EngineName(rec["engine"])
    since = ">=" + ".".join(map(str, engine_profile(engine, rec["release"]).since))
    return since if engine is EngineName.VLLM else f"{engine.value} {since}"


@contextmanager
def constants(c: ActivationModel) -> Iterator[None]:
    """capacity() with these activation constants (it reads its module's ACTIVATIONS otherwise)."""
    with mock.patch.object(capacity_module, "ACTIVATIONS", c):
        yield


@dataclass(frozen=True, kw_only=True)
class Prediction:
    cap: Capacity  # the replica: with pipeline parallelism its tokens are the fewest of any stage's
    printed: Capacity  # the GPU whose weights and cache the log prints: with pipeline parallelism the first stage
    available_kv_cache_gib: float  # before any clamping at zero: what the engine would print


def predict(rec: dict[str, Any], c: ActivationModel) -> Prediction | None:
    if rec["gpu_memory_gib"] is None:
        return None
    with constants(c):
        cap = capacity(
            model_of(rec),
            gpu_memory_bytes=int(rec["gpu_memory_gib"] * GiB),
            settings=settings_of(rec),
            accelerator_name=rec["gpu"] or "",
        )
    # With pipeline parallelism vLLM prints the weights and "Available KV cache memory" of the first rank only
    # (Capacity.stages); "GPU KV cache size" is the replica's, the fewest blocks of any stage.
    printed = cap.stages[0] if cap.stages else cap
    non_kv = (
        printed.weights_bytes_per_gpu
        + printed.runner_buffer_bytes
        + printed.activation_peak_bytes
        + printed.non_torch_bytes
        + (printed.cuda_graph_bytes if printed.cuda_graph_counted else 0)
    )
    return Prediction(cap=cap, printed=printed, available_kv_cache_gib=(printed.requested_bytes - non_kv) / GiB)


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What the profiling run sees: the release's row, the batched tokens and the sampler's rows."""

    tp: int
    batched: int
    rows: int
    path: str  # a key of PATHS
    extra_per_logit: float = 0.0  # EngineProfile.sampler_extra_bytes_per_logit

    @property
    def sort_sampler(self) -> bool:
        return self.path == "sort"


def _path(profile: Any, model: ModelSpec) -> str:
    if profile.sort_sampler:
        return "sort"
    return "v2" if runs_v2_runner(profile, model) else "v1"


def shape_of(rec: dict[str, Any]) -> Shape | None:
    """From the capacity where the GPU's memory is known, else from settings that pin both scheduler limits."""
    p = predict(rec, ACTIVATIONS)
    if p is not None:
        cap = p.cap
        return Shape(
            tp=cap.tensor_parallel_size,
            batched=cap.max_num_batched_tokens,
            rows=cap.max_num_seqs,
            path=_path(cap.profile, model_of(rec)),
            extra_per_logit=cap.profile.sampler_extra_bytes_per_logit,
        )
    s = rec["settings"]
    if rec["release"] is None or "max_num_batched_tokens" not in s or "max_num_seqs" not in s:
        return None
    profile = engine_profile(EngineName(rec["engine"]), rec["release"])
    batched = s["max_num_batched_tokens"]
    return Shape(
        tp=s.get("tensor_parallel_size", 1),
        batched=batched,
        rows=min(s["max_num_seqs"], batched),
        path=_path(profile, model_of(rec)),
        extra_per_logit=profile.sampler_extra_bytes_per_logit,
    )


def activation_gib(rec: dict[str, Any], c: ActivationModel) -> float | None:
    sh = shape_of(rec)
    if sh is None:
        return None
    m = model_of(rec)
    profile = engine_profile(EngineName(rec["engine"]), rec["release"])
    peak = activation_peak_bytes(
        m,
        tp=sh.tp,
        max_num_batched_tokens=sh.batched,
        max_num_seqs=sh.rows,
        constants=replace(c, sampler_bytes_per_logit=sampler_bytes_per_logit(profile, m, c)),
        sort_sampler=sh.sort_sampler,
    )
    return peak / GiB


def predicted_terms(rec: dict[str, Any], c: ActivationModel) -> dict[str, float]:
    """What the model says for each term the record logs (terms it cannot predict are left out)."""
    logged = rec["logged"]
    tp = rec["settings"].get("tensor_parallel_size", 1)
    pp = rec["settings"].get("pipeline_parallel_size", 1)
    m = model_of(rec)
    out: dict[str, float] = {}
    if "weights_gib" in logged and pp == 1:
        ep = rec["settings"].get("enable_expert_parallel", False)
        scheme = as_loaded(m.native_scheme, engine=EngineName(rec["engine"]), version=rec["release"])
        rope = rope_cache_bytes(m) if rec["engine"] == "vllm" else 0  # in vLLM's "Model loading took", as in capacity()
        out["weights_gib"] = (weight_bytes(m, tp=tp, scheme=scheme, ep=ep).weights_bytes_per_gpu + rope) / GiB
    if "non_torch_gib" in logged:
        out["non_torch_gib"] = non_torch_bytes(tp=tp, constants=c) / GiB
    if "cuda_graph_estimate_gib" in logged:
        out["cuda_graph_estimate_gib"] = cuda_graph_bytes(m, constants=c) / GiB
    if "activation_peak_gib" in logged and (act := activation_gib(rec, c)) is not None:
        out["activation_peak_gib"] = act
    # The printed cache gives the printed tokens only where one GPU's cache is the replica's (no pipeline stages).
    if "available_kv_cache_gib" in logged and "kv_cache_tokens" in logged and pp == 1:
        kv = kv_layout(m, tp=tp, kv_dtype=KvDtype.AUTO)
        per_block = kv.kv_bytes_per_token_per_gpu * 16
        out["tokens_from_logged_cache"] = int(logged["available_kv_cache_gib"] * GiB) // per_block * 16
    p = predict(rec, c)
    if p is not None and rec["engine"] == EngineName.TRTLLM:
        # TensorRT-LLM prints the pool it allocated: whole blocks of the capped, rounded-up token count.
        cap = p.cap
        if "kv_cache_tokens" in logged:
            out["kv_cache_tokens"] = cap.kv_cache_tokens
        if "allocated_kv_cache_gib" in logged:
            out["allocated_kv_cache_gib"] = cap.kv_cache_tokens * cap.kv.kv_bytes_per_token_per_gpu / GiB
    elif p is not None:
        if "weights_gib" in logged and pp > 1:
            out["weights_gib"] = p.printed.weights_bytes_per_gpu / GiB
        if "available_kv_cache_gib" in logged:
            out["available_kv_cache_gib"] = p.available_kv_cache_gib
        if "kv_cache_tokens" in logged:
            out["kv_cache_tokens"] = p.cap.kv_cache_tokens
    return out


def errors(rec: dict[str, Any], c: ActivationModel) -> dict[str, float]:
    """Per term: predicted - logged. GiB for memory terms, relative (predicted / logged - 1) for tokens."""
    logged = rec["logged"]
    out: dict[str, float] = {}
    for term, value in predicted_terms(rec, c).items():
        truth = logged["kv_cache_tokens"] if term == "tokens_from_logged_cache" else logged[term]
        out[term] = value / truth - 1 if term.endswith("tokens") or term.startswith("tokens") else value - truth
    return out


@dataclass(frozen=True, kw_only=True)
class Sample:
    path: str
    bytes_per_logit: float  # without the release's extra
    bound: bool  # an upper bound (the peak is not the sampler's), not a value


def sampler_samples(rec: dict[str, Any]) -> Sample | None:
    """What this record implies of its path's bytes per logit, or None where its peak is not known."""
    logged = rec["logged"]
    sh = shape_of(rec)
    if sh is None:
        return None
    if "activation_peak_gib" in logged:
        peak = logged["activation_peak_gib"] * GiB
    else:
        p = predict(rec, ACTIVATIONS)
        if p is None or "weights_gib" not in logged or "available_kv_cache_gib" not in logged:
            return None
        cap = p.cap
        graphs = cap.cuda_graph_bytes if cap.cuda_graph_counted else 0
        peak = cap.requested_bytes - (
            (logged["weights_gib"] + logged["available_kv_cache_gib"]) * GiB
            + cap.non_torch_bytes
            + graphs
            + cap.runner_buffer_bytes
        )
    no_sampler = replace(ACTIVATIONS, sampler_sort_bytes_per_logit=0.0, sampler_bytes_per_logit=0.0)
    forward = activation_peak_bytes(
        model_of(rec), tp=sh.tp, max_num_batched_tokens=sh.batched, max_num_seqs=sh.rows, constants=no_sampler
    )
    per_logit = (peak - ACTIVATIONS.workspace_bytes) / (sh.rows * model_of(rec).vocab_size) - sh.extra_per_logit
    return Sample(path=sh.path, bytes_per_logit=per_logit, bound=forward >= peak)


def fit(records: list[dict[str, Any]]) -> dict[str, Any]:
    values: dict[str, list[tuple[str, float]]] = {p: [] for p in PATHS}
    bounds: dict[str, list[tuple[str, float]]] = {p: [] for p in PATHS}
    for rec in records:
        if rec["split"] != "fit" or rec["engine"] != "vllm":
            continue
        got = sampler_samples(rec)
        if got is not None:
            (bounds if got.bound else values)[got.path].append((rec["id"], round(got.bytes_per_logit, 2)))
    out: dict[str, Any] = {}
    for path, name in PATHS.items():
        value = round(statistics.fmean(v for _, v in values[path]) * 2) / 2 if values[path] else None
        if bounds[path]:
            cap = math.floor(min(v for _, v in bounds[path]) * 2) / 2
            value = cap if value is None else min(value, cap)
        if path not in FITTED:
            value = None  # reported only: the constant is the source's
        out[name] = {"value": value, "from": dict(values[path]), "at_most": dict(bounds[path])}
    return out


def fitted_constants(result: dict[str, Any]) -> ActivationModel:
    c = ACTIVATIONS
    for name in PATHS.values():
        if result[name]["value"] is not None:
            c = replace(c, **{name: result[name]["value"]})
    return c


def table(records: list[dict[str, Any]], before: ActivationModel, after: ActivationModel) -> dict[str, Any]:
    """Median and worst absolute error per split, bucket and term, before and after."""
    out: dict[str, Any] = {}
    for split in ("fit", "check"):
        rows: dict[str, dict[str, dict[str, list[float]]]] = {}
        for rec in records:
            if rec["split"] != split:
                continue
            b, a = errors(rec, before), errors(rec, after)
            for term in a:
                cell = rows.setdefault(bucket(rec), {}).setdefault(term, {"before": [], "after": []})
                cell["before"].append(b[term])
                cell["after"].append(a[term])
        out[split] = {
            bk: {
                term: {
                    "n": len(v["after"]),
                    **{
                        when: {
                            "median_abs": round(statistics.median(abs(x) for x in v[when]), 3),
                            "worst_abs": round(max(abs(x) for x in v[when]), 3),
                        }
                        for when in ("before", "after")
                    },
                }
                for term, v in sorted(terms.items())
            }
            for bk, terms in sorted(rows.items())
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="store the fit and the error table in the data file")
    args = ap.parse_args()
    records = load()
    result = fit(records)
    after = fitted_constants(result)
    print(json.dumps(result, indent=1))
    errs = table(records, BEFORE, after)
    units = "GiB (predicted - logged); tokens terms: relative"
    print(f"errors, {units}")
    for split, buckets in errs.items():
        for bk, terms in buckets.items():
            for term, cell in terms.items():
                print(
                    f"{split:5s} {bk:8s} {term:26s} n={cell['n']}  before median {cell['before']['median_abs']:.3f}"
                    f" worst {cell['before']['worst_abs']:.3f}  after median {cell['after']['median_abs']:.3f}"
                    f" worst {cell['after']['worst_abs']:.3f}"
                )
    if args.write:
        raw = json.loads(DATA.read_text())
        raw["fit"] = {
            "procedure": "tools/fit_engine_logs.py: per V1-runner sampler path (sort, no sort), the mean of the FIT "
            "records' implied bytes per logit where the sampler sets the peak, rounded to 0.5, capped by the "
            "smallest upper bound of those where it does not ('at_most', rounded down to 0.5); a path with neither, "
            "and Model Runner V2's (cold-boot compile temporaries share its peak), keep the constant read from the "
            "source, their records' implied values reported",
            "result": result,
            "errors_units": units,
            "errors": errs,
        }
        DATA.write_text(json.dumps(raw, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
