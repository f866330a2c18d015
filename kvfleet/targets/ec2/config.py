"""EC2's ``target:`` section: the load balancer, the warm pool, the AMI and how an update replaces instances."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from kvfleet.config import aws
from kvfleet.config.base import Bool, Frozen, Int
from kvfleet.config.targets import PoolState, TargetSection
from kvfleet.sizing.hosting import Hosting
from kvfleet.targets.ec2 import PACKED

if TYPE_CHECKING:
    from kvfleet.config.schema import Deployment, Environment


class LoadBalancerConfig(Frozen):
    internal: Bool = Field(default=True, description="An internal load balancer (reachable from inside the VPC).")
    certificate_arn: str | None = Field(
        default=None,
        pattern=r"^arn:aws[a-z-]*:acm:[a-z0-9-]+:[0-9]{12}:certificate/[0-9a-f-]+$",
        description="ACM certificate: serve HTTPS on 443 with it (default: HTTP on 80 inside the VPC).",
    )
    allowed_cidrs: tuple[str, ...] = Field(
        default=(),
        description="Client networks allowed to reach the load balancer. Default: the VPC's own CIDR.",
    )
    idle_timeout_s: Int = Field(
        default=900,
        ge=60,
        le=4000,
        description="Seconds a connection may stay silent: a non-streaming generation sends nothing until done.",
    )

    @field_validator("allowed_cidrs")
    @classmethod
    def _cidrs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        import ipaddress

        for c in v:
            try:
                net = ipaddress.ip_network(c, strict=True)
            except ValueError:
                raise ValueError(f"not a CIDR block: {c}") from None
            if net.prefixlen == 0:
                raise ValueError(f"{c} opens the load balancer to every address; name your client networks")
        return v

    @model_validator(mode="after")
    def _public_serves_https(self) -> LoadBalancerConfig:
        # Prompts, completions and tenant headers would cross the internet in clear text over HTTP.
        if not self.internal and self.certificate_arn is None:
            raise ValueError(
                "internal: an internet-facing load balancer (internal: false) serves HTTPS only; set "
                "certificate_arn to an ACM certificate in this region, or keep internal: true"
            )
        return self


class WarmPoolConfig(Frozen):
    enabled: Bool = Field(
        default=False, description="Keep pre-initialized instances so scale-out skips boot and image pull."
    )
    min_size: Int = Field(
        default=1,
        ge=0,
        description=(
            "Instances kept in the warm pool: the pool holds exactly this many (its MinSize and "
            "MaxGroupPreparedCapacity), not the group's max_replicas minus its desired capacity."
        ),
    )
    state: PoolState = Field(
        default="Stopped",
        description=(
            "Stopped: pay only for volumes; Running: fastest, pay for the instances. Hibernated is refused: EC2 "
            "hibernates no GPU instance type."
        ),
    )

    @model_validator(mode="after")
    def _size(self) -> WarmPoolConfig:
        # MaxGroupPreparedCapacity = MinSize = 0 would keep no instance warm at all.
        if self.enabled and self.min_size < 1:
            raise ValueError("min_size must be at least 1 with a warm pool (enabled: true)")
        # EC2 hibernates only the general purpose, compute, memory and storage optimized families it lists, with at
        # most 150 GB of RAM (EC2 User Guide, "Prerequisites for EC2 instance hibernation"): no GPU instance, and
        # GPU memory could not be saved anyway. A hibernated pool of GPU instances would never leave launch.
        if self.state == "Hibernated":
            raise ValueError(
                "state: Hibernated needs a type EC2 can hibernate, and no GPU instance type is one; use Stopped "
                "(volumes only) or Running"
            )
        return self


class Ec2Target(TargetSection):
    pattern_words: ClassVar[Mapping[str, str]] = {
        "certificate_arn": "an ACM certificate ARN like arn:aws:acm:us-east-1:123456789012:certificate/ID",
        "ami_parameter": "a public SSM parameter path under /aws/service/",
    }

    platform: Literal["ec2"] = Field(description="An EC2 GPU Auto Scaling group behind a load balancer.")
    load_balancer: LoadBalancerConfig = Field(default_factory=LoadBalancerConfig)
    warm_pool: WarmPoolConfig = Field(default_factory=WarmPoolConfig)
    ami_parameter: str = Field(
        default="/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-amazon-linux-2023/latest/ami-id",
        pattern=r"^/aws/service/[A-Za-z0-9_./-]+$",
        description=(
            "Public SSM parameter of the GPU AMI (NVIDIA driver, Docker and the container toolkit), resolved at "
            "deploy time. Default: the Deep Learning Base OSS NVIDIA Driver AMI on Amazon Linux 2023."
        ),
    )
    min_healthy_percent: Int = Field(
        default=90,
        ge=0,
        le=100,
        description=(
            "Share of the fleet kept in service while an update replaces instances (an instance refresh, which "
            "replaces the warm pool's instances too)."
        ),
    )
    capacity_rebalance: Bool = Field(
        default=True, description="Replace instances at elevated risk of interruption before they are reclaimed."
    )
    pack_engines: Bool = Field(
        default=False,
        description=(
            "Several engines per instance where the plan's layout takes fewer GPUs than the instance has (at most "
            "5: each engine slot is a target group on its own port behind one forward action). Default: one engine "
            "per instance, spanning its GPUs."
        ),
    )
    shm_size_gib: Int = Field(
        default=16, ge=1, le=512, description="Shared memory for the engine (tensor parallelism)."
    )

    def host_image_parameter(self) -> str:
        """The parameter the environment's lock pins (kvfleet.config.host_lock.PinsHostImage)."""
        return self.ami_parameter

    @property
    def hosting(self) -> Hosting:
        return PACKED if self.pack_engines else super().hosting

    def deployment_problems(self, deployment: Deployment) -> list[str]:
        if self.pack_engines and deployment.scaling.min_replicas == 0:
            # Scale to zero wakes on the requests of the fleet's one target group (kvfleet.infra.scaling).
            return [
                "target.pack_engines: scale to zero counts one target group's requests and a packed instance has "
                "one per engine; set scaling.min_replicas to 1 or more, or pack_engines: false"
            ]
        return []

    def region_problems(self, region: str, at: str) -> list[str]:
        cert = self.load_balancer.certificate_arn
        if cert is None or (where := aws.arn_region(cert)) == region:
            return []
        return [
            f"{at}.load_balancer.certificate_arn: the certificate is in {where}, the load balancer in {region}; ACM "
            f"certificates are regional: request or import it in {region}"
        ]

    @classmethod
    def environment_problems(cls, environment: Environment) -> list[str]:
        if environment.network.vpc_id is None:
            return []
        # The load balancer's security group admits the VPC's CIDR by default, which synth does not look up.
        return [
            f"network.vpc_id: deployment {d.name} needs target.load_balancer.allowed_cidrs with an existing VPC (its "
            "CIDR is not looked up at synth)"
            for d in environment.deployments
            if isinstance(d.target, cls) and not d.target.load_balancer.allowed_cidrs
        ]

    def client_address(self, output: str) -> str:
        return f"{'https' if self.load_balancer.certificate_arn else 'http'}://{output}"

    def warm_pool_kept(self) -> tuple[PoolState, int] | None:
        if not self.warm_pool.enabled:
            return None
        return self.warm_pool.state, self.warm_pool.min_size


SECTION = Ec2Target
