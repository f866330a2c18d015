"""Speculative decoding: the drafter's weights, KV bytes, lookahead slots, and what the engine refuses.

Every expectation is the engine's or the model's own number, not kvfleet's formula restated:
* DeepSeek-V3's MTP module: the model card ("The total size of DeepSeek-V3 models on Hugging Face is 685B, which
  includes 671B of the Main Model weights and 14B of the Multi-Token Prediction (MTP) Module weights",
  https://huggingface.co/deepseek-ai/DeepSeek-V3). Both are rounded; the checkpoint also counts its FP8 block
  scales (one per 128 x 128 weights), about 0.04B, as parameters.
* KV bytes per layer: vLLM 0.32.0 v1/kv_cache_interface.py (FullAttentionSpec: 2 x KV heads x head size x dtype
  per token; MLAAttentionSpec: one latent of kv_lora_rank + qk_rope_head_dim).
* An EAGLE-3 head's modules: vLLM 0.32.0 model_executor/models/llama_eagle3.py, written out below as shapes.
* Slots: vLLM 0.32.0 config/vllm.py num_lookahead_tokens and config/speculative.py
  max_num_new_slots_for_drafting (its table: EAGLE3 0, MTP 0, N-gram 0, draft model 1).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvfleet.errors import SizingError
from kvfleet.sizing.capacity import EngineSettings, capacity
from kvfleet.sizing.catalog import catalog_model, resolve_model
from kvfleet.sizing.engines import EngineName
from kvfleet.sizing.precision import KvDtype
from kvfleet.sizing.speculative import (
    SpecMethod,
    Speculative,
    acceptance,
    acceptance_data,
    parse_method,
    resolve_drafter,
)
from kvfleet.sizing.units import GiB

HF = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
QWEN3_32B_EAGLE3 = str(HF / "specforge-qwen3-32b-eagle3")
LLAMA3_70B_EAGLE3 = str(HF / "specforge-llama3-70B-eagle3")
H100 = 80 * GiB
LLAMA_1B = "meta-llama/Llama-3.2-1B-Instruct"


def _drafter(target: str, spec: Speculative, *, tp: int = 1, batched: int = 8192) -> object:
    m = resolve_model(target)
    return resolve_drafter(
        m, spec, tp=tp, kv_dtype=KvDtype.AUTO, target_scheme=m.native_scheme, max_num_batched_tokens=batched
    )


def _cap(target: str, spec: Speculative | None, *, tp: int = 1, mem: int = H100, **kw: object) -> object:
    settings = EngineSettings(tensor_parallel_size=tp, speculative=spec, **kw)  # type: ignore[arg-type]
    return capacity(resolve_model(target), gpu_memory_bytes=mem, settings=settings, accelerator_name="H100")


# ---- MTP: DeepSeek-V3's one layer --------------------------------------------------------------------------


def test_deepseek_v3_config_names_one_mtp_layer() -> None:
    assert catalog_model("deepseek-ai/DeepSeek-V3").mtp_layers == 1  # config.json num_nextn_predict_layers


def test_deepseek_v3_mtp_module_matches_the_model_card() -> None:
    m = catalog_model("deepseek-ai/DeepSeek-V3")
    d = resolve_drafter(
        m,
        Speculative(method=SpecMethod.MTP),
        tp=8,
        kv_dtype=KvDtype.AUTO,
        target_scheme=m.native_scheme,
        max_num_batched_tokens=8192,
    )
    assert d.model is not None
    h = m.hidden_size
    # The checkpoint's MTP module: a decoder layer, its own copies of embedding and head, eh_proj, enorm/hnorm.
    module = sum(g.count for g in d.model.param_groups) + 2 * h * h + 2 * h
    assert module == pytest.approx(14e9, rel=0.05)
    assert m.total_params + module == pytest.approx(685e9, rel=0.002)
    assert d.num_speculative_tokens == 1  # vLLM defaults num_speculative_tokens to n_predict
    assert d.shares == ("embedding", "lm_head")  # llm_base_proposer.py: "Detected MTP model. Sharing ..."


def test_deepseek_v3_mtp_layer_kv_is_one_more_mla_latent() -> None:
    spec = Speculative(method=SpecMethod.MTP, num_speculative_tokens=1)
    base = _cap("deepseek-ai/DeepSeek-V3", None, tp=8, mem=141 * GiB)
    cap = _cap("deepseek-ai/DeepSeek-V3", spec, tp=8, mem=141 * GiB)
    latent = (512 + 64) * 2  # MLAAttentionSpec: kv_lora_rank + qk_rope_head_dim, bf16
    assert cap.drafter is not None and cap.drafter.kv_bytes_per_token_per_gpu == latent
    assert base.kv_bytes_per_token_per_gpu == 61 * latent
    assert cap.kv_bytes_per_token_per_gpu == 62 * latent
    # One group: a block holds block_size tokens of all 62 layers.
    b = cap.block_size
    assert cap.num_blocks == cap.kv_cache_bytes_per_gpu // (b * 62 * latent)
    assert cap.kv_cache_tokens == cap.num_blocks * b
    assert cap.weights_bytes_per_gpu == base.weights_bytes_per_gpu + cap.drafter.weights_bytes_per_gpu


def test_mtp_needs_mtp_layers() -> None:
    with pytest.raises(SizingError, match="ships no MTP layers") as err:
        _drafter("Qwen/Qwen3-32B", Speculative(method=SpecMethod.MTP))
    assert err.value.field == "speculative.method"


def test_mtp_takes_no_draft_model() -> None:
    with pytest.raises(SizingError, match="drop draft_model"):
        _drafter("deepseek-ai/DeepSeek-V3", Speculative(method=SpecMethod.MTP, draft_model="x"), tp=8)


# ---- EAGLE-3 heads -----------------------------------------------------------------------------------------


def _eagle3_head_bytes(*, h: int, heads: int, kv_heads: int, d: int, inter: int, draft_vocab: int, tp: int) -> int:
    """llama_eagle3.py's modules for one layer, bf16, per TP rank (vocab rows padded to 64 per rank)."""
    qkv = 2 * h * (heads + 2 * kv_heads) * d // tp  # QKVParallelLinear over [embeds, hidden]
    o = heads * d * h // tp
    mlp = 3 * h * inter // tp
    norms = 4 * h  # input_layernorm, hidden_norm, post_attention_layernorm, final norm
    fc = 3 * h * h  # ReplicatedLinear over three target hidden states
    rows = -(-draft_vocab // tp)
    lm_head = -(-rows // 64) * 64 * h
    d2t = draft_vocab * 8 // 2  # int64 draft_id_to_target_id, in bf16 units
    return 2 * (qkv + o + mlp + norms + fc + lm_head + d2t)


def test_eagle3_head_weights_for_qwen3_32b() -> None:
    spec = Speculative(method=SpecMethod.EAGLE3, draft_model=QWEN3_32B_EAGLE3, num_speculative_tokens=3)
    d = _drafter("Qwen/Qwen3-32B", spec)
    want = _eagle3_head_bytes(h=5120, heads=64, kv_heads=8, d=80, inter=25600, draft_vocab=32000, tp=1)
    assert d.weights_bytes_per_gpu == pytest.approx(want, rel=0.002)
    assert d.shares == ("embedding",)  # same width as the target: its embedding is shared


def test_eagle3_head_weights_shard_with_tp() -> None:
    spec = Speculative(method=SpecMethod.EAGLE3, draft_model=LLAMA3_70B_EAGLE3, num_speculative_tokens=3)
    d = _drafter("meta-llama/Llama-3.3-70B-Instruct", spec, tp=4)
    want = _eagle3_head_bytes(h=8192, heads=64, kv_heads=8, d=128, inter=28672, draft_vocab=32000, tp=4)
    assert d.weights_bytes_per_gpu == pytest.approx(want, rel=0.002)


def test_eagle3_head_with_its_own_head_size_shares_the_pool() -> None:
    """Qwen3-32B caches 2 x 8 x 128 x 2 B per layer, its SpecForge head 2 x 8 x 80 x 2: vLLM groups them as
    UniformTypeKVCacheSpecs, a block holding each layer's page at its own size."""
    spec = Speculative(method=SpecMethod.EAGLE3, draft_model=QWEN3_32B_EAGLE3, num_speculative_tokens=3)
    base = _cap("Qwen/Qwen3-32B", None, max_model_len=8192)
    cap = _cap("Qwen/Qwen3-32B", spec, max_model_len=8192)
    assert cap.drafter is not None and cap.drafter.kv_bytes_per_token_per_gpu == 2 * 8 * 80 * 2
    per_token = 64 * 2 * 8 * 128 * 2 + 2 * 8 * 80 * 2
    assert cap.kv_bytes_per_token_per_gpu == per_token
    assert cap.num_blocks == cap.kv_cache_bytes_per_gpu // (cap.block_size * per_token)
    # The head's weights and forward come out of the cache.
    assert cap.kv_cache_bytes_per_gpu < base.kv_cache_bytes_per_gpu - cap.drafter.weights_bytes_per_gpu
    assert cap.activation_peak_bytes > base.activation_peak_bytes
    # A request of max_model_len needs no more blocks: slots are capped at max_model_len (allocate_slots).
    assert cap.blocks_per_max_len_request == base.blocks_per_max_len_request


def test_eagle_head_must_match_the_target_vocabulary() -> None:
    spec = Speculative(method=SpecMethod.EAGLE3, draft_model=QWEN3_32B_EAGLE3, num_speculative_tokens=3)
    with pytest.raises(SizingError, match="vocabulary") as err:
        _drafter("meta-llama/Llama-3.1-8B", spec)
    assert err.value.field == "speculative.draft_model"


def test_eagle_needs_a_head_and_a_token_count() -> None:
    with pytest.raises(SizingError, match=r"catalog id or config\.json path"):
        _drafter("Qwen/Qwen3-32B", Speculative(method=SpecMethod.EAGLE3, num_speculative_tokens=3))
    with pytest.raises(SizingError, match="needs num_speculative_tokens"):
        _drafter("Qwen/Qwen3-32B", Speculative(method=SpecMethod.EAGLE3, draft_model=QWEN3_32B_EAGLE3))


def test_trtllm_pytorch_backend_has_no_eagle1() -> None:
    m = resolve_model("meta-llama/Llama-3.1-8B")
    with pytest.raises(SizingError, match="EAGLE-3 heads, not EAGLE-1"):
        resolve_drafter(
            m,
            Speculative(method=SpecMethod.EAGLE, draft_model="x", num_speculative_tokens=3),
            tp=1,
            kv_dtype=KvDtype.AUTO,
            target_scheme=m.native_scheme,
            max_num_batched_tokens=8192,
            engine=EngineName.TRTLLM,
        )


# ---- draft models and n-gram -------------------------------------------------------------------------------


def test_draft_model_keeps_its_own_embedding_and_cache() -> None:
    spec = Speculative(method=SpecMethod.DRAFT_MODEL, draft_model=LLAMA_1B, num_speculative_tokens=4)
    cap = _cap("meta-llama/Llama-3.1-8B", spec, max_model_len=8192)
    d = cap.drafter
    assert d is not None and d.shares == ()  # draft_model.py: "Draft models don't share embeddings"
    # Llama-3.2-1B: 16 layers x 2 x 8 KV heads x 64 x 2 B; the 8B: 32 x 2 x 8 x 128 x 2 B.
    assert d.kv_bytes_per_token_per_gpu == 16 * 2 * 8 * 64 * 2
    assert cap.num_blocks == cap.kv_cache_bytes_per_gpu // (cap.block_size * (32 * 4096 + 16 * 2048))
    assert d.weights_bytes_per_gpu / GiB == pytest.approx(2.3, abs=0.1)  # 1.24B parameters in bf16


def test_draft_model_must_share_the_vocabulary() -> None:
    spec = Speculative(method=SpecMethod.DRAFT_MODEL, draft_model="Qwen/Qwen3-0.6B", num_speculative_tokens=4)
    with pytest.raises(SizingError, match="vocabulary"):
        _drafter("meta-llama/Llama-3.1-8B", spec)


def test_draft_model_leaves_a_token_per_step() -> None:
    spec = Speculative(method=SpecMethod.DRAFT_MODEL, draft_model=LLAMA_1B, num_speculative_tokens=4)
    with pytest.raises(SizingError) as err:
        _cap("meta-llama/Llama-3.1-8B", spec, max_num_batched_tokens=1, max_num_seqs=1)
    assert err.value.field == "max_num_batched_tokens"


def test_ngram_adds_no_weights_or_kv_layers() -> None:
    spec = Speculative(method=SpecMethod.NGRAM, num_speculative_tokens=3)
    base = _cap("meta-llama/Llama-3.1-8B", None)
    cap = _cap("meta-llama/Llama-3.1-8B", spec)
    assert cap.weights_bytes_per_gpu == base.weights_bytes_per_gpu
    assert cap.kv_bytes_per_token_per_gpu == base.kv_bytes_per_token_per_gpu
    # Only the profile's rejection-sampler pass: 4 B more per logit of the sampler's rows (1024 x 128,256 here).
    rows, vocab = min(cap.max_num_seqs, cap.max_num_batched_tokens), 128_256
    assert cap.activation_peak_bytes - base.activation_peak_bytes == pytest.approx(rows * vocab * 4, rel=0.01)


# ---- slots -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "draft", "lookahead", "new_slots"),
    [
        (SpecMethod.EAGLE3, QWEN3_32B_EAGLE3, 3, 0),
        (SpecMethod.DRAFT_MODEL, "Qwen/Qwen3-0.6B", 3, 1),
        (SpecMethod.NGRAM, None, 0, 0),
    ],
)
def test_lookahead_and_drafting_slots(method: SpecMethod, draft: str | None, lookahead: int, new_slots: int) -> None:
    d = _drafter("Qwen/Qwen3-32B", Speculative(method=method, draft_model=draft, num_speculative_tokens=3))
    assert (d.lookahead_tokens, d.new_slots_for_drafting) == (lookahead, new_slots)
    assert d.extra_slots_per_request == 3 + lookahead  # 1 + K scheduled, plus the lookahead, past computed


def test_unknown_method_names_the_supported_ones() -> None:
    assert parse_method("EAGLE3") is SpecMethod.EAGLE3
    assert parse_method("draft-model") is SpecMethod.DRAFT_MODEL
    with pytest.raises(SizingError, match=r"medusa.*not modelled"):
        parse_method("medusa")


def test_eagle1_head_reads_the_targets_embedding_and_lm_head() -> None:
    """vLLM builds EagleLlamaForCausalLM (llama_eagle.py) from a one-layer llama config: one decoder layer over h
    inputs, fc 2 h -> h replicated, no lm_head (the target's). The 70B EAGLE-3 config stands in for a head."""
    spec = Speculative(method=SpecMethod.EAGLE, draft_model=LLAMA3_70B_EAGLE3, num_speculative_tokens=3)
    d = _drafter("meta-llama/Llama-3.3-70B-Instruct", spec, tp=2)
    h, heads, kv, hd, inter = 8192, 64, 8, 128, 28672
    layer = (h * (heads + 2 * kv) * hd + heads * hd * h + 3 * h * inter) // 2 + 3 * h
    assert d.weights_bytes_per_gpu == 2 * (layer + 2 * h * h)
    assert d.shares == ("embedding", "lm_head")
    assert d.kv_bytes_per_token_per_gpu == 2 * (kv // 2) * hd * 2


@pytest.mark.parametrize(
    ("model", "version"),
    [
        # A vision-language target: the encoder's profiling stays in the peak beside the drafter's.
        ("Qwen/Qwen2.5-VL-7B-Instruct", None),  # at its full context vLLM profiles a video
        # A release whose sampler sorts the vocabulary: its bytes per logit stay the sort path's.
        ("meta-llama/Llama-3.1-8B", "0.11.0"),
    ],
)
def test_a_drafter_adds_to_the_profile_run_and_takes_nothing_from_it(model: str, version: str | None) -> None:
    settings = EngineSettings(version=version)
    plain = capacity(resolve_model(model), gpu_memory_bytes=H100, settings=settings)
    spec = Speculative(method=SpecMethod.NGRAM, num_speculative_tokens=3)
    drafted = capacity(resolve_model(model), gpu_memory_bytes=H100, settings=replace(settings, speculative=spec))
    # N-gram has no drafter forward: what it adds is the rejection sampler's rows of logits, never less than before.
    assert drafted.activation_peak_bytes >= plain.activation_peak_bytes
    assert drafted.activation_peak_bytes - plain.activation_peak_bytes < 1 * GiB


# ---- the catalog's EAGLE heads (the authors' training configs) ---------------------------------------------


def test_catalog_eagle3_head_for_llama31_8b() -> None:
    """The catalog id resolves as a drafter: the head's modules as llama_eagle3.py builds them, at TP 1 and 2."""
    for tp in (1, 2):
        spec = Speculative(
            method=SpecMethod.EAGLE3, draft_model="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", num_speculative_tokens=3
        )
        d = _drafter("meta-llama/Llama-3.1-8B-Instruct", spec, tp=tp)
        want = _eagle3_head_bytes(h=4096, heads=32, kv_heads=8, d=128, inter=14336, draft_vocab=32000, tp=tp)
        assert d.weights_bytes_per_gpu == pytest.approx(want, rel=0.002), tp
        assert d.shares == ("embedding",)


def test_catalog_eagle1_head_reads_the_targets_embedding_and_lm_head() -> None:
    """llama_eagle.py: one decoder layer (the first without its input norm) and fc over [embeds, hidden] (2 h -> h,
    no bias, whole on every rank); no norm or lm_head of its own."""
    spec = Speculative(
        method=SpecMethod.EAGLE, draft_model="yuhuili/EAGLE-LLaMA3-Instruct-8B", num_speculative_tokens=3
    )
    h, heads, kv, d, inter = 4096, 32, 8, 128, 14336
    for tp in (1, 4):
        got = _drafter("meta-llama/Meta-Llama-3-8B", spec, tp=tp)
        layer = (h * (heads + 2 * kv) * d + heads * d * h + 3 * h * inter) // tp + h  # + post_attention_layernorm
        want = 2 * (layer + 2 * h * h)
        assert got.weights_bytes_per_gpu == pytest.approx(want, rel=0.002), tp
        assert set(got.shares) == {"embedding", "lm_head"}


# ---- what the plan says about speed ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "tau", "passes"),
    [
        # The published table's eagle3 K = 3 entry (data/speculative_acceptance.json), read here, not restated.
        (
            Speculative(
                method=SpecMethod.EAGLE3, draft_model="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", num_speculative_tokens=3
            ),
            None,
            "the drafter's 3 passes",
        ),
        (Speculative(method=SpecMethod.NGRAM, num_speculative_tokens=4, acceptance_length=2.5), 2.5, "n-gram lookups"),
    ],
    ids=["eagle3-published", "ngram-given"],
)
def test_the_speed_note_names_the_acceptance_length_the_planner_credits(
    spec: Speculative, tau: float | None, passes: str
) -> None:
    if tau is None:
        tau = float(acceptance_data()["defaults"]["eagle3"]["by_num_speculative_tokens"]["3"])
    assert acceptance(spec, spec.num_speculative_tokens).tokens_per_step == tau  # what planner.py prices
    cap = _cap("meta-llama/Llama-3.1-8B-Instruct", spec)
    [note] = [n for n in cap.notes if n.startswith("speed: ")]
    assert passes in note and f"verifying {spec.num_speculative_tokens + 1} tokens" in note
    assert f"crediting {tau:g} tokens per step" in note
    assert not any("does not price drafting" in n for n in cap.notes)
