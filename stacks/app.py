"""The CDK app: one environment file in, one stack per deployment out.

``app.py`` at the top level calls ``main``; tests call ``build_app`` directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks

from sizing.errors import KvfleetError
from stacks.config import ConfigError, Environment, load_environment
from stacks.deployment_stack import DeploymentStack
from stacks.resolve import resolve_environment

ROOT = Path(__file__).resolve().parent.parent
ENVIRONMENTS = ROOT / "environments"
DEFAULT_ENV = "dev"


def environment_path(name: str) -> Path:
    """``-c env=prod`` names environments/prod.yaml; a path to a YAML file is taken as is."""
    p = Path(name)
    return p if p.suffix in (".yaml", ".yml") else ENVIRONMENTS / f"{name}.yaml"


def build_app(env: Environment, *, app: cdk.App | None = None, nag: bool = True) -> cdk.App:
    app = app or cdk.App()
    if nag:
        # Findings fail synth; each accepted one is acknowledged beside its cause, with a reason.
        cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app, verbose=True))
    for r in resolve_environment(env):
        DeploymentStack(app, r.stack_name, resolved=r)
    return app


def main() -> None:
    app = cdk.App()
    name = app.node.try_get_context("env") or DEFAULT_ENV
    try:
        env = load_environment(environment_path(str(name)))
        build_app(env, app=app)
    except ConfigError as err:
        for line in err.lines:
            print(line, file=sys.stderr)
        sys.exit(2)
    except KvfleetError as err:
        print(f"kvfleet: {err}", file=sys.stderr)
        sys.exit(2)
    app.synth()
