"""Where EKS nodes pull the EKS add-on images from: one Amazon-owned ECR registry per region.

Pure data (no aws_cdk). The node role may pull from these registries and from the serving image's repository,
nothing else: EKS requires the node role to pull from ECR "because the built-in add-ons for networking run pods
that use container images from Amazon ECR" (EKS User Guide, "Amazon EKS node IAM role"), and those images live
in the registries below (EKS User Guide, "View Amazon container image registries for Amazon EKS add-ons"). The
managed policies EKS names for it, AmazonEC2ContainerRegistryPullOnly (created 2024-10-04: the pull actions,
ecr:GetAuthorizationToken, ecr:BatchGetImage and ecr:GetDownloadUrlForLayer among them) and
AmazonEC2ContainerRegistryReadOnly (those and the Describe and List calls), grant them with "Resource": "*" (AWS
Managed Policy Reference): every repository, the account's own included. The node role takes the pull actions on
these registries and the serving image's repository instead.
"""

from __future__ import annotations

# Region -> the account of its EKS add-on registry, <account>.dkr.ecr.<region>.amazonaws.com, commercial
# partition only (China, GovCloud and the European Sovereign Cloud are other partitions, whose ARNs and domains
# kvfleet does not write). Source: EKS User Guide, "View Amazon container image registries for Amazon EKS add-ons"
# (awsdocs/amazon-eks-user-guide latest/ug/workloads/add-ons-images.adoc at 1cc6ebb4). ap-east-2's row names the
# ap-east-1 domain in that table, a mistake kvfleet does not copy: it has no row here, and synth refuses the region.
ADDON_REGISTRY_ACCOUNTS: dict[str, str] = {
    "af-south-1": "877085696533",
    "ap-east-1": "800184023465",
    "ap-northeast-1": "602401143452",
    "ap-northeast-2": "602401143452",
    "ap-northeast-3": "602401143452",
    "ap-south-1": "602401143452",
    "ap-south-2": "900889452093",
    "ap-southeast-1": "602401143452",
    "ap-southeast-2": "602401143452",
    "ap-southeast-3": "296578399912",
    "ap-southeast-4": "491585149902",
    "ap-southeast-6": "333609536671",
    "ap-southeast-7": "121268973566",
    "ca-central-1": "602401143452",
    "ca-west-1": "761377655185",
    "eu-central-1": "602401143452",
    "eu-central-2": "900612956339",
    "eu-north-1": "602401143452",
    "eu-south-1": "590381155156",
    "eu-south-2": "455263428931",
    "eu-west-1": "602401143452",
    "eu-west-2": "602401143452",
    "eu-west-3": "602401143452",
    "il-central-1": "066635153087",
    "me-central-1": "759879836304",
    "me-south-1": "558608220178",
    "mx-central-1": "730335286997",
    "sa-east-1": "602401143452",
    "us-east-1": "602401143452",
    "us-east-2": "602401143452",
    "us-west-1": "602401143452",
    "us-west-2": "602401143452",
}

# The pull actions the node role takes on them (AmazonEC2ContainerRegistryPullOnly's, on named repositories);
# ecr:GetAuthorizationToken has no resource type and takes "*" (Service Authorization Reference, Amazon ECR).
ADDON_PULL_ACTIONS = ("ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer")


def addon_registry_problem(region: str) -> str | None:
    """Why a node in ``region`` could not be granted its add-on images; None when it can."""
    if region in ADDON_REGISTRY_ACCOUNTS:
        return None
    return (
        f'kvfleet knows no EKS add-on image registry for {region} (EKS User Guide, "View Amazon container image '
        'registries for Amazon EKS add-ons"), so its nodes could not pull the VPC CNI; deploy to another region'
    )
