"""The install extras: what each optional part of kvfleet imports, and the one error when it is not installed.

``pip install kvfleet`` is the planner (plan, capacity, simulate, workload, models, instances, schema, diff,
ci-template: rich, pydantic, PyYAML). The rest comes with an extra of pyproject.toml's ``[project.optional-
dependencies]``, named here with the top-level modules it brings; tests/test_install.py holds the two together.
A command that needs an extra calls ``require_extra`` before it imports one of them, so a missing extra is one
line that says what to install, not a traceback. Standard library only: it runs before any of them is imported.
"""

from __future__ import annotations

from importlib.util import find_spec

from kvfleet.errors import MissingExtraError

# Extra -> (what it brings, in words; the top-level modules that must be importable). Top-level only: finding
# ``aws_cdk.x`` would import aws_cdk, which starts the jsii runtime.
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cdk": ("the CDK", ("aws_cdk", "constructs", "cdk_nag", "sagemaker")),
    "plot": ("matplotlib", ("matplotlib",)),
    "bench": ("aiohttp and boto3", ("aiohttp", "boto3")),
    "agent": ("aiohttp, prometheus-client, uvloop and boto3", ("aiohttp", "prometheus_client", "uvloop", "boto3")),
}


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` this installation cannot import."""
    return [m for m in EXTRAS[extra][1] if find_spec(m) is None]


def require_extra(extra: str, command: str) -> None:
    """``MissingExtraError`` (``<command> needs <what>: pip install 'kvfleet[<extra>]'``) unless every module of
    ``extra`` is installed."""
    if missing_modules(extra):
        raise MissingExtraError(f"{command} needs {EXTRAS[extra][0]}: pip install 'kvfleet[{extra}]'")
