"""The CDK app: one environment file in, one stack per deployment out.

``app.py`` at the repository root calls ``main`` (``kvfleet synth <name>``, or ``npx cdk synth -c env=<name>``);
tests call ``build_app``. ``-c env=`` names a file in ``environments/`` of the working directory
(``-c environments_dir=`` moves it) or a path to a YAML file.

A bad file prints ``file:line: field: what to change`` lines and the app exits 2. The CDK CLI reports every app
failure as its own exit status 1, so ``kvfleet synth`` (which reads the status the app leaves in
``$KVFLEET_SYNTH_STATUS``) is the entry point whose exit status says "fix the file". A failure leaves nothing
of this run in the output directory: assets are staged there while stacks are built, before any template is.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks
from constructs import Construct

from kvfleet.config.choices import refuse_undecided
from kvfleet.config.host_lock import PinnedImage
from kvfleet.config.loader import LoadedEnvironment, environment_path, load_located, parse_field
from kvfleet.config.schema import Environment
from kvfleet.deployments import resolve_environment
from kvfleet.errors import EXIT_USER_ERROR, SYNTH_STATUS_ENV, ConfigError, KvfleetError
from kvfleet.infra.alerts import AlertsStack, alerts_stack_name
from kvfleet.infra.stack import DeploymentStack
from kvfleet.tuning import deriver
from kvfleet.workload.traces import Trace

DEFAULT_ENV = "dev"


def _in_deployment(err: KvfleetError, index: int, name: str) -> KvfleetError:
    """A construct's error about one deployment, its field as the file's key path (``deployments[i]....``)."""
    field = err.field
    if field is None:
        return KvfleetError(err.message, field=f"deployments[{index}]")
    path = parse_field(field)
    if path[0] == "deployments" and len(path) > 1 and path[1] in (name, index):
        rest = ".".join(str(p) for p in path[2:])
        return KvfleetError(err.message, field=f"deployments[{index}]" + (f".{rest}" if rest else ""))
    if path[0] in Environment.model_fields:  # the environment's own (region, network)
        return err
    if re.fullmatch(r"[a-z_]+(\.[a-z_]+)*", field):  # a key under the deployment (engine.version, image.uri)
        return KvfleetError(err.message, field=f"deployments[{index}].{field}")
    # A setting that is not a key of the file (an AMI type kvfleet picks): said in words, at the target.
    return KvfleetError(f"{field}: {err.message}", field=f"deployments[{index}].target")


def add_environment(
    scope: Construct,
    env: Environment,
    *,
    traces: Mapping[int, Trace] | None = None,
    host_images: Sequence[PinnedImage] = (),
) -> list[cdk.Stack]:
    """An environment's stacks (its alerts topic where it has none of its own, then one stack per deployment) in
    ``scope``: the app for `make synth`, or a ``cdk.Stage`` of a pipeline, which then deploys the same stacks.
    ``traces`` are the deployments' workload traces as the loader read them (by deployment index):
    ``scaling.derive`` replays them, and without one a step at the workload's peak. ``host_images`` are the images
    the lock beside the file pins (``LoadedEnvironment.host_images``); without them every host image is resolved
    at deploy."""
    # The thresholds the file leaves to scaling.derive are those `kvfleet plan` prints (the same search, cached).
    resolved = resolve_environment(env, derive=deriver(traces), host_images=host_images)
    # Who hears the alarms and who shares each prefix cache: planned without, never deployed without.
    refuse_undecided(env, [r.engine_args.enable_prefix_caching for r in resolved])
    alerts = (
        None
        if env.notifications.topic_arn is not None
        else AlertsStack(scope, alerts_stack_name(env.name), environment=env)
    )
    stacks: list[cdk.Stack] = [alerts] if alerts is not None else []
    for i, r in enumerate(resolved):
        try:
            stacks.append(DeploymentStack(scope, r.stack_name, resolved=r, alerts=alerts))
        except KvfleetError as err:
            raise _in_deployment(err, i, r.deployment.name) from None
    return stacks


def build_app(
    env: Environment,
    *,
    app: cdk.App | None = None,
    nag: bool = True,
    traces: Mapping[int, Trace] | None = None,
    host_images: Sequence[PinnedImage] = (),
) -> cdk.App:
    """The app of an environment (``add_environment`` in an app, with cdk-nag)."""
    app = app or cdk.App()
    if nag:
        # Findings fail synth; each accepted one is acknowledged beside its cause, with a reason.
        cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app, verbose=True))
    add_environment(app, env, traces=traces, host_images=host_images)
    return app


def _cleaned_on_failure(outdir: Path, build: Callable[[], Any]) -> None:
    """Run ``build``; if it raises, remove what it added to ``outdir``: the assets stacks stage while they are
    built (before synth writes any template), which a half-built app would leave behind."""
    before = set(os.listdir(outdir)) if outdir.is_dir() else None
    try:
        build()
    except BaseException:
        if before is None:
            shutil.rmtree(outdir, ignore_errors=True)
        else:
            for entry in set(os.listdir(outdir)) - before:
                target = outdir / entry
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    target.unlink(missing_ok=True)
        raise


def _exit(lines: list[str]) -> None:
    for line in lines:
        print(line, file=sys.stderr)
    if status_file := os.environ.get(SYNTH_STATUS_ENV):
        Path(status_file).write_text(str(EXIT_USER_ERROR), encoding="utf-8")
    sys.exit(EXIT_USER_ERROR)


def _main_pipeline(app: cdk.App, path: str) -> None:
    """``-c pipeline=pipeline.yaml``: the release pipeline's stack, with a stage per environment it names."""
    from kvfleet.config.pipeline import load_pipeline
    from kvfleet.infra.pipeline import build_pipeline

    try:
        loaded = load_pipeline(path)
        cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app, verbose=True))
        _cleaned_on_failure(Path(app.outdir), lambda: build_pipeline(loaded, app=app))
    except ConfigError as err:
        _exit(err.lines)
    except KvfleetError as err:
        _exit([f"kvfleet: {err}"])
    app.synth()


def main() -> None:
    app = cdk.App()
    if pipeline := app.node.try_get_context("pipeline"):
        _main_pipeline(app, str(pipeline))
        return
    name = app.node.try_get_context("env") or DEFAULT_ENV
    directory = app.node.try_get_context("environments_dir")
    loaded: LoadedEnvironment | None = None
    try:
        loaded = load_located(environment_path(str(name), environments_dir=directory))
        env = loaded.environment
        traces, images = loaded.traces, loaded.host_images
        _cleaned_on_failure(Path(app.outdir), lambda: build_app(env, app=app, traces=traces, host_images=images))
    except ConfigError as err:
        _exit(err.lines)
    except KvfleetError as err:
        _exit(loaded.problem(err).lines if loaded is not None else [f"kvfleet: {err}"])
    app.synth()
