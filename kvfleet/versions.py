"""Release versions: the one parser every layer uses (engine profiles, metric tables, image tables, config).

Standard library only; the serving image carries it with the engine adapters.
"""

from __future__ import annotations

import re

Version = tuple[int, int, int]

# 0.11, 0.11.0, v0.11.0, 0.11.0rc1, 0.11.0.post1, 1.0.0-cu128: the numeric release comes first.
_RELEASE = re.compile(
    r"^v?(?P<major>[0-9]+)\.(?P<minor>[0-9]+)(?:\.(?P<patch>[0-9]+))?(?P<rest>[.\-+][0-9A-Za-z.\-+]*|[a-z][0-9A-Za-z.\-+]*)?$"
)


def parse_version(text: str) -> Version:
    """(major, minor, patch) of a release string; a missing patch is 0. Raises ValueError on anything else."""
    m = _RELEASE.match(text.strip()) if text.isascii() else None
    if m is None:
        raise ValueError(f"expected a release like 0.11.0, got {text!r}")
    return (int(m["major"]), int(m["minor"]), int(m["patch"] or 0))


def is_version(text: str) -> bool:
    try:
        parse_version(text)
    except ValueError:
        return False
    return True


def normalize(text: str) -> str:
    """``0.11`` -> ``0.11.0``: the form release tables are keyed by."""
    return ".".join(map(str, parse_version(text)))


def sort_key(text: str) -> tuple[int, ...]:
    """Orders release strings numerically; strings that are not releases sort first."""
    try:
        return parse_version(text)
    except ValueError:
        return (-1,)
