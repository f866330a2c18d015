"""Speculative decoding: what a drafter adds to one engine start (weights, KV cache, slots, activations).

vLLM 0.32.0, read in its source:

* The drafter is built in the target's worker and its attention layers register KV-cache specs beside the
  target's (v1/spec_decode/llm_base_proposer.py ``load_model``: the draft layers are the attention layers the
  draft model added; v1/worker/gpu_model_runner.py ``get_kv_cache_spec`` walks them all). They take blocks from
  the one pool at the one block size: layers of one kind join the target's group (v1/core/kv_cache_utils.py
  ``get_kv_cache_groups``: a uniform spec, or ``UniformTypeKVCacheSpecs`` whose block sums every layer's page
  when the draft's heads or head size differ), so every block costs the target's and the drafter's bytes.
* Weights the drafter borrows (llm_base_proposer.py ``_maybe_share_embeddings`` / ``_maybe_share_lm_head``):
  EAGLE heads and MTP layers read the target's embedding (an EAGLE checkpoint's own copy is dropped when it
  equals the target's or is absent; a draft whose hidden size differs keeps its own; a head shipping a distinct
  copy keeps it too, which config.json cannot tell: it is taken as shared). EAGLE-1 heads
  (models/llama_eagle.py) have no lm_head and use the target's; EAGLE-3 heads (models/llama_eagle3.py) carry
  their own over ``draft_vocab_size`` rows; MTP layers share the target's (``shared_head.head``). A separate
  draft model shares nothing (v1/spec_decode/draft_model.py), must run at the target's tensor parallelism and
  have its vocabulary.
* Extra weights an EAGLE head has beyond its decoder layer: ``fc`` (a ReplicatedLinear, whole on every rank)
  of 2 h -> h (EAGLE-1) or 3 target-h -> h (EAGLE-3: three auxiliary hidden states by default), EAGLE-3's
  first layer's qkv over 2 h inputs and its ``hidden_norm``, and ``draft_id_to_target_id`` (int64) when its
  vocabulary is reduced. An MTP layer (models/deepseek_mtp.py) is one of the target's decoder layers plus
  ``eh_proj`` (an nn.Linear 2 h -> h: neither quantized nor sharded) and three norms.
* Slots (config/vllm.py ``num_lookahead_tokens``): eagle, eagle3, mtp and draft_model reserve
  ``num_speculative_tokens`` slots past the tokens scheduled; ngram none. A decoding request holds its
  computed tokens + 1 + K drafts being verified + the lookahead, capped at max_model_len
  (v1/core/kv_cache_manager.py ``allocate_slots``), so a request of max_model_len needs no more blocks.
* ``max_num_new_slots_for_drafting`` (config/speculative.py): 0 for eagle/eagle3/mtp/ngram, 1 for a draft
  model; vLLM refuses max_num_batched_tokens at or below it (config/vllm.py ``_set_max_num_scheduled_tokens``).
* The memory profile runs the drafter after the target in the same dummy run (gpu_model_runner.py
  ``_dummy_run``: ``self.drafter.dummy_run(num_tokens, ...)``), over the same token count; the target's hidden
  states the drafter reads (three layers' for EAGLE-3) stay alive through it; the dummy sampler run adds a
  rejection-sampler pass over one draft per request, holding twice the rows of bf16 logits while it samples
  (v1/sample/rejection_sampler.py). CUDA graphs are captured for the drafter too (PIECEWISE).

TensorRT-LLM's PyTorch backend (``speculative_config`` in the LLM-API options: decoding_type Eagle with
``eagle3_one_model``, MTP, NGram, DraftTarget) keeps one-model drafter layers in the target's KV-cache manager
as well; it is sized here by the same rules, which were not checked against its 1.0.0 source.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

from kvfleet.engines import ENGINES, vocabulary
from kvfleet.engines.vocabulary import DRAFTS_FROM_CHECKPOINT
from kvfleet.errors import KvfleetError, SizingError
from kvfleet.sizing.catalog import resolve_model
from kvfleet.sizing.engines import ACTIVATIONS, EngineName, activation_peak_bytes, engine_traits
from kvfleet.sizing.memory import VOCAB_PADDING, KvGroup, kv_heads_per_rank, kv_layout, validate_tp, weight_bytes
from kvfleet.sizing.models import ModelSpec
from kvfleet.sizing.precision import KvDtype, Part, WeightScheme
from kvfleet.sizing.units import cdiv

_FIELD = "speculative"
# Speculative methods are the engines' vocabulary, defined once there; the sizing core's settings name them as this.
SpecMethod = vocabulary.SpecMethod
# EAGLE-3 concatenates three of the target's hidden states unless its config names other layers
# (models/llama_eagle3.py: ``len(layer_ids) if layer_ids else 3``).
EAGLE3_AUX_HIDDEN_STATES = 3
_UNQUANTIZED_BYTES = 2  # bf16/fp16: fc, eh_proj and norms stay in the model dtype


@dataclass(frozen=True, kw_only=True)
class Speculative:
    """The speculative-decoding setting of one engine start."""

    method: SpecMethod
    num_speculative_tokens: int | None = None  # None: an MTP model's layer count; required otherwise
    draft_model: str | None = None  # catalog id or config.json path: the EAGLE head or the draft model
    # Mean tokens kept per verification step (tau, the bonus token included, 1 <= tau <= K + 1), measured on the
    # workload; None: the published measurement in data/speculative_acceptance.json for this method and K, if any.
    acceptance_length: float | None = None


@dataclass(frozen=True, kw_only=True)
class Drafter:
    """What the drafter adds to one GPU of one engine start."""

    method: SpecMethod
    num_speculative_tokens: int
    draft_ref: str | None  # the reference the drafter was named by (what the engine loads)
    model: ModelSpec | None  # the drafter's layers as a model; None for ngram
    weights_bytes_per_gpu: int
    shares: tuple[str, ...]  # the target's weights it reads instead of its own
    kv_groups: tuple[KvGroup, ...]
    lookahead_tokens: int  # slots reserved past the tokens scheduled (vLLM num_lookahead_tokens)
    new_slots_for_drafting: int  # vLLM max_num_new_slots_for_drafting
    activation_peak_bytes: int  # the drafter's own forward in the profile run, without workspace
    hidden_state_bytes: int  # the target's hidden states the drafter reads, alive through its forward
    cuda_graph_bytes: int
    notes: tuple[str, ...] = ()

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return sum(g.bytes_per_token for g in self.kv_groups)

    @property
    def extra_slots_per_request(self) -> int:
        """Slots a decoding request holds past its computed tokens and the next one: K drafts + lookahead."""
        return self.num_speculative_tokens + self.lookahead_tokens

    @property
    def layers(self) -> int:
        return sum(g.num_layers for g in self.kv_groups)


def parse_method(text: str, *, field: str = _FIELD + ".method") -> SpecMethod:
    try:
        return SpecMethod(text.strip().lower().replace("-", "_"))
    except ValueError:
        names = ", ".join(m.value for m in SpecMethod)
        raise SizingError(
            f"speculative method {text!r} is not sized here; use one of {names} (vLLM's medusa, mlp_speculator, "
            "suffix, dflash and dspark drafters are not modelled)",
            field=field,
        ) from None


def speculative_tokens(target: ModelSpec, spec: Speculative) -> int:
    """K as the engine resolves it (mtp: the model's MTP layer count when not given). SizingError names the field."""
    return _tokens(target, spec)


def _tokens(target: ModelSpec, spec: Speculative) -> int:
    k = spec.num_speculative_tokens
    if k is not None and (isinstance(k, bool) or k <= 0):
        raise SizingError(f"must be a positive integer, got {k}", field=_FIELD + ".num_speculative_tokens")
    if spec.method is SpecMethod.MTP:
        n = target.mtp_layers
        if n <= 0:
            raise SizingError(
                f"{target.model_id} ships no MTP layers (its config.json has no num_nextn_predict_layers); "
                "use eagle3 with a head trained for it, or ngram",
                field=_FIELD + ".method",
            )
        if k is None:
            return n  # config/speculative.py: defaults to n_predict
        if k > n and k % n:
            # config/speculative.py: "num_speculative_tokens ... must be divisible by n_predict"
            raise SizingError(
                f"{k} drafts cannot reuse {n} MTP layers evenly; use at most {n} or a multiple of {n}",
                field=_FIELD + ".num_speculative_tokens",
            )
        return k
    if k is None:
        raise SizingError(
            f"{spec.method.value} needs num_speculative_tokens (vLLM requires it); 3 to 5 is usual",
            field=_FIELD + ".num_speculative_tokens",
        )
    return k


def _resolve_draft(spec: Speculative) -> ModelSpec:
    if not spec.draft_model:
        what = "an EAGLE head's" if spec.method is not SpecMethod.DRAFT_MODEL else "the draft model's"
        raise SizingError(
            f"{spec.method.value} needs {what} catalog id or config.json path", field=_FIELD + ".draft_model"
        )
    try:
        return resolve_model(spec.draft_model)
    except KvfleetError as err:
        raise SizingError(err.message, field=_FIELD + ".draft_model") from None


def _without(model: ModelSpec, *, tp: int, scheme: WeightScheme, parts: frozenset[Part]) -> int:
    w = weight_bytes(model, tp=tp, scheme=scheme)
    return sum(b for p, b in w.bytes_by_part if p not in parts)


def _lm_head_bytes(rows: int, hidden: int, tp: int) -> int:
    # ParallelLMHead pads the rows to a multiple of 64 and gives each rank an equal share (vocab_parallel_embedding.py).
    return cdiv(cdiv(rows, VOCAB_PADDING) * VOCAB_PADDING, tp) * hidden * _UNQUANTIZED_BYTES


def _eagle(target: ModelSpec, head: ModelSpec, method: SpecMethod, tp: int) -> tuple[int, tuple[str, ...], list[str]]:
    if head.vocab_size != target.vocab_size:
        raise SizingError(
            f"the head's vocabulary ({head.vocab_size}) differs from {target.model_id}'s ({target.vocab_size}); "
            "use a head trained for this model",
            field=_FIELD + ".draft_model",
        )
    h = head.hidden_size
    body = _without(head, tp=tp, scheme=head.native_scheme, parts=frozenset({Part.EMBEDDING, Part.LM_HEAD}))
    shares = ["embedding"] if h == target.hidden_size else []
    own_embedding = 0 if shares else _lm_head_bytes(head.vocab_size, h, tp)
    notes: list[str] = []
    if method is SpecMethod.EAGLE:
        if h != target.hidden_size:
            raise SizingError(
                f"an EAGLE-1 head reads the target's hidden states: its hidden_size {h} must be {target.hidden_size}",
                field=_FIELD + ".draft_model",
            )
        fc = 2 * h * h * _UNQUANTIZED_BYTES
        return body + fc, (*shares, "lm_head"), notes
    fc = EAGLE3_AUX_HIDDEN_STATES * target.hidden_size * h * _UNQUANTIZED_BYTES
    # The first layer's qkv reads [embeds, hidden] (2 h inputs); the body counted h of them.
    qkv_rank = (head.num_attention_heads // tp + 2 * kv_heads_per_rank(head, tp)) * head.head_dim
    extra_qkv = h * qkv_rank * _UNQUANTIZED_BYTES + h * _UNQUANTIZED_BYTES  # + hidden_norm
    rows = head.draft_vocab_size or head.vocab_size
    lm_head = _lm_head_bytes(rows, h, tp)
    d2t = rows * 8 if rows != target.vocab_size else 0
    if rows != target.vocab_size:
        notes.append(f"EAGLE-3 head drafts over {rows:,} of the target's {target.vocab_size:,} tokens")
    return body + own_embedding + fc + extra_qkv + lm_head + d2t, tuple(shares), notes


def _mtp_layers(target: ModelSpec, scheme: WeightScheme, tp: int) -> tuple[ModelSpec, int]:
    n = target.mtp_layers
    # An MTP module is one more of the target's decoder layers (the last kind: MoE for DeepSeek-V3).
    layers = replace(
        target,
        model_id=f"{target.model_id} MTP",
        num_layers=n,
        layers=(target.layers[-1],) * n,
        vision_params=0,
        mtp_layers=0,
    )
    h = target.hidden_size
    body = _without(layers, tp=tp, scheme=scheme, parts=frozenset({Part.EMBEDDING, Part.LM_HEAD}))
    eh_proj = n * 2 * h * h * _UNQUANTIZED_BYTES  # nn.Linear: whole on every rank, not quantized
    norms = n * 3 * h * _UNQUANTIZED_BYTES  # enorm, hnorm, shared_head.norm
    return layers, body + eh_proj + norms


def resolve_drafter(
    target: ModelSpec,
    spec: Speculative,
    *,
    tp: int,
    kv_dtype: KvDtype,
    target_scheme: WeightScheme,
    max_num_batched_tokens: int,
    engine: EngineName = EngineName.VLLM,
) -> Drafter:
    """The drafter ``spec`` names, sized for ``target`` at this tensor parallelism. SizingError names the field."""
    k = _tokens(target, spec)
    method = spec.method
    traits = engine_traits(engine)
    if method.value not in ENGINES[engine].speculative_methods:
        raise SizingError(traits.speculative_refusal, field=_FIELD + ".method")
    if method is not SpecMethod.NGRAM and method not in DRAFTS_FROM_CHECKPOINT and spec.draft_model:
        raise SizingError(
            f"{method.value} drafts with the target's own layers; drop draft_model", field=_FIELD + ".draft_model"
        )
    if method is SpecMethod.NGRAM:
        if spec.draft_model:
            raise SizingError("ngram needs no draft model; drop draft_model", field=_FIELD + ".draft_model")
        return _ngram_drafter(k)
    d = _mtp_draft(target, k, target_scheme, tp) if method is SpecMethod.MTP else _checkpoint_draft(target, spec, tp)
    kv = kv_layout(d.model, tp=tp, kv_dtype=kv_dtype)
    groups = tuple(replace(g, draft=True) for g in kv.groups)
    a = _UNQUANTIZED_BYTES
    forward = activation_peak_bytes(d.model, tp=tp, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=1)
    c = ACTIVATIONS
    moe = c.cuda_graph_moe_factor if d.model.moe is not None else 1.0
    return Drafter(
        method=method,
        num_speculative_tokens=k,
        draft_ref=spec.draft_model,
        model=d.model,
        weights_bytes_per_gpu=d.weights_bytes_per_gpu,
        shares=d.shares,
        kv_groups=groups,
        lookahead_tokens=traits.lookahead_slots(method.value, k),
        new_slots_for_drafting=1 if method is SpecMethod.DRAFT_MODEL else 0,
        activation_peak_bytes=max(0, forward - c.workspace_bytes),
        hidden_state_bytes=d.hidden_copies * max_num_batched_tokens * target.hidden_size * a,
        cuda_graph_bytes=int(d.model.num_layers * c.cuda_graph_per_layer_bytes * moe),
        notes=d.notes,
    )


def _ngram_drafter(k: int) -> Drafter:
    return Drafter(
        method=SpecMethod.NGRAM,
        num_speculative_tokens=k,
        draft_ref=None,
        model=None,
        weights_bytes_per_gpu=0,
        shares=(),
        kv_groups=(),
        lookahead_tokens=0,
        new_slots_for_drafting=0,
        activation_peak_bytes=0,
        hidden_state_bytes=0,
        cuda_graph_bytes=0,
        notes=("ngram drafts from the prompt: no weights, no KV cache",),
    )


@dataclass(frozen=True, kw_only=True)
class _Draft:
    """A drafter's own layers and what they add to the target's weights."""

    model: ModelSpec
    weights_bytes_per_gpu: int
    shares: tuple[str, ...]  # the target's weights it reads instead of its own
    hidden_copies: int  # the target's hidden states it reads per token (EAGLE-3: several layers' worth)
    notes: tuple[str, ...] = ()


def _mtp_draft(target: ModelSpec, k: int, scheme: WeightScheme, tp: int) -> _Draft:
    """The model's own MTP layers, reading the target's embedding and lm_head."""
    draft, weights = _mtp_layers(target, scheme, tp)
    notes: tuple[str, ...] = ()
    if k > target.mtp_layers:
        notes = (f"{k} drafts rerun {target.mtp_layers} MTP layer(s); acceptance drops past them",)
    return _Draft(
        model=draft, weights_bytes_per_gpu=weights, shares=("embedding", "lm_head"), hidden_copies=1, notes=notes
    )


def _checkpoint_draft(target: ModelSpec, spec: Speculative, tp: int) -> _Draft:
    """An EAGLE head or a draft model of its own checkpoint, run at the target's tensor parallelism."""
    method = spec.method
    draft = _resolve_draft(spec)
    try:
        validate_tp(draft, tp, field=_FIELD + ".draft_model")
    except SizingError as err:
        raise SizingError(
            f"the drafter runs at the target's tensor_parallel_size {tp}, which {err.message}",
            field=_FIELD + ".draft_model",
        ) from None
    if method is not SpecMethod.DRAFT_MODEL:
        weights, shares, notes = _eagle(target, draft, method, tp)
        copies = EAGLE3_AUX_HIDDEN_STATES if method is SpecMethod.EAGLE3 else 1
        return _Draft(
            model=draft, weights_bytes_per_gpu=weights, shares=shares, hidden_copies=copies, notes=tuple(notes)
        )
    if draft.vocab_size != target.vocab_size:
        # SpeculativeConfig.verify_equal_vocab_size_if_draft_model
        raise SizingError(
            f"the draft model's vocabulary ({draft.vocab_size}) differs from the target's "
            f"({target.vocab_size}); vLLM needs one tokenizer: pick a draft of the same family",
            field=_FIELD + ".draft_model",
        )
    weights = weight_bytes(draft, tp=tp, scheme=draft.native_scheme).weights_bytes_per_gpu
    notes = []
    if draft.max_position_embeddings < target.max_position_embeddings:
        notes.append(
            f"the draft model stops drafting past {draft.max_position_embeddings:,} tokens "
            "(its max_position_embeddings)"
        )
    return _Draft(model=draft, weights_bytes_per_gpu=weights, shares=(), hidden_copies=0, notes=tuple(notes))


@cache
def acceptance_data() -> dict[str, Any]:
    """data/speculative_acceptance.json: published acceptance lengths by method and K, and the end-to-end checks."""
    text = resources.files("kvfleet.sizing").joinpath("data", "speculative_acceptance.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


@dataclass(frozen=True, kw_only=True)
class Acceptance:
    tokens_per_step: float  # tau
    source: str  # "given", "published: " and what it was measured on, or why none is credited


def acceptance(spec: Speculative, num_speculative_tokens: int) -> Acceptance:
    """The acceptance length the speed model credits: the user's, else the published one for this method and K, else 1
    (no gain) with a note that says so. SizingError (field speculative.acceptance_length) for a value out of range."""
    k = num_speculative_tokens
    field = _FIELD + ".acceptance_length"
    tau = spec.acceptance_length
    if tau is not None:
        if isinstance(tau, bool) or not (math.isfinite(tau) and 1.0 <= tau <= k + 1):
            raise SizingError(f"must lie between 1 and num_speculative_tokens + 1 = {k + 1}, got {tau}", field=field)
        return Acceptance(tokens_per_step=float(tau), source="given")
    entry = acceptance_data()["defaults"].get(spec.method.value)
    table = entry["by_num_speculative_tokens"] if entry else {}
    if str(k) not in table:
        # Conservative, not an error: the memory plan stands, and the speed counts the drafter's cost and no gain.
        known = f" (published for K = {', '.join(table)})" if table else ""
        return Acceptance(
            tokens_per_step=1.0,
            source=f"no published acceptance length for {spec.method.value} with {k} speculative tokens{known}, so "
            f"none is credited; give {field} (the mean acceptance length vLLM's spec-decode metrics report)",
        )
    return Acceptance(
        tokens_per_step=float(table[str(k)]), source=f"published: {entry['measured_on']}; {entry['source']}"
    )
