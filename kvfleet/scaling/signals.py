"""The signals a fleet scales on, each with the per-replica value to hold it at."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet import contract


@dataclass(frozen=True, kw_only=True)
class SignalTarget:
    signal: contract.Signal
    value: float  # per replica: a saturation fraction, requests waiting


def signal_targets(*, saturation: float, queue: float) -> tuple[SignalTarget, ...]:
    """Each scaling signal with its target, in the contract's order (``contract.SCALING_SIGNALS``)."""
    values = {contract.REPLICA_SATURATION.name: saturation, contract.REQUESTS_WAITING.name: queue}
    return tuple(SignalTarget(signal=s, value=values[s.name]) for s in contract.SCALING_SIGNALS)
