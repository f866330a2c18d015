"""Parallel layouts of one replica: tensor, pipeline and expert parallelism, and the shapes an engine refuses.

A replica runs on ``tp x pp`` GPUs. Tensor parallelism shards every layer; pipeline parallelism gives each stage
a contiguous run of layers (the first stage the embedding, the last the lm_head); expert parallelism keeps MoE
experts whole and spreads them over the ``tp`` ranks of a stage instead of splitting each expert's width
(attention stays tensor-parallel). Data-parallel attention (``dp``) runs ``dp`` engine cores behind one server,
each with its own ``tp x pp`` GPUs, KV cache and scheduler, while the MoE layers span all ``dp x tp`` ranks: an
MLA model's latent is held once per data-parallel rank instead of once per tensor-parallel rank.

The divisibility rules an engine checks at start-up are data in the engine's folder (``EngineCapacity.layout_rules``
in kvfleet/engines/<name>/profiles.py), each with the release and the file it was read from; ``check_layout``
applies the ones it knows by name and names the layout that would start instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfleet.engines.capacity import LayoutRule
from kvfleet.errors import SizingError
from kvfleet.sizing.engines import EngineName, engine_capacity, engine_title, engine_traits
from kvfleet.sizing.memory import validate_tp
from kvfleet.sizing.models import ModelSpec
from kvfleet.sizing.precision import WeightScheme
from kvfleet.versions import Version, parse_version


def _rule(name: str, engine: str, version: Version) -> LayoutRule | None:
    for r in engine_capacity(engine).layout_rules:
        if r.name == name and r.since <= version and (r.until is None or version < r.until):
            return r
    return None


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one replica spreads over its GPUs."""

    tp: int = 1
    pp: int = 1
    ep: bool = False  # experts whole and spread over the tp (x dp) ranks
    # Data-parallel attention: dp engine cores behind one server, each with its own tp x pp GPUs, KV cache and
    # scheduler; MoE layers span all dp x tp ranks (vLLM --data-parallel-size).
    dp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_ranks(self) -> int:
        """Ranks the experts are spread over: the tensor-parallel ranks times the data-parallel ones."""
        return self.tp * self.dp

    def label(self) -> str:
        out = f"tp={self.tp}"
        if self.pp > 1:
            out += f" pp={self.pp}"
        if self.dp > 1:
            out += f" dp={self.dp}"
        if self.ep:
            out += " ep"
        return out


def pp_partition(num_layers: int, pp: int, *, engine: str = EngineName.VLLM) -> tuple[int, ...]:
    """Layers per pipeline stage as the engine splits them (``EngineTraits.pipeline_remainder_first``): an even
    share, and the remainder one each to the first stages (TensorRT-LLM: torch.tensor_split), or to the stages
    before the last, counting back from the second-to-last (vLLM: the last stage also holds the final norm and the
    lm_head)."""
    if pp < 1:
        raise SizingError(f"must be at least 1, got {pp}", field="pipeline_parallel_size")
    if pp > num_layers:
        raise SizingError(
            f"{pp} stages for {num_layers} layers leave a stage without layers; use at most {num_layers}",
            field="pipeline_parallel_size",
        )
    parts = [num_layers // pp] * pp
    if engine_traits(engine).pipeline_remainder_first:
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


def _fp8_block_problems(
    model: ModelSpec, tp: int, ep: bool, version: Version, engine: str
) -> tuple[list[str], list[str]]:
    """(refusals, notes) of a block-quantized FP8 checkpoint at ``tp``, by the engine's fp8-block rules."""
    q = model.quantization
    if q is None or q.weight_block_size is None or tp == 1:
        return [], []
    bn, bk = q.weight_block_size
    problems: list[str] = []
    notes: list[str] = []
    linear = _rule("fp8-block-linear", engine, version)
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
    refined = _rule("fp8-block-moe-refined", engine, version)
    if model.moe is not None and not ep and (refined or _rule("fp8-block-moe", engine, version)):
        shard = model.moe.expert_intermediate_size // tp
        if shard % bn or shard % bk:
            g = math.gcd(bn, bk, shard, model.hidden_size)
            if refined is not None and g >= 32:
                notes.append(
                    f"each rank's expert shard is {shard} wide, not whole {bn}x{bk} FP8 blocks: "
                    f"{engine_title(engine)} refines the "
                    f"block scales to {g}x{g} and runs the Triton MoE kernels ({refined.source})"
                )
            else:
                problems.append(
                    f"each rank's expert intermediate shard is {model.moe.expert_intermediate_size} / {tp} = {shard} "
                    f"wide, not a multiple of the {bn}x{bk} FP8 block"
                )
    return problems, notes


def _group_problems(model: ModelSpec, tp: int, scheme: WeightScheme, version: Version, engine: str) -> list[str]:
    """Row-parallel input shards of group-quantized 4-bit weights must be whole groups (the wna16-group rule)."""
    g = scheme.group_size
    if tp == 1 or not g or scheme.weight_bits > 4 or scheme.name not in ("awq", "gptq", "w4a16"):
        return []
    if _rule("wna16-group", engine, version) is None:
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
    even = _rule("expert-parallel-even", engine, v)
    if even and layout.ep and model.moe is not None and model.moe.num_experts % layout.tp:
        problems.append(
            f"{engine_title(engine)} gives each of {layout.tp} expert-parallel ranks {model.moe.num_experts} // "
            f"{layout.tp} experts, which leaves some out"
        )
    problems += _data_parallel_problems(model, layout, engine, v)
    p, n = _fp8_block_problems(model, layout.tp, layout.ep, v, engine)
    problems += p
    notes += n
    problems += _group_problems(model, layout.tp, scheme, v, engine)
    return tuple(problems), tuple(notes)


def data_parallel_sized(engine: str, version: str | None) -> bool:
    """Whether kvfleet sizes data-parallel attention on this engine release (its data-parallel-attention rule)."""
    v = parse_version(version or engine_capacity(engine).default_version)
    return _rule("data-parallel-attention", engine, v) is not None


def _data_parallel_problems(model: ModelSpec, layout: Layout, engine: str, version: Version) -> list[str]:
    """Why a data-parallel layout does not start, or is not one kvfleet sizes (the engine's data-parallel rule)."""
    if layout.dp == 1:
        return []
    if layout.dp < 1:
        return [f"data_parallel_size must be at least 1, got {layout.dp}"]
    rule = _rule("data-parallel-attention", engine, version)
    if rule is None:
        return [f"data-parallel attention is not modelled for {engine_title(engine)} {'.'.join(map(str, version))}"]
    if model.moe is None or not layout.ep:
        # The engine starts it, but for a dense model (or experts split in width) its ranks share nothing: dp
        # separate engines, which kvfleet plans as replicas (engines per instance) instead.
        return ["data-parallel attention is sized only for a mixture-of-experts model with expert parallelism"]
    if layout.pp > 1:
        return ["data-parallel attention with pipeline parallelism is not modelled"]
    if model.moe.num_experts < layout.expert_ranks:
        return [
            f"{model.moe.num_experts} experts over {layout.expert_ranks} expert-parallel ranks leave a rank "
            f"without experts ({rule.source})"
        ]
    return []


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
    dp_problems = _data_parallel_problems(model, layout, engine, parse_version(version))
    field = "data_parallel_size" if dp_problems and problems[0] in dp_problems else "tensor_parallel_size"
    raise SizingError(f"{engine} {version} refuses {layout.label()}: {problems[0]}{fix}", field=field)


def _alternatives(model: ModelSpec, layout: Layout) -> list[Layout]:
    """Layouts on the same GPUs first (expert parallelism, tp x pp), then smaller tensor-parallel degrees."""
    gpus = layout.gpus
    out: list[Layout] = []
    if layout.dp > 1:
        # The same GPUs as one tensor-parallel engine, or data parallel with the experts whole.
        out += [Layout(tp=layout.tp, dp=layout.dp, ep=True), Layout(tp=gpus, ep=model.moe is not None)]
        return out
    if model.moe is not None and not layout.ep:
        out.append(Layout(tp=layout.tp, pp=layout.pp, ep=True))
    for pp in range(2, gpus + 1):
        if gpus % pp == 0 and pp != layout.pp:
            out.append(Layout(tp=gpus // pp, pp=pp, ep=layout.ep and gpus // pp > 1))
    out += [Layout(tp=t, pp=layout.pp, ep=layout.ep and t > 1) for t in range(layout.tp - 1, 0, -1)]
    return list(dict.fromkeys(out))  # expert parallelism over one rank is plain TP: drop the duplicates
