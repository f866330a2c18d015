"""`kvfleet check`: live checks of a deployed environment, as a release pipeline runs them."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvfleet import contract
from kvfleet.cli.args import (
    _fraction,
)
from kvfleet.errors import KvfleetError


def add_parser(sub: Any) -> None:
    ck = sub.add_parser(
        "check",
        help="live checks of a deployed environment, as a release pipeline runs them after each stage: each "
        "deployment healthy, one generation streamed, and (where a replica's /metrics is reachable) its KV cache "
        "against the plan; exit 1 when one fails",
    )
    ck.add_argument("environment", help="environments/<name>.yaml or a path")
    ck.add_argument("--deployment", help="check this deployment only")
    ck.add_argument("--role-arn", help="assume this role first (a pipeline stage's live-check role)")
    ck.add_argument("--no-generation", action="store_true", help="health only: send no generation")
    ck.add_argument(
        "--kv-tolerance",
        type=_fraction,
        default=contract.KV_SHORTFALL_TOLERANCE,
        help=f"allowed shortfall of the KV cache (default {contract.KV_SHORTFALL_TOLERANCE})",
    )
    ck.add_argument("--json", action="store_true", help="each deployment's checks and verdict as JSON")


def run(a: argparse.Namespace) -> int:
    """Live checks of every deployment of a deployed environment (kvfleet.bench.live)."""
    from kvfleet.extras import require_extra

    require_extra("bench", "check")
    from kvfleet.bench.live import assumed_session, check_deployment
    from kvfleet.config.loader import environment_path, load_located
    from kvfleet.deployments import config_error, plan_requests, resolve

    loaded = load_located(environment_path(a.environment))
    env = loaded.environment
    if env.region is None:
        raise loaded.problem(KvfleetError("name the region the stacks are deployed in; set region", field="region"))
    drs = plan_requests(env)
    if a.deployment is not None:
        names = [dr.deployment.name for dr in drs]
        drs = tuple(dr for dr in drs if dr.deployment.name == a.deployment)
        if not drs:
            raise KvfleetError(
                f"no deployment {a.deployment!r} in {loaded.source}; it has {', '.join(names)}", field="deployment"
            )
    resolved = []
    for dr in drs:
        try:
            resolved.append(resolve(env, dr))
        except KvfleetError as err:
            raise loaded.problem(config_error(err, dr.index)) from None
    session = assumed_session(a.role_arn, env.region)
    rows = []
    for r in resolved:
        check = check_deployment(r, session=session, generation=not a.no_generation, kv_tolerance=a.kv_tolerance)
        rows.append(
            {
                "deployment": r.deployment_id,
                "platform": r.deployment.target.platform,
                "stack": r.stack_name,
                "passed": check.passed,
                "checks": list(check.lines),
            }
        )
        if not a.json:
            print(f"{r.deployment_id} ({r.deployment.target.platform}, stack {r.stack_name}):")
            for line in check.lines:
                print(f"  {line}")
    failed = sum(not row["passed"] for row in rows)
    if a.json:
        print(json.dumps({"passed": not failed, "deployments": rows}, indent=2))
    else:
        print(f"{len(rows) - failed} of {len(rows)} deployment(s) passed" + ("" if not failed else "; promotion stops"))
    return 1 if failed else 0
