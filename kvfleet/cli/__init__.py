"""``kvfleet``: capacity, plans and catalogs, as tables for people or JSON for machines.

One module per command, each with ``add_parser(sub)`` and ``run(args) -> exit code``, registered by one line in
``COMMANDS``. Errors a user can cause print one line on stderr and exit 2. Heavy imports (rich, pydantic, YAML)
happen only in the commands that need them, so ``kvfleet`` starts about as fast as Python does.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from kvfleet.cli.args import EXIT_USAGE, _Parser, printable
from kvfleet.errors import KvfleetError

# The command -> its module, in the order `kvfleet --help` lists them.
COMMANDS: dict[str, str] = {
    "capacity": "kvfleet.cli.capacity",
    "plan": "kvfleet.cli.plan",
    "simulate": "kvfleet.cli.simulate",
    "bench": "kvfleet.cli.bench",
    "synth": "kvfleet.cli.synth",
    "check": "kvfleet.cli.check",
    "diff": "kvfleet.cli.diff",
    "ci-template": "kvfleet.cli.ci_template",
    "workload": "kvfleet.cli.workload",
    "models": "kvfleet.cli.models",
    "instances": "kvfleet.cli.instances",
    "schema": "kvfleet.cli.schema",
    "completion": "kvfleet.cli.completion",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvfleet")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def command_module(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name])


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvfleet", description="Size, plan and deploy LLM serving on AWS.")
    p.add_argument("--version", action="version", version=f"kvfleet {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        command_module(name).add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` is for the tool the command runs (synth: cdk synth), wherever the command's
    # own flags and positionals sit; argparse alone would give it to a positional that already took its value.
    after: list[str] = []
    if "--" in words:
        cut = words.index("--")
        words, after = words[:cut], words[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(words)
    if after and getattr(args, "passthrough_to", None) is None:
        parser.error(f"kvfleet {args.command} takes nothing after --")
    args.passthrough = after
    try:
        code: int = command_module(args.command).run(args)
        return code
    except KvfleetError as err:
        print(f"kvfleet: error: {printable(str(err))}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
