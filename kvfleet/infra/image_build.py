"""The kvfleet serving image as a build: what containers/Dockerfile is given, the tag naming its inputs, and the
shell that builds and pushes it into an account's repository where that tag is missing.

The tag is ``<engine release>-kvfleet<contract>-<inputs>`` (``contract.image_tag`` with a build id): ``<inputs>`` is
the first 12 hex digits of a SHA-256 over the Dockerfile, every file it copies (the agent, contract.py, the engines'
adapters, the agent's requirements) and its build arguments (the engine, the contract version, the base image, which
names the engine release). Computed at synth from the checkout, it needs no git and no Docker, and it changes with
any change to what the image holds: every agent change changes the stacks' image, so it rolls out to every fleet
(an EC2 instance pulls at boot and EKS pulls IfNotPresent: a reused tag would leave warm instances and cached nodes
on the old build). An unchanged agent keeps its tag, so the build is skipped where the tag exists, as the
repositories' immutable tags require (kvfleet/infra/repository.py).
"""

from __future__ import annotations

import hashlib
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import kvfleet
from kvfleet import contract
from kvfleet.config.dlc import kvfleet_image_on_dlc
from kvfleet.engines import ENGINES
from kvfleet.errors import KvfleetError

# The checkout the image is built from: the repository root holding kvfleet/ and containers/.
SOURCE_ROOT = Path(kvfleet.__file__).resolve().parent.parent
DOCKERFILE = "containers/Dockerfile"
BUILD_ID_DIGITS = 12  # 48 bits of SHA-256: no two builds of one release and contract share a tag by chance
# Left out of the digest as they are of the build context (.dockerignore): caches the interpreter writes.
_NOT_INPUTS = re.compile(r"(^|/)(__pycache__|\.pytest_cache|\.mypy_cache|\.ruff_cache)(/|$)|\.pyc$")
# The region whose AWS container an environment without a region is built on: containers/Dockerfile's default.
DEFAULT_BASE_REGION = "us-east-1"


@dataclass(frozen=True, kw_only=True)
class ImageBuild:
    """One serving image: containers/Dockerfile built for an engine release on a base, under its inputs' tag."""

    engine: str
    engine_version: str
    base_image: str
    repository: str
    tag: str

    @property
    def build_args(self) -> dict[str, str]:
        """The Dockerfile's ARGs: CONTRACT_VERSION is checked by its build step against the copied contract.py."""
        return {
            "ENGINE": self.engine,
            "CONTRACT_VERSION": str(contract.CONTRACT_VERSION),
            "BASE_IMAGE": self.base_image,
        }

    def docker_build(self, image: str) -> list[str]:
        """The build command, from the repository root, tagging ``image`` (a repository URI with this tag)."""
        args = [a for k, v in self.build_args.items() for a in ("--build-arg", f"{k}={v}")]
        return ["docker", "build", "-f", DOCKERFILE, *args, "-t", image, "."]


def copied_sources(dockerfile: str) -> tuple[str, ...]:
    """The build-context paths the Dockerfile's COPY instructions read (``--from`` copies read no context)."""
    text = re.sub(r"\\\n", " ", dockerfile)
    found: list[str] = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True) if line.strip() else []
        if not words or words[0].upper() != "COPY":
            continue
        args = words[1:]
        if any(a.startswith("--from") for a in args):
            continue
        found.extend(a for a in [a for a in args if not a.startswith("--")][:-1])
    return tuple(found)


def _input_files(root: Path) -> list[str]:
    dockerfile = root / DOCKERFILE
    if not dockerfile.is_file():
        raise KvfleetError(
            f"no {DOCKERFILE} under {root}: the kvfleet image is built from a kvfleet checkout; run from one, or "
            "set image.tag to the tag of an image you pushed",
            field="image.tag",
        )
    files = {DOCKERFILE}
    for source in copied_sources(dockerfile.read_text(encoding="utf-8")):
        path = root / source
        if path.is_dir():
            files.update(p.relative_to(root).as_posix() for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            files.add(source)
        else:
            raise KvfleetError(f"{DOCKERFILE} copies {source}, which is not in {root}", field="image")
    return sorted(f for f in files if not _NOT_INPUTS.search(f))


def _files_digest(root: Path) -> str:
    """The digest of the input files, read once per process while no file's size or mtime changes (synth asks for
    each deployment's tag)."""
    names = _input_files(root)
    stamp = tuple((n, (st := (root / n).stat()).st_size, st.st_mtime_ns) for n in names)
    return _read_digest(root, stamp)


@cache
def _read_digest(root: Path, stamp: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for name, _, _ in stamp:
        data = (root / name).read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def inputs_digest(build_args: Mapping[str, str], *, root: Path = SOURCE_ROOT) -> str:
    """The build id: the files the image is built from and its build arguments."""
    h = hashlib.sha256(_files_digest(root).encode())
    for key in sorted(build_args):
        h.update(f"\0{key}={build_args[key]}".encode())
    return h.hexdigest()[:BUILD_ID_DIGITS]


def base_image(engine: str, engine_version: str, region: str | None, instance_type: str) -> str:
    """What containers/Dockerfile builds the engine's image on: the engine's AWS container for this release in the
    region (a DLC is published per region, so the pull stays in it), else the adapter's default base."""
    if kvfleet_image_on_dlc(engine):
        from kvfleet.infra.images import dlc_image

        sm_type = instance_type if instance_type.startswith("ml.") else f"ml.{instance_type}"
        try:
            dlc = dlc_image(engine=engine, engine_version=engine_version, instance_type=sm_type)
            return dlc.in_region(region or DEFAULT_BASE_REGION).uri
        except KvfleetError:
            pass  # no AWS container of this release (or region): the adapter's base, as the Dockerfile's default
    return ENGINES[engine].default_base_image


def repository_name(engine: str) -> str:
    """The repository an engine's images go to: image.repository's default (kvfleet/infra/repository.py makes it)."""
    return f"kvfleet-{engine}"


def kvfleet_build(
    *, engine: str, engine_version: str, region: str | None, instance_type: str, root: Path = SOURCE_ROOT
) -> ImageBuild:
    """The image a deployment of ``engine`` at ``engine_version`` in ``region`` runs when its file names no tag."""
    base = base_image(engine, engine_version, region, instance_type)
    provisional = ImageBuild(
        engine=engine, engine_version=engine_version, base_image=base, repository=repository_name(engine), tag=""
    )
    build_id = inputs_digest(provisional.build_args, root=root)
    return ImageBuild(
        engine=engine,
        engine_version=engine_version,
        base_image=base,
        repository=provisional.repository,
        tag=f"{contract.image_tag(engine_version)}-{build_id}",
    )


def _ecr_registry(image: str) -> tuple[str, str] | None:
    """(registry host, region) of an ECR image reference; None for another registry (NVIDIA's is public)."""
    m = re.match(r"^(\d{12}\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?)/", image)
    return (m[1], m[2]) if m else None


def push_script(builds: Sequence[ImageBuild], *, account: str, region: str, role_arn: str | None = None) -> list[str]:
    """Shell commands (one per line, each complete, stopping at the first failure of a build: CodeBuild fails a step
    on a command's exit status, and runs them in one shell, so ``creds`` persists) that build and push each image
    into ``account``'s repository in ``region`` unless its tag is there. With ``role_arn``, the pushes run as that
    role (a pipeline in another account assumes the stage account's CDK image-publishing role); the base image is
    pulled with the caller's own credentials."""
    q = shlex.quote
    lines: list[str] = []
    target = "aws"
    if role_arn is not None:
        lines.append(
            f"creds=$(aws sts assume-role --role-arn {q(role_arn)} --role-session-name kvfleet-image "
            "--query 'Credentials.[AccessKeyId,SecretAccessKey,SessionToken]' --output text)"
        )
        target = (
            'env AWS_ACCESS_KEY_ID="$(echo "$creds" | cut -f1)" AWS_SECRET_ACCESS_KEY="$(echo "$creds" | cut -f2)" '
            'AWS_SESSION_TOKEN="$(echo "$creds" | cut -f3)" aws'
        )
    registry = f"{account}.dkr.ecr.{region}.amazonaws.com"
    for b in sorted(set(builds), key=lambda b: (b.repository, b.tag)):
        uri = f"{registry}/{b.repository}:{b.tag}"
        steps = []
        if (base := _ecr_registry(b.base_image)) is not None:
            steps.append(
                f"aws ecr get-login-password --region {base[1]} | "
                f"docker login --username AWS --password-stdin {base[0]}"
            )
        steps += [
            shlex.join(b.docker_build(uri)),
            f"{target} ecr get-login-password --region {region} | docker login --username AWS --password-stdin "
            f"{registry}",
            f"docker push {q(uri)}",
        ]
        lines.append(
            f"if {target} ecr describe-images --region {region} --repository-name {q(b.repository)} "
            f"--image-ids imageTag={q(b.tag)} > /dev/null 2>&1; then echo {q(uri + ' is pushed already')}; "
            f"else {' && '.join(steps)}; fi"
        )
    return lines
