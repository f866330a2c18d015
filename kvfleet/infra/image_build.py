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
from kvfleet import contract, versions
from kvfleet.config.dlc import kvfleet_image_on_dlc
from kvfleet.engines import ENGINES
from kvfleet.errors import KvfleetError

# The checkout the image is built from: the repository root holding kvfleet/ and containers/.
SOURCE_ROOT = Path(kvfleet.__file__).resolve().parent.parent
CONTAINERS = "containers/"
DOCKERFILE = f"{CONTAINERS}Dockerfile"
# Where an installed kvfleet carries containers/ (pyproject's package data for kvfleet.infra).
PACKAGED_CONTAINERS = "kvfleet/infra/containers/"
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


def _located(root: Path, name: str) -> Path:
    """Where build-context path ``name`` is read: under ``root`` (a checkout), else, for containers/, the copy an
    installed kvfleet carries (package data, the same bytes: kvfleet/infra/containers is a link to containers/ in a
    checkout), so the checkout and an install of the same source compute the same tag."""
    path = root / name
    if not path.exists() and name.startswith(CONTAINERS):
        return root / PACKAGED_CONTAINERS / name.removeprefix(CONTAINERS)
    return path


def _input_files(root: Path) -> list[tuple[str, Path]]:
    """(build-context path, where it is read) of each input, by path."""
    dockerfile = _located(root, DOCKERFILE)
    if not dockerfile.is_file():
        raise KvfleetError(
            f"no {DOCKERFILE} under {root}, nor the copy kvfleet ships in {PACKAGED_CONTAINERS}: reinstall kvfleet "
            "or run from a checkout, or set image.tag to the tag of an image you pushed",
            field="image.tag",
        )
    files = {DOCKERFILE: dockerfile}
    for source in copied_sources(dockerfile.read_text(encoding="utf-8")):
        path = _located(root, source)
        if path.is_dir():
            base = source.rstrip("/")
            files.update((f"{base}/{p.relative_to(path).as_posix()}", p) for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            files[source] = path
        else:
            raise KvfleetError(f"{DOCKERFILE} copies {source}, which is not in {root}", field="image")
    return sorted((n, p) for n, p in files.items() if not _NOT_INPUTS.search(n))


def _files_digest(root: Path) -> str:
    """The digest of the input files, read once per process while no file's size or mtime changes (synth asks for
    each deployment's tag)."""
    stamp = tuple((n, str(p), (st := p.stat()).st_size, st.st_mtime_ns) for n, p in _input_files(root))
    return _read_digest(stamp)


@cache
def _read_digest(stamp: tuple[tuple[str, str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for name, path, _, _ in stamp:
        data = Path(path).read_bytes()
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
    """What containers/Dockerfile builds the engine's image on, always an image of ``engine_version`` (the tag names
    that release): the engine's AWS container of this release, from the region (a DLC is published per region, so
    the pull stays in it) or else from the Dockerfile's default region; without one, the adapter's default base
    where that runs this release. Otherwise KvfleetError (engine.version): no base runs the release."""
    if kvfleet_image_on_dlc(engine):
        from kvfleet.infra.images import dlc_image

        sm_type = instance_type if instance_type.startswith("ml.") else f"ml.{instance_type}"
        try:
            dlc = dlc_image(engine=engine, engine_version=engine_version, instance_type=sm_type)
        except KvfleetError:
            pass  # no AWS container of this release: the adapter's base, if it runs the release
        else:
            published = dict(dlc.by_region)
            found = published.get(region or DEFAULT_BASE_REGION) or published.get(DEFAULT_BASE_REGION)
            return (found or dlc.by_region[0][1]).uri
    default = ENGINES[engine].default_base_image
    if (runs := base_release(default)) is not None and runs == versions.normalize(engine_version):
        return default
    raise KvfleetError(_no_base_message(engine, engine_version, default, runs), field="engine.version")


def base_release(image: str) -> str | None:
    """The engine release an image reference's tag names (``vllm:0.30.0-gpu-...``, ``release:1.0.0``), as the AWS
    vLLM DLC's and NVIDIA's TensorRT-LLM tags do (containers/Dockerfile's header); None for a tag naming none."""
    name = image.split("@", maxsplit=1)[0].rsplit("/", 1)[-1]
    tag = name.split(":", 1)[1] if ":" in name else ""
    m = re.match(r"v?(\d+(?:\.\d+)*)(?=$|[-+_])", tag)
    return versions.normalize(m[1]) if m else None


def _no_base_message(engine: str, engine_version: str, default: str, runs: str | None) -> str:
    """One line: why no base image runs the release, and the two ways out (a release with a base, or a tag of an
    image built on one the user chooses)."""
    title = ENGINES[engine].title
    if kvfleet_image_on_dlc(engine):
        from kvfleet.config.dlc import published

        releases = ", ".join(sorted(published(engine), key=versions.sort_key))
        why = f"AWS publishes no {title} container of {engine_version} (published: {releases})"
        fix = "pin engine.version to a published release"
    else:
        why = f"containers/Dockerfile's base for {title} is {default}"
        fix = f"pin engine.version: {runs}" if runs else "pin engine.version to the release that image runs"
    return (
        f"the kvfleet image is tagged with the {title} release it runs, and no base runs {title} {engine_version}: "
        f"{why}; {fix}, or build containers/Dockerfile with --build-arg BASE_IMAGE=<an image of {title} "
        f"{engine_version}>, push it and set image.tag to its tag"
    )


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


def base_repositories(builds: Sequence[ImageBuild], partition: str = "aws") -> list[str]:
    """The ARNs of the ECR repositories the builds' bases are pulled from (AWS's containers, in AWS's account). The push
    script pulls them with the caller's own credentials: the CDK image-publishing role may pull only from the
    bootstrap's asset repository (aws-cdk 2.1148.1, bootstrap-template.yaml, ImagePublishingRoleDefaultPolicy), and a
    pull from another account's repository needs the caller's own policy to allow it as well as the repository's
    (IAM User Guide, "Cross-account policy evaluation logic"). So the caller needs ecr:GetAuthorizationToken and
    these repositories' pull actions (kvfleet.infra.iam.ECR_PULL_ACTIONS)."""
    found = {
        f"arn:{partition}:ecr:{m[2]}:{m[1]}:repository/{m[3]}"
        for b in builds
        if (m := re.match(r"^(\d{12})\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com(?:\.cn)?/([^:@]+)", b.base_image))
    }
    return sorted(found)


def push_script(builds: Sequence[ImageBuild], *, account: str, region: str, role_arn: str | None = None) -> list[str]:
    """Shell commands (one per line, each complete, stopping at the first failure of a build: CodeBuild fails a step
    on a command's exit status, and runs them in one shell, so ``creds`` persists) that build and push each image
    into ``account``'s repository in ``region`` unless its tag is there. With ``role_arn``, the pushes run as that
    role (the stage account's CDK image-publishing role, which the repositories' policy lets push: the release
    pipeline's image step and the GitHub workflow's both assume it); the base image is pulled with the caller's own
    credentials (base_repositories says why)."""
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
