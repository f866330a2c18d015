"""The release pipeline file (``pipeline.yaml``): which environments a release goes through, in which order, and
where a person approves it.

Accounts and regions are not repeated here: each stage deploys the environment file it names, into the account
and region that file gives, so ``make synth ENV=<name>`` and the pipeline build the same stacks. A stage's file
must therefore name both (``account`` and ``region``): CDK Pipelines deploys a stage with the bootstrap roles of
that account, and the artifacts it needs in that region.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from kvfleet import contract
from kvfleet.config.base import Bool, Float, Frozen
from kvfleet.config.loader import (
    LoadedEnvironment,
    _line,
    environment_path,
    load_located,
    read_document,
    validate_document,
)
from kvfleet.config.schema import REGION_PATTERN
from kvfleet.errors import ConfigError, KvfleetError

PIPELINE_FILE = "pipeline.yaml"
# The IAM path of the role each stage's live-check stack makes: the pipeline's check steps may assume roles under it.
CHECK_ROLE_PATH = "/kvfleet-check/"
MAX_STAGES = 20

# CodeConnections (formerly CodeStar Connections) connection ARNs: both service prefixes are valid, the old one
# for connections made before the rename (AWS CodeConnections User Guide, "Connection ARN"; the CodeStarSource
# action takes either).
CONNECTION_ARN = (
    r"^arn:aws[a-z-]*:(codeconnections|codestar-connections):[a-z]{2}(-gov)?-[a-z]+-[0-9]:[0-9]{12}:"
    r"connection/[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
)


class PipelineSource(Frozen):
    """Where releases come from: a repository reached through a CodeConnections connection (GitHub, GitLab,
    Bitbucket), which someone with access to the repository confirms once in the console."""

    connection_arn: str = Field(
        pattern=CONNECTION_ARN,
        description="The connection's ARN (arn:aws:codeconnections:<region>:<account>:connection/<id>).",
    )
    repository: str = Field(
        pattern=r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)+$", description="owner/name of the repository holding this one."
    )
    branch: str = Field(default="main", description="The branch a release is cut from.")

    @field_validator("branch")
    @classmethod
    def _git_ref(cls, v: str) -> str:
        # git check-ref-format's rules, the ones a branch name can break.
        if (
            not v
            or len(v) > 255
            or re.search(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//", v)
            or v.startswith(("/", "-", "."))
            or v.endswith(("/", ".", ".lock"))
            or v == "@"
        ):
            raise ValueError(f"{v!r} is not a valid git branch name")
        return v


class PipelineStage(Frozen):
    environment: str = Field(
        pattern=r"^[a-z]([a-z0-9-]{0,19}[a-z0-9])?$",
        description="The environment file this stage deploys: environments/<environment>.yaml.",
    )
    approval: Bool | None = Field(
        default=None,
        description="A person approves before this stage deploys, after reading what it changes in the plan. "
        "Default: the last stage of a pipeline with several (production).",
    )


class LiveChecks(Frozen):
    """What runs after each stage deploys; a failure stops the promotion there."""

    generation: Bool = Field(
        default=True,
        description="Each deployment answers its health check and streams one generation (kvfleet check).",
    )
    kv_tolerance: Float = Field(
        default=contract.KV_SHORTFALL_TOLERANCE,
        ge=0,
        lt=1,
        description="Where a replica's /metrics is reachable (EC2, from the instance): fail when the engine "
        "allocated this much fewer KV-cache tokens than the plan (the plan drift gate).",
    )


class Pipeline(Frozen):
    name: str = Field(
        pattern=r"^[a-z]([a-z0-9-]{0,26}[a-z0-9])?$",
        description="The pipeline's name: lowercase letters, digits, '-' (not last), at most 28 characters. Its "
        "stack is kvfleet-pipeline-<name>.",
    )
    account: str = Field(pattern=r"^[0-9]{12}$", description="The account the pipeline runs in (12 digits).")
    region: str = Field(pattern=REGION_PATTERN, description="The region the pipeline runs in.")
    source: PipelineSource
    stages: tuple[PipelineStage, ...] = Field(
        min_length=1, max_length=MAX_STAGES, description="The environments a release goes through, in order."
    )
    checks: LiveChecks = Field(default_factory=LiveChecks)

    @model_validator(mode="after")
    def _each_environment_once(self) -> Pipeline:
        names = [s.environment for s in self.stages]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ValueError(
                    f"stages.{i}.environment: {name} is already stage {names.index(name)}; a release goes through "
                    "each environment once"
                )
        return self

    def approval_before(self, index: int) -> bool:
        stage = self.stages[index]
        if stage.approval is not None:
            return stage.approval
        return len(self.stages) > 1 and index == len(self.stages) - 1

    @property
    def stack_name(self) -> str:
        return f"kvfleet-pipeline-{self.name}"


@dataclass(frozen=True, kw_only=True)
class LoadedPipeline:
    pipeline: Pipeline
    source: str
    lines: dict[tuple[Any, ...], int] = field(default_factory=dict)
    # Each stage's environment file as loaded, in stage order, with its path as the pipeline names it.
    environments: tuple[LoadedEnvironment, ...] = ()
    # Relative to the pipeline file's directory, the repository root the pipeline's steps run in.
    relative_source: str = PIPELINE_FILE
    relative_paths: tuple[str, ...] = ()


def parse_pipeline(text: str | bytes, *, source: str = "<pipeline>") -> tuple[Pipeline, dict[tuple[Any, ...], int]]:
    data, lines = read_document(
        text,
        source=source,
        expected="a mapping with 'name', 'account', 'region', 'source' and 'stages'",
        kind="a pipeline file",
    )
    return validate_document(Pipeline, data, lines, source, described_in="the README (Release pipelines)"), lines


def load_pipeline(path: str | Path, *, environments_dir: str | Path | None = None) -> LoadedPipeline:
    """The pipeline file and every environment file it names, each checked as ``make synth`` checks it, and each
    with the account and region its stage deploys into."""
    p = Path(path)
    pipeline, lines = parse_pipeline(_read_pipeline_file(p), source=str(path))
    base = Path(environments_dir) if environments_dir is not None else p.parent / "environments"
    loaded: list[LoadedEnvironment] = []
    paths: list[str] = []
    root = p.parent.resolve()
    problems: list[str] = []
    for i, stage in enumerate(pipeline.stages):
        where = f"{path}:{_line(lines, ('stages', i, 'environment'))}"
        at = f"{where}: stages[{i}].environment"
        env_path = environment_path(stage.environment, environments_dir=base)
        if not env_path.is_file():
            problems.append(_missing_environment(at, env_path, base))
            continue
        try:
            env = load_located(env_path)
        except ConfigError as err:
            problems.extend(err.lines)
            continue
        problems.extend(_stage_environment_problems(env, stage, env_path, where))
        try:
            paths.append(env_path.resolve().relative_to(root).as_posix())
        except ValueError:
            problems.append(
                f"{at}: {env_path} is outside {root}, the repository the pipeline checks out; keep the environment "
                "files in it"
            )
        loaded.append(env)
    if problems:
        raise ConfigError(problems[:20] + ([f"{path}: and {len(problems) - 20} more"] if len(problems) > 20 else []))
    return LoadedPipeline(
        pipeline=pipeline,
        source=str(path),
        lines=lines,
        environments=tuple(loaded),
        relative_source=p.name,
        relative_paths=tuple(paths),
    )


def _read_pipeline_file(p: Path) -> bytes:
    if not p.is_file():
        raise KvfleetError(
            f"no pipeline file at {p}; write one (see the README's 'Release pipelines')", field="pipeline"
        )
    try:
        return p.read_bytes()
    except OSError as err:
        raise KvfleetError(f"cannot read {p}: {err.strerror}", field="pipeline") from None


def _missing_environment(at: str, env_path: Path, base: Path) -> str:
    found = sorted(x.stem for x in base.glob("*.yaml") if x.stem != "schema") if base.is_dir() else []
    return f"{at}: no environment file {env_path}" + (
        f"; found: {', '.join(found)}" if found else "; write it, or name one that exists"
    )


def _stage_environment_problems(env: LoadedEnvironment, stage: PipelineStage, env_path: Path, where: str) -> list[str]:
    """A stage's file must call itself what the stage calls it, and name the account and region it deploys into."""
    problems = []
    if env.environment.name != stage.environment:
        problems.append(
            f"{env_path}:{env.line('name')}: name: the file is named {stage.environment} by {where} "
            f"but calls itself {env.environment.name}; its stacks are named after its name: make them agree"
        )
    for key in ("account", "region"):
        if getattr(env.environment, key) is None:
            problems.append(
                f"{env_path}:1: {key}: a pipeline deploys each stage into the account and region its file names "
                f"(with that account's bootstrap roles); set {key} in this file ({where} names it)"
            )
    return problems
