"""Which AWS Deep Learning Container runs an engine release: the one rule, for the loader and for synth.

The vLLM DLC is released per vLLM version; TensorRT-LLM comes in DJL's image, whose tag names the TensorRT-LLM it
bundles (``0.33.0-tensorrtllm0.21.0-cu128``). ``dlc_release`` picks the release from any table of release -> tag
prefix: synth passes the SageMaker SDK's (kvfleet/infra/images.py), the loader the copy in data/dlc_releases.json
(checked against the SDK in tests/config/test_dlc.py), so a file `kvfleet plan` accepts is one synth accepts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from importlib import resources

from kvfleet import versions
from kvfleet.errors import KvfleetError

# The SageMaker SDK's framework name for each engine's DLC.
FRAMEWORKS: dict[str, str] = {"vllm": "vllm", "trtllm": "djl-tensorrtllm"}


def dlc_release(engine: str, engine_version: str, tag_prefixes: Mapping[str, str]) -> str:
    """The DLC release (a key of ``tag_prefixes``) that runs ``engine`` at ``engine_version``; KvfleetError
    (field engine.version) naming the releases there are when none does."""
    want = versions.normalize(engine_version)
    if engine == "vllm":
        if want not in tag_prefixes:
            raise KvfleetError(
                f"no AWS vLLM container for vLLM {engine_version}; published: "
                f"{', '.join(sorted(tag_prefixes, key=versions.sort_key))} (pin engine.version to one of them, or "
                "build containers/Dockerfile and use image.source kvfleet)",
                field="engine.version",
            )
        return want
    bundled = {
        prefix.split("tensorrtllm")[1].split("-")[0]: release
        for release, prefix in tag_prefixes.items()
        if "tensorrtllm" in prefix
    }
    if want not in bundled:
        raise KvfleetError(
            f"no AWS DJL container bundles TensorRT-LLM {engine_version}; bundled: "
            f"{', '.join(sorted(bundled, key=versions.sort_key))} (pin engine.version to one of them, or build "
            "containers/Dockerfile with --build-arg ENGINE=trtllm and use image.source kvfleet)",
            field="engine.version",
        )
    return bundled[want]


@cache
def published(engine: str) -> dict[str, str]:
    """The DLC releases for ``engine`` as kvfleet's copy of the SDK's table has them: release -> tag prefix."""
    text = resources.files("kvfleet.config").joinpath("data/dlc_releases.json").read_text(encoding="utf-8")
    table: dict[str, dict[str, str]] = json.loads(text)
    return dict(table.get(FRAMEWORKS[engine], {}))
