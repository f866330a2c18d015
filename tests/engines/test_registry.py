"""The engine registry: one line per engine, each package imported when its engine is first asked for, and what
every engine's folder must hold consistent with itself."""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest

from kvfleet.engines import ENGINE_MODULES, ENGINES, EngineArgs, EngineName
from kvfleet.engines.vocabulary import SpecMethod
from kvfleet.versions import parse_version


def test_an_engine_package_loads_only_when_asked_for() -> None:
    # The agent in an image serves one engine: it should not import the others' folders.
    code = (
        "import sys\n"
        "from kvfleet.engines import ENGINES\n"
        "assert 'kvfleet.engines.vllm' not in sys.modules and 'kvfleet.engines.trtllm' not in sys.modules\n"
        "assert ENGINES['vllm'].name == 'vllm' and list(ENGINES) == ['vllm', 'trtllm']\n"
        "assert 'kvfleet.engines.trtllm' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", sorted(ENGINE_MODULES))
def test_each_engines_capacity_rules_are_its_own(name: str) -> None:
    engine = ENGINES[name]
    capacity = engine.capacity
    assert all(p.engine == name for p in capacity.profiles)
    assert [p.since for p in capacity.profiles] == sorted(p.since for p in capacity.profiles)
    assert capacity.profiles[0].since <= parse_version(capacity.default_version)
    assert capacity.rope_rules and capacity.batch_defaults and capacity.quantization["releases"]
    assert engine.speculative_methods <= {m.value for m in SpecMethod}
    assert EngineName(name) is getattr(EngineName, name.upper())


@pytest.mark.parametrize("name", sorted(ENGINE_MODULES))
def test_an_engine_refuses_the_settings_it_says_it_refuses(name: str) -> None:
    engine = ENGINES[name]
    values = {
        "enforce_eager": True,
        "kv_cache_memory_bytes": 1 << 30,
        "served_model_name": "chat",
        "hf_overrides": '{"max_position_embeddings": 65536}',
        "limit_mm_per_prompt": (("image", 0),),
        "mm_encoder_tp_mode": "data",
        "mm_max_pixels": 1003520,
        "mamba_cache_dtype": "float32",
        "mamba_ssm_cache_dtype": "float32",
        "data_parallel_size": 2,
    }
    for setting, value in values.items():
        args = EngineArgs(**{setting: value})  # type: ignore[arg-type]
        if setting in engine.refused_settings:
            with pytest.raises(ValueError):
                engine.settings(args)
        else:
            engine.settings(args)


def test_a_speculative_method_outside_the_engines_list_is_refused_by_its_adapter() -> None:
    trtllm = ENGINES["trtllm"]
    for method in SpecMethod:
        draft = "yuhuili/EAGLE-LLaMA3-Instruct-8B" if method.value in ("eagle", "eagle3", "draft_model") else None
        args = EngineArgs(speculative_method=method.value, speculative_model=draft, num_speculative_tokens=3)
        if method.value in trtllm.speculative_methods:
            trtllm.settings(args)
        else:
            with pytest.raises(ValueError, match="speculative_method"):
                trtllm.settings(args)


def test_the_config_schema_spells_the_engines_vocabulary() -> None:
    # pydantic needs literal types in the schema; they are the vocabulary's words, in its order.
    from kvfleet.config.schema import EngineRef, SpeculativeConfig
    from kvfleet.engines.vocabulary import MM_ENCODER_TP_MODES

    encoder = EngineRef.model_fields["mm_encoder_tp_mode"].annotation
    assert typing.get_args(typing.get_args(encoder)[0]) == MM_ENCODER_TP_MODES
    method = SpeculativeConfig.model_fields["method"].annotation
    assert typing.get_args(method) == tuple(m.value for m in SpecMethod)
