"""Helpers for the CDK tests: build an app from environment text, with the project's feature flags."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

import aws_cdk as cdk
from aws_cdk.assertions import Template

from stacks.app import build_app
from stacks.config import Environment, parse_environment

REPO = Path(__file__).resolve().parents[2]
FEATURE_FLAGS = json.loads((REPO / "cdk.json").read_text(encoding="utf-8"))["context"]

# One SageMaker deployment; tests replace parts of it. Llama-3.1-8B on an L40S instance (local NVMe).
SAGEMAKER_ENV = """\
name: test
region: us-east-1
deployments:
  - name: chat
    model:
      id: meta-llama/Llama-3.1-8B
      hf_token_secret: kvfleet/hf-token
    engine:
      name: vllm
      version: "0.30.0"
    workload:
      max_input_tokens: 4096
      max_output_tokens: 1024
      concurrency_per_replica: 16
    target:
      platform: sagemaker
    scaling:
      min_replicas: 1
      max_replicas: 4
      drain_budget_s: 420
    sizing:
      instance_type: ml.g6e.xlarge
"""


def make_app(*, outdir: str | None = None) -> cdk.App:
    # Built-in CloudFormation validation is most of synth time; make synth runs it, unit tests need not.
    return cdk.App(context=FEATURE_FLAGS, outdir=outdir, builtin_cloud_formation_validation=False)


def environment(text: str = SAGEMAKER_ENV) -> Environment:
    return parse_environment(text, source="test.yaml")


def synth(text: str = SAGEMAKER_ENV, *, nag: bool = False) -> dict[str, Template]:
    app = build_app(environment(text), app=make_app(), nag=nag)
    stacks = [c for c in app.node.children if isinstance(c, cdk.Stack)]
    return {s.stack_name: Template.from_stack(s) for s in stacks}


def only(text: str = SAGEMAKER_ENV, *, nag: bool = False) -> Template:
    [t] = synth(text, nag=nag).values()
    return t


def props(t: Template, kind: str) -> list[dict[str, Any]]:
    """The Properties of every resource of one CloudFormation type."""
    return [r["Properties"] for r in t.find_resources(kind).values()]
