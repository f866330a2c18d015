"""The loop from a live endpoint back to the simulator: `kvfleet bench --calibrate` writes what it measured,
`kvfleet simulate --calibration` replays the fleet with it, and a file from another deployment is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvfleet.calibration import read_calibration
from kvfleet.cli import main
from tests.bench.test_bench import _paced, one_line, serving
from tests.envs import REPO


def test_measured_steps_feed_the_simulator(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    cal_file = tmp_path / "dev-chat.json"
    with serving(_paced(0.04)) as url:
        _, _, err = one_line(  # the exit status is the speed check's: this endpoint is far slower than the plan
            capsys, url, "--env", "dev", "--concurrency", "1,2", "--requests", "3", "--input-tokens", "64",
            "--output-tokens", "6", "--calibrate", str(cal_file), "--speed-tolerance", "0.99",
        )  # fmt: skip
    assert "calibration written to" in err, err
    cal = read_calibration(cal_file)
    # The levels asked for (1 and 2 clients) with the prompt asked for and a short one: two batch sizes and two
    # prompt lengths, enough to fit each term of the step model.
    assert cal.engine == "vllm" and cal.model == "meta-llama/Llama-3.1-8B" and len(cal.points) == 4
    assert sorted((p.concurrency, p.input_tokens) for p in cal.points) == [(1, 16), (1, 64), (2, 16), (2, 64)]
    assert cal.kv_cache_tokens is None  # this endpoint has no /metrics
    for p in cal.points:
        assert p.itl_s == pytest.approx(0.04, rel=0.5)  # the endpoint's 40 ms per token, as the client saw it
    assert cal.step_time_scale > 1  # 40 ms a token is slower than the plan's GPU
    # The fitted model follows what was measured at every level, and says so level by level.
    assert cal.steps is not None and len(cal.residuals) == 4
    for x in cal.residuals:
        assert x.predicted_itl_s == pytest.approx(x.itl_s, rel=0.2)
        assert x.predicted_output_tokens_per_s == pytest.approx(x.output_tokens_per_s, rel=0.25)
    assert "fitted step model:" in err and "concurrency 2, 64 in: TTFT p50" in err
    # The fitted steps replace the plan's: replayed in the range it was measured in (two clients, short prompts), a
    # token every 40 ms, as this endpoint paces them. (Far outside it, at the plan's own 1,500-token prompts and
    # dozens of sequences, a fit on 4 short levels extrapolates; the residuals say where it was measured.)
    shape = ["--concurrency", "2", "--requests", "20", "--input-tokens", "64", "--output-tokens", "6", "--json"]
    assert main(["simulate", "dev", *shape]) == 0
    [plain] = json.loads(capsys.readouterr().out)
    assert main(["simulate", "dev", *shape, "--calibration", str(cal_file)]) == 0
    [calibrated] = json.loads(capsys.readouterr().out)
    assert calibrated["itl_s"]["p50"] == pytest.approx(0.04, rel=0.25)
    assert calibrated["itl_s"]["p50"] > 1.2 * plain["itl_s"]["p50"]


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


def _calibration(tmp_path: Any, **fields: Any) -> Any:
    f = tmp_path / "measured.json"
    body = {
        "kind": "kvfleet.calibration",
        "version": 1,
        "measured_at": "2026-12-01T00:00:00Z",
        "instance_type": "ml.g6e.xlarge",
        "engine": "vllm",
        "engine_version": "0.30.0",
        "model": "meta-llama/Llama-3.1-8B",
        "tensor_parallel_size": 1,
        "kv_cache_tokens": 200_000,
        # Measured gaps twice the predicted ones: a step time scale of 2.
        "points": [
            {
                "concurrency": c,
                "input_tokens": 1500,
                "output_tokens": 300,
                "itl_s": 2 * itl,
                "predicted_itl_s": itl,
                "output_tokens_per_s": 1.0,
                "predicted_output_tokens_per_s": 2.0,
            }
            for c, itl in ((1, 0.01), (8, 0.02), (16, 0.03))
        ],
    }
    f.write_text(json.dumps({**body, **fields}), encoding="utf-8")
    return f


def _best(capsys: pytest.CaptureFixture[str], *args: str, env: str = "dev") -> dict[str, Any]:
    assert main(["plan", env, "--json", "--top", "20", *args]) == 0
    [row] = json.loads(capsys.readouterr().out)
    cands: list[dict[str, Any]] = row["candidates"]
    [g6e] = [c for c in cands if c["instance_type"] == "ml.g6e.xlarge" and c["kv_cache_dtype"] == "fp8"]
    return g6e


def test_plan_prices_the_measured_candidate_with_its_cache_and_steps(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """dev's ml.g6e.xlarge, planned from the model (409,056 KV tokens at fp8) and from a calibration that measured
    200,000 tokens and steps twice as slow: the cache is the measured one, every step time doubles, and the fleet
    grows to carry the same peak at half the speed (dev with room for it: max_replicas bounds the plan)."""
    roomy = tmp_path / "dev.yaml"
    text = (REPO / "environments" / "dev.yaml").read_text(encoding="utf-8")
    assert "max_replicas: 2\n" in text
    roomy.write_text(text.replace("max_replicas: 2\n", "max_replicas: 8\n"), encoding="utf-8")
    plain = _best(capsys, env=str(roomy))
    cal = _calibration(tmp_path)
    measured = _best(capsys, "--calibration", str(cal), env=str(roomy))
    block = plain["memory"]["block_size"]
    assert plain["memory"]["kv_cache_tokens"] == 409_056
    assert 200_000 - block <= measured["memory"]["kv_cache_tokens"] <= 200_000 + block
    assert measured["cache_concurrency"] < plain["cache_concurrency"]
    for key in ("decode_step_s", "prefill_step_s"):
        assert measured["under_load"][key] == pytest.approx(2 * plain["under_load"][key], rel=0.01), key
    assert measured["replicas"] > plain["replicas"]
    assert any(
        n.startswith(f"calibrated ({cal}, measured 2026-12-01T00:00:00Z): step times x2.00") for n in measured["notes"]
    )
    # simulate with the same file on that plan: the planner's candidate already holds the measured figures, so
    # nothing is applied twice (the plain plan's best is this instance type too).
    assert main(["simulate", str(roomy), "--json", "--calibration", str(cal)]) == 0


def test_a_calibration_for_no_candidate_leaves_the_plan_and_says_so(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    cal = _calibration(tmp_path, instance_type="ml.p5.48xlarge")
    plain = _best(capsys)
    assert main(["plan", "dev", "--json", "--top", "20", "--calibration", str(cal)]) == 0
    out = capsys.readouterr()
    [row] = json.loads(out.out)
    [same] = [c for c in row["candidates"] if c["instance_type"] == "ml.g6e.xlarge" and c["kv_cache_dtype"] == "fp8"]
    assert same["memory"]["kv_cache_tokens"] == plain["memory"]["kv_cache_tokens"]
    assert "it applies to no candidate planned (ml.p5.48xlarge tp=1" in out.err


def test_a_malformed_calibration_is_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    cal = _calibration(tmp_path, engine="sglang")
    assert main(["plan", "dev", "--calibration", str(cal)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "unknown engine 'sglang'" in line


def test_predict_prints_each_level_beside_what_it_measured(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """--predict simulates each level on one replica: the plan's (far faster than this 40 ms-a-token endpoint, and
    said so), then a calibration's fitted steps, which follow it."""
    cal_file = tmp_path / "paced.json"
    level = ["--concurrency", "1,2", "--requests", "4", "--input-tokens", "64", "--output-tokens", "6"]
    with serving(_paced(0.04)) as url:
        one_line(capsys, url, "--env", "dev", *level, "--calibrate", str(cal_file), "--speed-tolerance", "0.99")
        _, out, err = one_line(capsys, url, "--env", "dev", *level, "--predict", "--speed-tolerance", "0.99")
        assert "predicted on one replica (the plan of chat), against measured:" in out, err
        assert "concurrency 2, 64 in" not in out and "concurrency 2: TTFT p50" in out  # only the levels asked for
        _, out, err = one_line(capsys, url, *level, "--predict", "--calibration", str(cal_file), "--json")
    report = json.loads(out)
    for row in report["levels"]:
        p = row["predicted"]
        assert p["itl_s"]["mean"] == pytest.approx(row["itl_s"]["mean"], rel=0.25), row["level"]
        assert p["output_tokens_per_s"] == pytest.approx(row["output_tokens_per_s"], rel=0.3), row["level"]
        assert set(p["ttft_s"]) == {"p50", "p90", "p95", "p99", "mean"}


def test_predict_needs_a_plan_or_a_fitted_calibration(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    with serving(_paced(0.001)) as url:
        code, _, err = one_line(capsys, url, "--concurrency", "1", "--requests", "1", "--predict")
        assert code == 2 and "give --env FILE or --calibration FILE" in err and len(err.splitlines()) == 1
        old = str(_calibration(tmp_path))  # a version 1 file: a scale, no fitted steps
        code, _, err = one_line(capsys, url, "--concurrency", "1", "--requests", "1", "--predict", "--calibration", old)
        assert code == 2 and "has no fitted step model" in err and len(err.splitlines()) == 1
