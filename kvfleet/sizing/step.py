"""Batch-level engine step time, the engines' schedulers, and a steady-state estimate built on them.

Replaces the single-request roofline of ``perf.py`` (which stays, unchanged, for the planner until it is
rewired). Three layers, each usable alone:

1. ``step_time(replica, batch)`` prices one engine step: the prefill chunks it carries (tokens and the
   context position each starts at), the decoding sequences and the KV tokens they read. Per component,
   ``max(flops / (peak x efficiency), bytes / (bandwidth x efficiency))``; for the GEMMs a fitted p-norm of the
   two instead of the max, slower near the ridge point where a kernel reaches neither peak::

       linear     dense GEMMs on every token in the step (prefill + decode), weights read once per step;
                  MoE experts read only for the distinct experts the step's tokens touch:
                  E x (1 - (1 - k/E)^T) of E experts for T tokens picking k each
       lm_head    only for the rows that are sampled (one per sequence in the step), not every prompt token
       attention  prefill: causal FLOPs n x (p + n/2) per chunk; decode: reads every KV token once
       all-reduce 2 per layer with TP > 1: latency + 2 (tp-1)/tp x message / link bandwidth (NVLink or PCIe)
       overhead   fixed per step (CUDA graphs for decode) + per sequence + extra when the step has prefill

   Efficiencies are per (op kind, precision) constants in ``data/step_calibration.json``, fitted by
   ``tools/fit_step.py`` on the FIT cases and checked on held-out CHECK cases (tests/sizing/test_step.py).

2. The engines' schedulers are not here: each engine adapter owns one (``kvfleet.engines.scheduling``), and the
   fleet simulator (``kvfleet.sim.replica``) drives it step by step on ``step_time``.

3. ``steady_state(replica, workload)``: closed form for the planner. A replica running ``b`` sequences
   carries ``b x (OSL-1)/(k+OSL-1)`` decodes and ``b x ISL/(k+OSL-1)`` prefill tokens per step (``k``
   prefill steps per request, budget-bound), so ITL prices a mixed step, not a pure decode. TTFT adds the
   wait for the step in flight, the prompt's own chunks, the prompts queued ahead for the token budget (M/D/1
   in time: a prompt holds the budget for its own, long, chunk steps) and the queue for a slot: Little's law
   for a closed loop (``concurrency``), Erlang C with the Allen-Cunneen correction for Poisson arrivals
   (``arrival_rate_per_s``).

Planner use (one call per candidate and batch)::

    rep = replica(model=m, accelerator=acc, tp=tp, nvlink=it.nvlink, scheme=scheme, kv_dtype=kv)
    est = steady_state(rep, Workload(input_tokens=..., output_tokens=..., concurrency=b),
                       limits=Limits(max_num_batched_tokens=cap.max_num_batched_tokens, max_running=cap_seqs))
    est.itl_s, est.ttft_s, est.output_tokens_per_s
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cache
from importlib import resources
from typing import Any

from kvfleet.errors import SizingError
from kvfleet.sizing.hardware import Accelerator
from kvfleet.sizing.memory import kv_layout, weight_bytes
from kvfleet.sizing.models import ModelSpec
from kvfleet.sizing.precision import KvDtype, Part, WeightScheme
from kvfleet.sizing.speculative import Drafter, SpecMethod
from kvfleet.sizing.units import cdiv

# ---------------------------------------------------------------------------------------------
# Constants (calibrated; values and sources live in data/step_calibration.json)
# ---------------------------------------------------------------------------------------------


class ComputeClass(StrEnum):
    """What the GEMMs run as: the tensor-core rate they use and the efficiency constant they take."""

    BF16 = "bf16"  # 16-bit weights and activations
    FP8 = "fp8"  # FP8 weights and activations on FP8 tensor cores (Ada, Hopper, Blackwell)
    W8 = "w8"  # INT8 W8A8, or FP8 weights on GPUs without FP8 tensor cores (dequantized, Marlin)
    W4 = "w4"  # 4-bit weight-only (AWQ/GPTQ/w4a16/bnb/mxfp4/nvfp4 as priced here): 16-bit math


@dataclass(frozen=True, kw_only=True)
class StepConstants:
    gemm_eff: Mapping[str, float]  # achieved / peak FLOP/s of dense GEMMs, by ComputeClass
    attn_eff: float  # achieved / 16-bit peak of prefill attention kernels
    weights_bw_eff: float  # achieved / peak HBM bandwidth streaming weights (decode GEMV-like)
    kv_bw_eff: float  # achieved / peak HBM bandwidth reading KV in decode attention
    moe_compute_factor: float  # grouped expert GEMMs vs dense GEMMs at the same precision
    moe_bw_factor: float  # expert weight streaming vs dense weight streaming
    allreduce_latency_s: Mapping[str, float]  # per all-reduce, by link: "nvlink", "pcie"
    allreduce_bw_eff: float  # achieved / link bandwidth of an all-reduce
    pcie_bytes_per_s: float  # per direction, per GPU, where the instance has no NVLink
    step_overhead_s: float  # per step: scheduler, input prep, sampling launch (CUDA graphs on)
    per_seq_overhead_s: float  # per sequence in the step: sampling, detokenize, bookkeeping
    prefill_step_overhead_s: float  # extra when a step carries prefill (no full CUDA graph for it)
    eager_step_overhead_s: float  # extra per step without CUDA graphs (enforce_eager)
    draft_pass_overhead_s: float  # per drafter pass: its launches, sampling and the proposer's own bookkeeping
    roofline_sharpness: float = math.inf  # p in (compute^p + memory^p)^(1/p); inf: the hard max
    # Grouped expert GEMMs of 4-bit weight-only experts (MXFP4, NVFP4, W4A16) vs dense GEMMs of that class: other
    # kernels (vLLM's triton matmul_ogs and Marlin MoE) than the FP8/16-bit grouped GEMMs moe_compute_factor is from.
    moe_w4_compute_factor: float = 0.2
    fitted: tuple[str, ...] = ()  # names the fit set; the rest are priors with their source
    fit_date: str = ""


def _load_calibration() -> dict[str, Any]:
    text = resources.files("kvfleet.sizing").joinpath("data", "step_calibration.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


@cache
def calibration() -> dict[str, Any]:
    """The whole data file: constants (value + source), the fit record, and the measured cases."""
    return _load_calibration()


def constants_from(raw: Mapping[str, Any], *, fitted: Sequence[str] = (), fit_date: str = "") -> StepConstants:
    def v(name: str) -> Any:
        entry = raw[name]
        return entry["value"] if isinstance(entry, Mapping) and "value" in entry else entry

    return StepConstants(
        gemm_eff={k: float(x) for k, x in v("gemm_eff").items()},
        attn_eff=float(v("attn_eff")),
        weights_bw_eff=float(v("weights_bw_eff")),
        kv_bw_eff=float(v("kv_bw_eff")),
        moe_compute_factor=float(v("moe_compute_factor")),
        moe_bw_factor=float(v("moe_bw_factor")),
        allreduce_latency_s={k: float(x) for k, x in v("allreduce_latency_s").items()},
        allreduce_bw_eff=float(v("allreduce_bw_eff")),
        pcie_bytes_per_s=float(v("pcie_bytes_per_s")),
        step_overhead_s=float(v("step_overhead_s")),
        per_seq_overhead_s=float(v("per_seq_overhead_s")),
        prefill_step_overhead_s=float(v("prefill_step_overhead_s")),
        eager_step_overhead_s=float(v("eager_step_overhead_s")),
        draft_pass_overhead_s=float(v("draft_pass_overhead_s")),
        roofline_sharpness=float(v("roofline_sharpness")),
        moe_w4_compute_factor=float(v("moe_w4_compute_factor")) if "moe_w4_compute_factor" in raw else 0.2,
        fitted=tuple(fitted),
        fit_date=fit_date,
    )


@cache
def request_overhead_s(engine: str) -> float:
    """A request's time outside the engine's steps for ``engine`` (its API server, tokenizing, the first event's way
    back to the client), fitted on the ledger's one-client rows (tools/accuracy_ledger.py --fit-overhead); 0 where
    the fit found none."""
    value: Mapping[str, float] = calibration()["request_overhead_s"]["value"]
    return float(value.get(engine, 0.0))


@cache
def default_constants() -> StepConstants:
    data = calibration()
    fit = data.get("fit", {})
    return constants_from(data["constants"], fitted=fit.get("fitted", ()), fit_date=fit.get("date", ""))


# ---------------------------------------------------------------------------------------------
# The replica: what one step's cost depends on, precomputed once per candidate
# ---------------------------------------------------------------------------------------------

_BW = re.compile(r"([\d.]+)\s*(GB/s|TB/s)")


def nvlink_bytes_per_s(acc: Accelerator) -> float | None:
    """Per-GPU NVLink bandwidth, one direction: the catalog's figure is the bidirectional total
    (e.g. H100 "NVLink4, 900 GB/s" = 18 links x 50 GB/s both ways), so half of it."""
    m = _BW.search(acc.nvlink)
    if m is None:
        return None
    scale = 1e12 if m.group(2) == "TB/s" else 1e9
    return float(m.group(1)) * scale / 2


def compute_class(scheme: WeightScheme, acc: Accelerator) -> ComputeClass:
    if scheme.weight_bits >= 16:
        return ComputeClass.BF16
    if scheme.name == "fp8":
        return ComputeClass.FP8 if acc.fp8_support and acc.fp8_flops else ComputeClass.W8
    if scheme.weight_bits >= 8:
        return ComputeClass.W8
    return ComputeClass.W4


@dataclass(frozen=True, kw_only=True)
class Replica:
    """One engine instance (TP ranks on one host), reduced to per-rank numbers a step needs."""

    model_id: str
    tp: int
    nvlink: bool
    compute: ComputeClass
    peak_flops: float  # per GPU, of the GEMMs' compute class
    peak_flops_16: float  # per GPU, 16-bit (attention runs in 16-bit)
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # all-reduce link, per direction
    num_layers: int
    attn_layers: int
    hidden_size: int
    attn_dim_per_rank: int  # query heads x head_dim on one rank
    dense_flops_per_token: float  # 2 x per-rank dense linear params (attention, MLP, shared experts, router)
    expert_flops_per_token: float  # 2 x per-rank routed-expert params x k/E
    lm_head_flops_per_seq: float  # 2 x vocab/tp x hidden, per sampled row
    dense_weight_bytes: float  # per rank, read once every step
    expert_weight_bytes: float  # per rank, all routed experts
    num_experts: int
    experts_per_token: int
    kv_bytes_per_token: int  # per rank, every KV layer (full-attention equivalent)
    cuda_graphs: bool = True
    # Data-parallel attention: this rank is one of dp engine cores whose MoE layers exchange their tokens (an
    # all-gather before the experts and a reduce-scatter after, vLLM's default all2all backend), each rank holding
    # 1/dp of the routed experts; the rank's own batch is what a step here carries.
    dp: int = 1
    moe_layers: int = 0
    # Measured over modelled step time on this hardware and engine release (a calibration; 1: the model alone).
    time_scale: float = 1.0
    # Speculative decoding: every decoding sequence verifies K + 1 tokens a step and keeps tau of them (None: off).
    spec: SpecDecode | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclass(frozen=True, kw_only=True)
class SpecDecode:
    """Speculative decoding as one engine step sees it (``spec_decode``): the drafter proposes K tokens per decoding
    sequence, the target verifies K + 1 in one pass, and ``acceptance_length`` (tau, bonus token included) of them
    are kept on average, so a step moves a sequence tau tokens on."""

    method: str
    num_speculative_tokens: int  # K
    acceptance_length: float  # tau, 1 <= tau <= K + 1
    acceptance_source: str  # where tau comes from: a published measurement, or the user
    drafter: Replica | None  # the draft head, MTP layers or draft model on the same ranks; None: n-gram (no GPU work)

    def __post_init__(self) -> None:
        k, tau = self.num_speculative_tokens, self.acceptance_length
        if k < 1 or not (1.0 <= tau <= k + 1):
            raise SizingError(
                f"acceptance length {tau:g} must lie between 1 and num_speculative_tokens + 1 ({k + 1})",
                field="speculative.acceptance_length",
            )


def replica(
    *,
    model: ModelSpec,
    accelerator: Accelerator,
    tp: int,
    nvlink: bool,
    scheme: WeightScheme,
    kv_dtype: KvDtype = KvDtype.AUTO,
    cuda_graphs: bool = True,
    constants: StepConstants | None = None,
    dp: int = 1,
) -> Replica:
    """Precompute a replica (dp > 1: one engine core of it). SizingError where the catalog lacks bandwidth/FLOPs."""
    c = constants or default_constants()
    acc = accelerator
    sixteen = acc.bf16_flops or acc.fp16_flops
    if acc.hbm_bandwidth_bytes_per_s is None or sixteen is None:
        raise SizingError(f"the catalog has no bandwidth or dense TFLOPS for {acc.model}", field="gpu")
    cls = compute_class(scheme, acc)
    peak = acc.fp8_flops if cls is ComputeClass.FP8 and acc.fp8_flops else sixteen
    link = (nvlink_bytes_per_s(acc) if nvlink else None) or c.pcie_bytes_per_s
    dense_bytes, expert_bytes = _rank_weight_bytes(model, scheme, tp=tp, dp=dp)
    dense_params = 0.0
    expert_params = 0.0
    for g in model.param_groups:
        per_rank = g.count / tp if g.shardable else float(g.count)
        if g.part in (Part.ATTENTION, Part.MLP, Part.ROUTER):
            dense_params += per_rank
        elif g.part is Part.EXPERTS and model.moe is not None:
            expert_params += per_rank * model.moe.experts_per_token / model.moe.num_experts
    kv = kv_layout(model, tp=tp, kv_dtype=kv_dtype)
    return Replica(
        model_id=model.model_id,
        tp=tp,
        nvlink=nvlink and link != c.pcie_bytes_per_s,
        compute=cls,
        peak_flops=peak,
        peak_flops_16=sixteen,
        hbm_bytes_per_s=acc.hbm_bandwidth_bytes_per_s,
        link_bytes_per_s=link,
        num_layers=model.num_layers,
        attn_layers=model.attention_layers,
        hidden_size=model.hidden_size,
        attn_dim_per_rank=model.num_attention_heads * model.head_dim // tp,
        dense_flops_per_token=2 * dense_params,
        expert_flops_per_token=2 * expert_params,
        lm_head_flops_per_seq=2 * cdiv(model.vocab_size, tp) * model.hidden_size,
        dense_weight_bytes=dense_bytes,
        expert_weight_bytes=expert_bytes,
        num_experts=model.moe.num_experts if model.moe else 0,
        experts_per_token=model.moe.experts_per_token if model.moe else 0,
        kv_bytes_per_token=kv.kv_bytes_per_token_per_gpu,
        cuda_graphs=cuda_graphs,
        dp=dp,
        moe_layers=sum(1 for layer in model.layers if layer.moe and model.moe is not None),
    )


def _rank_weight_bytes(model: ModelSpec, scheme: WeightScheme, *, tp: int, dp: int) -> tuple[float, float]:
    """(dense, routed-expert) bytes one rank reads every step. The embedding is a lookup, not a read; experts are
    split in width over tp, or under data parallelism whole over tp x dp ranks, the fullest holding
    ceil(E / (tp x dp)) of them."""
    w = weight_bytes(model, tp=tp, scheme=scheme)
    by_part = dict(w.bytes_by_part)
    expert_bytes = float(by_part.get(Part.EXPERTS, 0))
    embed_bytes = float(by_part.get(Part.EMBEDDING, 0)) if not model.tie_word_embeddings else 0.0
    vision_bytes = float(by_part.get(Part.VISION, 0))
    dense_bytes = float(w.weights_bytes_per_gpu) - expert_bytes - embed_bytes - vision_bytes
    if dp > 1 and model.moe is not None:
        e = model.moe.num_experts
        expert_bytes = expert_bytes * tp * math.ceil(e / (tp * dp)) / e
    return dense_bytes, expert_bytes


def speculative_replica(
    rep: Replica,
    *,
    target: ModelSpec,
    target_scheme: WeightScheme,
    drafter: Drafter,
    accelerator: Accelerator,
    nvlink: bool,
    kv_dtype: KvDtype,
    acceptance_length: float,
    acceptance_source: str,
    constants: StepConstants | None = None,
) -> Replica:
    """``rep`` with speculative decoding by ``drafter`` (sized by ``resolve_drafter``) at acceptance length tau.

    The drafter's pass reads what the sizing counted as its own weights (an EAGLE head's layer, fc and lm_head over
    its draft vocabulary; MTP layers with eh_proj; a draft model whole) plus the target's lm_head where it borrows it;
    its FLOPs and KV reads are its layers', at the target's tensor parallelism."""
    if drafter.model is None:
        d = None
    else:
        scheme = target_scheme if drafter.method is SpecMethod.MTP else drafter.model.native_scheme
        d = replica(
            model=drafter.model,
            accelerator=accelerator,
            tp=rep.tp,
            nvlink=nvlink,
            scheme=scheme,
            kv_dtype=kv_dtype,
            cuda_graphs=rep.cuda_graphs,
            constants=constants,
        )
        if drafter.method is not SpecMethod.DRAFT_MODEL:
            own = float(drafter.weights_bytes_per_gpu) - d.expert_weight_bytes
            rows = drafter.model.vocab_size
            if "lm_head" in drafter.shares:
                target_w = dict(weight_bytes(target, tp=rep.tp, scheme=target_scheme).bytes_by_part)
                own += float(target_w.get(Part.LM_HEAD, 0))
            elif drafter.method is SpecMethod.EAGLE3:
                rows = drafter.model.draft_vocab_size or rows
            d = replace(
                d,
                dense_weight_bytes=own,
                lm_head_flops_per_seq=2 * cdiv(rows, rep.tp) * drafter.model.hidden_size,
            )
        d = replace(d, time_scale=rep.time_scale)
    spec = SpecDecode(
        method=drafter.method.value,
        num_speculative_tokens=drafter.num_speculative_tokens,
        acceptance_length=acceptance_length,
        acceptance_source=acceptance_source,
        drafter=d,
    )
    return replace(rep, spec=spec)


# ---------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PrefillChunk:
    tokens: int  # prompt tokens computed in this step
    start: int = 0  # tokens of this request already in the KV cache (its position)


@dataclass(frozen=True, kw_only=True)
class StepBatch:
    prefill: tuple[PrefillChunk, ...] = ()
    decode_seqs: int = 0
    decode_kv_tokens: int = 0  # KV tokens the decoding sequences read, summed over sequences
    # Tokens each decoding sequence computes: 1, or K + 1 when the target verifies K drafted tokens (each query
    # position reads the same KV, so KV bytes stay per sequence while attention FLOPs and GEMM rows grow).
    decode_tokens_per_seq: int = 1

    @property
    def prefill_tokens(self) -> int:
        return sum(ch.tokens for ch in self.prefill)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs * self.decode_tokens_per_seq

    @property
    def sequences(self) -> int:
        return len(self.prefill) + self.decode_seqs

    @property
    def sampled_rows(self) -> int:
        """Rows the lm_head computes: one per prompt chunk, every verified position of a decoding sequence."""
        return len(self.prefill) + self.decode_seqs * self.decode_tokens_per_seq


@dataclass(frozen=True, kw_only=True)
class StepTime:
    linear_s: float
    attention_s: float
    allreduce_s: float
    overhead_s: float
    linear_bound: str  # "memory" or "compute"

    @property
    def step_s(self) -> float:
        return self.linear_s + self.attention_s + self.allreduce_s + self.overhead_s


def expected_expert_fraction(tokens: int, *, experts: int, per_token: int) -> float:
    """Share of E experts that T tokens touch when each picks k uniformly: 1 - (1 - k/E)^T."""
    if experts <= 0 or tokens <= 0:
        return 0.0
    return 1.0 - (1.0 - per_token / experts) ** tokens


def _roofline(compute_s: float, memory_s: float, p: float) -> float:
    """A GEMM's time from its compute and memory bounds: the hard max where ``p`` is infinite, else the p-norm, which
    is slower near the ridge point, where a kernel reaches neither peak."""
    if math.isinf(p):
        return max(compute_s, memory_s)
    hi = max(compute_s, memory_s)
    if hi <= 0:
        return 0.0
    return float(hi * ((compute_s / hi) ** p + (memory_s / hi) ** p) ** (1 / p))


def step_time(rep: Replica, batch: StepBatch, constants: StepConstants | None = None) -> StepTime:
    c = constants or default_constants()
    t = batch.tokens
    if t == 0:
        return StepTime(linear_s=0.0, attention_s=0.0, allreduce_s=0.0, overhead_s=0.0, linear_bound="memory")
    gemm = c.gemm_eff[rep.compute.value]
    # Dense linear layers: every token multiplies every weight; the weights stream from HBM once.
    dense_flops = rep.dense_flops_per_token * t + rep.lm_head_flops_per_seq * batch.sampled_rows
    dense_c = dense_flops / (rep.peak_flops * gemm)
    dense_m = rep.dense_weight_bytes / (rep.hbm_bytes_per_s * c.weights_bw_eff)
    linear = _roofline(dense_c, dense_m, c.roofline_sharpness)
    bound = "compute" if dense_c > dense_m else "memory"
    if rep.is_moe:
        # Under data parallelism a rank's experts see every rank's tokens (all ranks step together, even batches
        # assumed); its share of the expert FLOPs stays that of its own tokens over all experts.
        seen = t * rep.dp
        frac = expected_expert_fraction(seen, experts=rep.num_experts, per_token=rep.experts_per_token)
        moe_f = c.moe_w4_compute_factor if rep.compute is ComputeClass.W4 else c.moe_compute_factor
        moe_c = rep.expert_flops_per_token * t / (rep.peak_flops * gemm * moe_f)
        moe_m = rep.expert_weight_bytes * frac / (rep.hbm_bytes_per_s * c.weights_bw_eff * c.moe_bw_factor)
        linear += _roofline(moe_c, moe_m, c.roofline_sharpness)
    # Attention: 2 matmuls (QK^T, PV) of 2 FLOPs per element; causal halves the square of a chunk.
    per_pos = 4.0 * rep.attn_layers * rep.attn_dim_per_rank
    attn = 0.0
    if batch.prefill:
        pf = sum(per_pos * ch.tokens * (ch.start + (ch.tokens + 1) / 2) for ch in batch.prefill)
        pb = sum((ch.start + ch.tokens) * rep.kv_bytes_per_token for ch in batch.prefill)
        attn += max(pf / (rep.peak_flops_16 * c.attn_eff), pb / (rep.hbm_bytes_per_s * c.kv_bw_eff))
    if batch.decode_seqs:
        df = per_pos * batch.decode_kv_tokens * batch.decode_tokens_per_seq
        db = batch.decode_kv_tokens * rep.kv_bytes_per_token
        attn += max(df / (rep.peak_flops_16 * c.attn_eff), db / (rep.hbm_bytes_per_s * c.kv_bw_eff))
    comm = 0.0
    if rep.tp > 1:
        # Ring all-reduce of the bf16 hidden state after attention and after the MLP, each layer.
        link = "nvlink" if rep.nvlink else "pcie"
        msg = t * rep.hidden_size * 2
        per = c.allreduce_latency_s[link] + 2 * (rep.tp - 1) / rep.tp * msg / (
            rep.link_bytes_per_s * c.allreduce_bw_eff
        )
        comm = 2 * rep.num_layers * per
    comm += _dp_exchange_s(rep, t, c)
    over = c.step_overhead_s + c.per_seq_overhead_s * batch.sequences
    if batch.prefill:
        over += c.prefill_step_overhead_s
    if not rep.cuda_graphs:
        over += c.eager_step_overhead_s
    f = rep.time_scale
    return StepTime(
        linear_s=f * linear, attention_s=f * attn, allreduce_s=f * comm, overhead_s=f * over, linear_bound=bound
    )


def _dp_exchange_s(rep: Replica, tokens: int, c: StepConstants) -> float:
    """Data parallelism's MoE exchange: per MoE layer an all-gather of every rank's hidden states and a
    reduce-scatter back, each moving (dp - 1) ranks' bf16 rows over the link, priced with the all-reduce's
    latency and efficiency (vllm/config/parallel.py all2all_backend allgather_reducescatter)."""
    if rep.dp == 1 or not rep.is_moe:
        return 0.0
    link = "nvlink" if rep.nvlink else "pcie"
    msg = tokens * rep.hidden_size * 2
    per = c.allreduce_latency_s[link] + (rep.dp - 1) * msg / (rep.link_bytes_per_s * c.allreduce_bw_eff)
    return 2 * rep.moe_layers * per


def _forward_s(st: StepTime) -> float:
    return st.linear_s + st.attention_s + st.allreduce_s


def draft_time_s(rep: Replica, batch: StepBatch, constants: StepConstants | None = None) -> float:
    """The drafter's K sequential passes in one step (vLLM's proposer, v1/spec_decode): the first over every position
    the step computes (verified tokens and prompt chunks: it needs their hidden states and its own KV), the other
    K - 1 over one token per decoding sequence. Each is priced by ``step_time`` on the drafter's own weights, FLOPs
    and KV, plus ``draft_pass_overhead_s``: a measured pass costs far more than its roofline (vllm #20780: about
    1 ms per extra draft of an 8B model's EAGLE-3 head, whose weights read in 0.3 ms). The engine's per-step
    overhead is charged once, by the target's step. An n-gram drafter runs on the CPU between steps: free here."""
    spec = rep.spec
    if spec is None or spec.drafter is None or batch.decode_seqs == 0:
        return 0.0
    c = constants or default_constants()
    k = spec.num_speculative_tokens
    first = step_time(spec.drafter, replace(batch, decode_tokens_per_seq=k + 1), c)
    rest = step_time(spec.drafter, StepBatch(decode_seqs=batch.decode_seqs, decode_kv_tokens=batch.decode_kv_tokens), c)
    return _forward_s(first) + (k - 1) * _forward_s(rest) + k * c.draft_pass_overhead_s * spec.drafter.time_scale


def engine_step_s(rep: Replica, batch: StepBatch, constants: StepConstants | None = None) -> float:
    """One engine step: ``step_time`` alone, or with speculation the target verifying K + 1 tokens per decoding
    sequence in one pass plus the drafter's K passes (``draft_time_s``). A step then moves each decoding sequence
    ``rep.spec.acceptance_length`` tokens on, so ITL = step / tau (``steady_state``)."""
    spec = rep.spec
    if spec is None or batch.decode_seqs == 0:
        return step_time(rep, batch, constants).step_s
    verify = step_time(rep, replace(batch, decode_tokens_per_seq=spec.num_speculative_tokens + 1), constants)
    return verify.step_s + draft_time_s(rep, batch, constants)


# ---------------------------------------------------------------------------------------------
# Steady state (closed form)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Workload:
    input_tokens: int
    output_tokens: int
    concurrency: float | None = None  # closed loop: this many clients, each sends again on completion
    arrival_rate_per_s: float | None = None  # open loop: Poisson arrivals (used when concurrency is None)
    service_cv2: float = 0.0  # squared coefficient of variation of service time (0: fixed lengths)
    # Replicas whose slots one queue shares: a least-outstanding router sends each arrival to a replica with a slot
    # free while any has one, so the fleet waits like one M/G/(n c) queue, not n separate M/G/c ones.
    pooled_replicas: int = 1


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_num_batched_tokens: int  # vLLM max_num_batched_tokens / TRT-LLM max_num_tokens
    max_running: int  # sequences that run at once: min(max_num_seqs, what the KV cache holds)


@dataclass(frozen=True, kw_only=True)
class SteadyState:
    running: float  # sequences in the batch
    decodes_per_step: float
    prefill_tokens_per_step: float
    prefill_steps: float  # steps one prompt's prefill spans
    itl_s: float  # mean gap between a sequence's tokens: mean step time / tokens_per_step
    decode_step_s: float  # a step with no prefill
    prefill_step_s: float  # a step that carries a prompt chunk
    ttft_service_s: float  # with a free slot: wait for the step in flight, budget queue, own chunks
    queue_wait_s: float  # waiting for a slot (inf when overloaded)
    output_tokens_per_s: float
    requests_per_s: float
    notes: tuple[str, ...] = field(default=())
    # What the percentiles (``latency_percentiles``) are drawn from: the share of steps that carry a prompt chunk,
    # the token-budget queue (busy share and mean wait, inside ttft_service_s), and the slot queue: waited for with
    # probability slot_wait_probability, exponentially (Poisson arrivals) or for a fixed time (a closed loop).
    prefill_step_share: float = 0.0
    # The prefill steps' times and their shares of them (whole chunks, a remainder), and one prompt's own.
    prefill_chunk_steps: tuple[tuple[float, float], ...] = ()
    own_chunks_s: float = 0.0
    budget_busy: float = 0.0
    budget_wait_s: float = 0.0
    slot_wait_probability: float = 0.0
    slot_wait_fixed: bool = False
    # Tokens a decoding sequence gains per step: 1, or the acceptance length tau with speculative decoding.
    tokens_per_step: float = 1.0
    # A request's time outside the engine's steps (the API server, tokenizing, the first event's way back): in every
    # TTFT a client measures (``request_overhead_s``).
    request_overhead_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.ttft_service_s + self.queue_wait_s + self.request_overhead_s


@dataclass(frozen=True, kw_only=True)
class Quantiles:
    p50_s: float
    p90_s: float
    p95_s: float  # kept: latency objectives default to p95
    p99_s: float

    def as_dict(self, digits: int = 4) -> dict[str, float]:
        return {
            "p50": round(self.p50_s, digits),
            "p90": round(self.p90_s, digits),
            "p95": round(self.p95_s, digits),
            "p99": round(self.p99_s, digits),
        }


@dataclass(frozen=True, kw_only=True)
class LatencyQuantiles:
    ttft: Quantiles
    itl: Quantiles


_QUANTILE_SAMPLES = 2000  # p99 from the 20 slowest: steady to a few percent, and a plan prints in milliseconds


@cache
def latency_percentiles(s: SteadyState) -> LatencyQuantiles:
    """TTFT and ITL p50/p95/p99 of a steady state (``kvfleet simulate`` checks them, tests/sim/test_percentiles.py).

    ITL: a step either decodes only or also carries a prompt chunk (``prefill_step_share`` of the steps), so the
    gaps between a sequence's tokens are those two step times in that mix. TTFT: what is left of the step in flight
    (uniform), the token-budget queue (busy with probability ``budget_busy``, then exponential), the prompt's own
    chunk steps (fixed), and the slot queue; drawn with a fixed seed, so a plan prints the same figures every run.
    """
    import random

    f = s.prefill_step_share
    chunks = s.prefill_chunk_steps or ((s.prefill_step_s, 1.0),)
    steps = sorted([(s.decode_step_s, 1 - f), *((t, f * share) for t, share in chunks)])

    def itl_q(q: float) -> float:
        # With speculation a step yields tau tokens on average: the mean gap, as the step's tokens stream out.
        seen = 0.0
        for t, share in steps:
            seen += share
            if seen >= q - 1e-12:
                return t / s.tokens_per_step
        return steps[-1][0] / s.tokens_per_step

    itl = Quantiles(p50_s=itl_q(0.5), p90_s=itl_q(0.9), p95_s=itl_q(0.95), p99_s=itl_q(0.99))
    if math.isinf(s.queue_wait_s):
        inf = Quantiles(p50_s=math.inf, p90_s=math.inf, p95_s=math.inf, p99_s=math.inf)
        return LatencyQuantiles(ttft=inf, itl=itl)
    rng = random.Random(20261202)
    fixed = (s.own_chunks_s or s.prefill_steps * s.prefill_step_s) + s.request_overhead_s
    budget_mean = s.budget_wait_s / s.budget_busy if s.budget_busy > 0 else 0.0
    slot_mean = s.queue_wait_s / s.slot_wait_probability if s.slot_wait_probability > 0 else 0.0
    # An arrival lands in a step with a chance that grows with the step's length (the inspection paradox): a long
    # mixed step is in flight more often than its share of the steps says.
    landing = [share * t for t, share in steps]
    draws = []
    for _ in range(_QUANTILE_SAMPLES):
        t = fixed + rng.random() * rng.choices(steps, weights=landing)[0][0]
        if budget_mean and rng.random() < s.budget_busy:
            t += rng.expovariate(1.0 / budget_mean)
        if slot_mean:
            if s.slot_wait_fixed:
                t += slot_mean
            elif rng.random() < s.slot_wait_probability:
                t += rng.expovariate(1.0 / slot_mean)
        draws.append(t)
    draws.sort()

    def at(q: float) -> float:
        return draws[min(len(draws) - 1, int(q * len(draws)))]

    ttft = Quantiles(p50_s=at(0.5), p90_s=at(0.9), p95_s=at(0.95), p99_s=at(0.99))
    return LatencyQuantiles(ttft=ttft, itl=itl)


def _erlang_c(servers: int, offered: float) -> float:
    """Probability an arrival waits in M/M/c (Erlang C) with ``offered`` = lambda x service time."""
    if offered >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    rho = offered / servers
    return b / (1.0 - rho * (1.0 - b))


def _flow(
    b: float, *, budget_tokens: int, isl: int, dec_steps: float, per_dec: int
) -> tuple[float, float, float, float]:
    """Prefill steps per prompt k, requests finishing per step X, decodes and prefill tokens per step.

    X is b / (k + OSL - 1) while the token budget keeps up; at most n / (ISL + OSL - 1) when it does not (the budget
    then bounds the batch, the rest wait)."""
    n = budget_tokens
    k = 1.0
    x = d = p = 0.0
    for _ in range(30):  # fixed point on k (prefill steps per prompt); converges in a few rounds
        x = min(b / (k + dec_steps), n / (isl + dec_steps * per_dec))
        d = x * dec_steps
        p = x * isl
        k_new = max(1.0, isl / max(1.0, n - d * per_dec))
        if abs(k_new - k) < 1e-6:
            break
        k = k_new
    return k, x, d, p


@dataclass(frozen=True, kw_only=True)
class _Chunks:
    """How one prompt's prefill rides the steps."""

    steps: tuple[tuple[float, float], ...]  # (step time, chunks of a prompt that take it)
    together: float  # prompts that share one prefill step
    at_once: float  # prompts the budget queue serves at a time

    @property
    def per_prompt(self) -> float:
        return sum(n for _, n in self.steps)

    @property
    def own_s(self) -> float:
        """This prompt's own chunk steps."""
        return sum(t * n for t, n in self.steps)


def _prefill_chunks(
    rep: Replica, c: StepConstants, *, isl: int, room: float, x: float, decodes: float, dec_kv: int
) -> _Chunks:
    """A prompt goes in chunks of what the budget leaves (``room``): whole ones and a remainder, each priced as the
    step it rides (3,000 tokens with 2,048 of room are a 2,048-token step and a 952-token one, not two of 2,048)."""
    whole = int(isl // room)
    rest = isl - whole * room
    if rest < 1:
        rest = 0.0

    # Prompts shorter than the room share prefill steps: x prompts start per step, so when x > 1 a prefill step
    # carries x whole prompts (the budget caps x at room / ISL), and each of them waits for all of them.
    together = min(max(1.0, x), max(1.0, room / isl)) if whole == 0 else 1.0

    def mixed_at(tokens: float, start: float, count: int = 1) -> float:
        chunk = PrefillChunk(tokens=max(1, round(tokens)), start=round(start))
        batch = StepBatch(prefill=(chunk,) * count, decode_seqs=round(decodes), decode_kv_tokens=dec_kv)
        return engine_step_s(rep, batch, c)

    def shared_at(tokens: float) -> float:
        # A fractional count of prompts per step: between the steps holding floor and ceil of them.
        lo = int(together)
        w = together - lo
        t_lo = mixed_at(tokens, 0, lo)
        return t_lo if w < 1e-9 else (1 - w) * t_lo + w * mixed_at(tokens, 0, lo + 1)

    chunk_steps: list[tuple[float, float]] = []
    if whole:
        chunk_steps.append((mixed_at(room, (whole - 1) * room / 2), float(whole)))  # at the whole chunks' mean start
    if rest:
        chunk_steps.append((mixed_at(rest, whole * room) if whole else shared_at(rest), 1.0))
    # Prompts that fit the room m at a time are served m at a time by the budget queue.
    at_once = max(1.0, float(room // isl)) if whole == 0 else 1.0
    return _Chunks(steps=tuple(chunk_steps), together=together, at_once=at_once)


def _prefill_waits(
    chunks: _Chunks, *, f: float, pure: float, step: float, req_per_s: float
) -> tuple[float, float, float]:
    """What a prompt waits for before its own chunk steps, with a slot free: the rest of the step in flight and the
    prompts queued ahead for the budget; and the budget's utilization. Returns (residual, budget wait, utilization)."""
    per_prompt, own = chunks.per_prompt, chunks.own_s
    # What is left of the step in flight: an arrival lands in a long (mixed) step more often than its share of the
    # steps (the inspection paradox), so the mean residual is E[step^2] / (2 E[step]), not half the mean step.
    prefill_second = f * sum(t * t * n for t, n in chunks.steps) / per_prompt
    second = (1 - f) * pure * pure + prefill_second
    residual = second / (2 * step) if step > 0 else 0.0
    # The budget queue is M/D/1 in time, not in tokens: a prompt holds the budget for its own chunk steps, which are
    # long, so the budget is busy for rho = lambda x S of the time although few steps carry prompts; prompts that fit
    # the room m at a time are served m at a time. Mean wait (lambda / m) S^2 / (2 (1 - rho)), less what `residual`
    # already holds (the prefill step in flight). Token shares priced it at the mean step's length: a tenth of the
    # wait NIM's 70B runs show at 25-50 clients with 5,000-token prompts, and a third of the simulator's p95 at 6,000.
    m = chunks.at_once
    u = min(0.95, req_per_s * own / m)
    in_flight = prefill_second / (2 * step) if step > 0 else 0.0
    budget_wait = max(0.0, req_per_s / m * own * own / (2 * (1 - u)) - in_flight)
    return residual, budget_wait, u


def _service(rep: Replica, wl: Workload, lim: Limits, b: float, c: StepConstants) -> SteadyState:
    isl, osl = wl.input_tokens, max(1, wl.output_tokens)
    n = lim.max_num_batched_tokens
    # With speculation a decoding sequence takes K + 1 tokens of the budget a step and moves tau tokens on, so its
    # answer spans (OSL - 1) / tau steps.
    spec = rep.spec
    tau = spec.acceptance_length if spec else 1.0
    per_dec = spec.num_speculative_tokens + 1 if spec else 1
    dec_steps = (osl - 1) / tau
    k, x, d, p = _flow(b, budget_tokens=n, isl=isl, dec_steps=dec_steps, per_dec=per_dec)
    room = max(1.0, n - d * per_dec)
    ctx = isl + (osl - 1) / 2  # mean KV a decoding sequence reads
    dec_kv = int(d * ctx)
    pure = engine_step_s(rep, StepBatch(decode_seqs=round(d), decode_kv_tokens=dec_kv), c)
    chunks = _prefill_chunks(rep, c, isl=isl, room=room, x=x, decodes=d, dec_kv=dec_kv)
    per_prompt, own = chunks.per_prompt, chunks.own_s
    mixed = own / per_prompt
    # A step carries a chunk with probability f (x prompts start per step, each over per_prompt steps, `together`
    # to a step).
    f = min(1.0, x * per_prompt / chunks.together)
    step = (1 - f) * pure + f * mixed  # mean step time
    req_per_s = x / step if step > 0 else 0.0
    # TTFT with a slot free: the rest of the step in flight, the prompts queued ahead for the budget, then the
    # steps that carry this prompt's chunks.
    residual, budget_wait, u = _prefill_waits(chunks, f=f, pure=pure, step=step, req_per_s=req_per_s)
    ttft_service = residual + budget_wait + own
    return SteadyState(
        prefill_chunk_steps=tuple((t, n / per_prompt) for t, n in chunks.steps),
        own_chunks_s=own,
        prefill_step_share=f,
        # An arrival finds a prompt queued ahead about rho^2 of the time (M/M/1's P(Lq >= 1)).
        budget_busy=u * u,
        budget_wait_s=budget_wait,
        running=x * (k + dec_steps),
        decodes_per_step=d,
        prefill_tokens_per_step=p,
        prefill_steps=k,
        itl_s=step / tau,
        decode_step_s=pure,
        prefill_step_s=mixed,
        ttft_service_s=ttft_service,
        queue_wait_s=0.0,
        output_tokens_per_s=req_per_s * osl,
        requests_per_s=req_per_s,
        tokens_per_step=tau,
    )


def steady_state(rep: Replica, wl: Workload, *, limits: Limits, constants: StepConstants | None = None) -> SteadyState:
    """ITL, output tokens/s and TTFT of one replica in steady state under ``wl`` (see module docstring)."""
    c = constants or default_constants()
    cap = max(1, limits.max_running)
    if wl.concurrency is not None:
        return _closed_loop(rep, wl, limits, cap, c)
    return _open_loop(rep, wl, limits, cap, c)


def _closed_loop(rep: Replica, wl: Workload, limits: Limits, cap: int, c: StepConstants) -> SteadyState:
    """``wl.concurrency`` clients, each sending its next request when its answer ends."""
    assert wl.concurrency is not None
    s = _service(rep, wl, limits, float(min(wl.concurrency, cap)), c)
    if wl.concurrency <= s.running + 1e-9:
        return s
    # Closed loop, more clients than run at once (slots or token budget): Little's law,
    # B = X (W + R) with X = running / R, so W = (B - running) x R / running. A queued client enters as a
    # sequence ends, so prompts reach the budget paced by the completions, not in Poisson bursts: no queue
    # for the budget beyond the step in flight (NIM 70B at 100-250 clients: +9% without it, +17% with).
    s = replace(s, ttft_service_s=s.ttft_service_s - s.budget_wait_s, budget_wait_s=0.0, budget_busy=0.0)
    r = s.ttft_service_s + max(0, wl.output_tokens - 1) * s.itl_s
    queued = wl.concurrency - s.running
    wait = queued * r / s.running
    return replace(
        s,
        queue_wait_s=wait,
        slot_wait_probability=1.0,
        slot_wait_fixed=True,
        notes=(f"{queued:.0f} requests queue for a slot",),
    )


def _open_loop(rep: Replica, wl: Workload, limits: Limits, cap: int, c: StepConstants) -> SteadyState:
    """Poisson arrivals at ``wl.arrival_rate_per_s``; a request that finds every slot busy waits for one."""
    lam = wl.arrival_rate_per_s or 0.0
    # Open loop: the batch size is what the arrivals keep running, b = lambda x R(b) (fixed point).
    b = 1.0
    s = _service(rep, wl, limits, b, c)
    for _ in range(50):
        r = s.ttft_service_s + max(0, wl.output_tokens - 1) * s.itl_s
        b_new = min(float(cap), max(1.0, lam * r))
        if abs(b_new - b) < 1e-3:
            break
        b = 0.5 * (b + b_new)  # damped: R grows with b
        s = _service(rep, wl, limits, b, c)
    r = s.ttft_service_s + max(0, wl.output_tokens - 1) * s.itl_s
    offered = lam * r
    if offered >= cap:
        return replace(s, queue_wait_s=math.inf, notes=(f"overloaded: {lam:g} req/s offers {offered:.0f} > {cap}",))
    # Arrivals wait only while every slot is busy, and then the slots turn over at the full batch's pace, which is
    # slower than the mean batch's: the slot queue is priced on R(cap), not R(b).
    full = _service(rep, wl, limits, float(cap), c) if b < cap else s
    r = max(r, full.ttft_service_s + max(0, wl.output_tokens - 1) * full.itl_s)
    offered = lam * r
    if offered >= cap:
        return replace(s, queue_wait_s=math.inf, notes=(f"overloaded: {lam:g} req/s offers {offered:.0f} > {cap}",))
    n = max(1, wl.pooled_replicas)
    offered, cap = offered * n, cap * n  # the fleet's slots and load, where one queue feeds them all
    pw = _erlang_c(cap, offered)
    # M/G/c (Allen-Cunneen): the M/M/c wait scaled by (1 + cs^2) / 2. The scale goes to the conditional wait: with
    # fixed lengths as many arrivals wait as with exponential ones, for a shorter time (an M/D/c queue shows both).
    wait = pw * r / (cap - offered) * (1 + wl.service_cv2) / 2
    # An arrival that waits for a slot enters as a sequence ends, paced by the completions: only the (1 - pw) that
    # find a slot free meet the budget queue (as a saturated closed loop, above).
    paced = s.budget_wait_s * pw
    return replace(
        s,
        queue_wait_s=wait,
        slot_wait_probability=pw,
        ttft_service_s=s.ttft_service_s - paced,
        budget_wait_s=s.budget_wait_s - paced,
        budget_busy=s.budget_busy * (1 - pw),
    )
