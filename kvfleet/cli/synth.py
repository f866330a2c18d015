"""`kvfleet synth`: check and plan an environment file, then run cdk synth."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from kvfleet.cli.args import progress
from kvfleet.errors import ConfigError, KvfleetError

if TYPE_CHECKING:
    from kvfleet.config.loader import LoadedEnvironment


def add_parser(sub: Any) -> None:
    sy = sub.add_parser(
        "synth",
        help="check and plan an environment file (exit 2 with file:line for each problem), then run cdk synth",
        usage="kvfleet synth [-h] [--json] [--cdk CDK] [--pipeline FILE] [environment] [-- CDK_ARGS ...]",
        epilog="Arguments after -- go to cdk synth, e.g. kvfleet synth dev -- --quiet -o out.",
    )
    sy.add_argument("environment", nargs="?", default="dev", help="environments/<name>.yaml or a path (default dev)")
    sy.set_defaults(passthrough_to="cdk synth")  # kvfleet synth dev -- --quiet -o out
    sy.add_argument("--json", action="store_true", help="a summary as JSON: the stacks and their templates")
    sy.add_argument("--cdk", help="the CDK CLI (default: node_modules/.bin/cdk here, else cdk on PATH)")
    sy.add_argument(
        "--pipeline",
        metavar="FILE",
        help="synthesize the release pipeline of this file (pipeline.yaml) and its stages instead of one environment",
    )


def run(a: argparse.Namespace) -> int:
    """The supported way to synthesize: the CDK CLI exits 1 for every failure of its app, so a bad file is found
    here first (exit 2), and a problem only the stacks find (exit 2 from the app) is read back from the status
    file the app writes, instead of the CLI's 1."""
    from kvfleet.extras import require_extra

    require_extra("cdk", "synth")
    say = progress()
    say(f"planning {a.pipeline or a.environment}")
    context = _checked_context(a)
    cdk = _cdk_cli(a.cdk)
    say("synthesizing with the CDK (about half a minute)", keep=True)
    code = _synth(cdk, context, a.passthrough, quiet_stdout=a.json)
    if a.json:
        print(json.dumps(_summary(a, context, code), indent=2))
    return code


def _checked_context(a: argparse.Namespace) -> str:
    """The environment file (or every stage's of a pipeline) loaded and planned as synth will: the CDK app's context.
    Every problem of every file is raised at once (``file:line: field: what to change``), before the CDK CLI starts:
    the app's own refusal (``add_environment``) stays for ``cdk synth`` run directly."""
    from kvfleet.config.loader import environment_path, load_located

    if a.pipeline is not None:
        from kvfleet.config.pipeline import load_pipeline

        problems = [line for stage in load_pipeline(a.pipeline).environments for line in _problems(stage)]
        context = f"pipeline={a.pipeline}"
    else:
        problems = _problems(load_located(environment_path(a.environment)))
        context = f"env={a.environment}"
    if problems:
        raise ConfigError(problems)
    return context


def _problems(loaded: LoadedEnvironment) -> list[str]:
    """What synth would refuse in one file, each at its line: a deployment that does not resolve, then the choices
    the file leaves open (who hears the alarms, who shares each prefix cache) as the app's ``refuse_undecided``
    sees them, with each deployment's prefix caching as the bridge resolves it."""
    from kvfleet.config.choices import undecided
    from kvfleet.deployments import config_error, plan_requests, resolve

    env = loaded.environment
    try:
        requests = plan_requests(env)
    except KvfleetError as err:
        return loaded.problem(err).lines
    lines: list[str] = []
    caching = [False] * len(env.deployments)  # one that does not resolve has its own problem already
    for dr in requests:
        try:
            caching[dr.index] = resolve(env, dr, host_images=loaded.host_images).engine_args.enable_prefix_caching
        except KvfleetError as err:
            lines.extend(loaded.problem(config_error(err, dr.index) if err.field is None else err).lines)
    for u in undecided(env, caching):
        lines.extend(loaded.problem(KvfleetError(u.message, field=u.field)).lines)
    return lines


def _cdk_cli(given: str | None) -> str:
    import shutil
    from pathlib import Path

    local = Path("node_modules") / ".bin" / "cdk"
    cdk = given or (str(local) if local.exists() else shutil.which("cdk"))
    if cdk is None:
        raise KvfleetError("no CDK CLI: run `npm ci` here (package.json pins it) or give --cdk", field="cdk")
    return cdk


def _synth(cdk: str, context: str, cdk_args: list[str], *, quiet_stdout: bool) -> int:
    """cdk synth's exit status, or the app's own (2 for a problem the stacks found) where it wrote one."""
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    from kvfleet.errors import SYNTH_STATUS_ENV

    with tempfile.TemporaryDirectory(prefix="kvfleet-synth-") as tmp:
        status = Path(tmp) / "status"
        # jsii prints a banner on every run under Node 20, which CDK still supports (app.py says the same).
        env = {"JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20", **os.environ, SYNTH_STATUS_ENV: str(status)}
        try:
            # With --json, stdout is the summary alone: what the CDK prints goes to stderr.
            out = 2 if quiet_stdout else None  # file descriptor 2: stderr, whatever sys.stderr is
            command = [cdk, "synth", "-c", context, *_app(cdk_args), *cdk_args]
            rc = subprocess.run(command, env=env, check=False, stdout=out)
        except OSError as err:
            raise KvfleetError(f"cannot run {cdk}: {err.strerror}", field="cdk") from None
        app_status = status.read_text(encoding="utf-8").strip() if status.exists() else ""
    return int(app_status) if app_status.isdigit() else rc.returncode


def _app(cdk_args: list[str]) -> list[str]:
    """The CDK app run by this interpreter, the one running kvfleet (cdk.json's `.venv/bin/python app.py` exists only
    in a clone set up by `make`), unless the CDK arguments name one."""
    import shlex

    if any(arg in ("-a", "--app") or arg.startswith("--app=") for arg in cdk_args):
        return []
    return ["--app", f'{shlex.quote(sys.executable)} -c "from kvfleet.infra.app import main; main()"']


def _summary(a: argparse.Namespace, context: str, code: int) -> dict[str, Any]:
    """What was synthesized, from the cloud assembly's manifest: each stack and its template."""
    from pathlib import Path

    out_dir = _output_dir(a.passthrough)
    stacks = []
    try:
        manifest = json.loads((Path(out_dir) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        manifest = {}
    for name, art in (manifest.get("artifacts") or {}).items():
        if art.get("type") == "aws:cloudformation:stack":
            props = art.get("properties") or {}
            template = str(Path(out_dir) / props["templateFile"]) if "templateFile" in props else None
            stacks.append({"stack": name, "template": template})
    return {"context": context, "exit_code": code, "output_dir": out_dir, "stacks": stacks}


def _output_dir(cdk_args: list[str]) -> str:
    """Where cdk synth writes the assembly: its -o/--output argument, else cdk.out."""
    for i, arg in enumerate(cdk_args):
        if arg in ("-o", "--output") and i + 1 < len(cdk_args):
            return cdk_args[i + 1]
        if arg.startswith("--output="):
            return arg.split("=", 1)[1]
    return "cdk.out"
