"""Container images: kvfleet's serving image in ECR, or the AWS Deep Learning Container for a pinned release.

The SageMaker Python SDK ships the registry table of every DLC (account per region, repository, tag);
``sagemaker.core.image_uris`` reads it with no network and no credentials. For an environment-agnostic
stack the region is unknown at synth, so the table for every region goes into the template as a
CloudFormation mapping and the region picks the row at deploy time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from aws_cdk import Aws, CfnMapping, Fn
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_iam as iam
from constructs import Construct

from kvfleet.config.dlc import dlc_framework, dlc_release, kvfleet_image_on_dlc
from kvfleet.deployments import ResolvedDeployment
from kvfleet.errors import KvfleetError
from kvfleet.infra import image_build
from kvfleet.infra.cuda import CudaVersion, image_cuda
from kvfleet.infra.iam import ECR_PULL_ACTIONS

_URI = re.compile(r"^(?P<account>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(\.cn)?/(?P<repo>[^:@]+)")


@dataclass(frozen=True, kw_only=True)
class EcrImage:
    uri: str
    account: str
    region: str
    repository: str


def parse_ecr_uri(uri: str) -> EcrImage:
    m = _URI.match(uri)
    if m is None:
        raise KvfleetError(f"{uri!r} is not an ECR image URI", field="image.uri")
    return EcrImage(uri=uri, account=m["account"], region=m["region"], repository=m["repo"])


@dataclass(frozen=True, kw_only=True)
class DlcImage:
    """One DLC release: its URI in each region where AWS publishes it."""

    framework: str  # the SDK's name: vllm, djl-tensorrtllm
    version: str  # the DLC release
    engine_version: str
    by_region: tuple[tuple[str, EcrImage], ...]

    @property
    def cuda(self) -> CudaVersion | None:
        """The CUDA the release is built for, from its tag (cu130 -> (13, 0))."""
        return image_cuda(self.by_region[0][1].uri) if self.by_region else None

    def in_region(self, region: str) -> EcrImage:
        for r, img in self.by_region:
            if r == region:
                return img
        raise KvfleetError(
            f"the {self.framework} {self.version} container is not published in {region}; "
            f"regions: {', '.join(r for r, _ in self.by_region)}",
            field="region",
        )


@cache
def _releases(framework: str) -> dict[str, dict[str, Any]]:
    """The SDK's table for ``framework``: release -> {registries, repository, tag_prefix, ...}."""
    from sagemaker.core import image_uris

    cfg: dict[str, Any] = image_uris.config_for_framework(framework)
    versions = cfg.get("versions") or cfg.get("inference", {}).get("versions")
    return dict(versions or {})


@cache
def _retrieve(framework: str, version: str, region: str, instance_type: str) -> str:
    from sagemaker.core import image_uris

    return str(image_uris.retrieve(framework=framework, region=region, version=version, instance_type=instance_type))


def dlc_image(*, engine: str, engine_version: str, instance_type: str) -> DlcImage:
    """The DLC that runs ``engine`` at ``engine_version`` (vLLM DLC, or DJL's TensorRT-LLM image)."""
    framework = dlc_framework(engine)
    releases = _releases(framework)
    # The rule the loader applies too (kvfleet.config.dlc), here on the SDK's own table.
    dlc_version = dlc_release(engine, engine_version, {k: str(v.get("tag_prefix", "")) for k, v in releases.items()})
    registries: dict[str, str] = releases[dlc_version]["registries"]
    # One SDK call builds the URI (its tag format differs per framework); every other region differs only
    # in registry account and region, which the same table gives.
    ref_region = "us-east-1" if "us-east-1" in registries else sorted(registries)[0]
    ref = parse_ecr_uri(_retrieve(framework, dlc_version, ref_region, instance_type))
    tail = ref.uri.split(".amazonaws.com", 1)[1]
    rows = []
    for region in sorted(registries):
        if not re.fullmatch(r"[a-z]{2}-[a-z]+-\d", region):
            continue  # other partitions (China, GovCloud ISO) use other domains and ARNs
        uri = f"{registries[region]}.dkr.ecr.{region}.amazonaws.com{tail}"
        rows.append((region, parse_ecr_uri(uri)))
    return DlcImage(framework=framework, version=dlc_version, engine_version=engine_version, by_region=tuple(rows))


def serving_image_cuda(r: ResolvedDeployment) -> CudaVersion | None:
    """The CUDA the deployment's image needs: a DLC's from its tag; a kvfleet image's (source kvfleet, or a uri,
    whose tag the loader holds to the kvfleet format) from a cuXYZ in its tag's build id, else from its base, the
    DLC of the same engine release (containers/Dockerfile's BASE_IMAGE). None when unknown: a kvfleet
    TensorRT-LLM image (NVIDIA's base tag does not name its CUDA)."""
    img = r.deployment.image
    if img.source == "uri":
        assert img.uri is not None
        if (named := image_cuda(img.uri.split("@")[0])) is not None:
            return named
    if img.source != "dlc" and not kvfleet_image_on_dlc(r.engine):
        return None
    sm_type = r.instance_type if r.instance_type.startswith("ml.") else f"ml.{r.instance_type}"
    try:
        dlc = dlc_image(engine=r.engine, engine_version=r.deployment.engine.version, instance_type=sm_type)
    except KvfleetError:
        if img.source == "dlc":
            raise
        return None  # a kvfleet image of a release AWS publishes no DLC for: built on another base
    return dlc.cuda


def kvfleet_tag(r: ResolvedDeployment, region: str | None) -> str:
    """The default tag of a kvfleet image: its release, its contract and the digest of what it is built from, so
    an agent change is a new image in every stack (kvfleet/infra/image_build.py)."""
    return image_build.kvfleet_build(
        engine=r.engine, engine_version=r.deployment.engine.version, region=region, instance_type=r.instance_type
    ).tag


def serving_image(scope: Construct, r: ResolvedDeployment, policy: iam.Policy, region: str | None) -> str:
    """The serving image's URI, with pull access for ``policy`` on that repository only."""
    img = r.deployment.image
    pull = list(ECR_PULL_ACTIONS)
    if img.source == "kvfleet":
        repository = img.repository or image_build.repository_name(r.engine)
        repo = ecr.Repository.from_repository_name(scope, "ImageRepository", repository)
        repo.grant_pull(policy)
        return repo.repository_uri_for_tag(img.tag or kvfleet_tag(r, region))
    if img.source == "uri":
        assert img.uri is not None
        e = parse_ecr_uri(img.uri)
        repo_arn = f"arn:{Aws.PARTITION}:ecr:{e.region}:{e.account}:repository/{e.repository}"
        uri = img.uri
    else:
        # The SDK picks the processor (GPU) from a SageMaker-style name.
        sm_type = r.instance_type if r.instance_type.startswith("ml.") else f"ml.{r.instance_type}"
        dlc = dlc_image(engine=r.engine, engine_version=r.deployment.engine.version, instance_type=sm_type)
        if region is not None:
            e = dlc.in_region(region)
            repo_arn = f"arn:{Aws.PARTITION}:ecr:{e.region}:{e.account}:repository/{e.repository}"
            uri = e.uri
        else:
            # Region unknown at synth: every region's URI goes into the template, the stack's region picks.
            table = CfnMapping(
                scope,
                "DlcImage",
                mapping={reg: {"uri": row.uri, "account": row.account} for reg, row in dlc.by_region},
            )
            uri = table.find_in_map(Aws.REGION, "uri")
            repo_name = dlc.by_region[0][1].repository  # the same in every region
            repo_arn = Fn.join(
                "",
                [
                    f"arn:{Aws.PARTITION}:ecr:{Aws.REGION}:",
                    table.find_in_map(Aws.REGION, "account"),
                    f":repository/{repo_name}",
                ],
            )
    policy.add_statements(
        iam.PolicyStatement(actions=pull, resources=[repo_arn]),
        iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"]),
    )
    return uri
