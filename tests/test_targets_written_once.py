"""A target is one folder and one registry line.

Nothing outside a target's folder (``kvfleet/targets/<name>/``) names a target: no comparison with a registered
target's name, no lookup keyed by one, no ``Literal`` of them, no import of a target's folder. The shared code asks
the registry (``kvfleet.targets``) and the target's parts instead. And a made-up target, ``toy``, written to a
temporary folder with what a target's folder holds (its record, its ``target:`` section, a construct, a live check,
its pipeline grants) and registered by one entry in ``TARGET_MODULES``, loads from an environment file, plans,
synthesizes and is checked live with nothing else changed.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.cli import main
from kvfleet.config.loader import load_environment
from kvfleet.config.schema import rebuild_targets
from kvfleet.errors import ConfigError
from kvfleet.targets import TARGET_MODULES, TARGETS

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "kvfleet"

# Where a target's name may be written outside its folder, each with the reason. The registry's own lines are the
# one place: TARGET_MODULES, one entry per target.
ALLOWED: dict[str, str] = {
    "kvfleet/targets/__init__.py": "the registry: TARGET_MODULES, one line per target",
}


def _in_target_folder(rel: Path) -> bool:
    """kvfleet/targets/<name>/...: a target's own folder."""
    return len(rel.parts) > 3 and rel.parts[:2] == ("kvfleet", "targets")


def _names_a_target(node: ast.AST, names: set[str]) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names


def _spelled(node: ast.AST, names: set[str]) -> list[ast.AST]:
    """The target names ``node`` compares with, looks up, keys a dict or a match case by, or lists in a Literal."""
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        operands += [e for c in node.comparators if isinstance(c, ast.Tuple | ast.List | ast.Set) for e in c.elts]
        return [n for n in operands if _names_a_target(n, names)]
    if isinstance(node, ast.Subscript):  # TARGETS["ec2"], data["sagemaker"], Literal["sagemaker", "ec2"]
        keys = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return [k for k in keys if _names_a_target(k, names)]
    if isinstance(node, ast.Dict):
        return [k for k in node.keys if k is not None and _names_a_target(k, names)]
    if isinstance(node, ast.MatchValue):
        return [node.value] if _names_a_target(node.value, names) else []
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        return [node.args[0]] if _names_a_target(node.args[0], names) else []
    return []


def target_names_outside_their_folders(root: Path, names: set[str]) -> list[str]:
    """``path:line: code`` for each place outside a target's folder that spells a target's name or imports a
    target's folder."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if _in_target_folder(rel) or str(rel) in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            found += [f"{rel}:{n.lineno}: {ast.unparse(node)[:100]}" for n in _spelled(node, names)]
            if isinstance(node, ast.ImportFrom | ast.Import):
                modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                found += [
                    f"{rel}:{node.lineno}: imports {m}"
                    for m in modules
                    if m.split(".")[:2] == ["kvfleet", "targets"] and len(m.split(".")) > 2
                ]
    return found


def test_nothing_outside_a_targets_folder_names_it() -> None:
    assert target_names_outside_their_folders(PACKAGE, set(TARGET_MODULES)) == []


@pytest.mark.parametrize(
    "source",
    [
        'if platform == "ec2":\n    pass\n',
        'if platform in ("sagemaker", "eks"):\n    pass\n',
        'x = TARGETS["eks"]\n',
        'x = {"sagemaker": 1}\n',
        'from typing import Literal\nP = Literal["sagemaker", "ec2"]\n',
        'match platform:\n    case "eks":\n        pass\n',
        'x = table.get("sagemaker")\n',
        "from kvfleet.targets.ec2.config import Ec2Target\n",
    ],
)
def test_a_target_name_outside_its_folder_is_found(tmp_path: Path, source: str) -> None:
    root = tmp_path / "kvfleet"
    (root / "infra").mkdir(parents=True)
    (root / "infra" / "bad.py").write_text(source, encoding="utf-8")
    (root / "targets" / "ec2").mkdir(parents=True)
    (root / "targets" / "ec2" / "live.py").write_text('x = TARGETS["ec2"]\n', encoding="utf-8")  # its own folder
    found = target_names_outside_their_folders(root, {"sagemaker", "ec2", "eks"})
    assert found and all(f.startswith("kvfleet/infra/bad.py:") for f in found), found


def test_the_command_line_plans_without_loading_a_targets_infra_or_live_check() -> None:
    # A target's __init__ is the registry's record only: `kvfleet plan` (no CDK, no boto3 installed with the planner)
    # loads the targets' records and sections, never their constructs or live checks.
    code = (
        "import sys, json; from kvfleet.cli import main; rc = main(['plan', 'dev', '--json']); "
        "watched = ('aws_cdk', 'boto3', 'kvfleet.targets'); "
        "print(json.dumps([rc, sorted(m for m in sys.modules if m.startswith(watched))]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    rc, loaded = json.loads(out.splitlines()[-1])
    assert rc == 0
    assert [m for m in loaded if not m.startswith("kvfleet.targets")] == []
    assert {m.rpartition(".")[2] for m in loaded if m.count(".") == 3} == {"config"}


# ---- a made-up target ----------------------------------------------------------------------------------------

NAME, MODULE = "toy", "toytarget"

TOY: dict[str, str] = {
    # The record: EC2's hosting and autoscaler under its own name, and the stack output clients reach it at.
    "__init__.py": """
        from kvfleet.targets import Target, TARGETS

        EC2 = TARGETS["ec2"]
        TARGET = Target(
            name="toy",
            summary="a made-up target",
            hosting=EC2.hosting,
            autoscaler=EC2.autoscaler,
            address_output="ToyEndpoint",
        )
    """,
    # Its section, with a check of its own on the rest of the deployment.
    "config.py": """
        from typing import ClassVar, Literal

        from pydantic import Field

        from kvfleet.config.targets import TargetSection


        class ToyTarget(TargetSection):
            pattern_words: ClassVar[dict[str, str]] = {"greeting": "lowercase letters, like hi"}

            platform: Literal["toy"] = Field(description="A made-up target.")
            greeting: str = Field(default="hello", pattern="^[a-z]+$", description="What its parameter says.")

            def deployment_problems(self, deployment):
                if deployment.scaling.max_replicas > 3:
                    return ["scaling.max_replicas: a toy holds at most 3; lower it"]
                return []

            def client_address(self, output):
                return f"toy://{output}"


        SECTION = ToyTarget
    """,
    # Its construct: an SSM parameter holding the endpoint's name.
    "infra.py": """
        from aws_cdk import aws_ssm as ssm
        from constructs import Construct

        from kvfleet.infra.context import ServingContext, TargetSpec
        from kvfleet.infra.metrics import PlatformMetrics


        class ToyEndpoint(Construct):
            def __init__(self, scope, id, *, context: ServingContext):
                super().__init__(scope, id)
                r = context.resolved
                self.parameter = ssm.StringParameter(
                    self, "Endpoint", string_value=f"{r.deployment_id}: {r.deployment.target.greeting}"
                )
                self.platform_metrics = PlatformMetrics()
                self.outputs = {"ToyEndpoint": self.parameter.parameter_name}


        CONSTRUCT = TargetSpec(construct_id="Toy", build=lambda s, i, c: ToyEndpoint(s, i, context=c))
    """,
    "live.py": """
        def run(d, check):
            check.ok(f"the toy answers at {d.outputs['ToyEndpoint']}")
    """,
    "pipeline.py": """
        from aws_cdk import aws_iam as iam


        def grant_live_check(stack, role, environment):
            role.add_to_policy(iam.PolicyStatement(actions=["ssm:GetParameter"], resources=["*"]))
            return [("*", "a toy's parameter name is generated")]
    """,
}

ENVIRONMENT = """
name: toys
account: "222222222222"
region: us-east-1
notifications: none
deployments:
  - name: chat
    model:
      id: meta-llama/Llama-3.1-8B
    engine:
      name: vllm
      version: "0.30.0"
    workload:
      max_input_tokens: 2048
      max_output_tokens: 512
      peak_requests_per_s: 2
    target:
      platform: toy
      greeting: hi
    scaling:
      min_replicas: 1
      max_replicas: 2
    serving:
      tenancy: single
"""


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The made-up target's folder on the import path and its one registry line; the environment file naming it."""
    folder = tmp_path / "src" / MODULE
    folder.mkdir(parents=True)
    for file, text in TOY.items():
        (folder / file).write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    env = tmp_path / "toys.yaml"
    env.write_text(ENVIRONMENT, encoding="utf-8")
    with monkeypatch.context() as m:
        m.syspath_prepend(str(folder.parent))
        m.setitem(TARGET_MODULES, NAME, MODULE)
        rebuild_targets()  # the environment file's target union is read from the registry
        yield env
    rebuild_targets()
    for module in [m for m in sys.modules if m == MODULE or m.startswith(MODULE + ".")]:
        del sys.modules[module]


def test_the_toy_loads_and_its_own_check_runs(toy: Path) -> None:
    env = load_environment(toy)
    section = env.deployments[0].target
    assert type(section).__module__ == f"{MODULE}.config"
    assert section.hosting == TARGETS["ec2"].hosting
    toy.write_text(ENVIRONMENT.replace("max_replicas: 2", "max_replicas: 4"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"deployments\[0\]\.scaling\.max_replicas: a toy holds at most 3"):
        load_environment(toy)
    toy.write_text(ENVIRONMENT.replace("greeting: hi", "greeting: Hi!"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"target\.greeting: expected lowercase letters, like hi$"):
        load_environment(toy)
    toy.write_text(ENVIRONMENT.replace("greeting: hi", "colour: red"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"deployments\[0\]\.target\.colour: unknown key"):
        load_environment(toy)


def test_the_toy_plans(toy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(toy), "--json"]) == 0
    (deployment,) = json.loads(capsys.readouterr().out)
    best = deployment["candidates"][0]
    # EC2's hosting: EC2 instance names and prices.
    assert not best["instance_type"].startswith("ml.")
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "ToyTarget" in schema["$defs"]


def test_the_toy_synthesizes_with_its_construct(toy: Path) -> None:
    import aws_cdk as cdk
    from aws_cdk.assertions import Template

    from kvfleet.infra.app import build_app
    from tests.infra.helpers import make_app

    app = build_app(load_environment(toy), app=make_app())
    [stack] = [s for s in app.node.children if isinstance(s, cdk.Stack) and not s.stack_name.endswith("-alerts")]
    template = Template.from_stack(stack)
    template.has_resource_properties("AWS::SSM::Parameter", {"Value": "toys-chat: hi"})
    assert "ToyEndpoint" in template.to_json()["Outputs"]


def test_the_toy_is_checked_live_and_its_pipeline_grants_are_its_own(toy: Path) -> None:
    import aws_cdk as cdk
    from aws_cdk.assertions import Match, Template

    from kvfleet.bench.live import check_deployment
    from kvfleet.deployments import resolve_environment
    from kvfleet.infra.live_check import LiveCheckStack
    from tests.infra.helpers import make_app

    env = load_environment(toy)
    [r] = resolve_environment(env)
    check = check_deployment(r, session=_Session({"ToyEndpoint": "toy-param"}))
    assert (check.passed, check.lines) == (True, ["ok    the toy answers at toy-param"])
    app = make_app()
    deployed = cdk.Stack(app, "toys-chat")
    stack = LiveCheckStack(app, "check", environment=env, stacks=[deployed], pipeline_account="111111111111")
    Template.from_stack(stack).has_resource_properties(
        "AWS::IAM::Policy",
        {"PolicyDocument": {"Statement": Match.array_with([Match.object_like({"Action": "ssm:GetParameter"})])}},
    )


class _Session:
    """A boto3 session whose one client is CloudFormation's, answering the stack's outputs."""

    region_name = "us-east-1"

    def __init__(self, outputs: dict[str, str]) -> None:
        self.outputs = outputs

    def client(self, service: str, **_: Any) -> Any:
        assert service == "cloudformation"
        return self

    def describe_stacks(self, StackName: str) -> dict[str, Any]:
        outputs = [{"OutputKey": k, "OutputValue": v} for k, v in self.outputs.items()]
        return {"Stacks": [{"StackName": StackName, "StackStatus": "CREATE_COMPLETE", "Outputs": outputs}]}
