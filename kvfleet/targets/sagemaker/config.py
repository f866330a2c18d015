"""SageMaker's ``target:`` section: the endpoint's shape, network isolation, how an update replaces instances, the
inference AMI."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, model_validator

from kvfleet.config.base import Bool, Int
from kvfleet.config.targets import TargetSection
from kvfleet.sizing.hosting import Hosting
from kvfleet.targets.sagemaker import COMPONENT_HOSTING, TARGET

if TYPE_CHECKING:
    from kvfleet.config.schema import Deployment
    from kvfleet.sizing.planner import Candidate

Shape = Literal["variant", "inference_components"]


class SageMakerTarget(TargetSection):
    pattern_words: ClassVar[Mapping[str, str]] = {
        "inference_ami_version": "a SageMaker inference AMI version like al2023-ami-sagemaker-inference-gpu-4-1",
    }

    platform: Literal["sagemaker"] = Field(description="A SageMaker real-time endpoint.")
    shape: Shape | None = Field(
        default=None,
        description=(
            "variant: one production variant, one engine per instance spanning its GPUs. inference_components: an "
            "inference component whose copies (one engine each, on the plan's GPUs per engine) SageMaker packs "
            "onto the instances, adding and removing instances as the copies scale (managed instance scaling); "
            "the plan may then put several engines on a multi-GPU instance. Default: inference_components where "
            "scaling.min_replicas is 0 (only they scale to zero), one copy per instance; else variant."
        ),
    )
    network_isolation: Bool = Field(
        default=False,
        description="Run the container with no network access: the model must come from S3 (model.s3_uri).",
    )
    update: Literal["blue_green", "rolling"] = Field(
        default="blue_green",
        description=(
            "How an endpoint update replaces instances. blue_green: a full new fleet, old instances kept "
            "scaling.drain_budget_s after traffic moves. rolling: batches of instances, waiting "
            "scaling.drain_budget_s between batches (needs no spare capacity for a whole fleet)."
        ),
    )
    canary_percent: Int | None = Field(
        default=None,
        ge=1,
        le=50,
        description="blue_green only: send this share of capacity to the new fleet first, then the rest.",
    )
    canary_wait_s: Int = Field(
        default=600, ge=0, le=3600, description="Seconds the canary runs (alarms watched) before the rest moves."
    )
    inference_ami_version: str | None = Field(
        default=None,
        pattern=r"^al2(023)?-ami-sagemaker-inference-gpu-[0-9]+(-[0-9]+)*$",
        description=(
            "SageMaker inference AMI (ProductionVariant InferenceAmiVersion), which fixes the instances' NVIDIA "
            "driver. Default: the one with the newest driver that runs the image's CUDA (checked at synth)."
        ),
    )

    @model_validator(mode="after")
    def _canary(self) -> SageMakerTarget:
        if self.canary_percent is not None and self.update != "blue_green":
            raise ValueError("canary_percent applies to update blue_green only")
        if self.canary_percent is not None and self.shape == "inference_components":
            # An inference component's update replaces copies in batches (its RollingUpdatePolicy); a variant's
            # canary traffic shift has no counterpart there.
            raise ValueError("canary_percent applies to shape variant only; inference components update copy by copy")
        return self

    def no_scale_to_zero(self) -> str | None:
        # Only an endpoint built from inference components scales to zero (TARGET.no_scale_to_zero's source): a file
        # that asks for a variant cannot; left to the default, min_replicas 0 chooses inference components.
        return TARGET.no_scale_to_zero if self.shape == "variant" else None

    def chosen_shape(self, deployment: Deployment) -> tuple[Shape, str]:
        """The endpoint's shape for ``deployment`` and why (the plan prints it, synth builds it)."""
        if self.shape is not None:
            return self.shape, "target.shape"
        if deployment.scaling.min_replicas == 0:
            return "inference_components", "scaling.min_replicas 0: only inference components scale to zero"
        return "variant", "the default; target.shape inference_components lets the plan pack engines"

    def hosting_note(self, deployment: Deployment, candidate: Candidate | None) -> str | None:
        shape, why = self.chosen_shape(deployment)
        if shape == "variant":
            return f"endpoint: one production variant, one engine per instance ({why})"
        if candidate is None:
            return f"endpoint: inference components ({why})"
        return (
            f"endpoint: inference components, copies of {candidate.gpus_per_replica} GPU(s), "
            f"{candidate.engines_per_instance} per {candidate.name} ({why})"
        )

    @property
    def hosting(self) -> Hosting:
        # The inference-component shape lets the planner put several engines on one instance.
        return COMPONENT_HOSTING if self.shape == "inference_components" else TARGET.hosting

    def deployment_problems(self, deployment: Deployment) -> list[str]:
        problems = []
        if self.shape is None and self.canary_percent is not None and deployment.scaling.min_replicas == 0:
            problems.append(
                "target.canary_percent: scaling.min_replicas 0 builds the endpoint from inference components, which "
                "update copy by copy; remove canary_percent"
            )
        if self.network_isolation and deployment.model.s3_uri is None:
            problems.append(
                "model.s3_uri: required with target.network_isolation, which leaves the container no network to "
                "download the model"
            )
        if self.network_isolation and deployment.serving.isolated:
            problems.append(
                "serving.tenant_secret: target.network_isolation leaves the container no network to read it from "
                "Secrets Manager; turn network_isolation off to isolate tenants"
            )
        return problems

    def client_address(self, output: str) -> str:
        # `kvfleet bench` streams to an endpoint by name through the SageMaker runtime (kvfleet.bench.sagemaker).
        return f"sagemaker:{output}"


SECTION = SageMakerTarget
