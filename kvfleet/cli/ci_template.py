"""`kvfleet ci-template`: pipeline.yaml as a GitHub Actions workflow."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvfleet.errors import KvfleetError


def add_parser(sub: Any) -> None:
    ct = sub.add_parser(
        "ci-template",
        help="a GitHub Actions workflow for the pipeline file's stages: tests and plan diffs on pull requests, "
        "deploys in order through GitHub environments with OIDC roles on a push",
    )
    ct.add_argument("pipeline", nargs="?", default="pipeline.yaml", help="the pipeline file (default pipeline.yaml)")
    ct.add_argument("-o", "--output", help="write it here (e.g. .github/workflows/release.yml) instead of stdout")
    ct.add_argument("--json", action="store_true", help="the workflow as JSON (the same document; YAML is the default)")


def run(a: argparse.Namespace) -> int:
    from pathlib import Path

    from kvfleet.citemplate import render, workflow
    from kvfleet.config.pipeline import load_pipeline

    loaded = load_pipeline(a.pipeline)
    text = json.dumps(workflow(loaded), indent=2) + "\n" if a.json else render(loaded)
    if a.output is None:
        print(text, end="")
        return 0
    try:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(text, encoding="utf-8")
    except OSError as err:
        raise KvfleetError(f"cannot write {a.output}: {err.strerror}", field="output") from None
    return 0
