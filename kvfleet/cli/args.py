"""What every `kvfleet` command shares: the exit code of a user's mistake, the one-line parser, argument types."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import Any, NoReturn

EXIT_USAGE = 2


def _console() -> Any:
    from rich.console import Console

    # Pipelines and CI logs are not terminals: give tables room instead of rich's 80 columns.
    return Console(width=None if sys.stdout.isatty() else 160, highlight=False)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        command = " ".join(self.prog.split()[1:])
        see = f"kvfleet {command} --help" if command else "kvfleet --help"
        self.exit(EXIT_USAGE, f"kvfleet: error: {message} (see {see})\n")


def _mm_limits(text: str) -> tuple[tuple[str, int], ...]:
    """vLLM's --limit-mm-per-prompt: a JSON object ({"image": 0}) or image=0,video=0."""
    text = text.strip()
    try:
        raw = json.loads(text) if text.startswith("{") else dict(p.split("=", 1) for p in text.split(",") if p)
    except (ValueError, json.JSONDecodeError):
        raise argparse.ArgumentTypeError(f"expected image=N,video=N or a JSON object, got {text!r}") from None
    if not isinstance(raw, dict) or not raw:
        raise argparse.ArgumentTypeError(f"expected image=N,video=N or a JSON object, got {text!r}")
    out: list[tuple[str, int]] = []
    for k, v in raw.items():
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{k}: expected a whole number of items, got {v!r}") from None
        out.append((str(k).strip(), n))
    return tuple(sorted(out))


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {v}")
    return v


def _int_list(text: str) -> list[int]:
    out = [_positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}")
    return out


def _float_list(text: str) -> list[float]:
    out = [_positive_float(part.strip()) for part in text.split(",") if part.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive numbers, got {text!r}")
    return out


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return v


def _fraction(text: str) -> float:
    v = _positive_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (ANSI escapes among them) and characters a UTF-8 stream
    cannot carry (lone surrogates from undecodable file names) shown as escapes, never raw."""
    return "\n".join(
        line
        if line.isprintable()
        else "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in line)
        for line in text.split("\n")
    )


def progress() -> Callable[..., None]:
    """A status line on stderr for work that takes seconds, shown only on a terminal (logs and pipes get nothing):
    say("what now") replaces the line; say(None) clears it; say("what", keep=True) leaves it as a line of its own
    (before a child process writes to the terminal)."""
    shown = sys.stderr.isatty()

    def say(what: str | None, *, keep: bool = False) -> None:
        if shown:
            text = "\r\033[K" + (f"kvfleet: {what}..." if what else "")
            print(text, end="\n" if keep else "", file=sys.stderr, flush=True)

    return say
