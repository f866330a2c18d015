"""The start-up estimate behind every health-check timeout, warm-up and startup probe."""

from __future__ import annotations

import pytest

from kvfleet.sizing import startup
from kvfleet.sizing.startup import startup_estimate
from kvfleet.sizing.units import GiB


def test_parts_add_up() -> None:
    e = startup_estimate(checkpoint_bytes=16 * GiB)
    assert e.download_s == pytest.approx(16 * GiB / startup.DOWNLOAD_BYTES_PER_S)
    assert e.load_s == pytest.approx(16.0)
    assert e.container_start_s == pytest.approx(e.load_s + startup.ENGINE_INIT_S)
    assert e.ready_s == pytest.approx(e.image_pull_s + e.download_s + e.container_start_s)


def test_grows_with_the_checkpoint() -> None:
    small = startup_estimate(checkpoint_bytes=16 * GiB)
    big = startup_estimate(checkpoint_bytes=140 * GiB)
    assert big.ready_s > small.ready_s
    assert big.download_s / small.download_s == pytest.approx(140 / 16)


def test_rejects_an_empty_checkpoint() -> None:
    with pytest.raises(ValueError, match="positive"):
        startup_estimate(checkpoint_bytes=0)
