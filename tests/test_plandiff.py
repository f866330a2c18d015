"""`kvfleet diff`: what a release changes in the plan, for an approver to read beside the template diff."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kvfleet.cli import main
from kvfleet.plandiff import diff_plans

REPO = Path(__file__).resolve().parents[1]
DEV = REPO / "environments" / "dev.yaml"


def _plan(capsys: pytest.CaptureFixture[str], env: Path) -> list[dict[str, object]]:
    assert main(["plan", str(env), "--json", "--top", "1"]) == 0
    rows: list[dict[str, object]] = json.loads(capsys.readouterr().out)
    return rows


def test_a_longer_context_moves_the_instance_and_the_price(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """dev with 4x the context and twice the sequences: the plan's instance, cache, flags and price move, and each
    change is a line under the deployment with the before and after."""
    longer = tmp_path / "dev.yaml"
    longer.write_text(
        DEV.read_text(encoding="utf-8")
        .replace("max_input_tokens: 4096", "max_input_tokens: 16384")
        .replace("concurrency_per_replica: 16", "concurrency_per_replica: 32"),
        encoding="utf-8",
    )
    before, after = _plan(capsys, DEV), _plan(capsys, longer)
    [change] = diff_plans(before, after)
    assert change.deployment == "chat" and change.status == "changed"
    got = {what: (b, a) for what, b, a in change.lines}
    assert got["--max-model-len"] == ("5,120", "17,408")
    assert got["--max-num-seqs"] == ("16", "32")
    assert "fleet $/h" in got and got["fleet $/h"][1].endswith("%)")
    # The CLI, on the two files: the same lines, then the refusal: dev scales on SageMaker, whose update fails on a
    # new instance type (tests/test_plandiff_type_change.py).
    assert main(["diff", str(DEV), str(longer), "--exit-code"]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("chat: changed\n") and "  --max-model-len: 5,120 -> 17,408" in out
    assert "fails in one update" in err
    saved = tmp_path / "deployed.json"
    saved.write_text(json.dumps(before), encoding="utf-8")
    assert main(["diff", str(saved), str(longer), "--markdown"]) == 2
    md = capsys.readouterr().out
    assert "| --max-model-len | 5,120 | 17,408 |" in md and md.startswith("### Plan changes:")
    assert main(["diff", str(saved), str(longer), "--json"]) == 2
    [doc] = json.loads(capsys.readouterr().out)
    assert doc["deployment"] == "chat" and doc["status"] == "changed"
    assert {"what": "--max-model-len", "before": "5,120", "after": "17,408"} in doc["changes"]
    assert main(["diff", str(saved), str(longer), "--json", "--markdown"]) == 2
    assert "give one" in capsys.readouterr().err


def test_the_same_plan_is_unchanged_and_added_and_removed_deployments_say_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = _plan(capsys, DEV)
    assert [c.status for c in diff_plans(rows, rows)] == ["unchanged"]
    renamed = [{**rows[0], "deployment": "chat-2"}]
    changes = diff_plans(rows, renamed)
    assert [(c.deployment, c.status) for c in changes] == [("chat-2", "added"), ("chat", "removed")]
    assert changes[0].lines[0][2].endswith("/h")


def test_a_file_that_is_not_a_plan_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"not": "a plan"}', encoding="utf-8")
    assert main(["diff", str(bad), str(DEV)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "not the output of kvfleet plan --json" in line


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_make_diff_plans_the_committed_file_beside_the_working_one() -> None:
    """`make diff ENV=dev`: the file at HEAD against the working tree's (the same here: unchanged), and no
    temporary file left behind."""
    r = subprocess.run(
        ["make", "-s", "diff", "ENV=dev"], check=False, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    if r.returncode != 0 and "not a git repository" in r.stderr:
        pytest.skip("not a git checkout")
    assert r.returncode == 0, r.stderr
    assert "chat: " in r.stdout
    assert not list((REPO / "environments").glob(".base-*"))
