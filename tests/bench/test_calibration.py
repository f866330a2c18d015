"""The loop from a live endpoint back to the simulator: `kvfleet bench --calibrate` writes what it measured,
`kvfleet simulate --calibration` replays the fleet with it, and a file from another deployment is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvfleet.calibration import read_calibration
from kvfleet.cli import main
from tests.bench.test_bench import _paced, one_line, serving


def test_measured_steps_feed_the_simulator(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    cal_file = tmp_path / "dev-chat.json"
    with serving(_paced(0.04)) as url:
        _, _, err = one_line(  # the exit status is the speed check's: this endpoint is far slower than the plan
            capsys, url, "--env", "dev", "--concurrency", "1,2", "--requests", "3", "--input-tokens", "64",
            "--output-tokens", "6", "--calibrate", str(cal_file), "--speed-tolerance", "0.99",
        )  # fmt: skip
    assert "calibration written to" in err, err
    cal = read_calibration(cal_file)
    assert cal.engine == "vllm" and cal.model == "meta-llama/Llama-3.1-8B" and len(cal.points) == 2
    assert cal.kv_cache_tokens is None  # this endpoint has no /metrics
    for p in cal.points:
        assert p.itl_s == pytest.approx(0.04, rel=0.5)  # the endpoint's 40 ms per token, as the client saw it
    scale = cal.step_time_scale
    assert scale > 1  # 40 ms a token is slower than the plan's GPU
    assert main(["simulate", "dev", "--json"]) == 0
    [plain] = json.loads(capsys.readouterr().out)
    assert main(["simulate", "dev", "--json", "--calibration", str(cal_file)]) == 0
    [calibrated] = json.loads(capsys.readouterr().out)
    # Every step priced `scale` times slower: the simulated gaps between tokens follow (queueing aside, at p50).
    ratio = calibrated["itl_s"]["p50"] / plain["itl_s"]["p50"]
    assert ratio == pytest.approx(scale, rel=0.2), (ratio, scale)


def test_a_calibration_from_another_deployment_is_refused(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "c.json"
    f.write_text(
        json.dumps(
            {
                "kind": "kvfleet.calibration",
                "version": 1,
                "measured_at": "2026-12-01T00:00:00Z",
                "instance_type": "ml.p5.48xlarge",
                "engine": "vllm",
                "engine_version": "0.30.0",
                "model": "meta-llama/Llama-3.1-8B",
                "tensor_parallel_size": 1,
                "kv_cache_tokens": 100000,
                "points": [],
            }
        ),
        encoding="utf-8",
    )
    assert main(["simulate", "dev", "--calibration", str(f)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "the calibration was measured on another deployment: instance_type ml.p5.48xlarge (the plan has" in line
    f.write_text("{}", encoding="utf-8")
    assert main(["simulate", "dev", "--calibration", str(f)]) == 2
    assert "not a kvfleet calibration" in capsys.readouterr().err
