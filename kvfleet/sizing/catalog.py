"""The built-in model catalog (``data/models.json``) and model resolution.

A model reference is a catalog id (``meta-llama/Llama-3.1-8B``), an alias (``llama-3.1-8b``), or a
path to a local config.json or the directory that holds it.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from kvfleet.errors import CatalogError, ModelConfigError
from kvfleet.sizing.models import ModelSpec, load_config_file, parse_hf_config


@dataclass(frozen=True, kw_only=True)
class CatalogEntry:
    model_id: str
    aliases: tuple[str, ...]
    family: str
    source: str
    config: dict[str, Any]


@cache
def catalog_entries() -> tuple[CatalogEntry, ...]:
    text = resources.files("kvfleet.sizing").joinpath("data", "models.json").read_text(encoding="utf-8")
    data = json.loads(text)
    out = []
    for raw in data["models"]:
        out.append(
            CatalogEntry(
                model_id=raw["id"],
                aliases=tuple(raw.get("aliases", ())),
                family=raw.get("family", ""),
                source=raw["source"],
                config=raw["config"],
            )
        )
    return tuple(out)


def _norm(name: str) -> str:
    return name.strip().lower()


@cache
def _index() -> dict[str, CatalogEntry]:
    idx: dict[str, CatalogEntry] = {}
    for e in catalog_entries():
        for key in (e.model_id, e.model_id.split("/")[-1], *e.aliases):
            idx.setdefault(_norm(key), e)
    return idx


@cache
def catalog_model(model_id: str) -> ModelSpec:
    e = _index().get(_norm(model_id))
    if e is None:
        raise CatalogError(f"{model_id!r} is not in the catalog", field="model")
    try:
        return parse_hf_config(e.config, model_id=e.model_id, source=e.source, family=e.family, aliases=e.aliases)
    except ModelConfigError as err:  # a broken catalog entry is a bug, but say which one
        raise CatalogError(f"catalog entry {e.model_id}: {err}") from None


def all_models() -> list[ModelSpec]:
    return [catalog_model(e.model_id) for e in catalog_entries()]


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except (OSError, ValueError):  # a model id too long to be a file name is not a path
        return False


def resolve_model(ref: str) -> ModelSpec:
    """A catalog id or alias, or a path to a config.json / its directory."""
    if not ref.strip():
        raise ModelConfigError("is empty; give a catalog id (kvfleet models) or a path to config.json", field="model")
    if _norm(ref) in _index():
        return catalog_model(ref)
    try:
        p = Path(ref).expanduser()
        if _exists(p) or ref.endswith(".json") or ref.startswith((".", "/", "~")):
            return load_config_file(p)
    except (OSError, ValueError) as err:  # a name too long for a path, a NUL byte, no home directory
        why = getattr(err, "strerror", None) or str(err)
        shown = ref[:80] + ("..." if len(ref) > 80 else "")
        raise ModelConfigError(
            f"cannot read {shown!r} as a path ({why}); give a catalog id (kvfleet models) or a path to config.json",
            field="model",
        ) from None
    names = [e.model_id for e in catalog_entries()]
    near = difflib.get_close_matches(ref, names, n=3, cutoff=0.4)
    near += [n for n in names if _norm(ref.rsplit("/", maxsplit=1)[-1]) in _norm(n) and n not in near][:3]
    hint = f"; did you mean {', '.join(near[:3])}?" if near else ""
    raise ModelConfigError(
        f"unknown model {ref!r}{hint} (kvfleet models lists the catalog; or give a path to a config.json)",
        field="model",
    )
