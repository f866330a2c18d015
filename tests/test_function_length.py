"""The house's size rules, held: no function in the package over 60 lines (from its `def` to its last line) but the
exceptions listed here with their reasons, and no module of the command line over 400 lines. Ruff holds branches,
statements and complexity (pyproject.toml); it has no rule on length in lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvfleet"
MAX_LINES = 60
MAX_CLI_MODULE_LINES = 400

# "path/from/package.py::function" -> why it stays longer. An entry that is no longer needed fails the test too, so
# the list stays true.
EXCEPTIONS: dict[str, str] = {}


def long_functions(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    out[f"{path.relative_to(root.parent).as_posix()}::{node.name}"] = lines
    return out


def test_no_function_is_over_60_lines_but_the_listed_ones() -> None:
    found = long_functions(PACKAGE)
    unlisted = {k: n for k, n in found.items() if k not in EXCEPTIONS}
    assert not unlisted, f"over {MAX_LINES} lines (split it, or list it in EXCEPTIONS with its reason): {unlisted}"
    stale = sorted(set(EXCEPTIONS) - set(found))
    assert not stale, f"listed in EXCEPTIONS but no longer over {MAX_LINES} lines; remove them: {stale}"


def test_the_check_finds_a_long_function(tmp_path: Path) -> None:
    pkg = tmp_path / "kvfleet"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (pkg / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n", encoding="utf-8")
    assert long_functions(pkg) == {"kvfleet/m.py::long": MAX_LINES + 1}


@pytest.mark.parametrize("module", sorted((PACKAGE / "cli").glob("*.py")), ids=lambda p: p.name)
def test_each_command_module_is_under_400_lines(module: Path) -> None:
    lines = len(module.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_CLI_MODULE_LINES, f"{module.name}: {lines} lines; split it"
