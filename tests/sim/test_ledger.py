"""The accuracy ledger: published serving benchmarks predicted as they ran (kvfleet/sim/ledger.py).

docs/accuracy.md must be what a fresh run writes, and the check rows' median errors must not grow past what it
records (lower the ceilings here when a change improves them)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest

from kvfleet.sim import ledger
from kvfleet.sizing.catalog import catalog_model
from tests.sizing.conftest import load_tool

REPO = Path(__file__).resolve().parents[2]
# The medians docs/accuracy.md records, rounded up to the next percent: a change that makes one worse fails here.
CEILINGS = {
    "check": {"ttft": 0.26, "tpot": 0.13, "itl": 0.15, "e2e": 0.08, "output_tokens_per_s": 0.14},
    "fit": {"ttft": 0.11, "tpot": 0.17, "itl": 0.09, "e2e": 0.11, "output_tokens_per_s": 0.06},
}


@pytest.fixture(scope="module")
def rows() -> list[ledger.Row]:
    return ledger.rows()


def test_the_ledger_document_is_current(rows: list[ledger.Row]) -> None:
    tool = load_tool("accuracy_ledger")
    fresh = ledger.render(rows) + "\n" + tool.capacity_section()
    assert (REPO / "docs" / "accuracy.md").read_text(encoding="utf-8") == fresh, (
        "docs/accuracy.md is stale: run .venv/bin/python tools/accuracy_ledger.py"
    )
    assert tool.COVERAGE.read_text(encoding="utf-8") == tool.coverage_json(), (
        "kvfleet/sizing/data/checked_releases.json is stale: run .venv/bin/python tools/accuracy_ledger.py"
    )


def test_a_sizing_says_when_no_public_log_of_its_release_is_checked() -> None:
    from kvfleet.sizing.capacity import EngineSettings, capacity
    from kvfleet.sizing.engines import EngineName

    model = catalog_model("meta-llama/Llama-3.1-8B")

    def notes(version: str) -> str:
        s = EngineSettings(engine=EngineName.VLLM, version=version, max_model_len=8192)
        return " ".join(capacity(model, gpu_memory_bytes=80 * 2**30, settings=s, accelerator_name="H100").notes)

    assert "no public start-up log of vllm 0.34.0 is checked" in notes("0.34.0")
    assert "no public start-up log" not in notes("0.27.1")  # four logs of it are


@pytest.mark.parametrize("split", ["check", "fit"])
def test_median_errors_do_not_grow(rows: list[ledger.Row], split: str) -> None:
    medians = ledger.medians(rows, split)
    for metric, ceiling in CEILINGS[split].items():
        value = medians[metric]
        assert value is not None and value <= ceiling, (split, metric, value)


def test_every_row_has_a_source_a_split_and_a_shape() -> None:
    cases = ledger.data()["cases"]
    assert len(cases) >= 80 and len({c["id"] for c in cases}) == len(cases)
    hosts = {urlparse(c["source"].split()[0]).netloc for c in cases}
    assert len(hosts) >= 4, hosts
    for c in cases:
        assert c["split"] in ("fit", "check") and c["source"].startswith("https://"), c["id"]
        shape = c["shape"]
        assert shape["kind"] in ("closed_loop", "offline"), c["id"]
        # Fixed lengths, or (a dataset of varying lengths) the token totals the client printed.
        assert (shape["input_tokens"] or 0) > 0 or shape.get("input_tokens_total", 0) > 0, c["id"]
    for alias in ledger.data()["model_aliases"].values():
        catalog_model(alias["as"])  # every alias names a catalog model


def test_the_request_overhead_is_the_fit_sets_and_moves_a_one_client_ttft() -> None:
    """step_calibration.json's per-engine overhead is what a fresh fit on the FIT rows gives, and it is in what a
    one-client row predicts."""
    from kvfleet.sizing.step import calibration

    assert calibration()["request_overhead_s"]["value"] == ledger.overhead_fit()
    case = next(c for c in ledger.data()["cases"] if c["id"] == "gpustack-vllm0.11.0-h100-qwen3-8b-tp1-sharegpt-c2")
    row = ledger.predict(case)
    assert row.predicted["ttft"] > ledger.overhead_fit()["vllm"]


def test_the_w4_expert_factor_is_the_fit_sets() -> None:
    """step_calibration.json's grouped-GEMM factor for 4-bit weight-only experts is what a fresh fit on the gpt-oss
    FIT rows gives (a coarser grid around it, to keep the test short, must land on the same value)."""
    from kvfleet.sizing.step import default_constants

    stored = default_constants().moe_w4_compute_factor
    assert ledger.moe_w4_fit([stored / 1.1, stored, stored * 1.1]) == stored
    fit_rows = [c for c in ledger.data()["cases"] if c.get("fits") == "moe_w4_compute_factor"]
    assert fit_rows and all(c["split"] == "fit" and "gpt-oss-20b" in c["model"] for c in fit_rows)


def test_a_row_fails_loudly_when_the_prediction_is_off(rows: list[ledger.Row]) -> None:
    """The errors are the prediction's: the same row against a measurement half as fast reads about +100%."""
    row = next(r for r in rows if r.skipped is None and "output_tokens_per_s" in r.measured)
    halved = ledger.Row(
        **{**row.__dict__, "measured": {"output_tokens_per_s": row.measured["output_tokens_per_s"] / 2}}
    )
    assert halved.errors()["output_tokens_per_s"] == pytest.approx(2 * (1 + row.errors()["output_tokens_per_s"]) - 1)


def test_a_published_chunked_prefill_flag_reaches_the_engines_scheduler() -> None:
    """trtllm-serve ran GPUStack's 32k prompts with --enable_chunked_prefill; without the flag TensorRT-LLM takes a
    context whole or not at all, and a 32k prompt is over its max_num_tokens (8192), so every request is refused."""
    case = next(
        c
        for c in ledger.data()["cases"]
        if c["id"] == "gpustack-trtllm1.2.0rc1-a100-80gb-qwen3-14b-tp1-32k-100-burst100"
    )
    assert case["settings"]["enable_chunked_prefill"] is True
    row = ledger.predict(case)
    assert row.predicted["output_tokens_per_s"] > 0 and "ttft" in row.predicted
    unchunked = {**case, "settings": {**case["settings"], "enable_chunked_prefill": None}}
    assert ledger.predict(unchunked).predicted.get("output_tokens_per_s") == 0.0
