"""A deployment's `speculative:` section: parsed, checked against its model once, sized and rendered as the
engine's own settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet.deployments import resolve_environment
from kvfleet.engines import adapter
from kvfleet.errors import KvfleetError
from tests.envs import SAGEMAKER_ENV, environment

NGRAM = SAGEMAKER_ENV + (
    "    speculative:\n      method: ngram\n      num_speculative_tokens: 3\n      acceptance_length: 1.4\n"
)


def test_ngram_reaches_the_engine_flags() -> None:
    [r] = resolve_environment(environment(NGRAM))
    args = r.engine_args
    assert (args.speculative_method, args.num_speculative_tokens) == ("ngram", 3)
    flags = adapter("vllm").flags(args)
    assert json.loads(flags[flags.index("--speculative-config") + 1]) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
    }
    assert r.candidate.capacity.drafter is not None


def test_a_draft_model_costs_cache() -> None:
    [plain] = resolve_environment(environment())
    text = SAGEMAKER_ENV + (
        "    speculative:\n      method: draft_model\n      draft_model: meta-llama/Llama-3.2-1B-Instruct\n"
        "      num_speculative_tokens: 4\n      acceptance_length: 2.2\n"
    )
    [r] = resolve_environment(environment(text))
    assert r.candidate.capacity.kv_cache_tokens < plain.candidate.capacity.kv_cache_tokens
    assert r.engine_args.speculative_model == "meta-llama/Llama-3.2-1B-Instruct"
    # The draft model is downloaded and read too: 1.24B parameters in bf16.
    assert (r.checkpoint_bytes - plain.checkpoint_bytes) / 2**30 == pytest.approx(2.3, abs=0.1)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("      method: eagle3\n      num_speculative_tokens: 3\n", "draft_model: eagle3 needs"),
        ("      method: ngram\n", "num_speculative_tokens: ngram needs it"),
        ("      method: medusa\n      num_speculative_tokens: 3\n", "method"),
    ],
)
def test_incomplete_section_is_one_line(section: str, message: str) -> None:
    with pytest.raises(KvfleetError, match=message) as err:
        environment(SAGEMAKER_ENV + "    speculative:\n" + section)
    assert "\n" not in str(err.value)


def test_mtp_on_a_model_without_mtp_layers_names_the_field() -> None:
    with pytest.raises(KvfleetError, match="ships no MTP layers") as err:
        resolve_environment(environment(SAGEMAKER_ENV + "    speculative:\n      method: mtp\n"))
    assert "speculative.method" in str(err.value)


def test_a_drafter_named_by_a_local_config_cannot_be_deployed() -> None:
    head = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs" / "specforge-qwen3-32b-eagle3"
    text = (
        SAGEMAKER_ENV.replace("meta-llama/Llama-3.1-8B", "Qwen/Qwen3-32B").replace("g6e.xlarge", "g6e.12xlarge")
        + f"    speculative:\n      method: eagle3\n      draft_model: {head}\n      num_speculative_tokens: 3\n"
    )
    with pytest.raises(KvfleetError, match="names no Hugging Face id") as err:
        resolve_environment(environment(text))
    assert "speculative.draft_model" in str(err.value)


@pytest.mark.parametrize(
    ("section", "message", "key"),
    [
        # A step keeps at most K drafts and the bonus token, and at least the bonus token.
        ("      method: ngram\n      num_speculative_tokens: 3\n      acceptance_length: 4.5\n", "exceeds", "accept"),
        (
            "      method: ngram\n      num_speculative_tokens: 3\n      acceptance_length: 0.5\n",
            "at least 1",
            "accept",
        ),
    ],
)
def test_acceptance_length_is_checked_at_the_file(section: str, message: str, key: str) -> None:
    text = SAGEMAKER_ENV + "    speculative:\n" + section
    line = next(i for i, t in enumerate(text.splitlines(), start=1) if t.strip().startswith(key))
    with pytest.raises(KvfleetError, match=message) as err:
        environment(text)
    assert str(err.value).startswith(f"test.yaml:{line}: deployments[0].speculative.acceptance_length: ")


def test_eagle3_without_acceptance_length_is_credited_with_the_published_one() -> None:
    head = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs" / "eagle3-llama3.1-8b"
    base = SAGEMAKER_ENV.replace("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct")
    text = base + f"    speculative:\n      method: eagle3\n      draft_model: {head}\n"
    text += "      num_speculative_tokens: 3\n"
    [r] = resolve_environment(environment(text))
    notes = " ".join(r.candidate.notes)
    assert "speed assumes 2.79 tokens accepted per step (published" in notes
    assert "vllm-project/vllm/issues/20780" in notes


def test_eagle3_with_a_k_nobody_published_is_credited_nothing_and_says_so() -> None:
    head = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs" / "eagle3-llama3.1-8b"
    base = SAGEMAKER_ENV.replace("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct")
    text = base + f"    speculative:\n      method: eagle3\n      draft_model: {head}\n"
    text += "      num_speculative_tokens: 9\n"
    [r] = resolve_environment(environment(text))
    notes = " ".join(r.candidate.notes)
    assert "speed assumes 1 tokens accepted per step (no published acceptance length for eagle3 with 9" in notes
    assert "give speculative.acceptance_length" in notes


@pytest.mark.parametrize(
    "section",
    [
        "      method: ngram\n      num_speculative_tokens: 3\n",
        "      method: draft_model\n      draft_model: meta-llama/Llama-3.2-1B-Instruct\n"
        "      num_speculative_tokens: 4\n",
    ],
)
def test_no_published_acceptance_length_plans_without_a_speed_gain(section: str) -> None:
    # The memory plan stands; the speed counts what drafting costs and credits no accepted draft until one is given.
    [r] = resolve_environment(environment(SAGEMAKER_ENV + "    speculative:\n" + section))
    notes = " ".join(r.candidate.notes)
    assert "speed assumes 1 tokens accepted per step (no published acceptance length" in notes
    assert "(x1.00)" in notes or "(x0." in notes  # never faster than without the drafter
