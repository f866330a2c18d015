"""`kvfleet workload` from the command line: the profile, or one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet.cli import main

REPO = Path(__file__).resolve().parents[2]
CONV = REPO / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"


def test_profile_as_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["workload", str(CONV)]) == 0
    out = capsys.readouterr().out
    assert "19,366 requests" in out and "busiest minute" in out
    assert main(["workload", str(CONV), "--json", "--duration-s", "600", "--rate-scale", "2"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["fmt"] == "azure" and p["duration_s"] <= 300
    assert set(p["input_tokens"]) == {"mean", "p50", "p90", "p99", "max"}


@pytest.mark.parametrize(
    "args",
    [["/nonexistent/trace.csv"], ["--start-s", "-1"], ["--start-s", "99999"], ["--format", "mooncake"]],
)
def test_bad_trace_or_window_is_one_line_and_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["workload", *(args if args[0].startswith("/") else [str(CONV), *args])]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvfleet: error: ") and "\n" not in err and "Traceback" not in err
