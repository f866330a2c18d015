"""`kvfleet completion`: a shell completion script for the whole command line, generated from its parser by shtab
(the commands, their flags and choices, and file paths where a command takes a file)."""

from __future__ import annotations

import argparse
from typing import Any

SHELLS = ("bash", "zsh", "tcsh")


def add_parser(sub: Any) -> None:
    c = sub.add_parser(
        "completion",
        help='print a shell completion script: eval "$(kvfleet completion bash)" (or zsh, tcsh)',
    )
    c.add_argument("shell", choices=SHELLS, help="the shell to complete in")


def run(a: argparse.Namespace) -> int:
    import shtab

    from kvfleet.cli import build_parser

    print(shtab.complete(build_parser(), shell=a.shell), end="")
    return 0
