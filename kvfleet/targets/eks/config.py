"""EKS's ``target:`` section: a new cluster or an existing one, its add-ons, Kubernetes version and namespace; and
what deployments sharing a cluster need of each other."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidatorFunctionWrapHandler, field_validator, model_validator

from kvfleet import contract
from kvfleet.config import aws
from kvfleet.config.aws import port_problem
from kvfleet.config.base import Bool, Frozen, Int
from kvfleet.config.targets import TargetSection

if TYPE_CHECKING:
    from kvfleet.config.schema import Deployment, Environment

# The Amazon EKS Kubernetes release calendar: version -> (EKS release, end of standard support, end of extended
# support). Source: docs.aws.amazon.com/eks/latest/userguide/kubernetes-versions.html#kubernetes-release-calendar
# (standard support for 14 months from the EKS release, then 12 months of extended support at extra cost per
# cluster hour), read on EKS_CALENDAR_CHECKED. Synth holds a version to these dates on the day it runs
# (support_date). A version joins EksVersion when aws-cdk-lib's eks-v2 KubernetesVersion offers it, kvfleet's
# kubectl layer (one minor either side) and a Cluster Autoscaler image of that minor cover it, and its row is here
# (tests/infra/eks/test_versions.py holds all four).
EKS_CALENDAR_CHECKED = date(2026, 12, 1)
EKS_VERSION_CALENDAR: dict[str, tuple[date, date, date]] = {
    "1.33": (date(2025, 5, 29), date(2026, 7, 29), date(2027, 7, 29)),
    "1.34": (date(2025, 10, 2), date(2026, 12, 2), date(2027, 12, 2)),
    "1.35": (date(2026, 1, 27), date(2027, 3, 27), date(2028, 3, 27)),
    "1.36": (date(2026, 6, 2), date(2027, 8, 2), date(2028, 8, 2)),
}
# Rows whose dates come from secondary sources only, not from the EKS calendar as read: AWS says 1.36 is available
# (EKS User Guide, "Review release notes for Kubernetes versions on standard support": "Kubernetes 1.36 is now
# available in Amazon EKS"), but the copy of the calendar read had no 1.36 row. Its dates agree with the 14 + 12
# month rule above and with two secondary sources, which agree with each other. The default stays on the newest
# version with a primary source (test_versions.py); read the calendar again to drop an entry here.
EKS_CALENDAR_SECONDARY: dict[str, str] = {
    "1.36": (
        "endoflife.date/amazon-eks (released 2026-06-02, end of standard support 2027-08-02, end of extended "
        "2028-08-02); devopsdreams.blogspot.com 2026/08 'Kubernetes 1.36 on Amazon EKS' (EKS release 2026-06-02, "
        "standard support through 2027-08-02)"
    ),
}
EksVersion = Literal["1.33", "1.34", "1.35", "1.36"]
# The day the support window is checked on: today (UTC) unless a caller fixes it (support_window_at).
_SUPPORT_DATE: ContextVar[date | None] = ContextVar("kvfleet_eks_support_date", default=None)


def support_date() -> date:
    """The day synth holds the Kubernetes version to the EKS calendar on: today in UTC, the calendar's timezone."""
    return _SUPPORT_DATE.get() or datetime.now(UTC).date()


@contextmanager
def support_window_at(day: date) -> Iterator[None]:
    """Check the support window as on ``day`` (tests, and a synth replayed for a past or future date)."""
    token = _SUPPORT_DATE.set(day)
    try:
        yield
    finally:
        _SUPPORT_DATE.reset(token)


def support_problem(version: str, *, new_cluster: bool, today: date) -> str | None:
    """What the EKS calendar says against ``version`` on ``today``; None when it may be used. A new cluster needs the
    version released and in standard support: EKS would create it past that date, but bill extended support from
    its first hour. An existing one may run in extended support, but not past its end (EKS then upgrades the control
    plane itself, and the manifests were validated for this version)."""
    released, standard_end, extended_end = EKS_VERSION_CALENDAR[version]
    if new_cluster:
        usable = [v for v, (start, end, _) in EKS_VERSION_CALENDAR.items() if start <= today <= end]
        instead = (
            f"create a new cluster on {max(usable, key=_minor)}"
            if usable
            else "no version this kvfleet knows is in standard support: upgrade kvfleet"
        )
        if today < released:
            return f"EKS releases {version} on {released}, after {today}; {instead}"
        if today > standard_end:
            return (
                f"EKS standard support for {version} ended {standard_end}: a new cluster on it is billed for "
                f"extended support from its first hour; {instead}"
            )
        return None
    if today > extended_end:
        return (
            f"EKS extended support for {version} ended {extended_end}: EKS upgrades the cluster's control plane "
            "itself; upgrade the cluster and set the version it runs"
        )
    return None


def _minor(version: str) -> int:
    return int(version.split(".")[1])


class ExistingCluster(Frozen):
    """An EKS cluster kvfleet attaches to: it adds the GPU node group, the add-ons asked for and the workload in its
    own namespace (target.namespace: give each deployment one of its own; with access cluster it is created and
    deleted with the stack, with access namespace it must exist).

    Nothing is looked up at synth, so the config names what the templates need. kvfleet's kubectl function gets
    in through an EKS access entry (cluster-admin, or with access namespace the Edit policy in target.namespace
    only), which needs the cluster's authentication mode to be API or
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
    access: Literal["cluster", "namespace"] = Field(
        default="cluster",
        description=(
            "What kvfleet's kubectl function may touch. `cluster`: cluster-admin (AmazonEKSClusterAdminPolicy), "
            "which the add-ons need (charts with CRDs, cluster roles, webhooks); kvfleet creates target.namespace. "
            "`namespace`: AmazonEKSEditPolicy in target.namespace only, for a cluster that already runs every add-on "
            "(every addons switch false, prometheus_url set); the namespace must exist, and its owner applies once the "
            "Role and RoleBinding synth prints, which let kvfleet manage KEDA's ScaledObject (no EKS access policy "
            "grants custom resources)."
        ),
    )
    node_image_repositories: tuple[
        Annotated[str, Field(pattern=r"^arn:aws[a-z-]*:ecr:[a-z0-9-]+:[0-9]{12}:repository/[a-z0-9._/*-]+$")], ...
    ] = Field(
        default=(),
        description=(
            "ECR repositories (ARNs; '*' in the name for a prefix) the cluster's own DaemonSets pull onto every node. "
            'kvfleet\'s GPU nodes pull with their role (EKS User Guide, "Amazon EKS node IAM role"), which may pull '
            "only the EKS add-on registry and the serving image: a log shipper or node agent that tolerates the GPU "
            "taint and comes from another repository would not start there until it is named here."
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


# The word that names every pod of the cluster as a caller (target.clients: cluster).
EVERY_POD = "cluster"
# Where NetworkPolicy is enforced: a cluster kvfleet creates gets the VPC CNI add-on with enableNetworkPolicy
# (kvfleet.targets.eks.infra.addons.VPC_CNI_ADDON); on an existing cluster it is the cluster's CNI's doing.
ENFORCEMENT = (
    "enforced where the cluster's CNI enforces NetworkPolicy: kvfleet turns it on (the VPC CNI add-on's "
    "enableNetworkPolicy) in a cluster it creates; on an existing cluster enforcement is the cluster's (the VPC CNI "
    'with enableNetworkPolicy, EKS User Guide, "Limit Pod traffic with Kubernetes network policies", or another '
    "CNI that enforces it)"
)


class EksClients(Frozen):
    """Who may reach the serving pods: the NetworkPolicy admits these to the serving port and nothing else in the
    cluster (Prometheus's own namespace is added for its scrape). At least one namespace or CIDR: a policy naming
    neither would leave the model reachable by nobody."""

    namespaces: tuple[str, ...] = Field(
        default=(),
        description="Namespaces whose pods call the model (an ingress controller, the applications).",
    )
    cidrs: tuple[str, ...] = Field(
        default=(),
        description=(
            "Source CIDRs admitted, e.g. the subnets of an AWS Load Balancer Controller ALB with target-type ip, "
            "whose ENIs connect to the pods' addresses."
        ),
    )

    @field_validator("namespaces")
    @classmethod
    def _namespaces(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for ns in v:
            if not aws.DNS_LABEL.fullmatch(ns):
                raise ValueError(f"{ns!r} is not a namespace name (lowercase letters, digits and '-', at most 63)")
        return v

    @field_validator("cidrs")
    @classmethod
    def _cidrs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for cidr in v:
            try:
                ipaddress.ip_network(cidr, strict=True)
            except ValueError:
                raise ValueError(f"{cidr!r} is not a CIDR block like 10.0.0.0/24") from None
        return v

    @model_validator(mode="after")
    def _someone(self) -> EksClients:
        if not (self.namespaces or self.cidrs):
            raise ValueError(
                f"names no caller, so the NetworkPolicy would admit nobody; give namespaces and/or cidrs, or write "
                f"clients: {EVERY_POD} (every pod in the cluster)"
            )
        return self


class EksTarget(TargetSection):
    pattern_words: ClassVar[Mapping[str, str]] = {
        "security_group_id": "a security group id like sg-0123456789abcdef0",
        "oidc_provider_arn": (
            "an IAM OIDC provider ARN like arn:aws:iam::123456789012:oidc-provider/oidc.eks.us-east-1.amazonaws.com/id/"
            "ID"
        ),
        "namespace": "a Kubernetes namespace: lowercase letters, digits and '-' (not first or last), at most 63",
        "node_image_repositories": (
            "an ECR repository ARN like arn:aws:ecr:us-east-1:123456789012:repository/logging/fluent-bit"
        ),
        "prometheus_url": "an http:// or https:// URL",
    }

    platform: Literal["eks"] = Field(description="A GPU node group and Deployment on EKS.")
    cluster: ExistingCluster | None = Field(
        default=None, description="Attach to this existing cluster instead of creating one (needs network.vpc_id)."
    )
    addons: EksAddons = Field(default_factory=EksAddons)
    kubernetes_version: EksVersion = Field(
        default="1.35",
        description=(
            "Kubernetes version of a new cluster, or of the existing one (pinned: manifests are validated for it). "
            "A new cluster needs a version in EKS standard support on the day synth runs."
        ),
    )
    namespace: str = Field(
        default="kvfleet", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", description="Namespace of the workload."
    )
    clients: EksClients | Literal["cluster"] | None = Field(
        default=None,
        description=(
            "Who may call the model (synth refuses a file that does not say): the callers' namespaces and/or source "
            f"CIDRs, or `{EVERY_POD}` for every pod in the cluster (the NetworkPolicy then admits every namespace's "
            "pods, still on the serving port only, and no address outside the cluster). The serving pods' "
            f"NetworkPolicy admits only these and Prometheus's scrape; {ENFORCEMENT}."
        ),
    )
    shm_size_gib: Int = Field(
        default=16, ge=1, le=512, description="Shared memory for the engine (tensor parallelism)."
    )

    @field_validator("clients", mode="wrap")
    @classmethod
    def _one_kind_of_clients(cls, v: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """The word or the mapping, each with its own error (a union would report both kinds against either)."""
        if v is None or v == EVERY_POD or isinstance(v, EksClients):
            return v
        if isinstance(v, str):
            raise ValueError(
                f"{v!r} is not a kind of caller; write {EVERY_POD} (every pod in the cluster), or namespaces and/or "
                "cidrs below this key"
            )
        return EksClients.model_validate(v)

    @model_validator(mode="after")
    def _supported_version(self) -> EksTarget:
        problem = support_problem(self.kubernetes_version, new_cluster=self.cluster is None, today=support_date())
        if problem is not None:
            raise ValueError(f"kubernetes_version: {problem}")
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

    @model_validator(mode="after")
    def _namespace_access_installs_nothing(self) -> EksTarget:
        """With namespace access kvfleet can write only in target.namespace, and every add-on's chart installs
        cluster-scoped objects or objects in its own namespace (kvfleet.targets.eks.infra.addons)."""
        if self.cluster is None or self.cluster.access != "namespace":
            return self
        a = self.addons
        for addon, installed in (
            ("device_plugin", a.device_plugin),
            ("keda", a.keda),
            ("prometheus_url", a.prometheus_url is None),
            ("cluster_autoscaler", a.cluster_autoscaler),
        ):
            if installed:
                fix = "set it to the cluster's Prometheus" if addon == "prometheus_url" else "set it to false"
                raise ValueError(
                    f"addons.{addon}: cluster.access namespace lets kvfleet write in namespace {self.namespace} only, "
                    f"and this add-on's chart installs outside it; {fix} (the cluster runs its own), or set "
                    "cluster.access: cluster"
                )
        return self

    def deployment_problems(self, deployment: Deployment) -> list[str]:
        if deployment.image.source != "dlc":
            return []
        return [
            "image.source: dlc runs the engine without the kvfleet agent, and on EKS the pod's drain hook and KEDA's "
            "triggers need it; use source kvfleet (or uri with a kvfleet image)"
        ]

    def undecided(self, deployment: Deployment) -> list[tuple[str, str]]:
        if self.clients is not None:
            return []
        where = "the cluster kvfleet creates enforces it" if self.cluster is None else "where the cluster enforces it"
        return [
            (
                "target.clients",
                "nobody is named to call the model, and the serving pods' NetworkPolicy admits only the callers named "
                f"({where}); write target.clients: {{namespaces: [...], cidrs: [...]}} (the callers' namespaces, a "
                f"load balancer's subnets), or target.clients: {EVERY_POD} (every pod in the cluster)",
            )
        ]

    def region_problems(self, region: str, at: str) -> list[str]:
        cluster = self.cluster
        oidc = cluster.oidc_provider_arn if cluster is not None else None
        if cluster is None or oidc is None or (where := aws.oidc_region(oidc)) == region:
            return []
        return [
            f"{at}.cluster.oidc_provider_arn: the provider is for a cluster in {where}, the environment deploys to "
            f"{region}; give the OIDC provider of cluster {cluster.name} (`aws eks describe-cluster` "
            "identity.oidc.issuer), or set region to the cluster's"
        ]

    @classmethod
    def environment_problems(cls, environment: Environment) -> list[str]:
        mine = [(i, d) for i, d in enumerate(environment.deployments) if isinstance(d.target, cls)]
        problems = _shared_cluster_problems(environment, mine)
        if environment.network.vpc_id is None and environment.network.nat_gateways == 0 and mine:
            problems.append(
                f"network.nat_gateways: deployment {mine[0][1].name} runs on EKS, whose nodes and pods need the "
                "internet (the public Helm repositories, and STS and EKS, which the new VPC has no endpoints for); "
                "set 1 or more"
            )
        # Every manifest of an EKS deployment is named <environment>-<deployment>, a DNS-1123 label.
        for i, d in mine:
            derived = contract.deployment_id(environment.name, d.name)
            if not aws.DNS_LABEL.fullmatch(derived):
                problems.append(
                    f"deployments.{i}.name: the Kubernetes objects are named {derived}, which is not a DNS label (at "
                    "most 63 lowercase letters, digits and '-'); shorten the deployment or environment name"
                )
        return problems


def _shared_cluster_problems(environment: Environment, mine: list[tuple[int, Deployment]]) -> list[str]:
    """Deployments that share an existing cluster share what lives in it: one namespace each, and each add-on
    installed by one of them only (a second Helm release of KEDA or the device plugin would collide)."""
    problems = []
    namespaces: dict[tuple[str, str], str] = {}
    installs: dict[tuple[str, str], str] = {}
    for i, d in mine:
        t = d.target
        assert isinstance(t, EksTarget)
        if t.cluster is None:
            continue
        cluster = t.cluster.name
        if environment.network.vpc_id is None:
            problems.append(
                f"network.vpc_id: deployment {d.name} attaches to cluster {cluster}; give the cluster's VPC (vpc_id, "
                "private_subnet_ids, availability_zones) so its GPU nodes join it"
            )
        where = f"deployments.{i}.target"
        if (other := namespaces.setdefault((cluster, t.namespace), d.name)) != d.name:
            problems.append(
                f"{where}.namespace: deployment {other} already uses namespace {t.namespace} on cluster {cluster}; "
                f"give {d.name} a namespace of its own"
            )
        a = t.addons
        for addon, installed in (
            ("device_plugin", a.device_plugin),
            ("keda", a.keda),
            ("prometheus_url", a.prometheus_url is None),
            ("cluster_autoscaler", a.cluster_autoscaler),
        ):
            if installed and (other := installs.setdefault((cluster, addon), d.name)) != d.name:
                fix = "set prometheus_url to its Prometheus" if addon == "prometheus_url" else "set it to false"
                problems.append(
                    f"{where}.addons.{addon}: deployment {other} already installs it on cluster {cluster}; {fix}"
                )
    return problems


SECTION = EksTarget
