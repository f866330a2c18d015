"""The install extras: `pip install kvfleet` is the planner alone, and each extra brings what its commands import.

The fast tests hold kvfleet/extras.py to pyproject.toml's extras. The slow ones build the working tree's wheel
once, install it into a clean virtualenv per extra set (none, cdk, plot, bench, agent) with pip, as a user would,
and run or import that set's entry points there: with no extra, `kvfleet plan` works, no extra's module is
importable, and a command that needs an extra says which in one line and exits 2. They need the package index
(pip's cache makes a second run fast).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvfleet import contract
from kvfleet.errors import EXIT_USER_ERROR, MissingExtraError
from kvfleet.extras import EXTRAS, require_extra

REPO = Path(__file__).resolve().parents[1]
DEV_ENV = REPO / "environments" / "dev.yaml"
SETS = ("", "cdk", "plot", "bench", "agent")  # "": no extra


def optional_dependencies() -> dict[str, list[Requirement]]:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in extras.items()}


# --- the extras as declared ------------------------------------------------------------------------------------


def test_every_extra_is_named_in_extras_py() -> None:
    assert set(optional_dependencies()) - {"all", "dev"} == set(EXTRAS)


def test_each_extras_modules_come_with_that_extra() -> None:
    """Each module require_extra looks for is installed by a distribution of its extra (read in this venv)."""
    owners = packages_distributions()
    problems = []
    for extra, reqs in optional_dependencies().items():
        if extra in EXTRAS:
            names = {canonicalize_name(r.name) for r in reqs}
            for module in EXTRAS[extra][1]:
                if not names & {canonicalize_name(d) for d in owners.get(module, [])}:
                    problems.append(f"{extra}: {module} comes from {owners.get(module)}, none of {sorted(names)}")
    assert problems == []


def test_all_is_every_extra_and_dev_installs_all() -> None:
    extras = optional_dependencies()
    assert [(r.name, r.extras) for r in extras["all"]] == [("kvfleet", set(EXTRAS))]
    assert ("kvfleet", {"all"}) in [(r.name, r.extras) for r in extras["dev"]]


def test_a_package_in_several_extras_has_one_pin() -> None:
    pins: dict[str, set[str]] = {}
    for reqs in optional_dependencies().values():
        for r in reqs:
            pins.setdefault(canonicalize_name(r.name), set()).add(str(r.specifier))
    assert {name: specs for name, specs in pins.items() if len(specs) > 1} == {}


def test_no_extras_package_is_a_base_dependency() -> None:
    base = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    names = {canonicalize_name(Requirement(r).name) for r in base}
    extras = {canonicalize_name(r.name) for reqs in optional_dependencies().values() for r in reqs}
    assert {"rich", "pydantic", "pyyaml"} <= names
    assert names & extras == set()


def test_a_missing_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    require_extra("cdk", "synth")  # installed here
    monkeypatch.setattr("kvfleet.extras.find_spec", lambda name: None)
    with pytest.raises(MissingExtraError) as err:
        require_extra("cdk", "synth")
    assert str(err.value) == "synth needs the CDK: pip install 'kvfleet[cdk]'"


# --- clean installs ---------------------------------------------------------------------------------------------


def _run(args: list[str | Path], *, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def _checked(args: list[str | Path], *, cwd: Path) -> None:
    done = _run(args, cwd=cwd)
    assert done.returncode == 0, f"{' '.join(map(str, args))}:\n{done.stdout}\n{done.stderr}"


class Venv:
    def __init__(self, root: Path, work: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.work = work  # an empty working directory: `python -c` must not import the repository's kvfleet

    def env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("KVFLEET_")
        }
        return {**env, "VIRTUAL_ENV": str(self.root), "PATH": f"{self.bin}{os.pathsep}{env.get('PATH', '')}"}

    def run(self, *args: str | Path) -> subprocess.CompletedProcess[str]:
        return _run(list(args), cwd=self.work, env=self.env())

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        return self.run(self.bin / "python", "-P", "-c", code)

    def kvfleet(self, *args: str | Path) -> subprocess.CompletedProcess[str]:
        return self.run(self.bin / "kvfleet", *args)


def _wheel(dist: Path) -> Path:
    """The working tree's wheel, built from a copy (setuptools writes build/ and egg-info beside its sources)."""
    src = dist.parent / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "kvfleet", src / "kvfleet", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _checked([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", dist, src], cwd=dist.parent)
    (wheel,) = dist.glob("kvfleet-*.whl")
    return wheel


def _install(root: Path, wheel: Path, extra: str) -> Venv:
    """A clean venv with the wheel and ``extra`` installed by this venv's pip (``--python``: no pip inside it)."""
    _checked([sys.executable, "-m", "venv", "--without-pip", root], cwd=root.parent)
    target = f"{wheel}[{extra}]" if extra else str(wheel)
    pip: list[str | Path] = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        root / "bin" / "python",
        "install",
        "--quiet",
        "--no-compile",
    ]
    _checked([*pip, target], cwd=root.parent)
    work = root.parent / f"work-{extra or 'none'}"
    work.mkdir()
    return Venv(root, work)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Venv]]:
    """The venv of an extra set ("" for none). All five install at once on first use: pip mostly waits on the
    network and the disk, so together they take little longer than the largest (cdk) alone."""
    root = tmp_path_factory.mktemp("install")
    (root / "dist").mkdir()
    wheel = _wheel(root / "dist")
    with ThreadPoolExecutor(max_workers=len(SETS)) as pool:
        futures: dict[str, Future[Venv]] = {
            extra: pool.submit(_install, root / f"venv-{extra or 'none'}", wheel, extra) for extra in SETS
        }
        yield lambda extra: futures[extra].result()
    shutil.rmtree(root)  # about 1 GB, most of it the CDK's


def _one_line_refusal(done: subprocess.CompletedProcess[str], extra: str) -> None:
    assert done.returncode == EXIT_USER_ERROR, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("kvfleet: ") and lines[0].endswith(f"pip install 'kvfleet[{extra}]'"), lines[0]


@pytest.mark.slow
def test_no_extra_plans_without_cdk_or_plotting(venv: Callable[[str], Venv]) -> None:
    v = venv("")
    done = v.kvfleet("--help")
    assert done.returncode == 0, done.stderr
    done = v.kvfleet("plan", DEV_ENV, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)
    done = v.python("import aws_cdk")
    assert done.returncode == 1 and "ModuleNotFoundError" in done.stderr
    # Not one module of any extra came with the planner.
    done = v.python(
        "import json; from kvfleet.extras import EXTRAS, missing_modules as m\n"
        "print(json.dumps({e: m(e) for e in EXTRAS}))"
    )
    assert json.loads(done.stdout) == {e: list(modules) for e, (_, modules) in EXTRAS.items()}, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (("bench", "http://127.0.0.1:9"), "bench"),
        (("check", str(DEV_ENV)), "bench"),
        (("simulate", str(DEV_ENV), "--png", "timeline.png"), "plot"),
    ],
    ids=["bench", "check", "simulate-png"],
)
def test_no_extra_a_command_needing_one_says_which(
    venv: Callable[[str], Venv], args: tuple[str, ...], extra: str
) -> None:
    _one_line_refusal(venv("").kvfleet(*args), extra)


@pytest.mark.slow
def test_no_extra_synth_says_install_the_cdk(venv: Callable[[str], Venv]) -> None:
    done = venv("").kvfleet("synth", DEV_ENV)
    _one_line_refusal(done, "cdk")
    assert "synth needs the CDK" in done.stderr


def _import_all(package: str) -> str:
    """Python that imports every module of ``package``."""
    return (
        f"import importlib, pkgutil, {package} as p\n"
        "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
    )


@pytest.mark.slow
def test_cdk_extra_imports_the_cdk_app(venv: Callable[[str], Venv]) -> None:
    # Every module of kvfleet.infra (the app, each target's construct), and the SDK table images.py reads at synth.
    done = venv("cdk").python(_import_all("kvfleet.infra") + "import sagemaker.core.image_uris")
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_plot_extra_draws_the_timeline(venv: Callable[[str], Venv]) -> None:
    v = venv("plot")
    done = v.kvfleet("simulate", DEV_ENV, "--png", "timeline.png")
    assert done.returncode == 0, done.stderr
    assert (v.work / "timeline.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_bench_extra_imports_the_client(venv: Callable[[str], Venv]) -> None:
    v = venv("bench")
    done = v.python(_import_all("kvfleet.bench"))
    assert done.returncode == 0, done.stderr
    assert v.kvfleet("bench", "--help").returncode == 0


@pytest.mark.slow
def test_agent_extra_starts_the_agent(venv: Callable[[str], Venv]) -> None:
    v = venv("agent")
    # The console script runs main, which asks for its settings (the container's environment) first.
    done = v.run(v.bin / "kvfleet-agent")
    assert done.returncode == EXIT_USER_ERROR, done.stderr
    assert done.stderr.startswith(f"{contract.AGENT_COMMAND}: {contract.ENV_MODEL}:"), done.stderr
    done = v.python(_import_all("kvfleet.agent"))
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_cdk_extra_computes_the_checkouts_image_tag(venv: Callable[[str], Venv]) -> None:
    # An install has no containers/: the Dockerfile and what it copies from there come as package data, so the
    # installed kvfleet tags the image the pipeline builds from the checkout of the same source.
    from kvfleet.infra.image_build import SOURCE_ROOT, kvfleet_build

    args = {"engine": "vllm", "engine_version": "0.30.0", "region": "eu-west-1", "instance_type": "g6e.xlarge"}
    done = venv("cdk").python(
        "import json, kvfleet.infra.image_build as b\n"
        f"print(json.dumps([str(b.SOURCE_ROOT), b.kvfleet_build(**{args!r}).tag]))"
    )
    assert done.returncode == 0, done.stderr
    root, tag = json.loads(done.stdout)
    assert root != str(SOURCE_ROOT) and not (Path(root) / "containers").exists()  # the install's, not this checkout
    assert (
        tag == kvfleet_build(engine="vllm", engine_version="0.30.0", region="eu-west-1", instance_type="g6e.xlarge").tag
    )
