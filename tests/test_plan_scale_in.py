"""`kvfleet plan` says what a scale-in cuts where the target kills a removed replica before scaling.drain_budget_s
(the target record's scale_in_drain), in text under the scaling section and in the JSON rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvfleet.cli import main
from kvfleet.cli.plan_scaling import scale_in_cut
from kvfleet.config.loader import environment_path, load_located
from kvfleet.deployments import plan_requests
from kvfleet.sizing.planner import plan
from kvfleet.sizing.step import latency_percentiles
from kvfleet.targets import TARGETS
from tests.envs import REPO, SAGEMAKER_ENV, environment


def _plan(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[list[str], dict[str, object]]:
    f = tmp_path / "env.yaml"
    f.write_text(text, encoding="utf-8")
    assert main(["plan", str(f)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert main(["plan", str(f), "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    return lines, row


def test_plan_says_a_scale_in_cuts_what_runs_past_the_kill(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The base deployment drains for 420 s; its target kills a removed replica 30 s after SIGTERM.
    [dr] = plan_requests(environment())
    kill = TARGETS[dr.deployment.target.platform].scale_in_drain
    assert kill is not None and kill.drain_s(420) < 420
    lines, row = _plan(tmp_path, SAGEMAKER_ENV, capsys)
    [line] = [x for x in lines if x.startswith("  scale-in: ")]
    drain = kill.drain_s(420)
    assert f"cuts generations running longer than {drain} s" in line
    assert f"killed {kill.kill_after_s} s after SIGTERM" in line and "drain_budget_s 420" in line
    assert line.endswith("updates (blue/green) still drain for the full 420 s")
    # It sits in the scaling section, after the thresholds' line.
    assert lines.index(line) == next(i for i, x in enumerate(lines) if x.startswith("scaling")) + 1
    # The generation time is the plan's: TTFT p95 under the planned load, then max_output_tokens at its mean ITL.
    load = plan(dr.request).best.planned_load
    want = latency_percentiles(load).ttft.p95_s + 1024 * load.itl_s
    assert math.isfinite(want) and want > drain  # 1,024 tokens at the plan's ITL outlast the 25 s
    cut = row["scaling"]["scale_in"]  # type: ignore[index]
    assert cut["generation_s"] == round(want, 1)
    assert f"takes about {want:.0f} s under the planned load" in line and "a scale-in cuts it" in line
    assert {k: cut[k] for k in ("drain_s", "kill_after_s", "drain_budget_s", "max_output_tokens")} == {
        "drain_s": drain,
        "kill_after_s": kill.kill_after_s,
        "drain_budget_s": 420,
        "max_output_tokens": 1024,
    }
    assert cut["source"] == kill.source and line in row["scaling"]["lines"]  # type: ignore[index]


def test_short_generations_are_said_to_end_within_the_drain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = SAGEMAKER_ENV.replace("max_output_tokens: 1024", "max_output_tokens: 64")
    lines, row = _plan(tmp_path, text, capsys)
    [line] = [x for x in lines if x.startswith("  scale-in: ")]
    assert "(TTFT p95, then each token at the mean ITL: within that)" in line
    assert row["scaling"]["scale_in"]["generation_s"] < 25  # type: ignore[index]


def test_no_line_where_the_budget_is_the_drain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines, row = _plan(tmp_path, SAGEMAKER_ENV.replace("drain_budget_s: 420", "drain_budget_s: 20"), capsys)
    assert not [x for x in lines if "scale-in: " in x]
    assert "scale_in" not in row["scaling"]  # type: ignore[operator]


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "environments").glob("*.yaml")))
def test_a_target_without_a_scale_in_kill_gets_no_line(name: str) -> None:
    # Read from the record, never by the target's name: a target whose record has no kill says nothing.
    for dr in plan_requests(load_located(environment_path(name)).environment):
        if TARGETS[dr.deployment.target.platform].scale_in_drain is None:
            assert scale_in_cut(dr) is None
