"""Regenerate docs/bootstrap/: the CloudFormation execution policies a stage account is bootstrapped with
(``cdk bootstrap --cloudformation-execution-policies``) instead of AdministratorAccess.

The actions are those CloudFormation's own resource handlers need to create, read, update and delete each resource
type the stage's stacks hold (each type's registry schema, ``handlers.<create|read|update|delete>.permissions``, as
bundled in the installed cfn-lint's schema data for us-east-1), for every resource type of every example
environment's synthesized stacks (environments/*.yaml: the deployment stacks, the alerts stack, and the stage's
live-check stack) and of the shape fixtures (tools/bootstrap_shapes/*.yaml: the shapes no example uses, such as
SageMaker inference components, scale to zero and packed EC2 engines), plus lambda:InvokeFunction for CDK's custom
resources, ssm:GetParameters for SSM parameter types, and what the intrinsic functions CloudFormation resolves with
the stack's role need (Fn::GetStackOutput's cloudformation:DescribeStacks, allowed on the alerts stacks only). A
function or dynamic reference without a rule here stops the tool. No service-wide or global wildcard: each action
is named.

    .venv/bin/python tools/bootstrap_policy.py          # write docs/bootstrap/
    .venv/bin/python tools/bootstrap_policy.py --check  # exit 1 when docs/bootstrap/ is stale
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's kvfleet, not another one installed
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

OUT = REPO / "docs" / "bootstrap"
# Environments synthesized for their resource types only: together with environments/*.yaml they hold every shape
# kvfleet can deploy, so a stage that uses a shape no example shows is not refused by its own execution policy.
SHAPES = REPO / "tools" / "bootstrap_shapes"
# The example stage accounts' pipeline account, as pipeline.yaml's examples write it (the trust is not a resource
# type: any account gives the same types).
PIPELINE_ACCOUNT = "111111111111"
HANDLERS = ("create", "read", "update", "delete")
# CloudFormation invokes a custom resource's provider function with the stack's role (CloudFormation User Guide,
# "Custom resources": the ServiceToken); CDK's metadata resource is not provisioned.
CUSTOM_RESOURCE_ACTIONS = ("lambda:InvokeFunction",)
NOT_PROVISIONED = frozenset({"AWS::CDK::Metadata"})
# A template parameter of an SSM parameter type (CDK's BootstrapVersion, the AMI ids) is resolved by CloudFormation
# with the stack's role (CloudFormation User Guide, "Specify existing resources at runtime with CloudFormation-supplied
# parameter types": SSM parameter types).
SSM_PARAMETER_TYPE = "AWS::SSM::Parameter::Value"
SSM_PARAMETER_ACTIONS = ("ssm:GetParameters",)
# IAM's managed policy size limit, whitespace not counted (IAM User Guide, "IAM and AWS STS quotas": managed policy
# size 6,144 characters).
MAX_POLICY_CHARS = 6144
# An IAM action as the Service Authorization Reference writes them: service prefix, then the action name (a trailing
# '*' in a few handler lists: read-only families such as ec2:Describe*).
IAM_ACTION = re.compile(r"[a-z0-9-]+:[A-Za-z0-9]+\*?")

# Intrinsic functions CloudFormation resolves with the stack's role, and what that role needs (CloudFormation Template
# Reference, each function's page):
FUNCTION_ACTIONS: dict[str, tuple[str, ...]] = {
    # "Fn::GetStackOutput", Parameters, RoleArn: a role with cloudformation:DescribeStacks on the referenced stack,
    # by default the current stack's execution role (cdk.json's weak cross-stack references write it for the alarms'
    # topic, an output of the environment's alerts stack).
    "Fn::GetStackOutput": ("cloudformation:DescribeStacks",),
    # "Fn::GetAZs", IAM permissions: DescribeAvailabilityZones and DescribeAccountAttributes, and in a VPC
    # DescribeSubnets.
    "Fn::GetAZs": ("ec2:DescribeAccountAttributes", "ec2:DescribeAvailabilityZones", "ec2:DescribeSubnets"),
}
# Evaluated by CloudFormation on the template and the stack's own resources, with no call of its own (Template
# Reference, "Intrinsic function reference" and "Condition functions"; Fn::GetAtt reads what the resource's read
# handler, already allowed, returns). Any other (Fn::Transform's macros, Fn::ImportValue) stops the tool until its
# rule is written here.
NO_CALL_FUNCTIONS = frozenset(
    {
        "Ref",
        "Fn::And",
        "Fn::Base64",
        "Fn::Cidr",
        "Fn::Contains",
        "Fn::EachMemberEquals",
        "Fn::EachMemberIn",
        "Fn::Equals",
        "Fn::FindInMap",
        "Fn::GetAtt",
        "Fn::If",
        "Fn::Join",
        "Fn::Length",
        "Fn::Not",
        "Fn::Or",
        "Fn::RefAll",
        "Fn::Select",
        "Fn::Split",
        "Fn::Sub",
        "Fn::ToJsonString",
        "Fn::ValueOf",
        "Fn::ValueOfAll",
    }
)
# A dynamic reference ('{{resolve:ssm:...}}', '{{resolve:secretsmanager:...}}'): CloudFormation reads the value with
# the stack's role (User Guide, "Get values stored in other services using dynamic references"). None is used; one
# stops the tool until the actions its service needs are written here with their source.
DYNAMIC_REFERENCE = re.compile(r"\{\{resolve:([a-z-]+):")
# The stacks an Fn::GetStackOutput may name: the environments' alerts stacks (kvfleet/infra/alerts.py), in any region
# and partition (IAM User Guide, "IAM JSON policy elements: Resource": a wildcard within any ARN segment but the
# service); the last segment is the stack's id, made at creation.
ALERTS_STACKS = "kvfleet-*-alerts"
STACK_OUTPUT_RESOURCE = f"arn:*:cloudformation:*:*:stack/{ALERTS_STACKS}/*"
FUNCTION_RESOURCES: dict[str, str] = {"Fn::GetStackOutput": STACK_OUTPUT_RESOURCE}


def schema_permissions(resource_type: str) -> list[str]:
    """The actions CloudFormation's handlers for ``resource_type`` need (registry schema, cfn-lint's copy)."""
    spec = importlib.util.find_spec("cfnlint.data.schemas")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("cfn-lint is not installed: pip install -e '.[dev]'")
    root = Path(spec.submodule_search_locations[0])
    index = json.loads((root / "providers" / "us-east-1.json").read_text(encoding="utf-8"))
    if resource_type not in index:
        raise SystemExit(f"{resource_type}: no CloudFormation registry schema in cfn-lint's data")
    schema = json.loads((root / "resources" / f"{index[resource_type]}.json").read_text(encoding="utf-8"))
    handlers = schema.get("handlers", {})
    if not handlers:
        raise SystemExit(f"{resource_type}: its schema lists no handler permissions; add its actions by hand")
    listed = {a for h in HANDLERS for a in handlers.get(h, {}).get("permissions", [])}
    # Some schemas list names that are no IAM action (AWS::S3::Bucket: 's3:REST.PUT.OBJECT'); IAM grants nothing by
    # them and a policy is clearer without.
    return sorted(a for a in listed if IAM_ACTION.fullmatch(a))


def required_actions(resource_types: Iterable[str]) -> dict[str, list[str]]:
    """Each provisioned resource type and the actions its handlers need."""
    out: dict[str, list[str]] = {}
    for t in sorted(set(resource_types) - NOT_PROVISIONED):
        custom = t.startswith("Custom::") or t == "AWS::CloudFormation::CustomResource"
        if t == SSM_PARAMETER_TYPE:
            out[t] = list(SSM_PARAMETER_ACTIONS)
        else:
            out[t] = list(CUSTOM_RESOURCE_ACTIONS) if custom else schema_permissions(t)
    return out


@dataclass(frozen=True, kw_only=True)
class Needs:
    """What the stage stacks ask of their execution role: the actions by resource type (or SSM parameter type), and
    by intrinsic function, each with the templates it was found in."""

    by_type: dict[str, list[str]]
    by_function: dict[str, list[str]]
    found_in: dict[str, list[str]]


def function_actions(functions: Iterable[str]) -> dict[str, list[str]]:
    """Each intrinsic function that needs the stack's role and its actions; SystemExit for one without a rule."""
    unknown = sorted(set(functions) - NO_CALL_FUNCTIONS - set(FUNCTION_ACTIONS))
    if unknown:
        raise SystemExit(
            f"{', '.join(unknown)}: no rule for what CloudFormation calls to resolve it; add it to FUNCTION_ACTIONS "
            "(with the actions its Template Reference page names) or NO_CALL_FUNCTIONS"
        )
    return {f: list(FUNCTION_ACTIONS[f]) for f in sorted(set(functions)) if f in FUNCTION_ACTIONS}


def template_functions(body: Mapping[str, Any], where: str) -> Iterator[tuple[str, Any]]:
    """Each intrinsic function the template holds, with its argument; SystemExit for a transform or a dynamic
    reference, which no rule here covers."""
    if "Transform" in body:
        raise SystemExit(
            f"{where}: Transform (a macro): no rule for what it calls; add one to tools/bootstrap_policy.py"
        )
    stack: list[Any] = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "Ref" or key.startswith("Fn::"):
                    yield key, value
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str) and (m := DYNAMIC_REFERENCE.search(node)):
            raise SystemExit(
                f"{where}: dynamic reference {{{{resolve:{m[1]}:...}}}}: no rule for what reading it needs; add its "
                "service's actions to tools/bootstrap_policy.py"
            )


def referenced_stacks(body: Mapping[str, Any], where: str) -> list[str]:
    """The stacks the template's Fn::GetStackOutput read; SystemExit for one its policy statement does not cover (a
    name CloudFormation computes, or a stack other than an alerts stack)."""
    names = []
    for fn, arg in template_functions(body, where):
        if fn != "Fn::GetStackOutput":
            continue
        name = arg.get("StackName") if isinstance(arg, dict) else None
        if not isinstance(name, str) or not fnmatchcase(name, ALERTS_STACKS) or "RoleArn" in arg:
            raise SystemExit(
                f"{where}: Fn::GetStackOutput {json.dumps(arg)}: the execution policies allow "
                f"cloudformation:DescribeStacks on {STACK_OUTPUT_RESOURCE} only, with the stack's own role"
            )
        names.append(name)
    return names


def uncovered(
    documents: Iterable[Mapping[str, Any]],
    by_type: Mapping[str, Sequence[str]],
    resources: Mapping[str, str] | None = None,
) -> list[str]:
    """Each needed action that no Allow statement of ``documents`` grants, as 'type: action'. An action is granted by a
    statement whose Action matches it (IAM actions are case-insensitive, '*' a wildcard) and whose Resource matches
    ``resources[type]`` (an ARN the template reaches), or is '*' where none is given."""
    statements = [st for d in documents for st in d["Statement"] if st["Effect"] == "Allow"]

    def allowed(action: str, resource: str) -> bool:
        return any(
            any(fnmatchcase(action.lower(), a.lower()) for a in _listed(st["Action"]))
            and any(fnmatchcase(resource, r) for r in _listed(st["Resource"]))
            for st in statements
        )

    where = resources or {}
    return [f"{t}: {a}" for t, actions in sorted(by_type.items()) for a in actions if not allowed(a, where.get(t, "*"))]


def _listed(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


def policy_documents(by_type: Mapping[str, list[str]], by_function: Mapping[str, list[str]]) -> list[dict[str, Any]]:
    """The union of the actions, split into managed policies under IAM's size limit, each action once, in order; an
    action a function needs on named resources only (FUNCTION_RESOURCES) gets its own statement on them."""
    scoped: dict[str, list[str]] = {}
    for fn, acts in by_function.items():
        if fn in FUNCTION_RESOURCES:
            scoped.setdefault(FUNCTION_RESOURCES[fn], []).extend(acts)
    unscoped = [acts for fn, acts in by_function.items() if fn not in FUNCTION_RESOURCES]
    actions = sorted({a for acts in [*by_type.values(), *unscoped] for a in acts})
    extra = [_statement(sorted(set(acts)), resource) for resource, acts in sorted(scoped.items())]
    documents: list[dict[str, Any]] = []
    current: list[str] = []
    for action in actions:
        if current and _size(_document([*current, action])) > MAX_POLICY_CHARS:
            documents.append(_document(current))
            current = []
        current.append(action)
    if current:
        documents.append(_document(current))
    for statement in extra:  # beside the last document's, or in one of its own where that would pass the limit
        last = documents[-1] if documents else None
        if last is not None and _size({**last, "Statement": [*last["Statement"], statement]}) <= MAX_POLICY_CHARS:
            last["Statement"].append(statement)
        else:
            documents.append({"Version": "2012-10-17", "Statement": [statement]})
    return documents


def _statement(actions: list[str], resource: str) -> dict[str, Any]:
    return {"Effect": "Allow", "Action": actions, "Resource": resource}


def _document(actions: list[str]) -> dict[str, Any]:
    # Resource "*": the stacks' resources have generated names, and the actions are the limit.
    return {"Version": "2012-10-17", "Statement": [_statement(actions, "*")]}


def _size(document: Mapping[str, Any]) -> int:
    return len(json.dumps(document, separators=(",", ":")))


@cache
def example_templates() -> tuple[tuple[str, str], ...]:
    """Every stack a stage account's execution role deploys: each example environment's stage stacks (its stacks and
    its live-check stack) and the account's ``kvfleet-images`` stack (the pipeline's Images wave and `make image`
    deploy it with the same role), synthesized as cdk.json configures them: (where, template JSON) in order."""
    import aws_cdk as cdk

    from kvfleet.config.loader import load_located
    from kvfleet.infra.app import add_environment
    from kvfleet.infra.live_check import LiveCheckStack, live_check_stack_name
    from kvfleet.infra.repository import REPOSITORIES_STACK, ImageRepositoriesStack

    flags = json.loads((REPO / "cdk.json").read_text(encoding="utf-8"))["context"]
    out: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as outdir:
        app = cdk.App(context=flags, outdir=outdir)
        where = cdk.Environment(account=PIPELINE_ACCOUNT, region="us-east-1")
        ImageRepositoriesStack(app, REPOSITORIES_STACK, env=where)
        for template in sorted(Path(app.synth().directory).glob("*.template.json")):
            out.append((f"images: {template.stem}", template.read_text(encoding="utf-8")))
    for path in environment_files():
        loaded = load_located(path)
        env = loaded.environment
        with tempfile.TemporaryDirectory() as outdir:
            app = cdk.App(context=flags, outdir=outdir)
            stacks = add_environment(app, env, traces=loaded.traces)
            # A stage names its account; a file that does not is given the pipeline's (the types are the same).
            staged = env if env.account else env.model_copy(update={"account": PIPELINE_ACCOUNT})
            name = live_check_stack_name(env.name)
            LiveCheckStack(app, name, environment=staged, stacks=stacks, pipeline_account=PIPELINE_ACCOUNT)
            for template in sorted(Path(app.synth().directory).glob("*.template.json")):
                out.append((f"{path.name}: {template.stem}", template.read_text(encoding="utf-8")))
    return tuple(out)


def environment_files() -> list[Path]:
    """The example environments, then the shape fixtures."""
    return sorted((REPO / "environments").glob("*.yaml")) + sorted(SHAPES.glob("*.yaml"))


def example_needs() -> Needs:
    """What every example environment's stage stacks need of the execution role, with where each was found."""
    found: dict[str, set[str]] = {}
    for where, text in example_templates():
        body = json.loads(text)
        kinds = [r["Type"] for r in body.get("Resources", {}).values()]
        kinds += [SSM_PARAMETER_TYPE for p in body.get("Parameters", {}).values() if SSM_PARAMETER_TYPE in p["Type"]]
        kinds += [fn for fn, _ in template_functions(body, where)]
        referenced_stacks(body, where)  # each within the scoped statement's resource, or SystemExit
        for kind in kinds:
            found.setdefault(kind, set()).add(where)
    functions = [k for k in found if k == "Ref" or k.startswith("Fn::")]
    return Needs(
        by_type=required_actions(k for k in found if k not in functions),
        by_function=function_actions(functions),
        found_in={k: sorted(v) for k, v in sorted(found.items())},
    )


def render() -> dict[str, str]:
    """The files of docs/bootstrap/, by name."""
    needs = example_needs()
    files = {
        f"execution-policy-{i}.json": json.dumps(doc, indent=1) + "\n"
        for i, doc in enumerate(policy_documents(needs.by_type, needs.by_function), start=1)
    }
    files["resource-types.json"] = json.dumps(needs.by_type, indent=1) + "\n"
    files["intrinsic-functions.json"] = json.dumps(needs.by_function, indent=1) + "\n"
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/bootstrap/ is stale")
    args = parser.parse_args(argv)
    files = render()
    existing = {p.name: p.read_text(encoding="utf-8") for p in OUT.glob("*.json")} if OUT.exists() else {}
    if args.check:
        if existing != files:
            print("docs/bootstrap/ is stale: run tools/bootstrap_policy.py", file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name in set(existing) - set(files):
        (OUT / name).unlink()
    for name, text in files.items():
        (OUT / name).write_text(text, encoding="utf-8")
    print(f"wrote {len(files)} files to {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
