"""The documentation: docs/environment-reference.md is what tools/env_reference.py writes from the schema today, every
relative link in README.md and docs/*.md reaches a file (and, into a Markdown file, a heading), and the README stays
short enough to read in one sitting."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]
README_MAX_LINES = 300


def _tool(name: str) -> ModuleType:
    """A script of tools/ as a module: they run as files, not as part of the package."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the tool look their module up by name
    spec.loader.exec_module(module)
    return module


def test_the_environment_reference_is_current() -> None:
    tool = _tool("env_reference")
    assert (REPO / "docs" / "environment-reference.md").read_text(encoding="utf-8") == tool.render(), (
        "docs/environment-reference.md is stale: run .venv/bin/python tools/env_reference.py"
    )


def test_the_environment_reference_names_every_field() -> None:
    tool = _tool("env_reference")
    text = (REPO / "docs" / "environment-reference.md").read_text(encoding="utf-8")
    schema = tool.environment_schema()
    for name, definition in [("(top level)", schema), *schema["$defs"].items()]:
        for field in definition.get("properties", {}):
            assert f"- `{field}`:" in text, f"{name}.{field} is missing from docs/environment-reference.md"


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans removed."""
    lines, fence = [], ""
    for line in text.splitlines():
        stripped = line.lstrip()
        if fence:
            if stripped.startswith(fence):
                fence = ""
            continue
        if m := re.match(r"(```+|~~~+)", stripped):
            fence = m.group(1)
            continue
        lines.append(re.sub(r"(`+).+?\1", "", line))
    return lines


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    lines, fence = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():  # headings keep their code spans' text
        stripped = line.lstrip()
        if fence:
            fence = "" if stripped.startswith(fence) else fence
            continue
        if m := re.match(r"(```+|~~~+)", stripped):
            fence = m.group(1)
            continue
        lines.append(line)
    for line in lines:
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = _anchor(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def _links(path: Path) -> list[str]:
    targets = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        targets += re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line)
    return targets


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_reach_a_file_and_a_heading(page: Path) -> None:
    problems = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        where = f"{page.relative_to(REPO)}: ({target})"
        if not dest.exists():
            problems.append(f"{where}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            problems.append(f"{where}: no heading with anchor #{fragment} in {dest.relative_to(REPO)}")
    assert not problems, "\n".join(problems)


def test_every_guide_is_reachable_from_the_readme() -> None:
    readme_links = {t.partition("#")[0] for t in _links(REPO / "README.md")}
    missing = [p.name for p in DOCS if f"docs/{p.name}" not in readme_links]
    assert not missing, f"README.md links no page of docs/ named {missing}"


def test_the_readme_reads_in_one_sitting() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move reference material into docs/"
