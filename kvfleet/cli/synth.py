"""`kvfleet synth`: check and plan an environment file, then run cdk synth."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from kvfleet.errors import KvfleetError

if TYPE_CHECKING:
    pass


def add_parser(sub: Any) -> None:
    sy = sub.add_parser(
        "synth",
        help="check and plan an environment file (exit 2 with file:line for each problem), then run cdk synth",
    )
    sy.add_argument("environment", nargs="?", default="dev", help="environments/<name>.yaml or a path (default dev)")
    sy.add_argument("cdk_args", nargs="*", help="for cdk synth, after --: e.g. -- --quiet -o out")
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
    import os
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from kvfleet.config.loader import environment_path, load_located
    from kvfleet.deployments import resolve_environment
    from kvfleet.errors import SYNTH_STATUS_ENV

    if a.pipeline is not None:
        from kvfleet.config.pipeline import load_pipeline

        for stage_env in load_pipeline(a.pipeline).environments:
            try:
                resolve_environment(stage_env.environment)
            except KvfleetError as err:
                raise stage_env.problem(err) from None
        context = f"pipeline={a.pipeline}"
    else:
        loaded = load_located(environment_path(a.environment))
        try:
            resolve_environment(loaded.environment)
        except KvfleetError as err:
            raise loaded.problem(err) from None
        context = f"env={a.environment}"
    local = Path("node_modules") / ".bin" / "cdk"
    cdk = a.cdk or (str(local) if local.exists() else shutil.which("cdk"))
    if cdk is None:
        raise KvfleetError("no CDK CLI: run `npm ci` here (package.json pins it) or give --cdk", field="cdk")
    with tempfile.TemporaryDirectory(prefix="kvfleet-synth-") as tmp:
        status = Path(tmp) / "status"
        env = {**os.environ, SYNTH_STATUS_ENV: str(status)}
        try:
            rc = subprocess.run([cdk, "synth", "-c", context, *a.cdk_args], env=env, check=False)
        except OSError as err:
            raise KvfleetError(f"cannot run {cdk}: {err.strerror}", field="cdk") from None
        app_status = status.read_text(encoding="utf-8").strip() if status.exists() else ""
    return int(app_status) if app_status.isdigit() else rc.returncode
