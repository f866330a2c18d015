"""`kvfleet schema`: the JSON Schema of environment files."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvfleet.errors import KvfleetError


def add_parser(sub: Any) -> None:
    sc = sub.add_parser("schema", help="JSON Schema of environment files (committed as environments/schema.json)")
    sc.add_argument("--output", "-o", help="write to this file instead of stdout")
    sc.add_argument("--json", action="store_true", help="JSON Schema is its only format; accepted like every command's")


def run(a: argparse.Namespace) -> int:
    from kvfleet.config.loader import environment_schema_json

    text = environment_schema_json()
    if a.output:
        try:
            with open(a.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as err:
            raise KvfleetError(f"cannot write {a.output}: {err.strerror}", field="output") from None
    else:
        sys.stdout.write(text)
    return 0
