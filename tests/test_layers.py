"""The package's layers and the one direction their imports may point.

Every ``import`` in ``kvfleet/`` (at module level, inside functions and under TYPE_CHECKING alike) is read from
the source and checked against ``ALLOWED``. Third-party imports are checked where a layer must stay light:
sizing, engines, the contract and the agent never import CDK, and the image layers only what the image installs.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "kvfleet"

# Layer of a module: its first component under kvfleet (kvfleet.sizing.planner -> sizing).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "versions": set(),
    "contract": set(),
    # The install extras and the one check that one is installed (kvfleet/extras.py).
    "extras": {"errors"},
    # Sizing asks each engine's adapter for its capacity rules (kvfleet/engines/<name>/profiles.py); engines never
    # import sizing.
    "sizing": {"errors", "versions", "engines"},
    "engines": {"contract", "versions"},
    # Each autoscaler once, on the contract's signals: the simulator runs it, the stacks render it.
    "scaling": {"contract"},
    "targets": {"sizing", "scaling"},
    "config": {"sizing", "engines", "targets", "contract", "errors", "versions", "workload"},
    "deployments": {"config", "sizing", "engines", "targets", "contract", "errors", "versions", "scaling"},
    "workload": {"contract", "errors"},
    "sim": {"sizing", "workload", "contract", "errors", "engines", "versions", "extras", "scaling"},
    # The live checks (bench.live) read a resolved deployment: what its stack outputs and its plan say.
    "bench": {"contract", "engines", "errors", "deployments", "targets", "extras"},
    "citemplate": {"config"},
    "calibration": {"errors", "sizing"},
    "plandiff": {"errors"},
    "volumes": {"deployments", "sizing"},
    # The bridge from a resolved deployment to the simulator (fleet, replay, derived thresholds).
    "tuning": {
        *("config", "deployments", "sim", "workload", "sizing", "targets", "errors", "calibration", "volumes"),
        *("engines", "scaling"),
    },
    "cli": {
        "config",
        "deployments",
        "sizing",
        "engines",
        "targets",
        "contract",
        "errors",
        "versions",
        "workload",
        "sim",
        "tuning",
        "bench",
        "calibration",
        "plandiff",
        "citemplate",
        "extras",
    },
    "infra": {
        "config",
        "deployments",
        "volumes",
        "tuning",
        "workload",
        "sizing",
        "scaling",
        "engines",
        "targets",
        "contract",
        "errors",
        "versions",
    },
    "agent": {"contract", "engines", "versions"},
}
# Third-party packages a layer may import (None: any). The agent's are the image's requirements.
THIRD_PARTY: dict[str, set[str] | None] = {
    "errors": set(),
    "versions": set(),
    "contract": set(),
    "extras": set(),
    "engines": set(),
    "sizing": set(),
    "scaling": set(),
    "targets": set(),
    # pydantic_core: the schema types a custom pydantic type returns (kvfleet.config.targets); pydantic brings it.
    "config": {"pydantic", "pydantic_core", "yaml"},
    "deployments": set(),
    "tuning": set(),
    "calibration": set(),
    "plandiff": set(),
    "citemplate": {"yaml"},
    "volumes": set(),
    "bench": {"aiohttp", "boto3", "botocore"},
    "workload": set(),
    # matplotlib only in sim/timeline.py, imported inside the function that draws: the simulator itself and the
    # CLI's start-up stay standard library.
    "sim": {"matplotlib"},
    "cli": {"rich", "shtab"},
    "infra": None,
    "agent": {"aiohttp", "prometheus_client", "uvloop", "boto3", "botocore"},
}


# A target's folder (kvfleet/targets/<name>/) holds one module per layer that needs the target, named for its role:
# its __init__ is the targets layer (the registry's record), the rest the layer of what they are part of.
TARGET_PARTS: dict[str, str] = {
    "config": "config",  # its environment-file section and checks
    "infra": "infra",  # its construct (a package)
    "live": "bench",  # what `kvfleet check` asks of it
    "pipeline": "infra",  # the release pipeline's live-check grants
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 3 and parts[1] == "targets":
        # A module of a target's folder that is none of its parts is outside every layer.
        return TARGET_PARTS.get(parts[3], f"targets.{parts[2]}.{parts[3]}")
    return parts[1] if len(parts) > 1 else ""


def target_folder(module: str) -> str | None:
    """The target whose folder holds ``module`` (kvfleet.targets.<name>...), else None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "targets" else None


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement, relative imports resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from kvfleet import contract` imports the module kvfleet.contract.
            if target == "kvfleet":
                out += [(node.lineno, f"kvfleet.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, target))
    return out


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        layer = layer_of(module)
        if layer not in ALLOWED:
            if module != root.name:
                found.append(f"{path.relative_to(root.parent)}: module outside every layer ({layer})")
            continue
        for line, target in imports(path, module):
            top = target.split(".")[0]
            where = f"{path.relative_to(root.parent)}:{line}"
            if top == root.name:
                other = layer_of(target)
                if other and other != layer and other not in ALLOWED[layer]:
                    found.append(f"{where}: {layer} imports {target}")
                # A target's folder stands alone: what two targets share lives outside both.
                elif target_folder(module) not in (None, target_folder(target)) and target_folder(target):
                    found.append(f"{where}: target {target_folder(module)} imports {target}")
            elif top not in sys.stdlib_module_names and top != "__future__":
                allowed = THIRD_PARTY[layer]
                if allowed is not None and top not in allowed:
                    found.append(f"{where}: {layer} imports {target}")
    return found


def test_every_import_points_the_allowed_way() -> None:
    assert violations(PACKAGE) == []


def test_every_module_is_in_a_layer() -> None:
    layers = {layer_of(module_name(p, PACKAGE)) for p in PACKAGE.rglob("*.py")} - {""}
    assert layers == set(ALLOWED)


@pytest.mark.parametrize(
    ("layer_file", "source", "expected"),
    [
        ("agent/bad.py", "from kvfleet.sizing.planner import plan\n", "agent imports kvfleet.sizing.planner"),
        ("agent/bad.py", "import yaml\n", "agent imports yaml"),
        ("agent/bad.py", "def f():\n    from kvfleet import config\n", "agent imports kvfleet.config"),
        ("sizing/bad.py", "from kvfleet.config.schema import Environment\n", "sizing imports kvfleet.config"),
        ("sizing/bad.py", "import aws_cdk\n", "sizing imports aws_cdk"),
        ("sizing/bad.py", "from ..infra import app\n", "sizing imports kvfleet.infra"),
        ("config/bad.py", "from kvfleet.infra.stack import DeploymentStack\n", "config imports kvfleet.infra"),
        ("contract.py", "from kvfleet.errors import KvfleetError\n", "contract imports kvfleet.errors"),
        ("infra/bad.py", "from kvfleet.agent.server import Agent\n", "infra imports kvfleet.agent.server"),
        (
            "engines/bad.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvfleet.sizing\n",
            "engines",
        ),
        # An engine's folder is the engines layer: its capacity rules are data, never the sizing core's code.
        (
            "engines/toy/profiles.py",
            "from kvfleet.sizing.engines import engine_profile\n",
            "engines imports kvfleet.sizing",
        ),
        ("engines/toy/adapter.py", "import yaml\n", "engines imports yaml"),
        # A target's folder: each module is the layer its role names.
        ("targets/toy/__init__.py", "from kvfleet.targets.toy.config import SECTION\n", "targets imports kvfleet"),
        ("targets/toy/__init__.py", "import pydantic\n", "targets imports pydantic"),
        ("targets/toy/config.py", "from kvfleet.infra.context import TargetSpec\n", "config imports kvfleet.infra"),
        ("targets/toy/config.py", "import aws_cdk\n", "config imports aws_cdk"),
        ("targets/toy/infra/stack.py", "from kvfleet.cli import main\n", "infra imports kvfleet.cli"),
        ("targets/toy/infra/__init__.py", "from kvfleet.agent import server\n", "infra imports kvfleet.agent"),
        ("targets/toy/live.py", "from kvfleet.infra.stack import DeploymentStack\n", "bench imports kvfleet.infra"),
        ("targets/toy/live.py", "import aws_cdk\n", "bench imports aws_cdk"),
        ("targets/toy/pipeline.py", "from kvfleet.cli import main\n", "infra imports kvfleet.cli"),
        ("targets/toy/helpers.py", "", "module outside every layer (targets.toy.helpers)"),
        (
            "targets/toy/infra/fleet.py",
            "from kvfleet.targets.other.infra import CONSTRUCT\n",
            "target toy imports kvfleet.targets.other.infra",
        ),
    ],
)
def test_a_wrong_import_is_found(tmp_path: Path, layer_file: str, source: str, expected: str) -> None:
    root = tmp_path / "kvfleet"
    target = root / layer_file
    target.parent.mkdir(parents=True, exist_ok=True)
    (root / "__init__.py").write_text("", encoding="utf-8")
    target.write_text(source, encoding="utf-8")
    found = violations(root)
    assert len(found) == 1 and expected in found[0], found
