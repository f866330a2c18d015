"""Hosting shapes: how a deployment target puts engines on instances. All the planner knows of a target.

The planner never sees target names; ``kvfleet.targets`` maps each target to its shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class PriceList(StrEnum):
    """Whose instance names and on-demand prices apply (the catalog has a column for each)."""

    SAGEMAKER = "sagemaker"  # SageMaker hosting: ml.* names, SageMaker's prices
    EC2 = "ec2"


class Routing(StrEnum):
    """How the host spreads requests over replicas: what the fleet's queueing looks like. The one spelling of each
    router: the planner sizes for it, the fleet simulator routes by it (kvfleet.sim.fleet), each target's stack
    configures it."""

    # To the replica with the fewest requests in flight: the fleet queues almost as one (pooled servers).
    LEAST_OUTSTANDING = "least_outstanding"
    RANDOM = "random"  # each replica an independent queue with its share of the arrivals
    ROUND_ROBIN = "round_robin"  # independent queues too, with smoother arrivals than random


@dataclass(frozen=True, kw_only=True)
class Hosting:
    price_list: PriceList
    # Only the instance types a SageMaker real-time endpoint accepts (the catalog's sagemaker_endpoint column).
    endpoint_types_only: bool = False
    # One engine per instance, spanning all its GPUs; otherwise an instance holds GPUs / TP engines.
    one_engine_per_instance: bool = False
    # The most engines one instance may hold where the host routes to each engine separately; None: no limit.
    max_engines_per_instance: int | None = None
    # The largest attached volume for image and weights, where the host limits it (GiB); instance store
    # replaces the volume on instance types that have it.
    max_volume_gib: int | None = None
    # Seconds a buffered (non-streamed) request may take before the host gives up on it; None: no such limit.
    buffered_response_limit_s: float | None = None
    routing: Routing = Routing.RANDOM
    # A shape with more instance types that the nothing-fits message may suggest, and how to ask for it.
    wider: Hosting | None = None
    wider_label: str = ""
