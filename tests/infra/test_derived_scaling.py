"""scaling.derive: synth deploys the thresholds `kvfleet plan` prints, and the file's pins stay as written."""

from __future__ import annotations

import json
import re

import pytest

from kvfleet import contract
from kvfleet.cli import main
from tests.infra.helpers import REPO, props
from tests.infra.test_saturation_ceilings import scaling_targets, synthesized

STAGING = REPO / "environments" / "staging.yaml"


def test_synth_deploys_what_plan_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(STAGING), "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    scaling = row["scaling"]
    assert scaling["derived"] and scaling["feasible"]
    policy = scaling["policy"]
    assert policy["meets_goal"] and policy["ttft_attainment"] >= scaling["goal"]
    # Every setting the file leaves out has a reason; none is marked pinned (staging sets only max_replicas).
    assert set(scaling["reasons"]) == {
        "saturation_target",
        "queue_depth_target",
        "min_replicas",
        "scale_in_after_s",
        "admission_queue",
    }
    assert not any(v["pinned"] for v in scaling["reasons"].values())
    assert all(v["reason"] for v in scaling["reasons"].values())

    [r], stacks = synthesized(STAGING)
    t = stacks[r.stack_name]
    targets = dict(scaling_targets(t))
    assert targets[contract.REPLICA_SATURATION.name] == policy["saturation_target"]
    assert targets[contract.REQUESTS_WAITING.name] == policy["queue_depth_target"]
    [group] = props(t, "AWS::AutoScaling::AutoScalingGroup")
    assert group["MinSize"] == str(policy["min_replicas"])
    assert group["MaxSize"] == "6"  # the file's, not searched
    # The scale-in wait: the simple policy's cooldown and the minutes its alarm must hold (one-minute periods).
    wait = policy["scale_in_after_s"]
    assert wait >= 900
    [scale_in] = [p for p in props(t, "AWS::AutoScaling::ScalingPolicy") if p.get("PolicyType") == "SimpleScaling"]
    assert scale_in["Cooldown"] == str(wait)
    [alarm] = [a for a in props(t, "AWS::CloudWatch::Alarm") if a.get("AlarmDescription", "").startswith("scale in by")]
    assert alarm["EvaluationPeriods"] * 60 == wait
    # The agent's token budget, read back from the user data's environment file: max_num_seqs plus the chosen queue
    # of typical reservations (average prompt + max_output_tokens), as a factor on the KV tokens it is told.
    queue = policy["admission_queue"]
    env = dict(re.findall(r"(KVFLEET_[A-Z_]+)=([^\\\s]+)", json.dumps(t.to_json())))
    budget = float(env[contract.ENV_ADMISSION_FACTOR]) * int(env[contract.ENV_TOKEN_BUDGET])
    w = r.deployment.workload
    assert w.avg_input_tokens is not None
    per_request = w.avg_input_tokens + w.max_output_tokens
    running = r.engine_args.max_num_seqs
    assert queue is not None and running is not None
    assert (running + queue) * per_request <= budget < (running + queue + 1) * per_request


def test_plan_says_what_the_file_values_cost(capsys: pytest.CaptureFixture[str]) -> None:
    """Without scaling.derive, --derive holds every value where the file (or its default) puts it and says, for
    each, what the best value of that setting alone would do."""
    assert main(["plan", str(REPO / "environments" / "prod.yaml"), "--derive"]) == 0
    out = capsys.readouterr().out
    assert "scaling (the file's values; --derive" in out
    assert "min_replicas 2: set in the file" in out
    assert "saturation_target 0.75: the default (the file does not set it)" in out
    assert "replay: TTFT within 3 s for" in out
