"""EKS target for one planned deployment: a GPU node group, the engine Deployment and KEDA, on a new cluster or
on an existing one named in the config.

Choices, and why:
- On an existing cluster kvfleet owns only what it adds. Its kubectl function gets in through an EKS access
  entry (no aws-auth ConfigMap edits, which CloudFormation cannot merge safely) and runs in the cluster
  security group, so a private-only API endpoint works.
- Node autoscaling is Cluster Autoscaler on the managed GPU node group. The plan fixes the instance
  types, and managed node groups already carry the auto-discovery tags it reads; Karpenter would bypass
  the node group (its own NodePool and EC2NodeClass, an interruption queue) for flexibility this
  workload does not use.
- Prometheus runs in the cluster (the community chart's server, scraping the annotated pods). KEDA
  queries it over the cluster network with no SigV4 credentials, and a scale decision never depends on
  a remote service; long-term retention can remote-write to Amazon Managed Service for Prometheus.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar, cast

from aws_cdk import Aws, CfnJson
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_eks_v2 as eks
from aws_cdk import aws_iam as iam
from aws_cdk.lambda_layer_kubectl_v34 import KubectlV34Layer
from constructs import Construct

from kvfleet.config.targets import EksTarget, ExistingCluster
from kvfleet.errors import KvfleetError
from kvfleet.infra.context import ServingContext
from kvfleet.infra.eks import checks
from kvfleet.infra.eks import manifests as k8s
from kvfleet.infra.iam import grant_model_read, grant_token_read, put_metric_data
from kvfleet.infra.images import serving_image
from kvfleet.infra.metrics import PlatformMetrics
from kvfleet.infra.nag import acknowledge, condition_id, logical_id
from kvfleet.infra.network import ServingNetwork

# kubectl in the provider's layer: one minor either side of the API server is within kubectl's skew policy.
KUBECTL_MINOR = "1.34"
# Helm charts, pinned: (chart, repository, version).
DEVICE_PLUGIN_CHART = ("nvidia-device-plugin", "https://nvidia.github.io/k8s-device-plugin", "0.17.1")
# KEDA supports the Kubernetes minor it was released with and the two before it (keda.sh, Operate > Cluster), so
# 2.17 would already be outside its window on 1.33; 2.19 is the newest minor pinned here. Its ScaledObject API
# (keda.sh/v1alpha1) only grows between minors, so the manifests still validate against the project's schema,
# written from 2.17's fields.
KEDA_CHART = ("keda", "https://kedacore.github.io/charts", "2.19.0")
# The chart's default nodeAffinity (values.yaml, 0.17.x) admits nodes carrying one of NFD's NVIDIA labels or this one.
DEVICE_PLUGIN_NODE_LABEL = ("nvidia.com/gpu.present", "true")
PROMETHEUS_CHART = ("prometheus", "https://prometheus-community.github.io/helm-charts", "27.20.0")
CLUSTER_AUTOSCALER_CHART = ("cluster-autoscaler", "https://kubernetes.github.io/autoscaler", "9.59.0")
# Cluster Autoscaler's minor version must match the cluster's (its compatibility policy); the chart's default image
# follows one release, so the image is chosen by Kubernetes version. Tags from the project's release notes
# (registry.k8s.io/autoscaling/cluster-autoscaler).
CLUSTER_AUTOSCALER_IMAGE_TAGS = {"1.33": "v1.33.6", "1.34": "v1.34.5", "1.35": "v1.35.0"}
PROMETHEUS_URL = "http://prometheus-server.monitoring.svc.cluster.local:80"
SERVING_ACCOUNT = "kvfleet-serving"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}

_C = TypeVar("_C", bound=Construct)


class EksService(Construct):
    def __init__(self, scope: Construct, id: str, *, context: ServingContext) -> None:
        super().__init__(scope, id)
        r = context.resolved
        d = r.deployment
        target = d.target
        assert isinstance(target, EksTarget)
        network = context.network
        region = context.region
        s = d.scaling
        instance = r.candidate.instance
        tp = r.candidate.tensor_parallel_size
        per_node = max(1, instance.accelerator_count // tp)  # replicas one GPU node holds

        self.kubectl_access: eks.AccessEntry | None = None
        self.cluster: eks.ICluster
        self.kubectl_provider: eks.IKubectlProvider
        layer = KubectlV34Layer(self, "KubectlLayer")
        if target.cluster is None:
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
            # jsii's generated ICluster protocol lists a member its own Cluster class lacks in Python.
            self.cluster, self.kubectl_provider = cast(eks.ICluster, created), created.kubectl_provider
            identity = eks.IdentityType.IRSA
        else:
            self.cluster, self.kubectl_provider = self._attach(target.cluster, network, layer)
            identity = eks.IdentityType.IRSA if target.cluster.oidc_provider_arn else eks.IdentityType.POD_IDENTITY
        labels = {
            "kvfleet.io/gpu": "true",
            "kvfleet.io/deployment": r.deployment_id,
            # The device plugin chart's DaemonSet (and the GPU Operator's) requires node labels that Node Feature
            # Discovery would add; this is the one the chart documents for forcing a GPU node without NFD.
            DEVICE_PLUGIN_NODE_LABEL[0]: DEVICE_PLUGIN_NODE_LABEL[1],
        }
        self.nodegroup = eks.Nodegroup(
            self,
            "Gpu",
            cluster=self.cluster,
            subnets=network.subnet_selection,
            ami_type=eks.NodegroupAmiType.AL2023_X86_64_NVIDIA,
            instance_types=[ec2.InstanceType(instance.name)],
            min_size=max(1, math.ceil(s.min_replicas / per_node)),
            max_size=max(1, math.ceil(s.max_replicas / per_node)),
            disk_size=r.disk_gib,
            labels=labels,
            taints=[eks.TaintSpec(effect=eks.TaintEffect.NO_SCHEDULE, key=GPU_TAINT["key"], value=GPU_TAINT["value"])],
        )

        # ---- the pods' identity: the model and the token, nothing else --------------------------------
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
        access = iam.Policy(self, "ServingPolicy", roles=[serving.role])
        if d.model.s3_uri:
            grant_model_read(access, d.model.s3_uri)
        if d.model.hf_token_secret:
            grant_token_read(self, access, d.model.hf_token_secret)
        access.add_statements(put_metric_data())
        acknowledge(
            access,
            "AwsSolutions-IAM5[Resource::*]",
            "cloudwatch:PutMetricData has no resource-level permissions; limited to the kvfleet namespace.",
        )
        acknowledge(
            pull, "AwsSolutions-IAM5[Resource::*]", "ecr:GetAuthorizationToken has no resource-level permissions."
        )

        # ---- cluster add-ons, pinned ------------------------------------------------------------------
        addons = target.addons
        tolerate_gpu = [{"key": GPU_TAINT["key"], "operator": "Exists", "effect": GPU_TAINT["effect"]}]
        self.device_plugin = (
            self._chart(
                "DevicePlugin",
                DEVICE_PLUGIN_CHART,
                "kube-system",
                {"tolerations": tolerate_gpu, "nodeSelector": {"kvfleet.io/gpu": "true"}},
            )
            if addons.device_plugin
            else None
        )
        self.keda = self._chart("Keda", KEDA_CHART, "keda", {}) if addons.keda else None
        self.prometheus = (
            self._chart(
                "Prometheus",
                PROMETHEUS_CHART,
                "monitoring",
                {
                    "alertmanager": {"enabled": False},
                    "prometheus-pushgateway": {"enabled": False},
                    "prometheus-node-exporter": {"enabled": False},
                    "kube-state-metrics": {"enabled": False},
                    "server": {"global": {"scrape_interval": "15s"}, "retention": "2d"},
                },
            )
            if addons.prometheus_url is None
            else None
        )
        self.cluster_autoscaler = (
            self._cluster_autoscaler(identity, target.kubernetes_version) if addons.cluster_autoscaler else None
        )

        # ---- the workload -----------------------------------------------------------------------------
        self.options = k8s.WorkloadOptions(
            image=image,
            prometheus_server_address=addons.prometheus_url or PROMETHEUS_URL,
            namespace=target.namespace,
            service_account_name=SERVING_ACCOUNT,
            taint_key=GPU_TAINT["key"],
            taint_value=GPU_TAINT["value"],
            shm_size_gib=target.shm_size_gib,
            model_sync_image="public.ecr.aws/aws-cli/aws-cli:2.27.20" if d.model.s3_uri else None,
            put_metric_data=True,
        )
        self.manifests = k8s.manifests(r, self.options)
        problems = checks.check_consistency(
            self.manifests,
            node_taints=[GPU_TAINT],
            gpus_per_node=instance.accelerator_count,
            tensor_parallel_size=tp,
            drain_budget_s=s.drain_budget_s,
            startup_estimate_s=r.startup.ready_s,
            # kubelet adds the well-known instance-type label to every node.
            node_labels={**labels, "node.kubernetes.io/instance-type": instance.name},
        )
        if problems:
            raise KvfleetError("; ".join(problems), field=f"deployments.{d.name}.target")
        ns = self._manifest("Namespace", k8s.namespace(self.options))
        serving.node.add_dependency(ns)
        for m in self.manifests:
            kind = str(m["kind"])
            applied = self._manifest(kind, m)
            applied.node.add_dependency(ns)
            applied.node.add_dependency(serving)
            if kind == "ScaledObject" and self.keda is not None:
                applied.node.add_dependency(self.keda)  # the CRD comes with the chart
        self._acknowledge_cdk_internals()
        self.platform_metrics = PlatformMetrics()  # replicas counted from their signals
        self.outputs = {"ClusterName": self.cluster.cluster_name}

    def _attach(
        self, existing: ExistingCluster, network: ServingNetwork, layer: KubectlV34Layer
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
            # Cluster-wide: the charts install CRDs, cluster roles and webhooks.
            access_policies=[
                eks.AccessPolicy.from_access_policy_name(
                    "AmazonEKSClusterAdminPolicy", access_scope_type=eks.AccessScopeType.CLUSTER
                )
            ],
        )
        return cluster, provider

    def _kubectl(self, construct: _C) -> _C:
        """What kubectl applies waits for kubectl's access to the attached cluster (a new one orders it itself)."""
        if self.kubectl_access is not None:
            construct.node.add_dependency(self.kubectl_access)
        return construct

    def _manifest(self, id: str, manifest: dict[str, Any]) -> eks.KubernetesManifest:
        return self._kubectl(eks.KubernetesManifest(self, f"Manifest{id}", cluster=self.cluster, manifest=[manifest]))

    def _chart(self, id: str, chart: tuple[str, str, str], namespace: str, values: dict[str, Any]) -> eks.HelmChart:
        name, repository, version = chart
        return self._kubectl(
            eks.HelmChart(
                self,
                f"Chart{id}",
                cluster=self.cluster,
                chart=name,
                repository=repository,
                version=version,
                namespace=namespace,
                create_namespace=True,
                values=values,
            )
        )

    def _cluster_autoscaler(self, identity: eks.IdentityType, kubernetes_version: str) -> eks.HelmChart:
        """Cluster Autoscaler with its own role, limited to scaling the node groups of this cluster."""
        autoscaler = self._kubectl(
            eks.ServiceAccount(
                self,
                "ClusterAutoscalerAccount",
                cluster=self.cluster,
                name="cluster-autoscaler",
                namespace="kube-system",
                identity_type=identity,
            )
        )
        autoscaler_policy = iam.Policy(
            self,
            "ClusterAutoscalerPolicy",
            roles=[autoscaler.role],
            statements=[
                iam.PolicyStatement(
                    actions=[
                        "autoscaling:DescribeAutoScalingGroups",
                        "autoscaling:DescribeAutoScalingInstances",
                        "autoscaling:DescribeLaunchConfigurations",
                        "autoscaling:DescribeScalingActivities",
                        "autoscaling:DescribeTags",
                        "ec2:DescribeImages",
                        "ec2:DescribeInstanceTypes",
                        "ec2:DescribeLaunchTemplateVersions",
                        "ec2:GetInstanceTypesFromInstanceRequirements",
                        "eks:DescribeNodegroup",
                    ],
                    resources=["*"],
                ),
                iam.PolicyStatement(
                    actions=["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"],
                    resources=["*"],
                    # Only the groups of this cluster's node groups.
                    conditions={
                        "StringEquals": CfnJson(
                            self,
                            "OwnedTag",
                            value={f"aws:ResourceTag/k8s.io/cluster-autoscaler/{self.cluster.cluster_name}": "owned"},
                        )
                    },
                ),
            ],
        )
        acknowledge(
            autoscaler_policy,
            "AwsSolutions-IAM5[Resource::*]",
            "Describe calls have no resource-level permissions; scaling calls are limited by condition to the "
            "groups tagged as owned by this cluster (EKS tags its managed node groups so).",
        )
        chart = self._chart(
            "ClusterAutoscaler",
            CLUSTER_AUTOSCALER_CHART,
            "kube-system",
            {
                "image": {"tag": CLUSTER_AUTOSCALER_IMAGE_TAGS[kubernetes_version]},
                "autoDiscovery": {"clusterName": self.cluster.cluster_name},
                "awsRegion": Aws.REGION,
                "rbac": {"serviceAccount": {"create": False, "name": "cluster-autoscaler"}},
                # Slow scale-in, like the pods: a GPU node takes minutes to come back.
                "extraArgs": {"scale-down-unneeded-time": "15m", "scale-down-delay-after-add": "15m"},
            },
        )
        chart.node.add_dependency(autoscaler)
        return chart

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
        for policy in ("AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryReadOnly"):
            acknowledge(
                self.nodegroup,
                f"AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{policy}]",
                "The managed policies EKS requires for worker nodes (kubelet, VPC CNI, image pulls).",
            )
