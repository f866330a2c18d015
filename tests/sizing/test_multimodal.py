"""Vision-language models: towers counted by module against published totals, and vLLM's multimodal profiling.

Parameter totals are the checkpoints' own (Hugging Face safetensors totals, or ``sum(p.numel())`` of the loaded
model as a public log printed it); the profiling rules are vLLM 0.32.0's (vllm/multimodal/encoder_budget.py,
vllm/v1/core/encoder_cache_manager.py, vllm/model_executor/models/qwen2_vl.py), checked against what vLLM logged.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.engines.base import EngineArgs
from kvfleet.engines.vllm.adapter import Vllm
from kvfleet.errors import ModelConfigError, SizingError
from kvfleet.sizing.capacity import EngineSettings, capacity
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.engines import encoder_profile, qwen_vl_video_tokens
from kvfleet.sizing.hardware import accelerator
from kvfleet.sizing.memory import weight_bytes
from kvfleet.sizing.models import parse_hf_config
from kvfleet.sizing.precision import Part
from kvfleet.sizing.units import GiB

QWEN_VL = "Qwen/Qwen2.5-VL-7B-Instruct"
LLAVA = "llava-hf/llava-1.5-7b-hf"


# --- parameters, part by part ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_id", "published", "source"),
    [
        # https://huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct: numParameters 8292166656 (the Hub's model listing);
        # also "Qwen2_5_VLForConditionalGeneration contains 8.29B parameters" in a verl training log.
        (QWEN_VL, 8_292_166_656, "Hugging Face safetensors total"),
        # LLaMA-Factory LoRA log of llava-hf/llava-1.5-7b-hf (revision 05ae2434): "trainable params: 4194304 ||
        # all params: 7067621376", so the checkpoint holds 7,067,621,376 - 4,194,304.
        (LLAVA, 7_063_427_072, "LLaMA-Factory log, all params less the LoRA adapter"),
        # Hugging Face API safetensors.total of google/gemma-3-4b-it and google/gemma-3-12b-it (4,300,079,472 is
        # also what sum(p.numel()) gives for Gemma3ForConditionalGeneration at revision 093f9f38).
        ("google/gemma-3-4b-it", 4_300_079_472, "Hugging Face safetensors total"),
        ("google/gemma-3-12b-it", 12_187_325_040, "Hugging Face safetensors total"),
        # keras-hub's mistral3 preset mistral_small_3.1_24b_instruct_2503_en: "params": 24011361280 (Pixtral tower,
        # patch merger and projector included).
        ("mistralai/Mistral-Small-3.1-24B-Instruct-2503", 24_011_361_280, "keras-hub preset metadata"),
        # Hugging Face safetensors total of meta-llama/Llama-4-Scout-17B-16E-Instruct (its listing: 108,641,793,536).
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 108_641_793_536, "Hugging Face safetensors total"),
    ],
)
def test_total_parameters_match_the_checkpoint(model_id: str, published: int, source: str) -> None:
    assert catalog_model(model_id).total_params == published, source


def test_qwen25_vl_vision_tower_alone() -> None:
    # A public fine-tuning script froze model.visual of Qwen2.5-VL-7B-Instruct and printed its parameters:
    # "视觉模块 (visual) 总参数: 676550144" (patch embed, 32 blocks, merger).
    assert catalog_model(QWEN_VL).vision_params == 676_550_144


def test_qwen2_vl_tower_follows_its_own_modules() -> None:
    # Qwen2-VL: LayerNorm blocks with an fc1/fc2 MLP of embed_dim x mlp_ratio; its hidden_size is the LM's.
    qwen2_vl = {
        "model_type": "qwen2_vl",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "vision_config": {
            "depth": 32,
            "embed_dim": 1280,
            "mlp_ratio": 4,
            "num_heads": 16,
            "in_chans": 3,
            "hidden_size": 3584,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }
    v = parse_hf_config(qwen2_vl, model_id="qwen2-vl").vision
    assert v is not None
    e = 1280
    block = 2 * 2 * e + (3 * e * e + 3 * e) + (e * e + e) + (e * 4 * e + 4 * e) + (4 * e * e + e)
    merger = 2 * e + (4 * e) ** 2 + 4 * e + 4 * e * 3584 + 3584
    assert v.params == 3 * 2 * 14 * 14 * e + 32 * block + merger
    # The Qwen2-VL paper (arXiv 2409.12191, Table 1) gives its vision encoder as 675M parameters.
    assert v.params == pytest.approx(675e6, rel=0.01)


def test_text_config_of_newer_transformers_parses_alike() -> None:
    # transformers >= 4.52 nests Qwen2.5-VL's language model as text_config (model_type qwen2_5_vl_text), as the
    # 4.57.1 printout of this checkpoint shows; the count must not change.
    flat = catalog_model(QWEN_VL)
    from kvfleet.sizing.catalog import _index

    cfg = dict(_index()[QWEN_VL.lower()].config)
    text = {k: cfg.pop(k) for k in list(cfg) if k not in ("model_type", "vision_config", "architectures")}
    cfg["text_config"] = {**text, "model_type": "qwen2_5_vl_text"}
    nested = parse_hf_config(cfg, model_id="nested")
    assert nested.total_params == flat.total_params
    assert nested.layers == flat.layers


def test_mllama_is_refused_with_the_release_and_alternatives() -> None:
    cfg = {
        "model_type": "mllama",
        "text_config": {"model_type": "mllama_text_model", "num_hidden_layers": 40},
        "vision_config": {"model_type": "mllama_vision_model"},
    }
    with pytest.raises(ModelConfigError) as err:
        parse_hf_config(cfg, model_id="meta-llama/Llama-3.2-11B-Vision-Instruct")
    text = str(err.value)
    assert err.value.field == "model_type"
    assert "24907" in text and "0.11.0" in text and "Qwen2.5-VL" in text


# --- vLLM's multimodal profiling --------------------------------------------------------------------------------


def test_qwen_vl_dummy_video_follows_max_model_len() -> None:
    # qwen2_vl.py get_max_video_tokens: frames whose tokens fit max_model_len, at most 14, two to a temporal patch.
    assert qwen_vl_video_tokens(16384, 8192) == 16384  # never below one temporal patch
    assert qwen_vl_video_tokens(16384, 32768) == 2 * 16384
    assert qwen_vl_video_tokens(16384, 128000) == 7 * 16384  # 14 frames: the cap


def test_encoder_budget_matches_vllm_082_log() -> None:
    # QwenLM/Qwen3-VL issue 1057 (H100 80GB, vLLM 0.8.2, Qwen2.5-VL-7B-Instruct): "Encoder cache will be initialized
    # with a budget of 16384 tokens, and profiled with 1 image items of the maximum feature size." That release
    # profiled images only; limiting video to 0 reproduces the batch under 0.32.0's rule.
    m = catalog_model(QWEN_VL)
    p = encoder_profile(
        m, tp=1, max_model_len=128000, max_num_batched_tokens=8192, max_num_seqs=1024, limits={"video": 0}
    )
    assert p is not None
    assert (p.modality, p.budget_tokens, p.items, p.tokens_per_item) == ("image", 16384, 1, 16384)


def test_small_items_fill_the_budget() -> None:
    # LLaVA-1.5's 576-token images: 8192 // 576 = 14 items share an 8,192-token budget.
    p = encoder_profile(
        catalog_model(LLAVA), tp=1, max_model_len=4096, max_num_batched_tokens=8192, max_num_seqs=1024, limits={}
    )
    assert p is not None
    assert (p.budget_tokens, p.items) == (8192, 14)
    one = encoder_profile(
        catalog_model(LLAVA), tp=1, max_model_len=4096, max_num_batched_tokens=8192, max_num_seqs=4, limits={"image": 2}
    )
    assert one is not None and one.items == 8  # max_num_seqs x images per prompt caps the batch


def test_text_only_drops_the_tower_and_the_profile() -> None:
    m = catalog_model(QWEN_VL)
    base = EngineSettings(max_model_len=32768)
    mm = capacity(m, gpu_memory_bytes=80 * GiB, settings=base)
    text = capacity(
        m, gpu_memory_bytes=80 * GiB, settings=replace(base, limit_mm_per_prompt=(("image", 0), ("video", 0)))
    )
    assert mm.encoder is not None and text.encoder is None
    assert mm.weights_bytes_per_gpu - text.weights_bytes_per_gpu == 676_550_144 * 2
    assert Part.VISION not in dict(text.weights.bytes_by_part)
    assert text.kv_cache_tokens > mm.kv_cache_tokens


def test_data_parallel_encoder_replicates_the_tower() -> None:
    m = catalog_model(QWEN_VL)
    s = EngineSettings(tensor_parallel_size=2, max_model_len=32768, limit_mm_per_prompt=(("video", 0),))
    sharded = capacity(m, gpu_memory_bytes=80 * GiB, settings=s)
    replicated = capacity(m, gpu_memory_bytes=80 * GiB, settings=replace(s, mm_encoder_tp_mode="data"))
    assert dict(replicated.weights.bytes_by_part)[Part.VISION] == 676_550_144 * 2
    assert dict(sharded.weights.bytes_by_part)[Part.VISION] == pytest.approx(676_550_144, rel=0.001)
    assert replicated.encoder is not None and replicated.encoder.data_parallel
    # Gemma 3's SigLIP does not declare supports_encoder_tp_data: vLLM falls back to weights.
    gemma = catalog_model("google/gemma-3-12b-it")
    g = capacity(gemma, gpu_memory_bytes=80 * GiB, settings=replace(s, mm_encoder_tp_mode="data", max_model_len=8192))
    assert g.encoder is not None and not g.encoder.data_parallel
    assert dict(g.weights.bytes_by_part)[Part.VISION] == pytest.approx(gemma.vision_params, rel=0.001)


def test_bad_multimodal_settings_name_the_field() -> None:
    m = catalog_model(QWEN_VL)
    with pytest.raises(SizingError) as err:
        capacity(m, gpu_memory_bytes=80 * GiB, settings=EngineSettings(limit_mm_per_prompt=(("audio", 1),)))
    assert err.value.field == "limit_mm_per_prompt"
    with pytest.raises(SizingError) as err:
        capacity(m, gpu_memory_bytes=80 * GiB, settings=EngineSettings(mm_encoder_tp_mode="pipeline"))
    assert err.value.field == "mm_encoder_tp_mode"


# --- against vLLM start-up logs -----------------------------------------------------------------------------------


def test_qwen25_vl_weights_against_logs() -> None:
    m = catalog_model(QWEN_VL)
    # QwenLM/Qwen3-VL issue 1057, vLLM 0.8.2, one H100: "Model loading took 15.6271 GB" (GiB). Predicted 15.45 (-1.2%).
    one = weight_bytes(m, tp=1, scheme=m.native_scheme).weights_bytes_per_gpu / GiB
    assert one == pytest.approx(15.6271, rel=0.03)
    # vllm issue 15136, vLLM 0.8.0, TP 4 (lm_head shard 38016 x 3584): "Model loading took 3.9972 GB" per rank.
    # Predicted 3.86 (-3.4%); a tower replicated on every rank would be 4.81 (+20%): vLLM shards it.
    four = weight_bytes(m, tp=4, scheme=m.native_scheme)
    assert four.weights_bytes_per_gpu / GiB == pytest.approx(3.9972, rel=0.04)
    replicated = four.weights_bytes_per_gpu - dict(four.bytes_by_part)[Part.VISION] + m.vision_params * 2
    assert replicated / GiB > 3.9972 * 1.15


def test_qwen25_vl_end_to_end_on_h100_vllm_082() -> None:
    # CHECK case (nothing was fitted to it). QwenLM/Qwen3-VL issue 1057: Qwen2.5-VL-7B-Instruct, one H100-SXM-80GB,
    # vLLM 0.8.2 defaults (utilization 0.9, max_model_len 128,000), encoder profiled with 1 image of 16,384 tokens:
    # "GPU KV cache size: 905,648 tokens", "Maximum concurrency for 128,000 tokens per request: 7.08x".
    # kvfleet predicts 967,520 tokens (+6.8%): the log implies 7.3 GiB of activations and runtime where kvfleet
    # counts 4.2 GiB (the vision encoder's 1.7 GiB peak is within the language model's sampler-bound 3.9 GiB), and
    # the weights load 0.18 GiB heavier than counted.
    h100 = accelerator("H100")
    mem = h100.usable_memory_bytes or h100.memory_bytes
    assert mem is not None
    cap = capacity(
        catalog_model(QWEN_VL),
        gpu_memory_bytes=mem,
        settings=EngineSettings(version="0.8.2", gpu_memory_utilization=0.9, limit_mm_per_prompt=(("video", 0),)),
        accelerator_name=h100.name,
    )
    assert cap.max_model_len == 128000
    assert cap.encoder is not None and cap.encoder.items == 1
    assert cap.kv_cache_tokens == pytest.approx(905_648, rel=0.08)
    assert cap.max_concurrency == pytest.approx(7.08, rel=0.08)


# --- the vLLM adapter ---------------------------------------------------------------------------------------------


def test_vllm_flags_and_engine_args_round_trip() -> None:
    args = EngineArgs(limit_mm_per_prompt=(("image", 4), ("video", 0)), mm_encoder_tp_mode="data")
    flags = Vllm().flags(args)
    # vllm/engine/arg_utils.py: --limit-mm-per-prompt takes a JSON object.
    assert flags[flags.index("--limit-mm-per-prompt") + 1] == '{"image": 4, "video": 0}'
    assert flags[flags.index("--mm-encoder-tp-mode") + 1] == "data"
    assert EngineArgs.from_json(args.to_json()) == args
    assert "limit-mm-per-prompt" not in Vllm().settings(EngineArgs())
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        EngineArgs(limit_mm_per_prompt=(("image", -1),))


def test_max_pixels_sizes_the_qwen_vl_dummy_image() -> None:
    # qwen2_vl.py get_image_size_with_most_features: max_pixels // 28^2 merged patches when they factor into a grid
    # at most 200:1; 1280 x 28 x 28 is the max_pixels Qwen's README suggests.
    from kvfleet.sizing.models import qwen_vl_tokens

    assert qwen_vl_tokens(12_845_056, 28) == 16384
    assert qwen_vl_tokens(1280 * 28 * 28, 28) == 1280
    assert qwen_vl_tokens(1021 * 28 * 28, 28) == 1020  # 1021 is prime: 1 x 1021 is too wide, 30 x 34 is not
    p = encoder_profile(
        catalog_model(QWEN_VL),
        tp=1,
        max_model_len=32768,
        max_num_batched_tokens=8192,
        max_num_seqs=1024,
        limits={"video": 0},
        max_pixels=1280 * 28 * 28,
    )
    assert p is not None and (p.tokens_per_item, p.budget_tokens, p.items) == (1280, 8192, 6)
    flags = Vllm().flags(EngineArgs(mm_max_pixels=1280 * 28 * 28))
    assert flags[flags.index("--mm-processor-kwargs") + 1] == '{"max_pixels": 1003520}'


def test_llava_next_largest_image_is_the_largest_pinpoint() -> None:
    # llava-hf/llava-v1.6 pinpoints, worked through vLLM 0.32.0 llava_next.py get_num_image_tokens by hand: the
    # 672 x 672 pinpoint is 2 x 2 tiles of 24 x 24 patches, so 576 base tokens + 48 x 48 + 48 newlines = 2,928; the
    # 1008 x 336 one gives 576 + 72 x 24 + 72 = 2,376.
    from kvfleet.sizing.catalog import _index

    cfg = dict(_index()[LLAVA.lower()].config)
    cfg["model_type"] = "llava_next"
    cfg["image_grid_pinpoints"] = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    m = parse_hf_config(cfg, model_id="llava-next")
    assert m.vision is not None and m.vision.image_tokens == 2928
    assert m.vision_params == catalog_model(LLAVA).vision_params + 4096  # image_newline


# Qwen3-VL-4B-Instruct's config as a Qwen3VLConfig literal (transformers 4.57.0.dev0) in DiffSynth-Studio's
# WanMLLMEncoder; token ids and rope details left out (they size nothing).
QWEN3_VL_4B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "head_dim": 128,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17],
        "depth": 24,
        "hidden_size": 1024,
        "in_channels": 3,
        "intermediate_size": 4096,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2560,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}


def test_qwen3_vl_counts_and_profiles_like_vllm() -> None:
    m = parse_hf_config(QWEN3_VL_4B, model_id="Qwen/Qwen3-VL-4B-Instruct")
    # Loaded Qwen3-VL-4B-Instruct (bfloat16) reports total_parameters: 4437815808 in a public evaluation log.
    assert m.total_params == 4_437_815_808
    v = m.vision
    assert v is not None
    # 16777216 // 32^2 image tokens; the dummy video is two frames of 25165824 // 2 pixels, one temporal patch.
    assert (v.image_tokens, v.video_tokens, v.embeds_per_token) == (16384, 12288, 4)
    p = encoder_profile(m, tp=1, max_model_len=32768, max_num_batched_tokens=8192, max_num_seqs=256, limits={})
    assert p is not None and (p.modality, p.tokens_per_item, p.items) == ("image", 16384, 1)
    # vLLM's Qwen3-VL hands over the merger's output and the three deepstack levels side by side per token.
    assert p.encoder_output_bytes == 16384 * 2560 * 4 * 2
    assert p.buffer_bytes == 3 * 8192 * 2560 * 2  # the deepstack input buffers, one per level
    video = encoder_profile(
        m, tp=1, max_model_len=32768, max_num_batched_tokens=8192, max_num_seqs=256, limits={"image": 0}
    )
    assert video is not None and (video.modality, video.tokens_per_item) == ("video", 12288)
