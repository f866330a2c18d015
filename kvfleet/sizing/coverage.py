"""Which engine releases the capacity model is held to a public start-up log of (data/checked_releases.json, written
by tools/accuracy_ledger.py from tests/sizing/data/engine_logs.json), so a sizing of another release says that it
rests on the release's source alone."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources


@cache
def checked_releases() -> dict[str, dict[str, int]]:
    text = resources.files("kvfleet.sizing").joinpath("data", "checked_releases.json").read_text(encoding="utf-8")
    releases: dict[str, dict[str, int]] = json.loads(text)["releases"]
    return releases


def unchecked_note(engine: str, version: str) -> str | None:
    """A note where no public start-up log of ``engine`` ``version`` is checked; None where one is."""
    checked = checked_releases().get(engine, {})
    if version in checked:
        return None
    known = ", ".join(checked) or "none"
    return (
        f"no public start-up log of {engine} {version} is checked: its memory model rests on the release's source "
        f"(releases with checked logs: {known}; docs/accuracy.md)"
    )
