"""Roofline estimates of prefill and decode speed for one replica.

Decode is bound by HBM bandwidth: every step each GPU reads its weight shard (for MoE, the experts
the batch touches) plus the KV cache of every running sequence. Prefill is bound by FLOPs:
2 x active parameters per token plus causal attention. Achieved fractions of the peaks and the fixed
per-step costs are constants below, chosen from widely reported vLLM behaviour rather than measured
here; they rank candidates and size fleets, they are not a benchmark::

    decode_step = max(bytes / (BW x BW_EFF), flops / (PEAK x MFU)) + STEP_OVERHEAD + TP all-reduces
    prefill     = flops(prompt) / (PEAK x PREFILL_MFU)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.sizing.hardware import Accelerator
from kvfleet.sizing.memory import KvLayout
from kvfleet.sizing.models import ModelSpec
from kvfleet.sizing.precision import WeightScheme

BW_EFFICIENCY = 0.75  # achieved / peak HBM bandwidth in decode GEMV-like kernels
DECODE_MFU = 0.45
PREFILL_MFU = 0.55
STEP_OVERHEAD_S = 0.0015  # scheduler + sampling + launch per decode step (CUDA graphs on)
ALLREDUCE_S = {"nvlink": 10e-6, "pcie": 30e-6}  # per all-reduce; 2 per layer with TP > 1


@dataclass(frozen=True, kw_only=True)
class PerfEstimate:
    batch: int
    context_tokens: int  # average tokens held per sequence during decode
    decode_step_s: float
    prefill_s: float  # one prompt of the workload's input length, alone
    bound: str  # "memory" or "compute" (decode)

    @property
    def itl_s(self) -> float:
        return self.decode_step_s

    @property
    def ttft_s(self) -> float:
        return self.prefill_s + self.decode_step_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch / self.decode_step_s


def peak_flops(acc: Accelerator, scheme: WeightScheme) -> float | None:
    """Dense FLOP/s the GEMMs run at: FP8 tensor cores for FP8 weights where present, else 16-bit."""
    sixteen = acc.bf16_flops or acc.fp16_flops
    if scheme.name == "fp8" and acc.fp8_support and acc.fp8_flops:
        return acc.fp8_flops
    return sixteen


def missing_perf_data(acc: Accelerator) -> str | None:
    if acc.hbm_bandwidth_bytes_per_s is None:
        return f"the catalog has no memory bandwidth for {acc.model}, so its speed cannot be estimated"
    if acc.bf16_flops is None and acc.fp16_flops is None:
        return f"the catalog has no dense TFLOPS for {acc.model}, so its speed cannot be estimated"
    return None


def _expert_fraction(model: ModelSpec, batch: int) -> float:
    """Expected share of routed experts a batch touches in one layer: 1 - (1 - k/E)^B."""
    if model.moe is None:
        return 1.0
    k, e = model.moe.experts_per_token, model.moe.num_experts
    return 1.0 - (1.0 - k / e) ** batch


def estimate(
    *,
    model: ModelSpec,
    acc: Accelerator,
    tp: int,
    nvlink: bool,
    scheme: WeightScheme,
    weights_bytes_per_gpu: int,
    expert_bytes_per_gpu: int,
    kv: KvLayout,
    batch: int,
    input_tokens: int,
    output_tokens: int,
) -> PerfEstimate:
    bw = acc.hbm_bandwidth_bytes_per_s
    flops = peak_flops(acc, scheme)
    assert bw is not None and flops is not None, "check missing_perf_data() first"
    context = input_tokens + output_tokens // 2
    touched = weights_bytes_per_gpu - expert_bytes_per_gpu * (1.0 - _expert_fraction(model, batch))
    kv_bytes = batch * kv.bytes_per_sequence(context)
    t_mem = (touched + kv_bytes) / (bw * BW_EFFICIENCY)
    attn_dim = model.num_attention_heads * model.head_dim / tp
    attn_layers = model.attention_layers
    decode_flops = batch * (2 * model.active_params / tp + 4 * attn_layers * context * attn_dim)
    t_comp = decode_flops / (flops * DECODE_MFU)
    comm = 0.0
    if tp > 1:
        comm = 2 * model.num_layers * ALLREDUCE_S["nvlink" if nvlink else "pcie"]
    step = max(t_mem, t_comp) + STEP_OVERHEAD_S + comm
    n = input_tokens
    prefill_flops = 2 * model.active_params / tp * n + 2 * attn_layers * n * n * attn_dim
    prefill = prefill_flops / (flops * PREFILL_MFU) + (comm * max(1, n // 2048))
    return PerfEstimate(
        batch=batch,
        context_tokens=context,
        decode_step_s=step,
        prefill_s=prefill,
        bound="memory" if t_mem >= t_comp else "compute",
    )
