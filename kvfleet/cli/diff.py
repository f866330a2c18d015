"""`kvfleet diff`: what a release changes in the plan."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from kvfleet.cli.plan import plan_environment
from kvfleet.cli.plan_output import plan_json
from kvfleet.errors import KvfleetError

if TYPE_CHECKING:
    from kvfleet.plandiff import Change


def add_parser(sub: Any) -> None:
    di = sub.add_parser(
        "diff",
        help="what a release changes in the plan (instance type, count, engine flags, KV tokens, $/h, scaling): "
        "each side an environment file, planned now, or the JSON of kvfleet plan --json",
    )
    di.add_argument("old", help="the plan before: an environment file, or a saved kvfleet plan --json")
    di.add_argument("new", help="the plan after")
    di.add_argument("--markdown", action="store_true", help="a Markdown table per deployment (a job summary)")
    di.add_argument("--exit-code", action="store_true", help="exit 1 when the plan changed (as git diff does)")
    di.add_argument("--json", action="store_true", help="each deployment's status and changes as JSON")


def run(a: argparse.Namespace) -> int:
    """What a release changes in the plan: each side an environment file (planned now) or `kvfleet plan --json`."""
    from kvfleet.plandiff import check_updates, describe, diff_plans, markdown
    from kvfleet.targets import type_change_rules

    sides = []
    for src in (a.old, a.new):
        if src.endswith(".json"):
            try:
                with open(src, encoding="utf-8") as f:
                    rows = json.load(f)
            except OSError as err:
                raise KvfleetError(f"cannot read {src}: {err.strerror or err}", field="plan") from None
            except (ValueError, UnicodeDecodeError) as err:
                raise KvfleetError(f"{src}: not JSON ({err})", field="plan") from None
        else:
            from kvfleet.cli.host_images import host_images

            results, scalings = plan_environment(src)
            images = host_images(src)  # what each deployment boots, from the lock beside the file
            rows = [
                {
                    **plan_json(name, target, p, 1),
                    **({"scaling": sc} if sc else {}),
                    **({"host_image": images[name]} if name in images else {}),
                }
                for (name, target, p), sc in zip(results, scalings, strict=True)
            ]
        sides.append((src, rows))
    changes = diff_plans(sides[0][1], sides[1][1], old_source=sides[0][0], new_source=sides[1][0])
    if a.json and a.markdown:
        raise KvfleetError("--json and --markdown are two formats of the same changes; give one", field="json")
    if a.json:
        print(json.dumps([_change_json(c) for c in changes], indent=2))
    else:
        print(markdown(changes, sides[0][0], sides[1][0]) if a.markdown else describe(changes))
    # A change its platform would fail in one update (a target record's type_change) is refused, with its two deploys.
    check_updates(sides[0][1], sides[1][1], rules=type_change_rules(), old_source=a.old, new_source=a.new)
    return 1 if a.exit_code and any(c.lines for c in changes) else 0


def _change_json(c: Change) -> dict[str, Any]:
    return {
        "deployment": c.deployment,
        "status": c.status,
        "changes": [{"what": what, "before": before, "after": after} for what, before, after in c.lines],
    }
