"""Serving engines: one folder per engine, and the registry every layer reads engine names from.

An engine is a package here (or anywhere importable) exposing ``ADAPTER``, an ``EngineAdapter``: its settings,
server command, metrics, routes and images, its scheduler model (``adapter.scheduler``) and its capacity rules
(``adapter.capacity``, which kvfleet.sizing sizes it by). ``ENGINE_MODULES`` names each package, one line per
engine; a package is imported the first time its engine is asked for. Standard library only (the image carries it).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import ClassVar

from kvfleet.engines.base import KV_CACHE_DTYPES, EngineAdapter, EngineArgs

# Engine name -> the package that holds it.
ENGINE_MODULES: dict[str, str] = {
    "vllm": "kvfleet.engines.vllm",
    "trtllm": "kvfleet.engines.trtllm",
}


def unknown_engine(name: str) -> str:
    """The one-line refusal of a name the registry does not hold."""
    return f"unknown engine {name!r}; known: {', '.join(ENGINE_MODULES)}"


class _Registry(Mapping[str, EngineAdapter]):
    """``ENGINE_MODULES`` as adapters, each package imported on first use (the agent loads only its own engine)."""

    def __getitem__(self, name: str) -> EngineAdapter:
        module = importlib.import_module(ENGINE_MODULES[name])
        found: EngineAdapter = module.ADAPTER
        if found.name != name:
            raise ValueError(f"{ENGINE_MODULES[name]}.ADAPTER is named {found.name!r}, registered as {name!r}")
        return found

    def __contains__(self, name: object) -> bool:
        return name in ENGINE_MODULES

    def __iter__(self) -> Iterator[str]:
        return iter(ENGINE_MODULES)

    def __len__(self) -> int:
        return len(ENGINE_MODULES)


ENGINES: Mapping[str, EngineAdapter] = _Registry()


def adapter(name: str) -> EngineAdapter:
    if name not in ENGINE_MODULES:
        raise ValueError(unknown_engine(name))
    return ENGINES[name]


class EngineName(str):
    """A registered engine's name (a key of ``ENGINE_MODULES``): constructing one from any other string is a
    ValueError. One instance per name, so ``is`` compares as ``==`` does."""

    VLLM: ClassVar[EngineName]
    TRTLLM: ClassVar[EngineName]
    _made: ClassVar[dict[str, EngineName]] = {}

    def __new__(cls, name: str) -> EngineName:
        if name not in ENGINE_MODULES:
            raise ValueError(unknown_engine(name))
        made = cls._made.get(name)
        if made is None:
            made = cls._made[name] = super().__new__(cls, name)
        return made

    def __getnewargs__(self) -> tuple[str]:
        return (str(self),)

    @property
    def value(self) -> str:
        """The name as a plain string."""
        return str(self)


# The built-in engines by name, for defaults and tests.
EngineName.VLLM = EngineName("vllm")
EngineName.TRTLLM = EngineName("trtllm")

__all__ = [
    "ENGINES",
    "ENGINE_MODULES",
    "KV_CACHE_DTYPES",
    "EngineAdapter",
    "EngineArgs",
    "EngineName",
    "adapter",
    "unknown_engine",
]
