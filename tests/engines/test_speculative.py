"""Speculative decoding as each engine is told it.

vLLM 0.32.0: --speculative-config takes SpeculativeConfig's fields (vllm/config/speculative.py: ``method``,
``model``, ``num_speculative_tokens``; mtp reads the target's own layers, so no model). TensorRT-LLM: the
LLM-API ``speculative_config`` with ``decoding_type`` (docs/source/features/speculative-decoding.md: "The
PyTorch backend supports only Eagle3. decoding_type: Eagle is accepted as a backward-compatible alias";
"speculative_model_dir can also be used as an alias"; MTP's "num_nextn_predict_layers ... must match
max_draft_len").
"""

from __future__ import annotations

import json

import pytest

from kvfleet.engines.base import EngineArgs
from kvfleet.engines.trtllm.adapter import TensorRtLlm
from kvfleet.engines.vllm.adapter import Vllm

EAGLE3 = EngineArgs(
    speculative_method="eagle3", speculative_model="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", num_speculative_tokens=3
)


def test_vllm_speculative_config_flag() -> None:
    flags = Vllm().flags(EAGLE3)
    value = flags[flags.index("--speculative-config") + 1]
    assert json.loads(value) == {
        "method": "eagle3",
        "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "num_speculative_tokens": 3,
    }


def test_vllm_mtp_names_no_model_and_may_leave_the_count() -> None:
    flags = Vllm().flags(EngineArgs(speculative_method="mtp"))
    assert json.loads(flags[flags.index("--speculative-config") + 1]) == {"method": "mtp"}


def test_vllm_dlc_variable_carries_the_json() -> None:
    env = Vllm().dlc_environment(EAGLE3, model="m", max_input_tokens=1, max_output_tokens=1)
    assert json.loads(env["SM_VLLM_SPECULATIVE_CONFIG"])["method"] == "eagle3"


def test_trtllm_speculative_config() -> None:
    opts = TensorRtLlm().settings(EAGLE3)
    assert opts["speculative_config"] == {
        "decoding_type": "Eagle",
        "max_draft_len": 3,
        "speculative_model_dir": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "eagle3_one_model": True,
    }
    mtp = TensorRtLlm().settings(EngineArgs(speculative_method="mtp", num_speculative_tokens=1))
    assert mtp["speculative_config"] == {"decoding_type": "MTP", "max_draft_len": 1, "num_nextn_predict_layers": 1}


def test_trtllm_refuses_eagle1_and_djl() -> None:
    with pytest.raises(ValueError, match="no eagle"):
        TensorRtLlm().settings(EngineArgs(speculative_method="eagle", speculative_model="h", num_speculative_tokens=3))
    with pytest.raises(ValueError, match="DJL"):
        TensorRtLlm().dlc_environment(EAGLE3, model="m", max_input_tokens=1, max_output_tokens=1)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"speculative_method": "medusa", "num_speculative_tokens": 2}, "must be one of"),
        ({"speculative_method": "eagle3", "num_speculative_tokens": 2}, "needs a draft checkpoint"),
        ({"speculative_method": "mtp", "speculative_model": "x"}, "takes no draft checkpoint"),
        ({"speculative_method": "ngram"}, "num_speculative_tokens: ngram needs it"),
        ({"num_speculative_tokens": 2}, "speculative_method: must be set"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
    ],
)
def test_engine_args_refuse_incomplete_speculation(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kw)  # type: ignore[arg-type]


def test_json_round_trip() -> None:
    assert EngineArgs.from_json(EAGLE3.to_json()) == EAGLE3
