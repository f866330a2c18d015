"""A pipeline deploys what `make synth` deploys: an environment's stacks added to a ``cdk.Stage`` (as a CDK
Pipelines stage holds them) keep their stack names and synthesize to the same templates as in the app, but for
what CDK derives from the construct path, which gains the stage's id: the Name tags, the names CDK generates
for the scaling policies, and the logical ids of security-group rules named after their peer. A deployment that
moves from `cdk deploy` to a pipeline therefore keeps its stacks, and CloudFormation replaces those rules and
policies once (the endpoint, the fleet and the cluster stay)."""

from __future__ import annotations

import json
import re
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Template

from kvfleet.config.loader import load_located
from kvfleet.infra.app import add_environment, build_app
from tests.infra.helpers import REPO, make_app


def _without_stage(value: object, stage: str) -> str:
    """A resource's properties as text with the stage's id taken out of construct paths (``Deploy-dev/``) and out
    of the names CDK generates from them (``Deploydev...`` and their 8-hex hash suffix)."""
    text = json.dumps(value, sort_keys=True)
    if stage:
        text = text.replace(f"{stage}/", "").replace(stage.replace("-", ""), "")
    return re.sub(r"([A-Za-z])[0-9A-F]{8}\"", r'\1"', text)


@pytest.mark.parametrize("name", ["dev", "staging"])
def test_a_stage_holds_the_same_stacks_as_the_app(name: str) -> None:
    loaded = load_located(REPO / "environments" / f"{name}.yaml")
    app = build_app(loaded.environment, app=make_app(), nag=False, traces=loaded.traces)
    direct = {s.stack_name: Template.from_stack(s).to_json() for s in app.node.children if isinstance(s, cdk.Stack)}
    stage_id = f"Deploy-{name}"
    stage = cdk.Stage(make_app(), stage_id)
    stacks = add_environment(stage, loaded.environment, traces=loaded.traces)
    staged = {s.stack_name: Template.from_stack(s).to_json() for s in stacks}
    # The same stack names: a pipeline updates the stacks `cdk deploy` made, never a second set beside them.
    assert set(staged) == set(direct) and len(direct) >= 2  # the alerts stack and a deployment's
    for stack_name, template in direct.items():
        mine: dict[str, Any] = template["Resources"]
        theirs: dict[str, Any] = staged[stack_name]["Resources"]
        # Resource for resource: the same types, in the same number...
        assert sorted(r["Type"] for r in theirs.values()) == sorted(r["Type"] for r in mine.values()), stack_name
        # ...and under the same logical id, the same properties but for the path-derived names.
        common = set(mine) & set(theirs)
        assert len(common) >= len(mine) - 4, sorted(set(mine) - common)  # the security-group rules named by peer
        for lid in common:
            assert _without_stage(theirs[lid], stage_id) == _without_stage(mine[lid], ""), (stack_name, lid)
