"""The CDK app: one environment file in, one stack per deployment out.

``app.py`` at the repository root calls ``main`` (``npx cdk synth -c env=<name>``); tests call ``build_app``.
``-c env=`` names a file in ``environments/`` of the working directory (``-c environments_dir=`` moves it)
or a path to a YAML file.
"""

from __future__ import annotations

import sys

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks

from kvfleet.config.loader import environment_path, load_environment
from kvfleet.config.schema import Environment
from kvfleet.deployments import resolve_environment
from kvfleet.errors import ConfigError, KvfleetError
from kvfleet.infra.alerts import AlertsStack, alerts_stack_name
from kvfleet.infra.stack import DeploymentStack

DEFAULT_ENV = "dev"


def build_app(env: Environment, *, app: cdk.App | None = None, nag: bool = True) -> cdk.App:
    app = app or cdk.App()
    if nag:
        # Findings fail synth; each accepted one is acknowledged beside its cause, with a reason.
        cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app, verbose=True))
    resolved = resolve_environment(env)
    alerts = (
        None
        if env.notifications.topic_arn is not None
        else AlertsStack(app, alerts_stack_name(env.name), environment=env)
    )
    for r in resolved:
        DeploymentStack(app, r.stack_name, resolved=r, alerts=alerts)
    return app


def main() -> None:
    app = cdk.App()
    name = app.node.try_get_context("env") or DEFAULT_ENV
    directory = app.node.try_get_context("environments_dir")
    try:
        env = load_environment(environment_path(str(name), environments_dir=directory))
        build_app(env, app=app)
    except ConfigError as err:
        for line in err.lines:
            print(line, file=sys.stderr)
        sys.exit(2)
    except KvfleetError as err:
        print(f"kvfleet: {err}", file=sys.stderr)
        sys.exit(2)
    app.synth()
