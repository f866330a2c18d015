"""`kvfleet workload`: the profile of a request trace."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvfleet.cli.args import (
    _positive_float,
)


def add_parser(sub: Any) -> None:
    w = sub.add_parser("workload", help="the profile of a request trace: lengths, arrival rate, bursts, prefix reuse")
    w.add_argument("trace", help="an Azure or BurstGPT CSV, Mooncake JSON lines, or the agent's request log")
    w.add_argument("--format", dest="trace_format", choices=["azure", "mooncake", "burstgpt", "kvfleet"])
    w.add_argument("--start-s", type=float, default=0.0, help="skip this many seconds of the trace")
    w.add_argument("--duration-s", type=_positive_float, help="keep this many seconds (default: the rest)")
    w.add_argument("--rate-scale", type=_positive_float, default=1.0, help="replay at this multiple of the rate")
    w.add_argument("--json", action="store_true")


def run(a: argparse.Namespace) -> int:
    from kvfleet.workload.profile import profile, render
    from kvfleet.workload.traces import read_trace

    trace = read_trace(a.trace, fmt=a.trace_format, start_s=a.start_s, duration_s=a.duration_s, rate_scale=a.rate_scale)
    p = profile(trace)
    if a.json:
        print(json.dumps(p.as_dict(), indent=2))
    else:
        print(render(p))
    return 0
