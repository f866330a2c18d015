"""Which AWS Deep Learning Container runs an engine release: the one rule, for the loader and for synth.

Which container, and how its releases map to the engine's, is the engine adapter's ``dlc`` (kvfleet.engines.base
.AwsContainer): the vLLM DLC is released per vLLM version; TensorRT-LLM comes in DJL's image, whose tag names the
TensorRT-LLM it bundles (``0.33.0-tensorrtllm0.21.0-cu128``). ``dlc_release`` picks the release from any table of
release -> tag prefix: synth passes the SageMaker SDK's (kvfleet/infra/images.py), the loader the copy in
data/dlc_releases.json (checked against the SDK in tests/config/test_dlc.py), so a file `kvfleet plan` accepts is one
synth accepts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from importlib import resources

from kvfleet import versions
from kvfleet.engines import ENGINES
from kvfleet.engines.base import AwsContainer
from kvfleet.errors import KvfleetError


def _container(engine: str) -> AwsContainer:
    """The engine's AWS container (its adapter's ``dlc``); KvfleetError where AWS publishes none."""
    found = ENGINES[engine].dlc
    if found is None:
        raise KvfleetError(
            f"AWS publishes no container for {ENGINES[engine].title}; build containers/Dockerfile with "
            f"--build-arg ENGINE={engine} and use image.source kvfleet",
            field="image.source",
        )
    return found


def dlc_framework(engine: str) -> str:
    """The SageMaker SDK's framework name for the engine's DLC."""
    return _container(engine).framework


def kvfleet_image_on_dlc(engine: str) -> bool:
    """Whether containers/Dockerfile builds the engine's kvfleet image on its DLC by default (then that image's CUDA
    is the DLC's of the same engine release)."""
    found = ENGINES[engine].dlc
    return found is not None and found.kvfleet_image_base


def dlc_release(engine: str, engine_version: str, tag_prefixes: Mapping[str, str]) -> str:
    """The DLC release (a key of ``tag_prefixes``) that runs ``engine`` at ``engine_version``; KvfleetError
    (field engine.version) naming the releases there are when none does."""
    want = versions.normalize(engine_version)
    c, title = _container(engine), ENGINES[engine].title
    if c.bundled_by is None:  # released per engine release, under the engine's version
        if want not in tag_prefixes:
            raise KvfleetError(
                f"no AWS {title} container for {title} {engine_version}; published: "
                f"{', '.join(sorted(tag_prefixes, key=versions.sort_key))} (pin engine.version to one of them, or "
                "build containers/Dockerfile and use image.source kvfleet)",
                field="engine.version",
            )
        return want
    bundled = {
        prefix.split(c.bundle_tag)[1].split("-")[0]: release
        for release, prefix in tag_prefixes.items()
        if c.bundle_tag in prefix
    }
    if want not in bundled:
        raise KvfleetError(
            f"no AWS {c.bundled_by} container bundles {title} {engine_version}; bundled: "
            f"{', '.join(sorted(bundled, key=versions.sort_key))} (pin engine.version to one of them, or build "
            f"containers/Dockerfile with --build-arg ENGINE={engine} and use image.source kvfleet)",
            field="engine.version",
        )
    return bundled[want]


@cache
def published(engine: str) -> dict[str, str]:
    """The DLC releases for ``engine`` as kvfleet's copy of the SDK's table has them: release -> tag prefix."""
    text = resources.files("kvfleet.config").joinpath("data/dlc_releases.json").read_text(encoding="utf-8")
    table: dict[str, dict[str, str]] = json.loads(text)
    return dict(table.get(dlc_framework(engine), {}))
