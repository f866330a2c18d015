"""The host images an environment file's lock pins (kvfleet.config.host_lock), as `kvfleet plan` and `kvfleet diff`
show them, and the lock's deliberate refresh (`kvfleet plan <file> --refresh-host-images`)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from kvfleet.config.host_lock import (
    Clients,
    LockError,
    PinnedImage,
    PinsHostImage,
    lock_path,
    lock_text,
    pinned,
    read_lock,
    refresh,
)
from kvfleet.config.loader import LoadedEnvironment, environment_path, load_located
from kvfleet.errors import KvfleetError


def _lock(loaded: LoadedEnvironment) -> tuple[Path, tuple[PinnedImage, ...]]:
    path = lock_path(loaded.source)
    try:
        return path, read_lock(path)
    except LockError as err:
        raise KvfleetError(str(err), field="lock") from None


def _wanted(loaded: LoadedEnvironment) -> dict[str, str]:
    """Deployment name -> the host image parameter its target pins (targets whose section says it pins one)."""
    return {
        d.name: d.target.host_image_parameter()
        for d in loaded.environment.deployments
        if isinstance(d.target, PinsHostImage)
    }


def host_images(environment: str) -> dict[str, dict[str, Any]]:
    """Deployment name -> what it boots: the pinned image, or the parameter resolved at each deploy (no lock row)."""
    loaded = load_located(environment_path(environment))
    _, images = _lock(loaded)
    region = loaded.environment.region
    out: dict[str, dict[str, Any]] = {}
    for name, parameter in _wanted(loaded).items():
        pin = pinned(images, parameter, region)
        out[name] = {
            "parameter": parameter,
            "region": region,
            "image_id": pin.image_id if pin else None,
            "image_name": pin.image_name if pin else None,
            "parameter_version": pin.parameter_version if pin else None,
            "resolved_on": pin.resolved_on if pin else None,
        }
    return out


def refresh_host_images(environment: str, *, clients: Clients | None = None, today: str | None = None) -> list[str]:
    """Resolve every pinned parameter again and rewrite the lock; one line per change (the lock is written only
    when something changed)."""
    loaded = load_located(environment_path(environment))
    region = loaded.environment.region
    wanted = set(_wanted(loaded).values())
    if wanted and region is None:
        raise KvfleetError("a host image is pinned per region; name the environment's region to pin it", field="region")
    if clients is None:
        from kvfleet.extras import require_extra

        require_extra("bench", "kvfleet plan --refresh-host-images")
        from kvfleet.bench.host_images import aws_client

        clients = aws_client
    path, current = _lock(loaded)
    images, changes = refresh(
        current,
        [(p, region) for p in wanted if region is not None],
        clients=clients,
        today=today or datetime.date.today().isoformat(),
    )
    if changes:
        path.write_text(lock_text(images), encoding="utf-8")
    return [f"{path}: {c}" for c in changes] or [f"{path}: unchanged"]
