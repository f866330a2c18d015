"""Host images pinned per release: the lock file beside an environment file.

A target whose host image is named by a public SSM parameter that moves with every release (EC2's DLAMI ``latest``
parameter: a new AMI every few weeks) deploys the image recorded here, not the parameter's value at deploy time. An
unrelated release then replaces no instance and never moves the NVIDIA driver under the CUDA check; a new image
is taken deliberately (``kvfleet plan <file> --refresh-host-images`` rewrites the lock, ``kvfleet diff`` shows the
change, the lock is committed with the release). ``environments/prod.yaml`` is locked by
``environments/prod.lock.json``: one row per (parameter, region), the image id the parameter held when it was
resolved, the image's name (its release) and the parameter's version.

Standard library only: synth reads the lock offline, on a fresh clone; only the refresh asks AWS (its callers pass
the clients).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

LOCK_SUFFIX = ".lock.json"
_IMAGE_ID = re.compile(r"^ami-[0-9a-f]{8,17}$")
_FIELDS = ("parameter", "region", "image_id", "image_name", "parameter_version", "resolved_on")


class LockError(ValueError):
    """A lock file that cannot be read: one line, ``file: field: what to change``."""


@runtime_checkable
class PinsHostImage(Protocol):
    """A target section whose host image is a public SSM parameter's value, pinned by the lock."""

    def host_image_parameter(self) -> str: ...


@dataclass(frozen=True, kw_only=True)
class PinnedImage:
    parameter: str  # the public SSM parameter it was resolved from
    region: str
    image_id: str  # what the parameter held (GetParameter's Value)
    image_name: str  # the image's name (DescribeImages): its release, which the target's host data gives a driver
    parameter_version: int  # GetParameter's Version: the parameter's history in that region
    resolved_on: str  # the day it was resolved (ISO date)

    def describe(self) -> str:
        return f"{self.image_id} ({self.image_name})"


def lock_path(environment_file: str | Path) -> Path:
    """``environments/prod.yaml`` -> ``environments/prod.lock.json``."""
    p = Path(environment_file)
    return p.with_name(p.stem + LOCK_SUFFIX)


def _row(raw: Any, where: str) -> PinnedImage:
    if not isinstance(raw, Mapping):
        raise LockError(f"{where}: not an object; rewrite the lock with kvfleet plan --refresh-host-images")
    for key in _FIELDS:
        if key not in raw:
            raise LockError(f"{where}.{key}: missing; rewrite the lock with kvfleet plan --refresh-host-images")
    if not isinstance(raw["image_id"], str) or not _IMAGE_ID.match(raw["image_id"]):
        raise LockError(f"{where}.image_id: {raw['image_id']!r} is not an AMI id (ami- and 8 or 17 hex digits)")
    if not isinstance(raw["parameter_version"], int) or isinstance(raw["parameter_version"], bool):
        raise LockError(f"{where}.parameter_version: {raw['parameter_version']!r} is not an integer")
    return PinnedImage(
        parameter=str(raw["parameter"]),
        region=str(raw["region"]),
        image_id=raw["image_id"],
        image_name=str(raw["image_name"]),
        parameter_version=raw["parameter_version"],
        resolved_on=str(raw["resolved_on"]),
    )


def read_lock(path: str | Path) -> tuple[PinnedImage, ...]:
    """The images a lock pins; none when there is no lock. Raises ``LockError`` for a malformed one."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ()
    except OSError as err:
        raise LockError(f"{p}: cannot be read ({err.strerror or err})") from None
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise LockError(f"{p}: not JSON ({err}); rewrite it with kvfleet plan --refresh-host-images") from None
    images = doc.get("images") if isinstance(doc, Mapping) else None
    if not isinstance(images, list):
        raise LockError(f"{p}: images: missing; rewrite the lock with kvfleet plan --refresh-host-images")
    rows = tuple(_row(raw, f"{p}: images[{i}]") for i, raw in enumerate(images))
    seen: set[tuple[str, str]] = set()
    for i, r in enumerate(rows):
        if (r.parameter, r.region) in seen:
            raise LockError(f"{p}: images[{i}]: {r.parameter} in {r.region} is pinned twice; keep one row")
        seen.add((r.parameter, r.region))
    return rows


def lock_text(images: Iterable[PinnedImage]) -> str:
    rows = sorted(images, key=lambda r: (r.parameter, r.region))
    doc = {
        "_about": "Host images pinned for this environment's release (kvfleet.config.host_lock): written only by "
        "kvfleet plan <file> --refresh-host-images, read offline by synth; commit it with the environment file.",
        "images": [asdict(r) for r in rows],
    }
    return json.dumps(doc, indent=2) + "\n"


def pinned(images: Iterable[PinnedImage], parameter: str, region: str | None) -> PinnedImage | None:
    """The image ``parameter`` is pinned to in ``region``; None when the lock has none (or the region is unknown)."""
    return next((r for r in images if r.parameter == parameter and r.region == region), None)


# (service, region) -> a client with get_parameter (ssm) or describe_images (ec2): boto3's, or a stubbed one in tests.
Clients = Callable[[str, str], Any]


def resolve(parameter: str, region: str, *, clients: Clients, today: str) -> PinnedImage:
    """What ``parameter`` holds in ``region`` now (SSM GetParameter), and the image's name (EC2 DescribeImages)."""
    found = clients("ssm", region).get_parameter(Name=parameter)["Parameter"]
    image_id = str(found["Value"])
    [image] = clients("ec2", region).describe_images(ImageIds=[image_id])["Images"]
    return PinnedImage(
        parameter=parameter,
        region=region,
        image_id=image_id,
        image_name=str(image["Name"]),
        parameter_version=int(found["Version"]),
        resolved_on=today,
    )


def refresh(
    current: Iterable[PinnedImage], wanted: Iterable[tuple[str, str]], *, clients: Clients, today: str
) -> tuple[tuple[PinnedImage, ...], tuple[str, ...]]:
    """The lock with every wanted (parameter, region) resolved again (rows no longer wanted are dropped), and one
    line per change."""
    old = {(r.parameter, r.region): r for r in current}
    new = {key: resolve(*key, clients=clients, today=today) for key in sorted(set(wanted))}
    changes = []
    for key, row in new.items():
        before = old.get(key)
        if before is None:
            changes.append(f"{key[0]} in {key[1]}: pinned to {row.describe()}")
        elif before.image_id != row.image_id:
            changes.append(f"{key[0]} in {key[1]}: {before.describe()} -> {row.describe()}")
        else:
            new[key] = before  # unchanged: keep the day it was first pinned
    changes += [f"{k[0]} in {k[1]}: no longer used, unpinned" for k in old.keys() - new.keys()]
    return tuple(new.values()), tuple(changes)
