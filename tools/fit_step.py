"""Fit the step-time model's constants to the FIT cases of kvfleet/sizing/data/step_calibration.json.

Deterministic coordinate descent on a log scale: each round tries every fitted constant at a fixed set
of multipliers, keeps the best, and halves the step sizes when nothing improves. The objective is the
sum over FIT cases and their measured metrics of log(predicted / measured)^2. CHECK cases are never read
by the fit; they are only reported. ``--write`` stores the fitted values and the fit record in the file.

    .venv/bin/python tools/fit_step.py [--write]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from datetime import date
from pathlib import Path
from typing import Any

# This checkout's kvfleet (and its data file), not another one installed in the environment.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfleet.sizing import step

DATA = Path(step.__file__).parent / "data" / "step_calibration.json"
# name -> (lower, upper). gemm_eff.fp8 also sets bf16 = fp8 x 2 / 1.2 (FP8 prefill measured ~1.2x bf16).
FITTED: dict[str, tuple[float, float]] = {
    "gemm_eff.fp8": (0.05, 0.95),
    "weights_bw_eff": (0.3, 0.95),
    "kv_bw_eff": (0.2, 0.95),
    "step_overhead_s": (1e-4, 0.02),
    "per_seq_overhead_s": (0.0, 2e-4),
    "prefill_step_overhead_s": (0.0, 0.05),
}
FP8_OVER_BF16_PREFILL = 1.2
MULTIPLIERS = (0.5, 0.7, 0.85, 0.95, 1.05, 1.18, 1.4, 2.0)


def _get(raw: dict[str, Any], name: str) -> float:
    if name == "gemm_eff.fp8":
        return float(raw["gemm_eff"]["value"]["fp8"])
    return float(raw[name]["value"])


def _set(raw: dict[str, Any], name: str, value: float) -> None:
    if name == "gemm_eff.fp8":
        raw["gemm_eff"]["value"]["fp8"] = value
        raw["gemm_eff"]["value"]["bf16"] = min(0.9, value * 2 / FP8_OVER_BF16_PREFILL)
    else:
        raw[name]["value"] = value


def _errors(raw: dict[str, Any], split: str) -> list[tuple[str, str, float]]:
    consts = step.constants_from(raw)
    out = []
    for case in step.cases():
        if case.split != split:
            continue
        for metric, err in step.case_errors(case, consts).items():
            out.append((case.cid, metric, err))
    return out


def _loss(raw: dict[str, Any]) -> float:
    return sum(math.log1p(e) ** 2 for _, _, e in _errors(raw, "fit"))


def fit(raw: dict[str, Any], rounds: int = 12) -> dict[str, Any]:
    best = _loss(raw)
    spread = 1.0
    for _ in range(rounds):
        improved = False
        for name, (lo, hi) in FITTED.items():
            base = _get(raw, name)
            for m in MULTIPLIERS:
                trial = min(hi, max(lo, base * m**spread)) if base > 0 else lo + (hi - lo) * 0.05 * m
                _set(raw, name, trial)
                loss = _loss(raw)
                if loss < best - 1e-12:
                    best, base, improved = loss, trial, True
            _set(raw, name, base)
        if not improved:
            spread /= 2
    return raw


def report(raw: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for split in ("fit", "check"):
        errs = _errors(raw, split)
        out[split] = {}
        for metric in ("itl_ms", "ttft_ms", "output_tokens_per_s"):
            xs = [e for _, m, e in errs if m == metric]
            if xs:
                out[split][metric] = {
                    "n": len(xs),
                    "median_abs": round(statistics.median(abs(x) for x in xs), 3),
                    "worst_abs": round(max(abs(x) for x in xs), 3),
                    "median_signed": round(statistics.median(xs), 3),
                }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="store the fitted constants in the data file")
    args = ap.parse_args()
    data = json.loads(DATA.read_text(encoding="utf-8"))
    raw = fit(data["constants"])
    summary = report(raw)
    for name in FITTED:
        print(f"{name:26} {_get(raw, name):.6g}")
    print(json.dumps(summary, indent=1))
    if args.write:
        data["constants"] = raw
        data["fit"] = {
            "date": date.today().isoformat(),
            "fitted": sorted(FITTED),
            "procedure": "tools/fit_step.py: coordinate descent on log scale over the fitted constants, "
            f"multipliers {list(MULTIPLIERS)}, step halved when a round does not improve",
            "objective": "sum over FIT cases and metrics of log(predicted / measured)^2",
            "errors": summary,
        }
        DATA.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {DATA}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
