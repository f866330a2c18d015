"""Fleet simulator speed: simulated seconds per wall second (CPU time of one process, so one core).

Replays the whole hour of the Azure 2023 conversation trace (traces/azure2023) through a four-replica fleet
of Llama 3.1 8B on H100s priced by the sizing core's step model, with target tracking on, and once more with
every decode step simulated on its own (the leaps switched off) as the baseline of the same run. Target: at
least 1000x real time with leaps (BLIS/inference-sim reports about 200x).

    python benchmarks/sim_speed.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvfleet.engines.vllm.scheduler import VllmScheduler  # noqa: E402
from kvfleet.sim.fleet import FleetSpec, Scaling, simulate  # noqa: E402
from kvfleet.sim.replica import EngineLimits  # noqa: E402
from kvfleet.sim.steps import RooflineSteps  # noqa: E402
from kvfleet.sizing.catalog import catalog_model  # noqa: E402
from kvfleet.sizing.hardware import accelerator  # noqa: E402
from kvfleet.sizing.precision import weight_scheme  # noqa: E402
from kvfleet.sizing.step import replica  # noqa: E402
from kvfleet.workload.traces import read_trace  # noqa: E402

VLLM = VllmScheduler()  # the engine the plans here run

TARGET = 1000.0
# The hour as a user runs it: `kvfleet simulate dev --trace <the hour>`, start-up and planning included (wall time).
CLI_TARGET = 2000.0
TRACE = REPO / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"


def cli_run() -> float:
    """Seconds of wall time for the CLI to plan the dev environment and replay the whole hour."""
    import subprocess

    exe = Path(sys.executable).with_name("kvfleet")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvfleet.cli"]
    t0 = time.perf_counter()
    subprocess.run([*cmd, "simulate", "dev", "--trace", str(TRACE)], cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - t0


def run(*, exact: bool, duration_s: float | None) -> tuple[float, float, int]:
    model = catalog_model("meta-llama/Llama-3.1-8B-Instruct")
    steps = RooflineSteps(
        replica(model=model, accelerator=accelerator("H100"), tp=1, nvlink=True, scheme=weight_scheme("bf16"))
    )
    spec = FleetSpec(
        scheduler=VLLM,
        limits=EngineLimits(
            max_num_seqs=256, max_num_batched_tokens=8192, kv_blocks=28_000, admission_tokens=2 * 28_000 * 16
        ),
        model=steps,
        scaling=Scaling(kind="target_tracking", min_replicas=2, max_replicas=8, kv_cache_target=0.75, queue_target=2.0),
        initial_replicas=4,
        cold_start_s=300,
        usd_per_replica_hour=6.88,
        exact_steps=exact,
    )
    trace = read_trace(TRACE, duration_s=duration_s)  # as recorded: ~5.5 requests/s
    t0 = time.process_time()
    result = simulate(trace, spec)
    cpu = time.process_time() - t0
    return result.end_s, cpu, len(trace)


def main() -> int:
    sim_s, cpu_s, n = run(exact=False, duration_s=None)
    base_sim, base_cpu, base_n = run(exact=True, duration_s=600)
    speed, base_speed = sim_s / cpu_s, base_sim / base_cpu
    print(
        f"fleet simulator, leaps:        {n:,} requests, {sim_s:,.0f} s simulated in {cpu_s:.2f} s CPU = {speed:,.0f}x"
    )
    print(
        f"fleet simulator, single steps: {base_n:,} requests, {base_sim:,.0f} s simulated in {base_cpu:.2f} s CPU = "
        f"{base_speed:,.0f}x"
    )
    print(
        f"leaps / single steps: {speed / base_speed:.1f}x; target >= {TARGET:,.0f}x real time: "
        f"{'met' if speed >= TARGET else 'MISSED'}"
    )
    hour = read_trace(TRACE).duration_s
    wall = min(cli_run() for _ in range(3))
    cli_speed = hour / wall
    print(
        f"kvfleet simulate dev --trace <the hour>: {hour:,.0f} s of trace in {wall:.2f} s wall (best of 3) = "
        f"{cli_speed:,.0f}x; target >= {CLI_TARGET:,.0f}x: {'met' if cli_speed >= CLI_TARGET else 'MISSED'}"
    )
    return 0 if speed >= TARGET and cli_speed >= CLI_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
