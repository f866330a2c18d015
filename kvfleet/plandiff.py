"""What a release changes in a plan: two `kvfleet plan --json` documents compared deployment by deployment.

An approver reads this beside the CloudFormation diff: that the 70B endpoint moves from p4de to p5, that each
replica's KV cache shrinks, or that the fleet costs a third more, is not visible in a template diff. Each
deployment's chosen candidate (the plan's first) is compared on what it deploys, and where the plan derived its
scaling, the thresholds it chose (stdlib only: it reads JSON).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet.errors import KvfleetError


def _get(*keys: str) -> Callable[[Mapping[str, Any]], Any]:
    def read(row: Mapping[str, Any]) -> Any:
        v: Any = row
        for k in keys:
            if not isinstance(v, Mapping) or k not in v:
                return None
            v = v[k]
        return v

    return read


# (label, where in the chosen candidate, whether a change in it is shown as a percentage)
FIELDS: tuple[tuple[str, Callable[[Mapping[str, Any]], Any], bool], ...] = (
    ("instance type", _get("instance_type"), False),
    ("instances", _get("instance_count"), False),
    ("replicas", _get("replicas"), False),
    ("tensor parallel", _get("tensor_parallel_size"), False),
    ("pipeline parallel", _get("pipeline_parallel_size"), False),
    ("expert parallel", _get("expert_parallel"), False),
    ("weights", _get("weight_precision"), False),
    ("KV cache dtype", _get("kv_cache_dtype"), False),
    ("KV tokens per replica", _get("memory", "kv_cache_tokens"), True),
    ("sequences per replica", _get("concurrency_per_replica"), False),
    ("fleet $/h", _get("fleet_usd_per_hour"), True),
    ("TTFT s under load", _get("ttft_s"), True),
    ("ITL s under load", _get("itl_s"), True),
)
SCALING = ("saturation_target", "queue_depth_target", "min_replicas", "scale_in_after_s", "admission_queue")


@dataclass(frozen=True, kw_only=True)
class Change:
    """One deployment's changes, each as (what, before, after); none where nothing changed."""

    deployment: str
    status: str  # "changed", "added", "removed", "unchanged"
    lines: tuple[tuple[str, str, str], ...]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _pct(old: Any, new: Any) -> str:
    if isinstance(old, (int, float)) and isinstance(new, (int, float)) and old:
        return f" ({(new - old) / old:+.0%})"
    return ""


def _rows(doc: Any, source: str) -> dict[str, Mapping[str, Any]]:
    if not isinstance(doc, list) or not all(
        isinstance(r, Mapping) and isinstance(r.get("deployment"), str) for r in doc
    ):
        raise KvfleetError(f"{source}: not the output of kvfleet plan --json (a list of deployments)", field="plan")
    return {r["deployment"]: r for r in doc}


def _chosen(row: Mapping[str, Any]) -> Mapping[str, Any]:
    cands = row.get("candidates")
    return cands[0] if isinstance(cands, list) and cands and isinstance(cands[0], Mapping) else {}


def _compare(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    a, b = _chosen(old), _chosen(new)
    out = []
    for label, read, pct in FIELDS:
        va, vb = read(a), read(b)
        if va != vb:
            out.append((label, _fmt(va), _fmt(vb) + (_pct(va, vb) if pct else "")))
    fa = _get("engine_settings", "settings")(a) or {}
    fb = _get("engine_settings", "settings")(b) or {}
    for flag in sorted(set(fa) | set(fb)):
        if fa.get(flag) != fb.get(flag):
            out.append((f"--{flag}", _fmt(fa.get(flag)), _fmt(fb.get(flag))))
    pa = _get("scaling", "policy")(old) or {}
    pb = _get("scaling", "policy")(new) or {}
    for key in SCALING:
        if pa.get(key) != pb.get(key) and (key in pa or key in pb):
            out.append((f"scaling.{key}", _fmt(pa.get(key)), _fmt(pb.get(key))))
    # A new host image replaces every instance (and moves the NVIDIA driver): shown as the release's change.
    ia, ib = _host_image(old), _host_image(new)
    if ia != ib and ib is not None:
        out.append(("host image", _fmt(ia), ib))
    return out


def _host_image(row: Mapping[str, Any]) -> str | None:
    """What the deployment boots, as the plan's ``host_image`` says (kvfleet.config.host_lock): the pinned image, or
    the parameter's value at each deploy; None where the plan says nothing (a target without one, an older plan)."""
    img = row.get("host_image")
    if not isinstance(img, Mapping):
        return None
    if img.get("image_id"):
        return f"{img['image_id']} ({img.get('image_name') or '?'})"
    return f"unpinned: {img.get('parameter')} at each deploy"


def diff_plans(old: Any, new: Any, *, old_source: str = "old", new_source: str = "new") -> tuple[Change, ...]:
    """Each deployment of either plan, in the new plan's order then the removed ones, with what changed."""
    a, b = _rows(old, old_source), _rows(new, new_source)
    out = []
    for name, row in b.items():
        if name not in a:
            c = _chosen(row)
            count, kind, usd = (_fmt(c.get(k)) for k in ("instance_count", "instance_type", "fleet_usd_per_hour"))
            what = f"{count} x {kind}, ${usd}/h"
            out.append(Change(deployment=name, status="added", lines=(("deployment", "-", what),)))
            continue
        lines = tuple(_compare(a[name], row))
        out.append(Change(deployment=name, status="changed" if lines else "unchanged", lines=lines))
    out.extend(
        Change(deployment=name, status="removed", lines=(("deployment", _fmt(_chosen(row).get("instance_type")), "-"),))
        for name, row in a.items()
        if name not in b
    )
    return tuple(out)


def _scales(row: Mapping[str, Any]) -> bool | None:
    """Whether the plan's deployment scales (its ``replica_range``, [min, max]); None where the plan does not say
    (one written before kvfleet recorded it)."""
    rng = row.get("replica_range")
    if isinstance(rng, list) and len(rng) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in rng):
        return bool(rng[1] > rng[0])
    return None


def refused_updates(
    old: Any, new: Any, *, rules: Mapping[str, str], old_source: str = "old", new_source: str = "new"
) -> tuple[str, ...]:
    """One line per deployment whose release its platform fails in one update: ``rules`` maps a platform to the
    two deploys it takes instead (kvfleet.targets' ``type_change``); the release changes the instance type of a
    deployment the deployed plan scales. A deployed plan that does not say whether it scales is not refused: a
    fixed-size deployment could then never be released."""
    a, b = _rows(old, old_source), _rows(new, new_source)
    out = []
    for name, row in b.items():
        before = a.get(name)
        platform = row.get("platform")
        if before is None or not isinstance(platform, str) or before.get("platform") != platform:
            continue
        procedure = rules.get(platform)
        was, now = _chosen(before).get("instance_type"), _chosen(row).get("instance_type")
        if procedure is None or was is None or now is None or was == now or not _scales(before):
            continue
        low, high = before["replica_range"]
        out.append(
            f"{new_source}: {name}: instance type {was} -> {now} fails in one update on {platform}, where the "
            f"deployed plan scales it ({low}-{high} replicas); {procedure}"
        )
    return tuple(out)


def check_updates(old: Any, new: Any, *, rules: Mapping[str, str], old_source: str, new_source: str) -> None:
    """Refuse a release its platforms would fail in one update (``refused_updates``), naming the two deploys."""
    refused = refused_updates(old, new, rules=rules, old_source=old_source, new_source=new_source)
    if refused:
        raise KvfleetError(" | ".join(refused))


def describe(changes: Sequence[Change]) -> str:
    """One line per change, under its deployment."""
    lines = []
    for c in changes:
        if not c.lines:
            lines.append(f"{c.deployment}: unchanged")
            continue
        lines.append(f"{c.deployment}: {c.status}")
        lines.extend(f"  {what}: {before} -> {after}" for what, before, after in c.lines)
    return "\n".join(lines) if lines else "no deployments"


def markdown(changes: Sequence[Change], old_source: str, new_source: str) -> str:
    """A table per changed deployment: a CI job summary or a pull-request comment."""
    esc = html.escape
    out = [f"### Plan changes: `{esc(old_source)}` -> `{esc(new_source)}`", ""]
    for c in changes:
        if not c.lines:
            out.append(f"- **{esc(c.deployment)}**: unchanged")
            continue
        out += ["", f"**{esc(c.deployment)}** ({c.status})", "", "| | before | after |", "|---|---|---|"]
        out += [f"| {esc(w)} | {esc(b)} | {esc(a)} |" for w, b, a in c.lines]
    return "\n".join(out)
