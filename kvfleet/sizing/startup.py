"""How long a replica takes from launch to ready: model download, weight load, engine start.

Health-check timeouts (SageMaker), instance warm-up (EC2 Auto Scaling) and startup probes
(Kubernetes) all come from this one estimate, so a bigger model gets longer timeouts everywhere.

The throughputs are deliberately conservative planning figures, not measurements: a timeout that is
too short kills a replica that would have come up, one that is too long only delays a rollback.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.sizing.units import GiB, MiB

# S3 -> instance disk, one instance. Multi-part downloads on 25-100 Gbps instances reach several GiB/s;
# 200 MiB/s also covers small instances and Hugging Face Hub downloads through one NAT gateway.
DOWNLOAD_BYTES_PER_S = 200 * MiB
# Local disk -> GPU memory (safetensors, memory-mapped).
LOAD_BYTES_PER_S = 1 * GiB
# Container start, engine process start, memory profiling, CUDA-graph capture / torch.compile.
ENGINE_INIT_S = 180.0
# Image pull of a ~10-20 GiB engine image (SageMaker and EC2 without a warm pool pay it).
IMAGE_PULL_S = 120.0


@dataclass(frozen=True, kw_only=True)
class StartupEstimate:
    checkpoint_bytes: int
    download_s: float
    load_s: float
    engine_init_s: float
    image_pull_s: float

    @property
    def ready_s(self) -> float:
        """Launch to ready, image pull included."""
        return self.image_pull_s + self.download_s + self.load_s + self.engine_init_s

    @property
    def container_start_s(self) -> float:
        """Container start to ready, once the weights are on local disk."""
        return self.load_s + self.engine_init_s


def startup_estimate(*, checkpoint_bytes: int) -> StartupEstimate:
    if checkpoint_bytes <= 0:
        raise ValueError("checkpoint_bytes must be positive")
    return StartupEstimate(
        checkpoint_bytes=checkpoint_bytes,
        download_s=checkpoint_bytes / DOWNLOAD_BYTES_PER_S,
        load_s=checkpoint_bytes / LOAD_BYTES_PER_S,
        engine_init_s=ENGINE_INIT_S,
        image_pull_s=IMAGE_PULL_S,
    )
