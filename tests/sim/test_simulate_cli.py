"""`kvfleet simulate` on a benchmark shape: one engine start from flags or a planned deployment, and the flags it
refuses because they would change nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet.cli import main

REPO = Path(__file__).resolve().parents[2]
BARE = [
    *("--model", "meta-llama/Llama-3.1-8B", "--instance-type", "p5.48xlarge", "--tp", "1"),
    *("--engine", "vllm", "--engine-version", "0.11.0", "--precision", "bf16"),
]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["simulate", *argv])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_a_closed_loop_on_one_engine_start_reports_percentiles_and_throughput(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shape = ["--concurrency", "64", "--requests", "640", "--input-tokens", "1000", "--output-tokens", "1000", "--json"]
    code, out, err = run(capsys, *BARE, *shape)
    assert code == 0, err
    [row] = json.loads(out)
    assert row["requests"] == row["completed"] == 640
    for metric in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        p = row[metric]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], metric
        assert p["mean"] > 0
    assert row["output_tokens_per_s"] > 0 and row["requests_per_s"] > 0
    assert row["output_tokens_per_s"] == pytest.approx(1000 * row["requests_per_s"], rel=1e-6)
    assert "closed loop: 64 clients" in row["load"] and "p5.48xlarge" in row["subject"]
    # Four times the clients on the same engine: more throughput, a later first token.
    code, out, err = run(
        capsys,
        *BARE,
        *["--concurrency", "256", "--requests", "1024", "--input-tokens", "1000"],
        "--output-tokens",
        "1000",
        "--json",
    )
    assert code == 0, err
    [busy] = json.loads(out)
    assert busy["output_tokens_per_s"] > row["output_tokens_per_s"]
    assert busy["ttft_s"]["p90"] > row["ttft_s"]["p90"]


def test_poisson_and_a_local_model_directory(capsys: pytest.CaptureFixture[str]) -> None:
    model = REPO / "tests" / "fixtures" / "hf_configs" / "Qwen3-30B-A3B-FP8"
    code, out, err = run(
        capsys,
        *f"--model {model} --instance-type g6e.xlarge --rate 2 --requests 200 --input-tokens 500".split(),
        *["--output-tokens", "100", "--range-ratio", "0.3"],
    )
    assert code == 0, err
    assert "Poisson arrivals at 2 requests/s, 200 requests" in out and "TTFT" in out and "throughput" in out


def test_a_sweep_runs_each_level_in_the_words_kvfleet_bench_uses(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *BARE, "--concurrency", "1,16", "--requests", "64", "--input-tokens", "500",
                         "--output-tokens", "100", "--json")  # fmt: skip
    assert code == 0, err
    one, sixteen = json.loads(out)
    assert "1 client," in one["load"] and "16 clients" in sixteen["load"]
    assert sixteen["output_tokens_per_s"] > 5 * one["output_tokens_per_s"]
    assert sixteen["itl_s"]["p50"] > one["itl_s"]["p50"]


def test_a_deployments_planned_fleet_runs_a_benchmark_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "dev", "--concurrency", "8", "--requests", "64", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert rows and all(r["autoscaler"] == "none" and r["requests"] == 64 for r in rows)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["dev", "--duration-s", "60"], "--duration-s only applies to --trace"),
        (["dev", "--rate-scale", "2"], "--rate-scale only applies to --trace"),
        (["dev", "--requests", "10"], "only applies to --concurrency or --rate"),
        (["dev", "--concurrency", "4", "--rate", "2"], "two loads"),
        (["dev", "--concurrency", "4", "--png", "x.png"], "a closed loop has none"),
        (["dev", "--rate", "1,2", "--png", "x.png"], "give one --rate"),
        (["dev", "--tp", "2"], "give --model too"),
        (["dev", *BARE, "--concurrency", "4"], "not both"),
        (["--model", "meta-llama/Llama-3.1-8B", "--concurrency", "4"], "--instance-type"),
        (BARE, "give a load"),
        ([*BARE, "--concurrency", "4"], "--input-tokens and --output-tokens"),
        ([], "give an environment file, or --model"),
        (
            [*BARE, "--concurrency", "4", "--input-tokens", "200000", "--output-tokens", "10"],
            "max_model_len",
        ),
        ([*BARE, "--concurrency", "4", "--input-tokens", "10", "--output-tokens", "10", "--tp", "16"], "8 GPUs"),
    ],
)
def test_flags_that_would_change_nothing_or_cannot_run_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert needle in err


def test_the_plan_prints_its_planned_load_as_the_simulator_runs_it(capsys: pytest.CaptureFixture[str]) -> None:
    """The chosen candidate's planned load through the fleet simulator and the engine's own scheduler, beside the
    closed form the candidates are ranked by."""
    assert main(["plan", "dev", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    sim = row["simulated"]
    assert sim["candidate"] and "Poisson arrivals at 2 requests/s" in sim["load"]
    for metric in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert 0 < sim[metric]["p50"] <= sim[metric]["p90"] <= sim[metric]["p99"], metric
    # The closed form's median agrees with the simulated one on this light load (tests/sim/test_percentiles.py
    # holds the two together on harder cases).
    planned = row["candidates"][0]["planned_load"]
    assert sim["ttft_s"]["p50"] == pytest.approx(planned["ttft_s"]["p50"], rel=0.25)
    assert main(["plan", "dev"]) == 0
    assert "simulated (Poisson arrivals at 2 requests/s" in capsys.readouterr().out


def test_a_file_that_derives_its_scaling_is_replayed_with_what_synth_deploys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """staging derives its thresholds: the replay runs the derived ones (those plan prints and synth deploys), not
    the file's starting values."""
    assert main(["plan", str(REPO / "environments" / "staging.yaml"), "--json"]) == 0
    [planned] = json.loads(capsys.readouterr().out)
    policy = planned["scaling"]["policy"]
    code, out, err = run(capsys, str(REPO / "environments" / "staging.yaml"), "--json")
    assert code == 0, err
    [row] = json.loads(out)
    used = row["scaling"]
    assert used["derived"] is True
    for key in ("saturation_target", "queue_depth_target", "min_replicas"):
        assert used[key] == policy[key], key
