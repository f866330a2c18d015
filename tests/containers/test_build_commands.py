"""Every `docker build` of the serving image the project shows people (the README, docs/, the Dockerfile's own
header) passes the build arguments the Dockerfile declares, the CONTRACT_VERSION its build check accepts
(contract.py's), and a tag the stacks accept: written by hand, they are held to contract.py here. What `make image`
and the pipeline run is generated (kvfleet/infra/image_build.py, tests/infra/test_images.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvfleet import contract

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "containers" / "Dockerfile"


def build_commands(text: str) -> list[list[str]]:
    """The `docker build` commands in a text (a Markdown block or comment lines), continuations joined."""
    lines = [re.sub(r"^\s*#\s?", "", line) for line in text.splitlines()]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [shlex.split(m) for m in re.findall(r"docker build [^\n]*", joined)]


def _sources() -> list[Path]:
    return [REPO / "README.md", DOCKERFILE, *sorted((REPO / "docs").glob("*.md"))]


def _build_args(cmd: list[str]) -> dict[str, str]:
    return dict(cmd[i + 1].split("=", 1) for i, a in enumerate(cmd) if a == "--build-arg")


def problems(cmd: list[str], declared: set[str]) -> list[str]:
    found = []
    args = _build_args(cmd)
    if args.get("CONTRACT_VERSION") != str(contract.CONTRACT_VERSION):
        found.append(f"CONTRACT_VERSION={args.get('CONTRACT_VERSION')}: contract.py is {contract.CONTRACT_VERSION}")
    found += [f"--build-arg {k}: the Dockerfile declares no such ARG" for k in sorted(set(args) - declared)]
    tag = cmd[cmd.index("-t") + 1].rsplit(":", 1)[1] if "-t" in cmd else ""
    parsed = contract.parse_image_tag(tag)
    if parsed is None or parsed[1] != contract.CONTRACT_VERSION:
        found.append(f"-t ...:{tag}: not a tag of contract {contract.CONTRACT_VERSION} (contract.image_tag)")
    return found


def test_every_shown_build_command_speaks_this_contract() -> None:
    declared = set(re.findall(r"^ARG (\w+)", DOCKERFILE.read_text(), re.M))
    seen = 0
    for path in _sources():
        for cmd in build_commands(path.read_text(encoding="utf-8")):
            assert not problems(cmd, declared), (path.name, shlex.join(cmd), problems(cmd, declared))
            seen += 1
    assert seen >= 2  # the Dockerfile's header shows two, and the docs show how to build


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        ("docker build -f containers/Dockerfile --build-arg CONTRACT_VERSION=2 -t r:0.30.0-kvfleet2 .", "CONTRACT"),
        ("docker build --build-arg CONTRACT_VERSION={v} --build-arg ENGIN=vllm -t r:0.30.0-kvfleet{v} .", "ENGIN"),
        ("docker build --build-arg CONTRACT_VERSION={v} -t r:latest .", "latest"),
    ],
)
def test_the_check_finds_an_old_or_wrong_command(command: str, problem: str) -> None:
    declared = set(re.findall(r"^ARG (\w+)", DOCKERFILE.read_text(), re.M))
    [cmd] = build_commands(f"# {command.format(v=contract.CONTRACT_VERSION)}")
    assert any(problem in p for p in problems(cmd, declared))
