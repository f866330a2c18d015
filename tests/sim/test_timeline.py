"""The run over time: series that add up to the report, a valid PNG, and `kvfleet simulate --png`."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from kvfleet.cli import main
from kvfleet.engines.vllm.scheduler import VllmScheduler
from kvfleet.sim.fleet import FleetResult, FleetSpec, Scaling, simulate
from kvfleet.sim.replica import EngineLimits
from kvfleet.sim.report import summarize
from kvfleet.sim.timeline import DPI, FIGURE_INCHES, Timeline, render_png, timeline
from kvfleet.workload.traces import Trace
from tests.sim.synthetic import MODEL, steady

VLLM = VllmScheduler()  # the engine the plans here run

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fleet(*, initial: int, admission_tokens: int | None = None, kind: str = "target_tracking") -> FleetSpec:
    return FleetSpec(
        scheduler=VLLM,
        limits=EngineLimits(
            max_num_seqs=64, max_num_batched_tokens=4096, kv_blocks=2_000, admission_tokens=admission_tokens
        ),
        model=MODEL,
        scaling=Scaling(kind=kind, min_replicas=1, max_replicas=8, kv_cache_target=0.5, queue_target=2.0),  # type: ignore[arg-type]
        initial_replicas=initial,
        cold_start_s=120,
        usd_per_replica_hour=3.6,
    )


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, which the PNG specification puts first, after the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def run(trace: Trace, spec: FleetSpec) -> tuple[FleetResult, Timeline]:
    result = simulate(trace, spec)
    return result, timeline(result, trace, spec)


def test_the_series_add_up_to_the_report_and_follow_the_samples() -> None:
    # One replica under 12 requests/s with a tight admission budget: 429s, a scale-out and a cold start.
    trace = steady(12, 900)
    spec = fleet(initial=1, admission_tokens=20_000)
    result, tl = run(trace, spec)
    report = summarize(result, spec)
    assert report.rejected_429 > 0 and result.scale_events
    n = len(result.samples)
    assert n > 0
    whole_run = ("scale_events", "saturation_target", "queue_target")
    per_sample = [getattr(tl, f.name) for f in fields(tl) if f.name not in whole_run]
    assert all(len(series) == n for series in per_sample)
    assert all(dt > 0 for dt in tl.interval_s) and sum(tl.interval_s) == pytest.approx(tl.t_s[-1])
    assert sum(tl.arrivals) == len(trace) == report.requests
    assert sum(tl.completed) == report.completed
    assert sum(tl.rejected_429) == report.rejected_429 and sum(tl.rejected_503) == report.rejected_503
    # The replicas series is the report's replicas over time: same samples, same bounds.
    counts = [r + s for r, s in zip(tl.replicas, tl.starting, strict=True)]
    assert (min(counts), max(counts)) == (report.replicas_min, report.replicas_max)
    assert list(tl.replicas) == [x.replicas for x in result.samples]
    assert list(tl.scale_events) == result.scale_events
    # A replica launched at the scale-out serves only after its cold start.
    out_s = result.scale_events[0][0]
    first_more = next(t for t, r in zip(tl.t_s, tl.replicas, strict=True) if r > 1)
    assert first_more >= out_s + spec.cold_start_s
    assert all(0.0 <= m <= x <= 1.0 for m, x in zip(tl.kv_mean, tl.kv_max, strict=True))
    # Saturation (what the autoscaler holds at the target) is never below KV use, the larger of it and the slots.
    assert list(tl.saturation) == [x.saturation for x in result.samples]
    assert all(0.0 <= k <= s <= 1.0 for k, s in zip(tl.kv_mean, tl.saturation, strict=True))
    assert (tl.saturation_target, tl.queue_target) == (0.5, 2.0)


def test_arrivals_after_the_last_sample_land_in_the_last_interval() -> None:
    # No replica at all: every request is a 503 and nothing is left to drain, so sampling stops at the last
    # publish interval before the last arrival; the last interval holds the arrivals after it.
    trace = steady(1, 65)
    result, tl = run(trace, fleet(initial=0))
    assert result.samples[-1].t_s < trace.arrival_s[-1]
    assert sum(tl.arrivals) == sum(tl.rejected_503) == len(trace) == result.stats.rejected_503


def test_a_horizon_counts_only_the_requests_replayed() -> None:
    trace = steady(2, 600)
    spec = fleet(initial=2)
    result = simulate(trace, spec, horizon_s=300)
    tl = timeline(result, trace, spec)
    assert sum(tl.arrivals) == result.requests < len(trace)


def test_no_autoscaler_draws_no_target() -> None:
    _, tl = run(steady(1, 60), fleet(initial=1, kind="none"))
    assert tl.saturation_target is None and tl.queue_target is None


def test_the_png_is_a_png_of_the_figure_size(tmp_path: Path) -> None:
    _, tl = run(steady(12, 600), fleet(initial=1, admission_tokens=20_000))
    out = tmp_path / "timeline.png"
    render_png(tl, out, title="chat: ml.g6e.xlarge x1 (1-8, target_tracking)\nsteady")
    assert png_size(out) == (round(FIGURE_INCHES[0] * DPI), round(FIGURE_INCHES[1] * DPI))


def test_the_cli_starts_without_matplotlib() -> None:
    code = "import sys, kvfleet.cli, kvfleet.sim.timeline; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, check=False).returncode == 0


def test_kvfleet_simulate_writes_the_png_and_says_where(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chat.png"
    args = ["simulate", "dev", "--trace", str(TRACE), "--duration-s", "300", "--png", str(out)]
    assert main(args) == 0
    assert f"timeline written to {out}" in capsys.readouterr().out
    assert png_size(out)[0] > 0
    out.unlink()
    assert main([*args, "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["png"] == str(out) and out.is_file()


def test_several_deployments_get_one_png_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = yaml.safe_load((REPO / "environments" / "dev.yaml").read_text(encoding="utf-8"))
    second = {**env["deployments"][0], "name": "chat-b"}
    env["deployments"].append(second)
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(env), encoding="utf-8")
    out = tmp_path / "run.png"
    assert main(["simulate", str(path), "--trace", str(TRACE), "--duration-s", "120", "--png", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("chat", "chat-b"):
        written = tmp_path / f"run-{name}.png"
        assert f"timeline written to {written}" in printed and png_size(written)[0] > 0
    assert not out.exists()


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("missing/t.png", "there is no directory"),
        ("adir.png", "it is a directory"),
        ("t.jpg", "does not end in .png"),
        ("locked/t.png", "is not writable"),
    ],
)
def test_kvfleet_simulate_bad_png_path_is_one_line_before_any_replay(
    where: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "adir.png").mkdir()
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if where.startswith("locked") and os.access(locked, os.W_OK):
        pytest.skip("this user writes to read-only directories (root)")

    def no_replay(*args: object, **kwargs: object) -> FleetResult:
        raise AssertionError("the path is checked before the replay")

    monkeypatch.setattr("kvfleet.sim.fleet.simulate", no_replay)
    assert main(["simulate", "dev", "--png", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvfleet: error: png: ") and expected in err and "\n" not in err


def test_kvfleet_simulate_a_failed_write_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kvfleet.sim.timeline.render_png", full_disk)
    out = tmp_path / "t.png"
    assert main(["simulate", "dev", "--trace", str(TRACE), "--duration-s", "60", "--png", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"kvfleet: error: png: cannot write {out}: No space left on device"
