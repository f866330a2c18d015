"""CLI start-up: ``kvfleet plan ... --json`` against a bare ``python -c pass``, and the import check.

Prints best-of-N wall times and their ratio, then the modules ``import kvfleet.cli`` pulls in
(``python -X importtime``). Exits 1 if a heavy module (pydantic, yaml, rich, aws_cdk, boto3, matplotlib) is
imported by ``kvfleet.cli`` itself: those belong inside the commands that need them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

N = 10
REPO = Path(__file__).resolve().parents[1]
HEAVY = ("pydantic", "yaml", "rich", "aws_cdk", "boto3", "matplotlib")
PLAN_ARGS = ["plan", "--model", "meta-llama/Llama-3.1-8B", "--max-input-tokens", "2048", "--max-output-tokens", "512"]


def kvfleet() -> list[str]:
    script = Path(sys.executable).parent / "kvfleet"
    if script.is_file():
        return [str(script)]
    found = shutil.which("kvfleet")
    return [found] if found else [sys.executable, "-m", "kvfleet.cli"]


def best_of(cmd: list[str], n: int = N) -> float:
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - start)
    return best


def imported_modules(module: str) -> list[tuple[str, int]]:
    """(top-level package, cumulative microseconds) for each package ``import module`` loads."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPROFILEIMPORTTIME"}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    totals: dict[str, int] = {}
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = (part.strip() for part in line.removeprefix("import time:").split("|"))
        if not cumulative.isdigit():
            continue  # the header row
        top = name.split(".")[0]
        totals[top] = max(totals.get(top, 0), int(cumulative))
    return sorted(totals.items(), key=lambda kv: -kv[1])


def main() -> int:
    bare = best_of([sys.executable, "-c", "pass"])
    plan = best_of([*kvfleet(), *PLAN_ARGS, "--json"])
    print(f"python -c pass:            {bare * 1e3:8.1f} ms (best of {N})")
    print(f"kvfleet plan ... --json:   {plan * 1e3:8.1f} ms (best of {N})")
    print(f"ratio:                     {plan / bare:8.2f}x")

    mods = imported_modules("kvfleet.cli")
    print("\nimport kvfleet.cli loads (top-level packages, cumulative us, slowest first):")
    for name, us in mods[:15]:
        print(f"  {name:<36} {us:>8}")
    heavy = sorted(name for name, _ in mods if name in HEAVY)
    if heavy:
        print(f"\nFAIL: import kvfleet.cli loads {', '.join(heavy)}")
        return 1
    print(f"\nPASS: import kvfleet.cli loads none of {', '.join(HEAVY)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
