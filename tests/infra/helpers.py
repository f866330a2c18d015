"""Helpers for the CDK tests: build an app from environment text, with the project's feature flags."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

import aws_cdk as cdk
from aws_cdk.assertions import Template

from kvfleet.infra.app import build_app
from tests.envs import FEATURE_FLAGS, REPO, SAGEMAKER_ENV, environment

__all__ = ["REPO", "SAGEMAKER_ENV", "environment", "make_app", "only", "props", "synth", "synth_all"]


def make_app(*, outdir: str | None = None) -> cdk.App:
    # Built-in CloudFormation validation is most of synth time; make synth runs it, unit tests need not.
    return cdk.App(context=FEATURE_FLAGS, outdir=outdir, builtin_cloud_formation_validation=False)


def synth_all(text: str = SAGEMAKER_ENV, *, nag: bool = False) -> dict[str, Template]:
    """Every stack of the environment: one per deployment, and the alerts stack when kvfleet creates the topic."""
    app = build_app(environment(text), app=make_app(), nag=nag)
    stacks = [c for c in app.node.children if isinstance(c, cdk.Stack)]
    return {s.stack_name: Template.from_stack(s) for s in stacks}


def synth(text: str = SAGEMAKER_ENV, *, nag: bool = False) -> dict[str, Template]:
    """The deployment stacks."""
    return {name: t for name, t in synth_all(text, nag=nag).items() if not name.endswith("-alerts")}


def only(text: str = SAGEMAKER_ENV, *, nag: bool = False) -> Template:
    """The template of the environment's one deployment (besides its alerts stack)."""
    [t] = synth(text, nag=nag).values()
    return t


def props(t: Template, kind: str) -> list[dict[str, Any]]:
    """The Properties of every resource of one CloudFormation type."""
    return [r["Properties"] for r in t.find_resources(kind).values()]
