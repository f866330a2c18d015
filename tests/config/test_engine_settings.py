"""A deployment's engine settings (`engine:` beside name and version): parsed with file:line errors, sized by the
plan, and started with by the engine, so the plan and the engine cannot disagree."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from kvfleet import contract
from kvfleet.config.loader import parse_located
from kvfleet.deployments import ResolvedDeployment, plan_requests, resolve_environment
from kvfleet.engines import EngineArgs, adapter
from kvfleet.errors import ConfigError, KvfleetError
from tests.config.test_schema import problems
from tests.envs import SAGEMAKER_ENV, environment
from tests.sizing.test_hybrid_state import qwen3_next_config

ENGINE = '      version: "0.30.0"\n'


def with_engine(settings: str, text: str = SAGEMAKER_ENV, version: str = "0.30.0") -> str:
    """``text`` with ``settings`` (lines indented under `engine:`) after the engine's version."""
    assert ENGINE in text
    return text.replace(ENGINE, f'      version: "{version}"\n' + settings)


def resolve(text: str) -> ResolvedDeployment:
    [r] = resolve_environment(environment(text))
    return r


def started_with(r: ResolvedDeployment) -> EngineArgs:
    """The settings the serving image reads, as the stacks hand them over."""
    return EngineArgs.from_json(r.container_environment()[contract.ENV_ENGINE_ARGS])


def vllm_flags(r: ResolvedDeployment) -> list[str]:
    return adapter("vllm").flags(started_with(r))  # type: ignore[attr-defined,no-any-return]


def flag(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


# ---- vision-language models -------------------------------------------------------------------------------

# Qwen2.5-VL-7B at its whole context (128,000 tokens): vLLM profiles the encoder with the dummy video, 14 frames
# of its largest image two to a temporal patch, 7 x 16,384 = 114,688 tokens (vllm/model_executor/models/qwen2_vl.py
# get_max_video_tokens, vLLM 0.32.0); one image of 12,845,056 pixels (the processor's max_pixels) is 16,384.
QWEN_VL = (
    SAGEMAKER_ENV.replace("id: meta-llama/Llama-3.1-8B", "id: Qwen/Qwen2.5-VL-7B-Instruct")
    .replace("max_input_tokens: 4096", "max_input_tokens: 120000")
    .replace("max_output_tokens: 1024", "max_output_tokens: 8000")
    .replace("concurrency_per_replica: 16", "concurrency_per_replica: 1")
)
ONE_IMAGE = "      limit_mm_per_prompt: {image: 1, video: 0}\n"


def test_images_only_plans_a_smaller_encoder_budget_and_reaches_the_flags() -> None:
    default = resolve(QWEN_VL)
    images = resolve(with_engine(ONE_IMAGE, QWEN_VL))
    enc, enc1 = default.candidate.capacity.encoder, images.candidate.capacity.encoder
    assert enc is not None and enc1 is not None
    assert (enc.modality, enc.budget_tokens) == ("video", 114_688)
    assert (enc1.modality, enc1.items, enc1.budget_tokens) == ("image", 1, 16_384)
    assert images.candidate.capacity.activation_peak_bytes < default.candidate.capacity.activation_peak_bytes
    assert images.kv_cache_tokens > default.kv_cache_tokens
    # The engine starts with the limit the plan sized, in the image's JSON, the command line and AWS's image.
    args = started_with(images)
    assert args.limit_mm_per_prompt == (("image", 1), ("video", 0))
    assert '--limit-mm-per-prompt \'{"image": 1, "video": 0}\'' in adapter("vllm").describe(args)
    assert flag(vllm_flags(images), "--limit-mm-per-prompt") == '{"image": 1, "video": 0}'
    dlc = adapter("vllm").dlc_environment(args, model="m", max_input_tokens=1, max_output_tokens=1)
    assert json.loads(dlc["SM_VLLM_LIMIT_MM_PER_PROMPT"]) == {"image": 1, "video": 0}
    # Without the setting, vLLM's own default: no flag.
    assert "--limit-mm-per-prompt" not in vllm_flags(default)


def test_text_only_loads_no_vision_tower_and_the_engine_is_told() -> None:
    text_only = resolve(with_engine("      limit_mm_per_prompt: {image: 0, video: 0}\n", QWEN_VL))
    cap = text_only.candidate.capacity
    assert cap.encoder is None
    assert "vision" not in {p.value for p, _ in cap.weights.bytes_by_part}
    assert json.loads(flag(vllm_flags(text_only), "--limit-mm-per-prompt") or "") == {"image": 0, "video": 0}


def test_encoder_mode_and_pixels_travel() -> None:
    r = resolve(with_engine("      mm_encoder_tp_mode: data\n      mm_max_pixels: 1003520\n" + ONE_IMAGE, QWEN_VL))
    enc = r.candidate.capacity.encoder
    assert enc is not None and enc.tokens_per_item == 1003520 // (28 * 28)  # 1,280 tokens: Qwen-VL's 28-pixel unit
    flags = vllm_flags(r)
    assert flag(flags, "--mm-encoder-tp-mode") == "data"
    assert json.loads(flag(flags, "--mm-processor-kwargs") or "") == {"max_pixels": 1003520}
    assert r.candidate.settings.mm_max_pixels == 1003520


# ---- hybrid linear-attention / Mamba models ----------------------------------------------------------------


@pytest.fixture
def hybrid(tmp_path: Path) -> str:
    """A Qwen3-Next-80B-A3B geometry (transformers' Qwen3NextConfig defaults) served from S3, on 8 H100s."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(qwen3_next_config()), encoding="utf-8")
    return (
        SAGEMAKER_ENV.replace("id: meta-llama/Llama-3.1-8B", f"id: {path}\n      s3_uri: s3://models/qwen3-next/")
        .replace("      hf_token_secret: kvfleet/hf-token\n", "")
        .replace("instance_type: ml.g6e.xlarge", "instance_type: ml.p5.48xlarge")
    )


@pytest.mark.parametrize(
    ("version", "setting", "pages", "engine_flag"),
    [
        # vLLM caches prefixes of hybrid models by default from 0.28.0 (mamba_cache_mode align: two state pages).
        ("0.32.0", "", 2, "--enable-prefix-caching"),
        ("0.32.0", "      enable_prefix_caching: false\n", 1, "--no-enable-prefix-caching"),
        ("0.28.0", "", 2, "--enable-prefix-caching"),
        # Earlier releases left it off for them: the plan sizes one page, and the engine is told so rather than
        # started with prefix caching the plan did not size.
        ("0.27.1", "", 1, "--no-enable-prefix-caching"),
        ("0.27.1", "      enable_prefix_caching: true\n", 2, "--enable-prefix-caching"),
    ],
)
def test_a_hybrid_models_prefix_caching_reaches_plan_and_flags(
    hybrid: str, version: str, setting: str, pages: int, engine_flag: str
) -> None:
    r = resolve(with_engine(setting, hybrid, version=version))
    assert r.candidate.capacity.state_pages_per_request == pages
    assert r.candidate.capacity.prefix_caching is (pages == 2)
    flags = vllm_flags(r)
    assert engine_flag in flags
    assert {"--enable-prefix-caching", "--no-enable-prefix-caching"} & set(flags) == {engine_flag}


def test_turning_prefix_caching_off_holds_more_sequences(hybrid: str) -> None:
    on = resolve(with_engine("", hybrid, version="0.32.0")).candidate.capacity
    off = resolve(with_engine("      enable_prefix_caching: false\n", hybrid, version="0.32.0")).candidate.capacity
    assert off.blocks_per_max_len_request == on.blocks_per_max_len_request - 3  # three state groups, one page less
    assert off.max_concurrency > on.max_concurrency


def test_the_ssm_state_dtype_is_sized_and_given(hybrid: str) -> None:
    auto = resolve(with_engine("", hybrid, version="0.32.0"))
    fp32 = resolve(with_engine("      mamba_ssm_cache_dtype: float32\n", hybrid, version="0.32.0"))
    st, st32 = auto.candidate.capacity.kv.state, fp32.candidate.capacity.kv.state
    assert st is not None and st32 is not None and st32.bytes_per_layer > st.bytes_per_layer
    assert flag(vllm_flags(fp32), "--mamba-ssm-cache-dtype") == "float32"
    assert "--mamba-ssm-cache-dtype" not in vllm_flags(auto)
    dlc = adapter("vllm").dlc_environment(started_with(fp32), model="m", max_input_tokens=1, max_output_tokens=1)
    assert dlc["SM_VLLM_MAMBA_SSM_CACHE_DTYPE"] == "float32"


def test_a_dense_model_gets_the_release_default_explicitly() -> None:
    # Llama: prefix caching on in every modelled release; the engine is told so.
    r = resolve(SAGEMAKER_ENV)
    assert r.candidate.capacity.prefix_caching is True and r.engine_args.enable_prefix_caching is True
    off = resolve(with_engine("      enable_prefix_caching: false\n"))
    assert "--no-enable-prefix-caching" in vllm_flags(off)
    # The simulator replays without prefix hits when the engine caches none.
    assert off.engine_args.enable_prefix_caching is False


def test_trtllm_block_reuse_follows_the_setting() -> None:
    text = with_engine("      enable_prefix_caching: false\n").replace("name: vllm", "name: trtllm")
    text = text.replace('version: "0.30.0"', 'version: "1.0.0"')
    r = resolve(text)
    assert adapter("trtllm").settings(r.engine_args)["kv_cache_config"]["enable_block_reuse"] is False


# ---- bad values: one line each, at the key ------------------------------------------------------------------


def lines_of(text: str) -> list[str]:
    return problems(text)


@pytest.mark.parametrize(
    ("setting", "field", "message"),
    [
        ("limit_mm_per_prompt: {image: -1}", "limit_mm_per_prompt.image", "must be at least 0"),
        ("limit_mm_per_prompt: {audio: 1}", "limit_mm_per_prompt.audio", "unknown key"),
        ("limit_mm_per_prompt: 3", "limit_mm_per_prompt", "expected a mapping"),
        ("mm_encoder_tp_mode: replicated", "mm_encoder_tp_mode", "use 'weights' or 'data'"),
        ("mm_max_pixels: 0", "mm_max_pixels", "must be greater than 0"),
        ("mamba_ssm_cache_dtype: fp8", "mamba_ssm_cache_dtype", "use 'auto', 'float32', 'float16' or 'bfloat16'"),
        ("enable_prefix_caching: 1", "enable_prefix_caching", "expected true or false"),
    ],
)
def test_a_bad_value_is_one_line_at_its_key(setting: str, field: str, message: str) -> None:
    from tests.config.test_schema import BASE, line_of

    text = BASE.replace('      version: "0.11.0"\n', f'      version: "0.11.0"\n      {setting}\n')
    [line] = lines_of(text)
    key = setting.split(":", maxsplit=1)[0]
    assert line.startswith(f"envs/test.yaml:{line_of(text, key + ':')}: deployments[0].engine.{field}: {message}")


def test_vllm_settings_on_trtllm_are_refused_at_their_keys() -> None:
    from tests.config.test_schema import BASE, line_of

    text = BASE.replace("name: vllm", "name: trtllm").replace('version: "0.11.0"', 'version: "1.0.0"')
    text = text.replace(
        '      version: "1.0.0"\n',
        '      version: "1.0.0"\n      limit_mm_per_prompt: {image: 1}\n      mamba_ssm_cache_dtype: float32\n',
    )
    lines = lines_of(text)
    assert [line.split(": ")[:2] for line in lines] == [
        [f"envs/test.yaml:{line_of(text, 'limit_mm_per_prompt')}", "deployments[0].engine.limit_mm_per_prompt"],
        [f"envs/test.yaml:{line_of(text, 'mamba_ssm_cache_dtype')}", "deployments[0].engine.mamba_ssm_cache_dtype"],
    ]
    assert all("use engine vllm" in line for line in lines)
    # prefix caching is TensorRT-LLM's block reuse: allowed
    parse_located(
        text.replace(
            "      limit_mm_per_prompt: {image: 1}\n      mamba_ssm_cache_dtype: float32\n",
            "      enable_prefix_caching: false\n",
        ),
        source="t.yaml",
    )


@pytest.mark.parametrize(
    ("setting", "field", "message"),
    [
        ("      limit_mm_per_prompt: {image: 2}\n", "limit_mm_per_prompt", "no vision tower"),
        ("      mm_max_pixels: 1003520\n", "mm_max_pixels", "no vision tower"),
        ("      mamba_ssm_cache_dtype: float32\n", "mamba_ssm_cache_dtype", "no linear-attention / Mamba layers"),
    ],
)
def test_a_setting_the_model_has_nothing_for_names_its_line(setting: str, field: str, message: str) -> None:
    text = with_engine(setting)
    loaded = parse_located(text, source="envs/test.yaml")
    with pytest.raises(KvfleetError) as info:
        plan_requests(loaded.environment)
    err = loaded.problem(info.value)
    assert isinstance(err, ConfigError)
    [line] = err.lines
    where = next(n for n, t in enumerate(text.splitlines(), 1) if t.strip().startswith(field + ":"))
    assert line.startswith(f"envs/test.yaml:{where}: deployments[0].engine.{field}: meta-llama/Llama-3.1-8B")
    assert message in line


def test_the_command_line_for_people_is_pasteable() -> None:
    r = resolve(with_engine(ONE_IMAGE, QWEN_VL))
    words = shlex.split(adapter("vllm").describe(r.engine_args))
    assert words[words.index("--limit-mm-per-prompt") + 1] == '{"image": 1, "video": 0}'
