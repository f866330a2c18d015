"""Parallel layouts of one replica: tensor, pipeline and expert parallelism, and the shapes an engine refuses.

A replica runs on ``tp x pp`` GPUs. Tensor parallelism shards every layer; pipeline parallelism gives each stage
a contiguous run of layers (the first stage the embedding, the last the lm_head); expert parallelism keeps MoE
experts whole and spreads them over the ``tp`` ranks of a stage instead of splitting each expert's width
(attention stays tensor-parallel).

The divisibility rules an engine checks at start-up are data (``RULES``), each with the release and the file it
was read from; ``check_layout`` applies them and names the layout that would start instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfleet.errors import SizingError
from kvfleet.sizing.memory import validate_tp
from kvfleet.sizing.models import ModelSpec
from kvfleet.sizing.precision import WeightScheme
from kvfleet.versions import Version, parse_version


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One shape check that makes an engine refuse to start, where it was read."""

    name: str
    engine: str  # "vllm" or "trtllm"
    since: Version  # first release the rule is known to hold for, as read
    until: Version | None  # first release where it no longer holds; None: still holds in the newest read
    source: str
    what: str


# Each rule as the engine's source states it. The releases are those read; a rule's ``since`` is the oldest release
# whose source was read for it, not necessarily the release that introduced it.
RULES: tuple[Rule, ...] = (
    Rule(
        name="attention-heads",
        engine="vllm",
        since=(0, 0, 0),
        until=None,
        source="vllm/config/model.py ModelConfig.verify_with_parallel_config (vLLM 0.32.0)",
        what="the attention heads divide evenly over the tensor-parallel ranks",
    ),
    Rule(
        name="kv-heads",
        engine="vllm",
        since=(0, 0, 0),
        until=None,
        source="vllm/model_executor/layers/linear.py QKVParallelLinear (vLLM 0.32.0)",
        what="KV heads divide over the ranks, or the ranks over the KV heads (then each KV head is replicated)",
    ),
    Rule(
        name="fp8-block-linear",
        engine="vllm",
        since=(0, 0, 0),
        until=None,
        source="vllm/model_executor/layers/quantization/utils/fp8_utils.py validate_fp8_block_shape (vLLM 0.32.0)",
        what=(
            "block-quantized FP8: each rank's output shard of a column-parallel layer is whole block_n blocks and "
            "its input shard of a row-parallel layer whole block_k blocks"
        ),
    ),
    Rule(
        name="fp8-block-moe",
        engine="vllm",
        since=(0, 0, 0),
        # The first release with refine_fp8_moe_block_shape (data/vllm_release_markers.json fp8-moe-block-refine);
        # 0.28.0's Fp8MoEMethod.create_weights still raises.
        until=(0, 29, 0),
        source=(
            "vllm/model_executor/layers/quantization/fp8.py Fp8MoEMethod.create_weights (the same check as "
            "fp8_utils.py validate_fp8_block_shape_moe) up to vLLM 0.28.0; vLLM 0.8.5 refuses Qwen3-235B-A22B-FP8 at "
            "TP 8: 'The output_size of gate's and up's weight = 192 is not divisible by weight quantization "
            "block_n = 128' (vllm-project/vllm issue 17569)"
        ),
        what="block-quantized FP8 MoE: each rank's expert intermediate shard is whole blocks",
    ),
    Rule(
        name="fp8-block-moe-refined",
        engine="vllm",
        since=(0, 29, 0),
        until=None,
        source=(
            "vllm/model_executor/layers/fused_moe/oracle/fp8.py refine_fp8_moe_block_shape (vLLM 0.29.0 on) and "
            "resolve_fp8_moe_weight_block_shape (vLLM 0.32.0)"
        ),
        what=(
            "block-quantized FP8 MoE whose expert shard is not whole blocks: the block scales are refined to "
            "gcd(block_n, block_k, shard, hidden) when that is at least 32 (Triton MoE kernels only), else refused"
        ),
    ),
    Rule(
        name="wna16-group",
        engine="vllm",
        since=(0, 0, 0),
        until=None,
        source=(
            "vllm/model_executor/kernels/linear/mixed_precision/marlin.py can_implement and "
            "vllm/model_executor/kernels/linear/__init__.py choose_mp_linear_kernel (vLLM 0.32.0)"
        ),
        what=(
            "4-bit group-quantized weights (AWQ, GPTQ, w4a16): each rank's input shard of a row-parallel layer is "
            "whole quantization groups (MoE experts fall back to the WNA16 MoE kernels instead of refusing)"
        ),
    ),
    Rule(
        name="pipeline-layers",
        engine="vllm",
        since=(0, 0, 0),
        until=None,
        source="vllm/distributed/utils.py get_pp_indices (vLLM 0.32.0)",
        what="every pipeline stage holds at least one layer",
    ),
    Rule(
        name="pipeline-layers",
        engine="trtllm",
        since=(0, 0, 0),
        until=None,
        source="tensorrt_llm/mapping.py Mapping.pp_layers (NVIDIA/TensorRT-LLM commit 05ebebb2)",
        what="pipeline stages at most the hidden layers; the first num_layers % pp stages hold one layer more",
    ),
    Rule(
        name="expert-parallel-even",
        engine="trtllm",
        since=(0, 0, 0),
        until=None,
        source=(
            "tensorrt_llm/mapping.py Mapping.ep_experts and Mapping.__init__ (tp_size = moe_tp_size x moe_ep_size) "
            "(NVIDIA/TensorRT-LLM commit 05ebebb2)"
        ),
        what="expert parallelism gives every rank num_experts // ep experts: the experts divide over the ranks",
    ),
    Rule(
        name="expert-parallel-needs-moe",
        engine="vllm",
        since=(0, 0, 0),
        until=None,
        source="vllm/config/model.py ModelConfig._verify_with_expert_parallelism (vLLM 0.32.0)",
        what="--enable-expert-parallel needs a model with experts",
    ),
)


def _rule(name: str, engine: str, version: Version) -> Rule | None:
    for r in RULES:
        if r.name == name and r.engine == engine and r.since <= version and (r.until is None or version < r.until):
            return r
    return None


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one replica spreads over its GPUs."""

    tp: int = 1
    pp: int = 1
    ep: bool = False  # experts whole and spread over the tp ranks of a stage

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def label(self) -> str:
        out = f"tp={self.tp}"
        if self.pp > 1:
            out += f" pp={self.pp}"
        if self.ep:
            out += " ep"
        return out


def pp_partition(num_layers: int, pp: int, *, engine: str = "vllm") -> tuple[int, ...]:
    """Layers per pipeline stage as the engine splits them. vLLM (vllm/distributed/utils.py get_pp_indices, vLLM
    0.32.0): an even share, and the remainder one each to the stages before the last, counting back from the
    second-to-last (the last stage also holds the final norm and the lm_head). TensorRT-LLM (``RULES``
    pipeline-layers): torch.tensor_split, the first stages one more."""
    if pp < 1:
        raise SizingError(f"must be at least 1, got {pp}", field="pipeline_parallel_size")
    if pp > num_layers:
        raise SizingError(
            f"{pp} stages for {num_layers} layers leave a stage without layers; use at most {num_layers}",
            field="pipeline_parallel_size",
        )
    parts = [num_layers // pp] * pp
    if engine == "trtllm":
        for i in range(num_layers % pp):
            parts[i] += 1
        return tuple(parts)
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return tuple(parts)


def experts_per_rank(num_experts: int, ep: int) -> int:
    """The most experts one rank holds: vLLM gives each of ``ep`` ranks num_experts // ep and the first
    num_experts % ep ranks one more (vllm/model_executor/layers/fused_moe/expert_map_manager.py
    determine_expert_map, vLLM 0.32.0); memory is sized by the fullest rank."""
    return math.ceil(num_experts / ep)


def _fp8_block_problems(model: ModelSpec, tp: int, ep: bool, version: Version) -> tuple[list[str], list[str]]:
    """(refusals, notes) of a block-quantized FP8 checkpoint at ``tp``."""
    q = model.quantization
    if q is None or q.weight_block_size is None or tp == 1:
        return [], []
    bn, bk = q.weight_block_size
    problems: list[str] = []
    notes: list[str] = []
    linear = _rule("fp8-block-linear", "vllm", version)
    # Column-parallel outputs (q, k, v per rank; gate/up of dense MLPs) and row-parallel inputs (o_proj, down_proj).
    if linear is not None and model.mla is None:
        q_out = model.num_attention_heads * model.head_dim // tp
        kv_out = max(1, model.num_kv_heads // tp) * model.head_dim
        for what, size, block in (
            ("query projection output", q_out, bn),
            ("key/value projection output", kv_out, bn),
            ("attention output projection input", q_out, bk),
        ):
            if size % block:
                problems.append(f"each rank's {what} is {size} wide, not a multiple of the {block}-wide FP8 block")
    dense = any(not layer.moe for layer in model.layers) or model.moe is None
    if linear is not None and dense and (model.intermediate_size // tp) % bn:
        problems.append(
            f"each rank's MLP intermediate shard is {model.intermediate_size // tp} wide, not a multiple of the "
            f"{bn}-wide FP8 block"
        )
    shared = model.moe.shared_expert_intermediate_size if model.moe is not None else 0
    if linear is not None and shared and (shared // tp) % bn:
        # Shared experts are plain tensor-parallel MLPs (vLLM builds them as MergedColumnParallelLinear), even
        # under expert parallelism.
        problems.append(
            f"each rank's shared-expert intermediate shard is {shared // tp} wide, not a multiple of the {bn}-wide "
            "FP8 block"
        )
    if model.moe is not None and not ep:
        shard = model.moe.expert_intermediate_size // tp
        if shard % bn or shard % bk:
            refined = _rule("fp8-block-moe-refined", "vllm", version)
            g = math.gcd(bn, bk, shard, model.hidden_size)
            if refined is not None and g >= 32:
                notes.append(
                    f"each rank's expert shard is {shard} wide, not whole {bn}x{bk} FP8 blocks: vLLM refines the "
                    f"block scales to {g}x{g} and runs the Triton MoE kernels ({refined.source})"
                )
            else:
                problems.append(
                    f"each rank's expert intermediate shard is {model.moe.expert_intermediate_size} / {tp} = {shard} "
                    f"wide, not a multiple of the {bn}x{bk} FP8 block"
                )
    return problems, notes


def _group_problems(model: ModelSpec, tp: int, scheme: WeightScheme) -> list[str]:
    """Row-parallel input shards of group-quantized 4-bit weights must be whole groups."""
    g = scheme.group_size
    if tp == 1 or not g or scheme.weight_bits > 4 or scheme.name not in ("awq", "gptq", "w4a16"):
        return []
    out = []
    o_in = model.num_attention_heads * model.head_dim // tp
    if model.mla is None and o_in % g:
        out.append(f"each rank's attention output projection input is {o_in} wide, not whole groups of {g}")
    dense = model.moe is None or any(not layer.moe for layer in model.layers)
    if dense and (model.intermediate_size // tp) % g:
        width = model.intermediate_size // tp
        out.append(f"each rank's MLP down projection input is {width} wide, not whole groups of {g}")
    return out


def layout_problems(
    model: ModelSpec, layout: Layout, *, engine: str, version: str, scheme: WeightScheme
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(why the engine refuses this layout, notes on how it runs it), without suggestions."""
    v = parse_version(version)
    problems: list[str] = []
    notes: list[str] = []
    try:
        validate_tp(model, layout.tp)
    except SizingError as err:
        problems.append(err.message)
    if layout.pp > model.num_layers:
        problems.append(f"{layout.pp} pipeline stages for {model.num_layers} layers leave a stage without layers")
    if layout.ep and model.moe is None:
        problems.append("expert parallelism needs a mixture-of-experts model")
    if engine == "trtllm" and layout.ep and model.moe is not None and model.moe.num_experts % layout.tp:
        problems.append(
            f"TensorRT-LLM gives each of {layout.tp} expert-parallel ranks {model.moe.num_experts} // {layout.tp} "
            "experts, which leaves some out"
        )
    if engine == "vllm":
        p, n = _fp8_block_problems(model, layout.tp, layout.ep, v)
        problems += p
        notes += n
        problems += _group_problems(model, layout.tp, scheme)
    return tuple(problems), tuple(notes)


def check_layout(
    model: ModelSpec, layout: Layout, *, engine: str, version: str, scheme: WeightScheme
) -> tuple[str, ...]:
    """Notes on how the engine runs ``layout``; SizingError naming the broken rule and a layout that starts."""
    problems, notes = layout_problems(model, layout, engine=engine, version=version, scheme=scheme)
    if not problems:
        return notes
    alternatives = [
        alt.label()
        for alt in _alternatives(model, layout)
        if not layout_problems(model, alt, engine=engine, version=version, scheme=scheme)[0]
    ]
    fix = f"; {' or '.join(alternatives[:3])} starts" if alternatives else ""
    raise SizingError(f"{engine} {version} refuses {layout.label()}: {problems[0]}{fix}", field="tensor_parallel_size")


def _alternatives(model: ModelSpec, layout: Layout) -> list[Layout]:
    """Layouts on the same GPUs first (expert parallelism, tp x pp), then smaller tensor-parallel degrees."""
    gpus = layout.gpus
    out: list[Layout] = []
    if model.moe is not None and not layout.ep:
        out.append(Layout(tp=layout.tp, pp=layout.pp, ep=True))
    for pp in range(2, gpus + 1):
        if gpus % pp == 0 and pp != layout.pp:
            out.append(Layout(tp=gpus // pp, pp=pp, ep=layout.ep and gpus // pp > 1))
    out += [Layout(tp=t, pp=layout.pp, ep=layout.ep and t > 1) for t in range(layout.tp - 1, 0, -1)]
    return list(dict.fromkeys(out))  # expert parallelism over one rank is plain TP: drop the duplicates
