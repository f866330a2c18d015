"""`kvfleet diff` refuses a release its platform fails in one update: a new instance type for a deployment the
deployed plan scales, on a target whose record says so (SageMaker: "Update endpoints that use auto scaling").
The two deploys it names instead pass, each against the plan deployed before it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet.cli import main
from kvfleet.errors import KvfleetError
from kvfleet.plandiff import check_updates, refused_updates
from kvfleet.targets import TARGETS, type_change_rules

REPO = Path(__file__).resolve().parents[1]
DEV = REPO / "environments" / "dev.yaml"


def row(platform: str, instance_type: str, replica_range: list[int] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"deployment": "chat", "platform": platform, "candidates": [{"instance_type": instance_type}]}
    if replica_range is not None:
        out["replica_range"] = replica_range
    return out


def test_the_rules_are_the_target_records() -> None:
    rules = type_change_rules()
    assert set(rules) == {n for n, t in TARGETS.items() if t.type_change is not None} == {"sagemaker"}
    rule = TARGETS["sagemaker"].type_change
    assert rule is not None and "endpoint-scaling-update" in rule.source
    assert "scaling.min_replicas equal to max_replicas" in rules["sagemaker"]


@pytest.mark.parametrize(
    ("before", "after", "refused"),
    [
        (row("sagemaker", "ml.g6e.xlarge", [1, 2]), row("sagemaker", "ml.g5.xlarge", [1, 2]), True),
        # The new plan's range does not matter: the deployed variant is registered until a deploy removes it.
        (row("sagemaker", "ml.g6e.xlarge", [1, 2]), row("sagemaker", "ml.g5.xlarge", [1, 1]), True),
        # Fixed size deployed: no scalable target, the update passes (the documented procedure's second deploy).
        (row("sagemaker", "ml.g6e.xlarge", [1, 1]), row("sagemaker", "ml.g5.xlarge", [1, 2]), False),
        # Same type: nothing to refuse.
        (row("sagemaker", "ml.g6e.xlarge", [1, 2]), row("sagemaker", "ml.g6e.xlarge", [1, 4]), False),
        # A target without the rule.
        (row("ec2", "g6e.xlarge", [1, 2]), row("ec2", "g5.xlarge", [1, 2]), False),
        # A deployed plan that does not say whether it scales is let through (a fixed size could never move).
        (row("sagemaker", "ml.g6e.xlarge", None), row("sagemaker", "ml.g5.xlarge", [1, 2]), False),
    ],
)
def test_refused_only_for_a_scaling_deployment_changing_type(
    before: dict[str, Any], after: dict[str, Any], refused: bool
) -> None:
    lines = refused_updates([before], [after], rules=type_change_rules(), new_source="env.yaml")
    assert bool(lines) is refused
    if refused:
        [line] = lines
        assert line.startswith("env.yaml: chat: instance type ml.g6e.xlarge -> ml.g5.xlarge fails in one update")
        assert type_change_rules()["sagemaker"] in line


def test_check_updates_raises_one_line() -> None:
    before, after = row("sagemaker", "ml.g6e.xlarge", [1, 2]), row("sagemaker", "ml.g5.xlarge", [1, 2])
    with pytest.raises(KvfleetError) as err:
        check_updates([before], [after], rules=type_change_rules(), old_source="deployed.json", new_source="e.yaml")
    assert "\n" not in str(err.value)


def _plan(capsys: pytest.CaptureFixture[str], env: Path) -> list[dict[str, Any]]:
    assert main(["plan", str(env), "--json", "--top", "1"]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return rows


def test_the_pipeline_diff_refuses_and_the_two_deploys_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """dev (SageMaker, 1-2 replicas) with 4x the context moves to another instance type: the pipeline's
    `kvfleet diff deployed.json env.yaml` fails with the procedure; its two deploys each pass."""
    text = DEV.read_text(encoding="utf-8")
    assert "max_replicas: 2" in text
    longer = text.replace("max_input_tokens: 4096", "max_input_tokens: 16384").replace(
        "concurrency_per_replica: 16", "concurrency_per_replica: 32"
    )
    deployed = tmp_path / "deployed.json"
    rows = _plan(capsys, DEV)
    assert rows[0]["replica_range"] == [1, 2]
    deployed.write_text(json.dumps(rows), encoding="utf-8")
    new = tmp_path / "new.yaml"
    new.write_text(longer, encoding="utf-8")
    assert main(["diff", str(deployed), str(new)]) == 2
    out, err = capsys.readouterr()
    assert "  instance type: ml.g6e.xlarge -> " in out  # the diff is still shown
    [line] = err.strip().splitlines()
    assert f"{new}: chat: instance type ml.g6e.xlarge -> " in line
    assert "scaling.min_replicas equal to max_replicas" in line
    # First deploy: the deployed type pinned and the range closed at its count (max_replicas bounds the plan, so
    # closing it below the count the peak needs would move the type again).
    closed = tmp_path / "closed.yaml"
    pinned = text.replace("min_replicas: 1", "min_replicas: 2").replace(
        "    sizing:\n", "    sizing:\n      instance_type: ml.g6e.xlarge\n"
    )
    assert pinned != text and "instance_type: ml.g6e.xlarge" in pinned
    closed.write_text(pinned, encoding="utf-8")
    assert main(["diff", str(deployed), str(closed)]) == 0
    capsys.readouterr()
    deployed.write_text(json.dumps(_plan(capsys, closed)), encoding="utf-8")
    # Second: the new type with the range back.
    assert main(["diff", str(deployed), str(new)]) == 0
