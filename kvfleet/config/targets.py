"""Each deployment target's section of an environment file (``target:``), one class per target.

A class's ``platform`` literal is its name in ``kvfleet.targets.TARGETS`` (a test checks they agree), and
``hosting`` is the shape the planner sizes for.
"""

from __future__ import annotations

from datetime import date
from typing import Annotated, Literal, get_args

from pydantic import Field, field_validator, model_validator

from kvfleet.config.aws import port_problem
from kvfleet.config.base import Bool, Frozen, Int
from kvfleet.sizing.hosting import Hosting
from kvfleet.targets import TARGETS


class _TargetConfig(Frozen):
    platform: str

    @property
    def hosting(self) -> Hosting:
        return TARGETS[self.platform].hosting


class SageMakerTarget(_TargetConfig):
    platform: Literal["sagemaker"] = Field(description="A SageMaker real-time endpoint.")
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
        return self


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
    state: Literal["Stopped", "Running", "Hibernated"] = Field(
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


class Ec2Target(_TargetConfig):
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
    shm_size_gib: Int = Field(
        default=16, ge=1, le=512, description="Shared memory for the engine (tensor parallelism)."
    )


# The Amazon EKS Kubernetes release calendar: version -> (EKS release, end of standard support, end of extended
# support). Source: docs.aws.amazon.com/eks/latest/userguide/kubernetes-versions.html#kubernetes-release-calendar
# (standard support for 14 months from the EKS release, then 12 months of extended support at extra cost per
# cluster hour), checked on EKS_CALENDAR_CHECKED. A version joins EksVersion when kvfleet's kubectl layer (one
# minor either side) and a Cluster Autoscaler image of that minor cover it.
EKS_CALENDAR_CHECKED = date(2026, 12, 1)
EKS_VERSION_CALENDAR: dict[str, tuple[date, date, date]] = {
    "1.33": (date(2025, 5, 29), date(2026, 7, 29), date(2027, 7, 29)),
    "1.34": (date(2025, 10, 2), date(2026, 12, 2), date(2027, 12, 2)),
    "1.35": (date(2026, 1, 27), date(2027, 3, 27), date(2028, 3, 27)),
}
EksVersion = Literal["1.33", "1.34", "1.35"]
# A new cluster starts with at least this much standard support left, so its first upgrade is planned, not forced
# into extended-support pricing within weeks.
NEW_CLUSTER_MIN_STANDARD_SUPPORT_DAYS = 90


class ExistingCluster(Frozen):
    """An EKS cluster kvfleet attaches to: it adds the GPU node group, the add-ons asked for and the workload in its
    own namespace (target.namespace, created and deleted with the stack: give each deployment one of its own).

    Nothing is looked up at synth, so the config names what the templates need. kvfleet's kubectl function gets
    cluster-admin through an EKS access entry, which needs the cluster's authentication mode to be API or
    API_AND_CONFIG_MAP (`aws eks update-cluster-config --name NAME --access-config
    authenticationMode=API_AND_CONFIG_MAP` switches a ConfigMap-only cluster without disruption). It runs in the
    cluster security group inside network.private_subnet_ids, so those subnets need a route to the EKS and STS
    APIs (NAT or VPC endpoints); the Helm charts it installs come from their public repositories.

    The cluster must have schedulable nodes without taints (Linux, x86_64) besides the GPU group kvfleet adds:
    the add-ons it installs there (KEDA, Prometheus, Cluster Autoscaler) tolerate no taint, and the GPU nodes are
    tainted nvidia.com/gpu=present:NoSchedule. Its EKS version may be in extended support.
    """

    name: str = Field(
        pattern=r"^[0-9A-Za-z][A-Za-z0-9_-]{0,99}$", description="Name of the existing cluster (in this region)."
    )
    security_group_id: str = Field(
        pattern=r"^sg-[0-9a-f]{8,17}$",
        description=(
            "The cluster security group EKS created for the cluster (`aws eks describe-cluster` "
            "resourcesVpcConfig.clusterSecurityGroupId): the kubectl function runs in it to reach the API endpoint."
        ),
    )
    oidc_provider_arn: str | None = Field(
        default=None,
        pattern=r"^arn:aws[a-z-]*:iam::[0-9]{12}:oidc-provider/oidc\.eks\.[a-z0-9-]+\.amazonaws\.com(\.cn)?/id/[0-9A-Za-z]+$",
        description=(
            "The cluster's IAM OIDC provider: pods get their AWS roles through IRSA. Without it they get them "
            "through EKS Pod Identity, which needs the eks-pod-identity-agent add-on on the cluster."
        ),
    )


class EksAddons(Frozen):
    """The cluster add-ons the workload needs. A new cluster gets all of them; an existing one may already run some."""

    device_plugin: Bool = Field(
        default=True,
        description="Install the NVIDIA device plugin (off when the cluster already runs it or the GPU Operator).",
    )
    keda: Bool = Field(default=True, description="Install KEDA (off when the cluster already runs KEDA 2.x).")
    prometheus_url: str | None = Field(
        default=None,
        pattern=r"^https?://[A-Za-z0-9.-]+(:[0-9]+)?(/[^\s]*)?$",
        description=(
            "Query this Prometheus instead of installing one. It must scrape pods annotated prometheus.io/scrape "
            "(the kubernetes-pods job of the community chart does) and answer KEDA without authentication."
        ),
    )
    cluster_autoscaler: Bool = Field(
        default=True,
        description=(
            "Install Cluster Autoscaler for the GPU node group (off when the cluster already runs one with "
            "node group auto-discovery: EKS tags managed node groups for it)."
        ),
    )

    @field_validator("prometheus_url")
    @classmethod
    def _port(cls, v: str | None) -> str | None:
        if v is not None and (problem := port_problem(v)) is not None:
            raise ValueError(problem)
        return v


class EksTarget(_TargetConfig):
    platform: Literal["eks"] = Field(description="A GPU node group and Deployment on EKS.")
    cluster: ExistingCluster | None = Field(
        default=None, description="Attach to this existing cluster instead of creating one (needs network.vpc_id)."
    )
    addons: EksAddons = Field(default_factory=EksAddons)
    kubernetes_version: EksVersion = Field(
        default="1.35",
        description=(
            "Kubernetes version of a new cluster, or of the existing one (pinned: manifests are validated for it). "
            f"A new cluster needs {NEW_CLUSTER_MIN_STANDARD_SUPPORT_DAYS} days of EKS standard support left."
        ),
    )
    namespace: str = Field(
        default="kvfleet", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", description="Namespace of the workload."
    )
    shm_size_gib: Int = Field(
        default=16, ge=1, le=512, description="Shared memory for the engine (tensor parallelism)."
    )

    @model_validator(mode="after")
    def _new_cluster_version(self) -> EksTarget:
        if self.cluster is None:
            end = EKS_VERSION_CALENDAR[self.kubernetes_version][1]
            left = (end - EKS_CALENDAR_CHECKED).days
            if left < NEW_CLUSTER_MIN_STANDARD_SUPPORT_DAYS:
                newest = max(EKS_VERSION_CALENDAR, key=lambda v: EKS_VERSION_CALENDAR[v][1])
                raise ValueError(
                    f"kubernetes_version: EKS standard support for {self.kubernetes_version} ends {end} ("
                    f"{max(left, 0)} days after {EKS_CALENDAR_CHECKED}); create a new cluster on {newest}"
                )
        return self

    @model_validator(mode="after")
    def _new_cluster_addons(self) -> EksTarget:
        if self.cluster is None:
            missing = [name for name in ("device_plugin", "keda") if not getattr(self.addons, name)]
            if missing:
                raise ValueError(
                    f"addons.{missing[0]}: a new cluster has nothing else to provide it; set it to true, or attach "
                    "to an existing cluster with target.cluster"
                )
        return self


# The targets an environment file may name; a new target adds its class here.
Target = Annotated[SageMakerTarget | Ec2Target | EksTarget, Field(discriminator="platform")]

# The classes of the union, for code that walks every target.
TARGET_CLASSES: tuple[type[_TargetConfig], ...] = get_args(get_args(Target)[0])
