"""A pipeline stage deploys the AMI its environment's lock pins, as `kvfleet synth` does: the loader reads the lock
beside each stage's environment file and the stage's stacks are given it (no app context names the file there)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import aws_cdk as cdk
from aws_cdk.assertions import Template

from kvfleet.config.host_lock import PinnedImage, lock_path, lock_text
from kvfleet.config.pipeline import load_pipeline
from kvfleet.infra.pipeline import build_pipeline, stage_stacks
from kvfleet.targets.ec2.config import Ec2Target
from tests.infra.helpers import REPO, make_app, props

PARAMETER = Ec2Target.model_fields["ami_parameter"].default
RELEASE = "Deep Learning Base OSS Nvidia Driver GPU AMI (Amazon Linux 2023) 20260901"  # a release hosts.json lists
EC2_STAGE = "staging"  # the example pipeline's EC2 environment


def pipeline_with_lock(root: Path, image_id: str | None) -> dict[str, list[cdk.Stack]]:
    """The example pipeline and its environment files copied to ``root``, the EC2 stage's file locked to
    ``image_id`` (None: no lock), synthesized; each stage's stacks by environment name."""
    shutil.copy(REPO / "pipeline.yaml", root / "pipeline.yaml")
    shutil.copytree(REPO / "environments", root / "environments")
    env_file = root / "environments" / f"{EC2_STAGE}.yaml"
    lock_path(env_file).unlink(missing_ok=True)
    if image_id is not None:
        pin = PinnedImage(
            parameter=PARAMETER,
            region="us-east-1",
            image_id=image_id,
            image_name=RELEASE,
            parameter_version=41,
            resolved_on="2026-09-10",
        )
        lock_path(env_file).write_text(lock_text([pin]), encoding="utf-8")
    stack = build_pipeline(load_pipeline(root / "pipeline.yaml"), app=make_app(outdir=str(root / "out")))
    return dict(stage_stacks(stack))


def launch_template_image(stacks: list[cdk.Stack]) -> Any:
    [lt] = [lt for s in stacks for lt in props(Template.from_stack(s), "AWS::EC2::LaunchTemplate")]
    return lt["LaunchTemplateData"]["ImageId"]


def test_a_pipeline_stage_deploys_the_pinned_ami(tmp_path: Path) -> None:
    (tmp_path / "locked").mkdir()
    (tmp_path / "unlocked").mkdir()
    locked = pipeline_with_lock(tmp_path / "locked", "ami-0123456789abcdef0")
    assert launch_template_image(locked[EC2_STAGE]) == "ami-0123456789abcdef0"
    # Without the lock the stage resolves the public parameter at each deploy (a CloudFormation SSM parameter).
    unlocked = pipeline_with_lock(tmp_path / "unlocked", None)
    assert "SsmParameterValue" in str(launch_template_image(unlocked[EC2_STAGE]))
