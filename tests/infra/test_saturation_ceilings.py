"""Every example environment scales on a signal its replicas can reach: saturation, not raw KV-cache use.

vLLM's KV-cache use counts only the blocks of running sequences, and max_num_seqs caps those; where the plan sizes
the cache for more sequences than max_num_seqs lets run, KV use tops out below 1. The saturation signal (the larger
of KV use and running over max_num_seqs) reaches 1 whichever limit binds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Template

from kvfleet import contract
from kvfleet.config.loader import load_environment, load_located
from kvfleet.deployments import ResolvedDeployment, resolve_environment
from kvfleet.infra.app import build_app
from kvfleet.tuning import deriver
from tests.infra.helpers import REPO, make_app, props

ENV_FILES = sorted((REPO / "environments").glob("*.yaml"))  # schema.json is not an environment
SATURATION_CEILING = 1.0  # running sequences reach max_num_seqs, so saturation reaches 1 on every plan


def kv_ceiling(r: ResolvedDeployment) -> float:
    """The most of its KV cache a replica's running sequences can hold: max_num_seqs of max_model_len tokens each,
    over the cache's tokens, at most 1."""
    args, cap = r.engine_args, r.candidate.capacity
    assert args.max_num_seqs is not None and args.max_model_len is not None
    return min(1.0, args.max_num_seqs * args.max_model_len / cap.kv_cache_tokens)


def _manifest_objects(t: Template) -> list[dict[str, Any]]:
    """Every object the kubectl provider applies; CloudFormation references read as "<token>"."""
    out: list[dict[str, Any]] = []
    for r in props(t, "Custom::AWSCDK-EKS-KubernetesResource"):
        text = r["Manifest"]
        if isinstance(text, dict):
            [sep, parts] = text["Fn::Join"]
            text = sep.join(p if isinstance(p, str) else "<token>" for p in parts)
        out += json.loads(text)
    return out


def scaling_targets(t: Template) -> list[tuple[str, float]]:
    """(signal name, target) of every scaling policy or KEDA trigger in the template, whichever target made it."""
    found: list[tuple[str, float]] = []
    for p in props(t, "AWS::ApplicationAutoScaling::ScalingPolicy"):  # SageMaker
        cfg = p["TargetTrackingScalingPolicyConfiguration"]
        found.append((cfg["CustomizedMetricSpecification"]["MetricName"], float(cfg["TargetValue"])))
    for p in props(t, "AWS::AutoScaling::ScalingPolicy"):  # EC2 (the scale-in step policy has no target)
        if p["PolicyType"] == "TargetTrackingScaling":
            cfg = p["TargetTrackingConfiguration"]
            found.append((cfg["CustomizedMetricSpecification"]["MetricName"], float(cfg["TargetValue"])))
    by_prometheus = {s.prometheus_name: s.name for s in contract.SIGNALS}
    for obj in _manifest_objects(t):  # EKS
        if obj.get("kind") == "ScaledObject":
            for trig in obj["spec"]["triggers"]:
                query = trig["metadata"]["query"]
                [name] = [n for p, n in by_prometheus.items() if re.search(rf"\b{re.escape(p)}\b", query)]
                found.append((name, float(trig["metadata"]["threshold"])))
    return found


def synthesized(env_file: Path) -> tuple[tuple[ResolvedDeployment, ...], dict[str, Template]]:
    """The resolved deployments as synth deploys them (scaling.derive applied) and their templates."""
    loaded = load_located(env_file)
    env = loaded.environment
    app = build_app(env, app=make_app(), nag=False, traces=loaded.traces)
    stacks = {s.stack_name: Template.from_stack(s) for s in app.node.children if isinstance(s, cdk.Stack)}
    resolved = resolve_environment(env, derive=deriver(loaded.traces))
    return resolved, stacks


def docstring_ceilings(doc: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^\s*- ([\w-]+): (\d\.\d\d) ", doc, re.MULTILINE)}


@pytest.mark.parametrize("env_file", ENV_FILES, ids=[p.stem for p in ENV_FILES])
def test_every_saturation_target_is_below_its_ceiling(env_file: Path) -> None:
    """Each synthesized scaling target on saturation lies below 1, the saturation ceiling; none is on raw KV use.

    The raw KV ceilings (max_num_seqs x max_model_len / KV-cache tokens, per replica, at most 1) of the example
    environments' plans, which the old design targeted 0.75 against:

    - chat-trace: 0.99 (79 x 5,131 / 408,544)
    - dev: 0.20 (16 x 5,120 / 409,056)
    - platform: 0.61 (32 x 9,216 / 481,904)
    - prod: 0.20 (32 x 18,432 / 2,911,472)
    - shared-cluster: 0.61 (32 x 9,216 / 481,904)
    - staging: 0.18 (32 x 10,240 / 1,820,848)

    Only chat-trace's cache could reach 0.75; on the other five the KV policy and the saturation alarm never fired.
    """
    doc = test_every_saturation_target_is_below_its_ceiling.__doc__
    assert doc is not None
    listed = docstring_ceilings(doc)
    assert set(listed) == {p.stem for p in ENV_FILES}  # every example environment, and only those
    resolved, stacks = synthesized(env_file)
    assert resolved
    for r in resolved:
        kv = kv_ceiling(r)
        assert round(kv, 2) == listed[env_file.stem], (r.deployment_id, kv)
        targets = scaling_targets(stacks[r.stack_name])
        on_saturation = [v for name, v in targets if name == contract.REPLICA_SATURATION.name]
        assert on_saturation == [r.scaling.saturation_target], targets
        assert all(0 < v < SATURATION_CEILING for v in on_saturation)
        # Nothing scales on raw KV use any more, whose ceiling may sit under the target.
        assert contract.KV_CACHE_UTILIZATION.name not in {name for name, _ in targets}
        assert {name for name, _ in targets} == {s.name for s in contract.SCALING_SIGNALS}


def test_the_old_kv_target_was_out_of_reach_where_the_cache_holds_more_than_max_num_seqs() -> None:
    """Why the signal changed: on most example plans the default target (0.75) lies above the raw KV ceiling."""
    below = []
    for env_file in ENV_FILES:
        for r in resolve_environment(load_environment(env_file)):
            if kv_ceiling(r) < r.scaling.saturation_target:
                below.append(r.deployment_id)
    assert {"dev-chat", "prod-chat-70b"} <= set(below)
