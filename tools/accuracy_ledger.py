"""Regenerate docs/accuracy.md: every published serving benchmark of kvfleet/sizing/data/serving_benchmarks.json
simulated as it ran, with the errors per split, engine, GPU and load level (kvfleet/sim/ledger.py).

    .venv/bin/python tools/accuracy_ledger.py          # write docs/accuracy.md
    .venv/bin/python tools/accuracy_ledger.py --check  # exit 1 when docs/accuracy.md is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's kvfleet, not another one installed

from kvfleet.engines import ENGINES  # noqa: E402
from kvfleet.sim import ledger  # noqa: E402
from kvfleet.sizing.engines import default_version  # noqa: E402

DOC = REPO / "docs" / "accuracy.md"
LOGS = REPO / "tests" / "sizing" / "data" / "engine_logs.json"
# What the capacity model reads at run time to say when a release has no checked log (kvfleet.sizing.coverage).
COVERAGE = REPO / "kvfleet" / "sizing" / "data" / "checked_releases.json"


STEPS = REPO / "kvfleet" / "sizing" / "data" / "step_calibration.json"


def write_overhead(fitted: dict[str, float]) -> None:
    import json

    data = json.loads(STEPS.read_text(encoding="utf-8"))
    data["request_overhead_s"] = {
        "value": fitted,
        "source": "tools/accuracy_ledger.py --fit-overhead: per engine, the mean over the ledger's FIT rows with one "
        "client (kvfleet/sizing/data/serving_benchmarks.json) of the measured TTFT less the simulated one without "
        "overhead, floored at 0: the API server, tokenizing and the first event's way back, which the step model "
        "leaves out. It differs by host and endpoint (17 ms on the L4 completions row, 49 ms on the H100 chat row); "
        "a calibration (kvfleet bench --calibrate) measures a deployment's own",
    }
    STEPS.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    from kvfleet.sizing import step

    step.calibration.cache_clear()
    step.request_overhead_s.cache_clear()
    print(f"request overhead per engine: {fitted}")


def write_moe_w4(factor: float) -> None:
    import json

    data = json.loads(STEPS.read_text(encoding="utf-8"))
    data["constants"]["moe_w4_compute_factor"] = {
        "value": factor,
        "source": "tools/accuracy_ledger.py --fit-moe-w4: the factor that brings the ledger's gpt-oss-20b FIT rows "
        "(kvfleet/sizing/data/serving_benchmarks.json: vLLM 0.11 on H100 and A100, MXFP4 experts) closest by TTFT, "
        "TPOT and output tokens/s; gpt-oss-120b's rows and NVFP4 MoE rows check it. moe_compute_factor's 0.2 (FP8 "
        "and 16-bit grouped GEMMs) ran gpt-oss 45-80% slow",
    }
    STEPS.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    from kvfleet.sizing import step

    step.calibration.cache_clear()
    step.default_constants.cache_clear()
    print(f"moe_w4_compute_factor: {factor}")


def coverage_json() -> str:
    """The engine releases with a public start-up log in tests/sizing/data/engine_logs.json, and how many."""
    import json

    counts: dict[str, dict[str, int]] = {}
    for r in json.loads(LOGS.read_text(encoding="utf-8"))["records"]:
        if r["release"]:
            by_engine = counts.setdefault(r["engine"], {})
            by_engine[r["release"]] = by_engine.get(r["release"], 0) + 1
    body = {
        "about": "Engine releases whose KV-cache sizing is held to a public start-up log (tests/sizing/data/"
        "engine_logs.json, which names each log's source), and how many; written by tools/accuracy_ledger.py",
        "releases": {e: dict(sorted(v.items(), key=lambda kv: _key(kv[0]))) for e, v in sorted(counts.items())},
    }
    return json.dumps(body, indent=2) + "\n"


def capacity_section() -> str:
    """The start-up logs the capacity model is held to (tests/sizing/data/engine_logs.json), per engine release, and
    whether the default release and the example environments' pins have one."""
    import json
    import re

    records = json.loads(LOGS.read_text(encoding="utf-8"))["records"]
    by_release: dict[tuple[str, str], list[str]] = {}
    for r in records:
        by_release.setdefault((r["engine"], r["release"] or "unknown"), []).append(r["split"])
    pins = sorted(set(re.findall(r'^\s+version: "([\d.]+)"', _environments(), re.M)))
    lines = [
        "## Capacity: start-up logs per engine release",
        "",
        "The KV cache the engine allocates is held to public start-up logs in `tests/sizing/data/engine_logs.json`",
        "(fit and check apart; `tools/fit_engine_logs.py` prints every term's error).",
        "",
        "| engine | release | logs (fit / check) |",
        "|---|---|---:|",
    ]
    for (engine, release), splits in sorted(by_release.items(), key=lambda kv: (kv[0][0], _key(kv[0][1]))):
        lines.append(f"| {engine} | {release} | {splits.count('fit')} / {splits.count('check')} |")
    lines.append("")
    for engine, default in sorted((name, default_version(name)) for name in ENGINES):
        n = len(by_release.get((engine, default), []))
        lines.append(
            f"- Default {engine} release {default}: {n} log(s){'' if n else ', modelled from its source alone'}."
        )
    for pin in pins:
        n = len(by_release.get(("vllm", pin), []))
        lines.append(f"- vLLM {pin}, pinned by the example environments: {n} log(s) of that exact release.")
    return "\n".join(lines) + "\n"


def _environments() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "environments").glob("*.yaml")))


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", release)) if release != "unknown" else (999,)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/accuracy.md differs from a fresh run")
    p.add_argument(
        "--fit-overhead",
        action="store_true",
        help="refit each engine's request overhead on the ledger's one-client FIT rows into step_calibration.json",
    )
    p.add_argument(
        "--fit-moe-w4",
        action="store_true",
        help="refit the grouped-GEMM factor of 4-bit weight-only experts on the ledger's gpt-oss FIT rows",
    )
    a = p.parse_args()
    if a.fit_moe_w4:
        write_moe_w4(ledger.moe_w4_fit())
    if a.fit_overhead:
        write_overhead(ledger.overhead_fit())
    text = ledger.render(ledger.rows()) + "\n" + capacity_section()
    coverage = coverage_json()
    if a.check:
        stale = not DOC.exists() or DOC.read_text(encoding="utf-8") != text
        stale = stale or not COVERAGE.exists() or COVERAGE.read_text(encoding="utf-8") != coverage
        print(f"{DOC.relative_to(REPO)} is {'stale: run tools/accuracy_ledger.py' if stale else 'current'}")
        return 1 if stale else 0
    DOC.write_text(text, encoding="utf-8")
    COVERAGE.write_text(coverage, encoding="utf-8")
    print(f"wrote {DOC.relative_to(REPO)} and {COVERAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
