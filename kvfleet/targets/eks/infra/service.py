"""EKS target for one planned deployment: a GPU node group, the engine Deployment and KEDA, on a new cluster or
on an existing one named in the config.

Choices, and why:
- On an existing cluster kvfleet owns only what it adds. Its kubectl function gets in through an EKS access
  entry (no aws-auth ConfigMap edits, which CloudFormation cannot merge safely) and runs in the cluster
  security group, so a private-only API endpoint works.
- The add-ons (device plugin, KEDA, Prometheus, Cluster Autoscaler) are pinned Helm charts, each chosen in
  ``addons``; the manifests are plain data from ``manifests``, checked at synth by ``checks`` (modules of this
  package).
- A new cluster gets two node groups: the GPU one (tainted, so only GPU pods land there) and a small untainted
  one for CoreDNS and the add-ons, none of which tolerates that taint. Synth checks that every workload has a
  node group it schedules on (``kvfleet.targets.eks.infra.scheduling``) and that the VPC endpoints admit the nodes
  (``kvfleet.targets.eks.infra.access``); node disks are sized in ``kvfleet.targets.eks.infra.nodes``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, TypeVar, cast

from aws_cdk import Annotations, Aws, CfnJson, CfnMapping, Fn, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_eks_v2 as eks
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk.lambda_layer_kubectl_v34 import KubectlV34Layer
from aws_cdk.lambda_layer_kubectl_v35 import KubectlV35Layer
from constructs import Construct

from kvfleet.deployments import ResolvedDeployment
from kvfleet.errors import KvfleetError
from kvfleet.infra.context import ServingContext
from kvfleet.infra.cuda import host_for_image, nvidia_gpu
from kvfleet.infra.iam import ECR_PULL_ACTIONS, grant_model_read, grant_token_read, put_metric_data
from kvfleet.infra.images import serving_image, serving_image_cuda
from kvfleet.infra.metrics import PlatformMetrics
from kvfleet.infra.nag import acknowledge, condition_id, logical_id
from kvfleet.infra.network import ServingNetwork
from kvfleet.targets.eks import CLUSTER_OUTPUT, TARGET
from kvfleet.targets.eks.config import EVERY_POD, EksClients, EksTarget, ExistingCluster
from kvfleet.targets.eks.infra import access, checks, namespace_access, nodes, registries, scheduling
from kvfleet.targets.eks.infra import addons as charts
from kvfleet.targets.eks.infra import manifests as k8s
from kvfleet.targets.eks.infra.hosts import HOSTS

# What EKS requires of a node role besides the image pulls (EKS User Guide, "Amazon EKS node IAM role"): the kubelet's
# EC2 calls and the Pod Identity agent's, and the VPC CNI's, which kvfleet leaves on the node role (the guide
# recommends a role of the aws-node service account's own; not done here).
NODE_MANAGED_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy")
# kubectl in the provider's layer, by cluster version: kubectl's version-skew policy (kubernetes.io, "Version Skew
# Policy", kubectl) allows one minor either side of the API server. The 1.34 layer serves 1.33-1.35 (their
# templates unchanged since it was the only one), the 1.35 layer serves 1.36.
KUBECTL_MINORS = {"1.33": "1.34", "1.34": "1.34", "1.35": "1.34", "1.36": "1.35"}
KUBECTL_LAYERS: dict[str, type[KubectlV34Layer] | type[KubectlV35Layer]] = {
    "1.34": KubectlV34Layer,
    "1.35": KubectlV35Layer,
}
SERVING_ACCOUNT = "kvfleet-serving"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GPU_NODE_SELECTOR = {"kvfleet.io/gpu": "true"}  # what the device plugin and the pods select the GPU nodes by
DEPLOYMENT_NODE_LABEL = "kvfleet.io/deployment"  # value: the deployment id the node group is for
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"  # kubelet adds this well-known label to every node
MODEL_SYNC_IMAGE = "public.ecr.aws/aws-cli/aws-cli:2.27.20"  # copies model.s3_uri before the engine starts

_C = TypeVar("_C", bound=Construct)


def gpu_node_labels(r: ResolvedDeployment) -> dict[str, str]:
    """The labels of the deployment's GPU node group."""
    return {
        **GPU_NODE_SELECTOR,
        DEPLOYMENT_NODE_LABEL: r.deployment_id,
        # The device plugin chart's DaemonSet (and the GPU Operator's) requires node labels that Node Feature
        # Discovery would add; this is the one the chart documents for forcing a GPU node without NFD.
        charts.DEVICE_PLUGIN_NODE_LABEL[0]: charts.DEVICE_PLUGIN_NODE_LABEL[1],
    }


# The instance families CDK's eks-v2 Nodegroup takes for GPU ones (aws-cdk-lib 2.275.0,
# aws-eks-v2/lib/private/nodegroup.js isGpuInstanceType): for any other family it refuses the NVIDIA AMI type ("The
# specified AMI does not match the instance types architecture"), newer GPUs (p5, p5e, p5en, p6, g7, g7e) included,
# although EKS runs AL2023_x86_64_NVIDIA on them, and aws-ec2's InstanceType cannot even parse a name with a hyphen
# ("p6-b200.48xlarge": "Malformed instance type identifier"). For those the node group is given the AMI type alone
# (CDK checks the pair only when it has both) and the instance type is set on the CloudFormation resource; for these
# families CDK's own check stays in force.
CDK_GPU_FAMILIES = frozenset({"p2", "p3", "p3dn", "p4de", "p4d", "g3s", "g3", "g4dn", "g4ad", "g5", "g5g", "g6", "g6e"})


def _cdk_knows_gpu(instance_type: str) -> bool:
    return instance_type.split(".", maxsplit=1)[0] in CDK_GPU_FAMILIES


class EksService(Construct):
    """The steps, in order: the cluster (new or attached), the GPU node group, the pods' identity, the add-ons,
    the workload. Construct ids are fixed: the CloudFormation logical ids derive from them."""

    cluster: eks.ICluster
    kubectl_provider: eks.IKubectlProvider
    kubectl_access: eks.AccessEntry | None
    vpc_cni: eks.Addon | None
    nodegroup: eks.Nodegroup
    system_nodegroup: eks.Nodegroup | None
    device_plugin: eks.HelmChart | None
    keda: eks.HelmChart | None
    prometheus: eks.HelmChart | None
    cluster_autoscaler: eks.HelmChart | None
    options: k8s.WorkloadOptions
    manifests: list[k8s.Manifest]
    owner_setup: list[k8s.Manifest]  # what the cluster's owner applies once (namespace access); else empty

    def __init__(self, scope: Construct, id: str, *, context: ServingContext) -> None:
        super().__init__(scope, id)
        r = context.resolved
        target = r.deployment.target
        assert isinstance(target, EksTarget)
        self.owner_setup = []
        identity = self._cluster(target, context.network)
        self._nodegroup(r, context.network, context.region)
        self._system_nodegroup(target, context.network, context.region)
        serving, image = self._serving_identity(r, target, identity, context.region)
        self._addons(target, identity)
        self._workload(r, target, serving, image)
        self._check_placements(r, target)
        self._check_endpoint_access()
        self._acknowledge_cdk_internals()
        self.platform_metrics = PlatformMetrics()  # replicas counted from their signals
        self.outputs = {
            CLUSTER_OUTPUT: self.cluster.cluster_name,
            TARGET.group_output or "": self.nodegroup.nodegroup_name,
        }

    # ---- the cluster ---------------------------------------------------------------------------------

    def _cluster(self, target: EksTarget, network: ServingNetwork) -> eks.IdentityType:
        """A new cluster, or the existing one the config names; returns how the pods get their AWS role."""
        layer = KUBECTL_LAYERS[KUBECTL_MINORS[target.kubernetes_version]](self, "KubectlLayer")
        self.kubectl_access = None
        self.vpc_cni = None  # an existing cluster's CNI is the cluster's
        if target.cluster is not None:
            self.cluster, self.kubectl_provider = self._attach(target.cluster, target.namespace, network, layer)
            # IRSA needs the cluster's OIDC provider; without one, EKS Pod Identity.
            return eks.IdentityType.IRSA if target.cluster.oidc_provider_arn else eks.IdentityType.POD_IDENTITY
        self.cluster, self.kubectl_provider = self._new_cluster(target, network, layer)
        return eks.IdentityType.IRSA

    def _new_cluster(
        self, target: EksTarget, network: ServingNetwork, layer: lambda_.ILayerVersion
    ) -> tuple[eks.ICluster, eks.IKubectlProvider]:
        """A private cluster with every control-plane log, and no capacity of its own."""
        created = eks.Cluster(
            self,
            "Cluster",
            version=eks.KubernetesVersion.of(target.kubernetes_version),
            vpc=network.vpc,
            vpc_subnets=[network.subnet_selection],
            # Managed node groups, not Auto Mode: the plan picks the GPU instance types.
            default_capacity=0,
            default_capacity_type=eks.DefaultCapacityType.NODEGROUP,
            endpoint_access=eks.EndpointAccess.PRIVATE,
            cluster_logging=[
                eks.ClusterLoggingTypes.API,
                eks.ClusterLoggingTypes.AUDIT,
                eks.ClusterLoggingTypes.AUTHENTICATOR,
                eks.ClusterLoggingTypes.CONTROLLER_MANAGER,
                eks.ClusterLoggingTypes.SCHEDULER,
            ],
            kubectl_provider_options=eks.KubectlProviderOptions(kubectl_layer=layer),
        )
        acknowledge(
            created,
            "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/AmazonEKSClusterPolicy]",
            "The managed policy EKS requires for the cluster's service role.",
        )
        assert created.kubectl_provider is not None
        self._vpc_cni(created)
        endpoints_sg = getattr(network, "endpoint_security_group", None)  # a new VPC's interface endpoints
        if endpoints_sg is not None:
            # Managed node groups without a launch template carry only the cluster security group EKS creates
            # (EKS user guide, "View Amazon EKS security group requirements for clusters"); the nodes pull
            # images and the pods call CloudWatch and Secrets Manager through these endpoints.
            endpoints_sg.add_ingress_rule(
                created.cluster_security_group, ec2.Port.tcp(access.HTTPS), "HTTPS from the EKS nodes"
            )
        # jsii's generated ICluster protocol lists a member its own Cluster class lacks in Python.
        return cast(eks.ICluster, created), created.kubectl_provider

    def _vpc_cni(self, cluster: eks.Cluster) -> None:
        """The VPC CNI as an EKS add-on that enforces NetworkPolicy (addons.VPC_CNI_ADDON), so the serving pods'
        policy holds on the cluster kvfleet creates."""
        addon = charts.VPC_CNI_ADDON
        self.vpc_cni = eks.Addon(
            self,
            "VpcCni",
            cluster=cast(eks.ICluster, cluster),  # jsii's ICluster protocol, as in _new_cluster
            addon_name=addon.name,
            configuration_values=dict(addon.configuration),
        )
        resource = cast(eks.CfnAddon, self.vpc_cni.node.default_child)
        resource.add_property_override("ResolveConflicts", addon.resolve_conflicts)

    def _attach(
        self, existing: ExistingCluster, namespace: str, network: ServingNetwork, layer: lambda_.ILayerVersion
    ) -> tuple[eks.ICluster, eks.IKubectlProvider]:
        """The existing cluster, a kubectl provider that can reach it, and the access entry that lets it in."""
        cluster_sg = ec2.SecurityGroup.from_security_group_id(
            self, "ClusterSecurityGroup", existing.security_group_id, mutable=False
        )
        # The provider needs the cluster (for its ARN and VPC) and the cluster needs the provider (for manifests
        # and charts): the cluster is referenced twice, once without a provider to build it.
        bare = eks.Cluster.from_cluster_attributes(
            self, "ClusterForKubectl", cluster_name=existing.name, vpc=network.vpc
        )
        provider = eks.KubectlProvider(
            self,
            "KubectlProvider",
            cluster=bare,
            kubectl_layer=layer,
            # Inside the VPC, in the cluster security group: the API endpoint may be private only.
            private_subnets=network.vpc.private_subnets,
            security_groups=[cluster_sg],
        )
        cluster = eks.Cluster.from_cluster_attributes(
            self,
            "Cluster",
            cluster_name=existing.name,
            vpc=network.vpc,
            cluster_security_group_id=existing.security_group_id,
            kubectl_provider=provider,
            # kubectl's prune lists cluster-scoped kinds, which namespace access may not (namespace_access).
            prune=existing.access == "cluster",
            open_id_connect_provider=(
                iam.OpenIdConnectProvider.from_open_id_connect_provider_arn(self, "Oidc", existing.oidc_provider_arn)
                if existing.oidc_provider_arn
                else None
            ),
        )
        assert provider.role is not None
        self.kubectl_access = eks.AccessEntry(
            self,
            "KubectlAccess",
            cluster=cluster,
            principal=provider.role.role_arn,
            access_policies=[_kubectl_policy(existing, namespace)],
        )
        if existing.access == "namespace":
            # The group the owner's RoleBinding binds: the ScaledObject, which no access policy grants.
            entry = cast(eks.CfnAccessEntry, self.kubectl_access.node.default_child)
            entry.add_property_override("KubernetesGroups", [namespace_access.scaler_group(namespace)])
        return cluster, provider

    # ---- the GPU nodes --------------------------------------------------------------------------------

    def _nodegroup(self, r: ResolvedDeployment, network: ServingNetwork, region: str | None) -> None:
        """The plan's instance type, tainted for GPU pods, sized for the replica range."""
        # The AL2023 NVIDIA AMI's driver must run the image's CUDA (hosts.json).
        gpu = nvidia_gpu(r)
        self.host = (
            host_for_image(
                rule=HOSTS,
                image=f"{r.deployment.image.source} image of {r.engine} {r.deployment.engine.version}",
                cuda=serving_image_cuda(r),
                gpu=gpu,
            )
            if gpu
            else None
        )
        s = r.scaling
        per_node = max(1, r.candidate.instance.accelerator_count // r.candidate.gpus_per_replica)  # replicas
        known = _cdk_knows_gpu(r.candidate.instance.name)
        self.nodegroup = eks.Nodegroup(
            self,
            "Gpu",
            cluster=self.cluster,
            subnets=network.subnet_selection,
            ami_type=eks.NodegroupAmiType.AL2023_X86_64_NVIDIA,
            instance_types=[ec2.InstanceType(r.candidate.instance.name)] if known else None,
            min_size=max(1, math.ceil(s.min_replicas / per_node)),
            max_size=max(1, math.ceil(s.max_replicas / per_node)),
            disk_size=nodes.gpu_node_disk_gib(model_cache_gib=k8s.model_cache_gib(r), pods_per_node=per_node),
            labels=gpu_node_labels(r),
            taints=[eks.TaintSpec(effect=eks.TaintEffect.NO_SCHEDULE, key=GPU_TAINT["key"], value=GPU_TAINT["value"])],
            node_role=self._node_role("GpuNodeRole", region),
        )
        if not known:  # the instance type on the resource itself: EKS takes the NVIDIA AMI for every NVIDIA type
            resource = cast(eks.CfnNodegroup, self.nodegroup.node.default_child)
            resource.add_property_override("InstanceTypes", [r.candidate.instance.name])

    def _system_nodegroup(self, target: EksTarget, network: ServingNetwork, region: str | None) -> None:
        """A new cluster's untainted nodes for CoreDNS and the add-ons, none of which tolerates the GPU taint. An
        existing cluster brings its own (ExistingCluster says so)."""
        self.system_nodegroup = None
        if target.cluster is not None:
            return
        self.system_nodegroup = eks.Nodegroup(
            self,
            "System",
            cluster=self.cluster,
            subnets=network.subnet_selection,
            ami_type=eks.NodegroupAmiType.AL2023_X86_64_STANDARD,
            instance_types=[ec2.InstanceType(nodes.SYSTEM_INSTANCE_TYPE)],
            min_size=nodes.SYSTEM_NODES,
            max_size=nodes.SYSTEM_NODES,
            desired_size=nodes.SYSTEM_NODES,
            labels=dict([nodes.SYSTEM_NODE_LABEL]),
            node_role=self._node_role("SystemNodeRole", region),
        )

    def _node_role(self, id: str, region: str | None) -> iam.Role:
        """A node role with what EKS requires of it (kubelet, the VPC CNI) and the pull of the EKS add-on images from
        their registry only (kvfleet.targets.eks.infra.registries), never AmazonEC2ContainerRegistryReadOnly's
        every repository; the GPU role gets the serving image's repository besides (``_serving_identity``)."""
        role = iam.Role(
            self,
            id,
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name(n) for n in NODE_MANAGED_POLICIES],
        )
        for name in NODE_MANAGED_POLICIES:
            acknowledge(
                role,
                f"AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{name}]",
                'The managed policies EKS requires of a node role (EKS User Guide, "Amazon EKS node IAM role").',
            )
        if region is not None:
            if (problem := registries.addon_registry_problem(region)) is not None:
                raise KvfleetError(problem, field="region")
            account: str = registries.ADDON_REGISTRY_ACCOUNTS[region]
            # cdk-nag's name of the statement's resource, acknowledged below.
            finding = f"arn:<AWS::Partition>:ecr:{region}:{account}:repository/*"
        else:  # the stack's region picks the row at deploy
            account = self._addon_registries().find_in_map(Aws.REGION, "account")
            finding = "arn:<AWS::Partition>:ecr:<AWS::Region>:<AddonRegistries.region.account>:repository/*"
        addon_images = iam.Policy(
            self,
            f"{id}AddonImages",
            roles=[role],
            statements=[
                iam.PolicyStatement(
                    actions=list(registries.ADDON_PULL_ACTIONS),
                    resources=[
                        Fn.join("", [f"arn:{Aws.PARTITION}:ecr:{region or Aws.REGION}:", account, ":repository/*"])
                    ],
                ),
                iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"]),
            ],
        )
        acknowledge(
            addon_images,
            "AwsSolutions-IAM5[Resource::*]",
            "ecr:GetAuthorizationToken has no resource-level permissions.",
        )
        acknowledge(
            addon_images,
            f"AwsSolutions-IAM5[Resource::{finding}]",
            "AWS's EKS add-on registry of the region: every repository in it holds EKS add-on images (VPC CNI, "
            "kube-proxy, CoreDNS, the Pod Identity agent), which the nodes pull.",
        )
        return role

    def _addon_registries(self) -> CfnMapping:
        """The EKS add-on registry of every region, for a stack whose region is known only at deploy."""
        found = self.node.try_find_child("AddonRegistries")
        if isinstance(found, CfnMapping):
            return found
        return CfnMapping(
            self,
            "AddonRegistries",
            mapping={region: {"account": a} for region, a in registries.ADDON_REGISTRY_ACCOUNTS.items()},
        )

    def node_pools(self, r: ResolvedDeployment, target: EksTarget) -> list[scheduling.NodePool]:
        """The nodes as the scheduler sees them: labels (the node group's and the kubelet's) and taints."""
        gpu = scheduling.NodePool(
            name=f"GPU node group ({r.candidate.instance.name})",
            labels={**scheduling.kubelet_labels(r.candidate.instance.name), **gpu_node_labels(r)},
            taints=(GPU_TAINT,),
        )
        if target.cluster is not None:
            # Documented in ExistingCluster: the cluster has untainted Linux x86_64 nodes of its own.
            general = scheduling.NodePool(
                name=f"cluster {target.cluster.name}'s own nodes",
                labels={scheduling.OS_LABEL: "linux", scheduling.ARCH_LABEL: "amd64"},
            )
        else:
            general = scheduling.NodePool(
                name=f"system node group ({nodes.SYSTEM_INSTANCE_TYPE})",
                labels={**scheduling.kubelet_labels(nodes.SYSTEM_INSTANCE_TYPE), **dict([nodes.SYSTEM_NODE_LABEL])},
            )
        return [gpu, general]

    def placements(self, target: EksTarget) -> list[scheduling.Placement]:
        """Every workload the stack installs, with the scheduling constraints it will run with."""
        out = [] if target.cluster is not None else [charts.COREDNS_PLACEMENT]  # EKS adds it to a new cluster
        for chart in (self.device_plugin, self.keda, self.prometheus, self.cluster_autoscaler):
            if chart is not None:
                pin = next(p for p in _PINS if p.chart == chart.chart)
                out += charts.chart_placements(pin, self._chart_values[pin.chart])
        [dep] = [m for m in self.manifests if m["kind"] == "Deployment"]
        pod = dep["spec"]["template"]["spec"]
        out.append(scheduling.pod_placement("the serving pods", "kvfleet.targets.eks.infra.manifests.deployment", pod))
        return out

    def _check_placements(self, r: ResolvedDeployment, target: EksTarget) -> None:
        """Every workload has a node group it can schedule on, or synth fails."""
        problems = scheduling.check_placements(self.placements(target), self.node_pools(r, target))
        if problems:
            raise KvfleetError("; ".join(problems), field=f"deployments.{r.deployment.name}.target")

    def _check_endpoint_access(self) -> None:
        """Every node group's security group is admitted on 443 by the endpoints its nodes and pods call, or synth
        fails (kvfleet.targets.eks.infra.access)."""
        stack = Stack.of(self)

        def ref(value: Any) -> str:  # a CloudFormation value, comparable: the same group reads the same
            return json.dumps(stack.resolve(value), sort_keys=True)

        endpoints: list[access.Endpoint] = []
        rules: list[access.IngressRule] = []
        for c in stack.node.find_all():
            if isinstance(c, ec2.CfnVPCEndpoint) and c.vpc_endpoint_type == "Interface":
                endpoints.append(
                    access.Endpoint(
                        name=c.node.path,
                        service=_endpoint_service(stack.resolve(c.service_name)),
                        security_groups=tuple(ref(g) for g in stack.resolve(c.security_group_ids) or ()),
                    )
                )
            elif isinstance(c, ec2.CfnSecurityGroupIngress):
                source = c.source_security_group_id
                rules.append(
                    access.IngressRule(
                        group=ref(c.group_id),
                        source_group=None if source is None else ref(source),
                        protocol=str(c.ip_protocol),
                        from_port=_int(stack.resolve(c.from_port)),
                        to_port=_int(stack.resolve(c.to_port)),
                    )
                )
            elif isinstance(c, ec2.CfnSecurityGroup):
                for inline in stack.resolve(c.security_group_ingress) or ():  # CDK's inline rules
                    rules.append(_inline_rule(ref(c.attr_group_id), inline, ref))
        callers = []
        for group in (self.nodegroup, self.system_nodegroup):
            if group is None:
                continue
            cfn = group.node.default_child
            assert isinstance(cfn, eks.CfnNodegroup) and cfn.launch_template is None  # so: the cluster group only
            callers.append(
                access.Caller(
                    name=f"the nodes of {group.node.path}",
                    security_groups=(ref(self.cluster.cluster_security_group_id),),
                    services=access.NODE_SERVICES,
                )
            )
        problems = access.check_endpoint_access(callers, endpoints, rules)
        if problems:
            raise KvfleetError("; ".join(problems), field="network")

    # ---- the pods' identity: the image, the model and the token, nothing else ------------------------------

    def _serving_identity(
        self, r: ResolvedDeployment, target: EksTarget, identity: eks.IdentityType, region: str | None
    ) -> tuple[eks.ServiceAccount, str]:
        """The pods' service account and its policy; the nodes pull the image. Returns the account and the image."""
        d = r.deployment
        serving = self._kubectl(
            eks.ServiceAccount(
                self,
                "Serving",
                cluster=self.cluster,
                name=SERVING_ACCOUNT,
                namespace=target.namespace,
                identity_type=identity,
            )
        )
        pull = iam.Policy(self, "ImagePull", roles=[self.nodegroup.role])
        image = serving_image(self, r, pull, region)
        if target.cluster is not None and target.cluster.node_image_repositories:
            # The existing cluster's own DaemonSets run on these nodes too, pulled with this role.
            repositories = list(target.cluster.node_image_repositories)
            pull.add_statements(iam.PolicyStatement(actions=list(ECR_PULL_ACTIONS), resources=repositories))
            for arn in (a for a in repositories if "*" in a):
                acknowledge(
                    pull,
                    f"AwsSolutions-IAM5[Resource::{arn}]",
                    "repositories the file names by prefix (target.cluster.node_image_repositories) for the "
                    "cluster's own DaemonSets",
                )
        access = iam.Policy(self, "ServingPolicy", roles=[serving.role])
        if d.model.s3_uri:
            grant_model_read(access, d.model.s3_uri)
        if d.model.hf_token_secret:
            grant_token_read(self, access, d.model.hf_token_secret)
        if d.serving.tenant_secret is not None:
            grant_token_read(self, access, d.serving.tenant_secret, id="TenantSecret")
        access.add_statements(put_metric_data())
        acknowledge(
            access,
            "AwsSolutions-IAM5[Resource::*]",
            "cloudwatch:PutMetricData has no resource-level permissions; limited to the kvfleet namespace.",
        )
        acknowledge(
            pull, "AwsSolutions-IAM5[Resource::*]", "ecr:GetAuthorizationToken has no resource-level permissions."
        )
        return serving, image

    # ---- cluster add-ons, pinned (kvfleet.targets.eks.infra.addons) -------------------------------------------

    def _addons(self, target: EksTarget, identity: eks.IdentityType) -> None:
        """The add-ons the config asks for: a new cluster gets all of them, an existing one what it lacks."""
        addons = target.addons
        self._chart_values: dict[str, dict[str, Any]] = {}
        self.device_plugin = (
            self._chart(
                "DevicePlugin",
                charts.DEVICE_PLUGIN_CHART,
                charts.DEVICE_PLUGIN_NAMESPACE,
                charts.device_plugin_values(gpu_taint=GPU_TAINT, node_selector=GPU_NODE_SELECTOR),
            )
            if addons.device_plugin
            else None
        )
        # KEDA's chart defaults: the operator and its metrics API server.
        self.keda = self._chart("Keda", charts.KEDA_CHART, charts.KEDA_NAMESPACE, {}) if addons.keda else None
        self.prometheus = (
            self._chart("Prometheus", charts.PROMETHEUS_CHART, charts.PROMETHEUS_NAMESPACE, charts.prometheus_values())
            if addons.prometheus_url is None
            else None
        )
        self.cluster_autoscaler = (
            self._cluster_autoscaler(identity, target.kubernetes_version) if addons.cluster_autoscaler else None
        )

    def _cluster_autoscaler(self, identity: eks.IdentityType, kubernetes_version: str) -> eks.HelmChart:
        """Cluster Autoscaler with its own role, limited to scaling the node groups of this cluster."""
        autoscaler = self._kubectl(
            eks.ServiceAccount(
                self,
                "ClusterAutoscalerAccount",
                cluster=self.cluster,
                name=charts.CLUSTER_AUTOSCALER_ACCOUNT,
                namespace=charts.CLUSTER_AUTOSCALER_NAMESPACE,
                identity_type=identity,
            )
        )
        owned = {f"aws:ResourceTag/k8s.io/cluster-autoscaler/{self.cluster.cluster_name}": "owned"}
        autoscaler_policy = iam.Policy(
            self,
            "ClusterAutoscalerPolicy",
            roles=[autoscaler.role],
            statements=charts.cluster_autoscaler_statements(CfnJson(self, "OwnedTag", value=owned)),
        )
        acknowledge(
            autoscaler_policy,
            "AwsSolutions-IAM5[Resource::*]",
            "Describe calls have no resource-level permissions; scaling calls are limited by condition to the "
            "groups tagged as owned by this cluster (EKS tags its managed node groups so).",
        )
        chart = self._chart(
            "ClusterAutoscaler",
            charts.CLUSTER_AUTOSCALER_CHART,
            charts.CLUSTER_AUTOSCALER_NAMESPACE,
            charts.cluster_autoscaler_values(
                cluster_name=self.cluster.cluster_name, kubernetes_version=kubernetes_version, region=Aws.REGION
            ),
        )
        chart.node.add_dependency(autoscaler)
        return chart

    # ---- the workload -----------------------------------------------------------------------------------

    def _workload(self, r: ResolvedDeployment, target: EksTarget, serving: eks.ServiceAccount, image: str) -> None:
        """The manifests (kvfleet.targets.eks.infra.manifests), checked against the nodes, applied in order."""
        self.options = k8s.WorkloadOptions(
            image=image,
            prometheus_server_address=target.addons.prometheus_url or charts.PROMETHEUS_URL,
            namespace=target.namespace,
            service_account_name=SERVING_ACCOUNT,
            node_selector=GPU_NODE_SELECTOR,
            deployment_node_label=DEPLOYMENT_NODE_LABEL,
            taint_key=GPU_TAINT["key"],
            taint_value=GPU_TAINT["value"],
            shm_size_gib=target.shm_size_gib,
            model_sync_image=MODEL_SYNC_IMAGE if r.deployment.model.s3_uri else None,
            put_metric_data=True,
            **_clients(target),
        )
        self.manifests = k8s.manifests(r, self.options)
        self._check_workload(r)
        ns = self._namespace(r, target)
        if ns is not None:
            serving.node.add_dependency(ns)
        for m in self.manifests:
            kind = str(m["kind"])
            applied = self._manifest(kind, m)
            if ns is not None:
                applied.node.add_dependency(ns)
            applied.node.add_dependency(serving)
            if kind == "ScaledObject" and self.keda is not None:
                applied.node.add_dependency(self.keda)  # the CRD comes with the chart

    def _namespace(self, r: ResolvedDeployment, target: EksTarget) -> eks.KubernetesManifest | None:
        """The namespace kvfleet creates; with namespace access none (it exists, its owner's), and synth checks that
        the access covers every kind applied and says what the owner applies once."""
        namespace = k8s.namespace(self.options)
        if target.cluster is None or target.cluster.access == "cluster":
            return self._manifest("Namespace", namespace)
        kinds = [str(m["kind"]) for m in self.manifests] + ["ServiceAccount"]
        if problems := namespace_access.uncovered(kinds):
            raise KvfleetError("; ".join(problems), field=f"deployments.{r.deployment.name}.target.cluster.access")
        self.owner_setup = namespace_access.owner_setup(namespace)
        Annotations.of(self).add_info(
            f"cluster {target.cluster.name}: kvfleet's access is {namespace_access.NAMESPACE_POLICY} in namespace "
            f"{target.namespace}; before the first deploy the cluster's owner applies this once (kubectl apply -f -):\n"
            + namespace_access.render(self.owner_setup)
        )
        return None

    def _check_workload(self, r: ResolvedDeployment) -> None:
        """The manifests fit the node group built above and the agent in the pod, or synth fails."""
        instance = r.candidate.instance
        problems = checks.check_consistency(
            self.manifests,
            node_taints=[GPU_TAINT],
            gpus_per_node=instance.accelerator_count,
            tensor_parallel_size=r.candidate.tensor_parallel_size,
            pipeline_parallel_size=r.candidate.pipeline_parallel_size,
            data_parallel_size=r.candidate.data_parallel_size,
            drain_budget_s=r.scaling.drain_budget_s,
            startup_estimate_s=r.startup.ready_s,
            node_labels={**gpu_node_labels(r), INSTANCE_TYPE_LABEL: instance.name},
        )
        if problems:
            raise KvfleetError("; ".join(problems), field=f"deployments.{r.deployment.name}.target")

    # ---- helpers ----------------------------------------------------------------------------------------

    def _kubectl(self, construct: _C) -> _C:
        """What kubectl applies waits for kubectl's access to the attached cluster (a new one orders it itself)."""
        if self.kubectl_access is not None:
            construct.node.add_dependency(self.kubectl_access)
        return construct

    def _manifest(self, id: str, manifest: dict[str, Any]) -> eks.KubernetesManifest:
        return self._kubectl(eks.KubernetesManifest(self, f"Manifest{id}", cluster=self.cluster, manifest=[manifest]))

    def _chart(self, id: str, chart: charts.ChartPin, namespace: str, values: dict[str, Any]) -> eks.HelmChart:
        self._chart_values[chart.chart] = values
        return self._kubectl(
            eks.HelmChart(
                self,
                f"Chart{id}",
                cluster=self.cluster,
                chart=chart.chart,
                repository=chart.repository,
                version=chart.version,
                release=chart.release,
                namespace=namespace,
                create_namespace=True,
                values=values,
            )
        )

    def _acknowledge_cdk_internals(self) -> None:
        provider = self.kubectl_provider
        handler = provider.node.find_child("Handler")
        assert isinstance(provider, Construct) and isinstance(handler, Construct)
        why = "aws-cdk-lib's kubectl provider (a Lambda that applies the manifests and Helm charts): "
        for policy in (
            "service-role/AWSLambdaBasicExecutionRole",
            "service-role/AWSLambdaVPCAccessExecutionRole",
            "AmazonEC2ContainerRegistryReadOnly",
        ):
            acknowledge(
                provider,
                f"AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{policy}]",
                why + "CDK attaches this AWS managed policy to its role.",
            )
        acknowledge(
            provider,
            f'AwsSolutions-IAM4[Policy::{{"Fn::If":["{condition_id(handler.node.find_child("HasEcrPublic"))}",'
            '{"Fn::Join":["",["arn:",{"Ref":"AWS::Partition"},":iam::aws:policy/'
            'AmazonElasticContainerRegistryPublicReadOnly"]]},{"Ref":"AWS::NoValue"}]}]',
            why + "CDK adds public-ECR read access where the region has public ECR (for the kubectl image layer).",
        )
        acknowledge(provider, "AwsSolutions-L1", why + "CDK pins its runtime; upgrading aws-cdk-lib moves it.")
        acknowledge(
            provider,
            f"AwsSolutions-IAM5[Resource::<{logical_id(handler)}.Arn>:*]",
            why + "its framework invokes the handler's versions.",
        )


_PINS = (charts.DEVICE_PLUGIN_CHART, charts.KEDA_CHART, charts.PROMETHEUS_CHART, charts.CLUSTER_AUTOSCALER_CHART)


def _kubectl_policy(existing: ExistingCluster, namespace: str) -> eks.IAccessPolicy:
    """Cluster-admin where kvfleet installs add-ons (their charts hold CRDs, cluster roles and webhooks) and creates
    the namespace; otherwise the Edit policy in the deployment's namespace (namespace_access)."""
    if existing.access == "cluster":
        return eks.AccessPolicy.from_access_policy_name(
            "AmazonEKSClusterAdminPolicy", access_scope_type=eks.AccessScopeType.CLUSTER
        )
    return eks.AccessPolicy.from_access_policy_name(
        namespace_access.NAMESPACE_POLICY, access_scope_type=eks.AccessScopeType.NAMESPACE, namespaces=[namespace]
    )


def _clients(target: EksTarget) -> dict[str, Any]:
    """The NetworkPolicy's callers as WorkloadOptions takes them: the file's, and Prometheus's for its scrape."""
    clients = target.clients
    if clients is None:  # synth refuses the file first (kvfleet.config.choices); a construct built alone too
        raise KvfleetError(
            "who may call the model is undecided; set target.clients (kvfleet plan says what to write)",
            field="target.clients",
        )
    if clients == EVERY_POD:
        return {"clients_in_every_namespace": True}
    assert isinstance(clients, EksClients)
    return {"client_namespaces": (*clients.namespaces, *_scrape_namespaces(target)), "client_cidrs": clients.cidrs}


def _scrape_namespaces(target: EksTarget) -> tuple[str, ...]:
    """Where Prometheus scrapes the pods from: the chart's namespace, or the one a cluster-local prometheus_url
    names (<service>.<namespace>.svc...); a Prometheus elsewhere is the file's to admit (target.clients)."""
    url = target.addons.prometheus_url
    if url is None:
        return (charts.PROMETHEUS_NAMESPACE,)
    host = url.split("://", 1)[1].split("/", 1)[0].split(":", 1)[0].split(".")
    return (host[1],) if len(host) >= 3 and host[2] == "svc" else ()


def _endpoint_service(name: Any) -> str:
    """The service of an endpoint's ServiceName, com.amazonaws.<region>.<service>, as CDK writes it (a join on
    the region reference, or a plain string)."""
    if isinstance(name, dict) and "Fn::Join" in name:
        parts = name["Fn::Join"][1]
        return str(parts[-1]).lstrip(".")
    return str(name).split(".", 3)[-1]


def _inline_rule(group: str, inline: dict[str, Any], ref: Callable[[Any], str]) -> access.IngressRule:
    source = inline.get("SourceSecurityGroupId", inline.get("sourceSecurityGroupId"))
    return access.IngressRule(
        group=group,
        source_group=None if source is None else ref(source),
        protocol=str(inline.get("IpProtocol", inline.get("ipProtocol"))),
        from_port=_int(inline.get("FromPort", inline.get("fromPort"))),
        to_port=_int(inline.get("ToPort", inline.get("toPort"))),
    )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) else None
