"""Regenerate docs/bootstrap/: the CloudFormation execution policies a stage account is bootstrapped with
(``cdk bootstrap --cloudformation-execution-policies``) instead of AdministratorAccess.

The actions are those CloudFormation's own resource handlers need to create, read, update and delete each resource
type the stage's stacks hold (each type's registry schema, ``handlers.<create|read|update|delete>.permissions``, as
bundled in the installed cfn-lint's schema data for us-east-1), for every resource type of every example
environment's synthesized stacks (environments/*.yaml: the deployment stacks, the alerts stack, and the stage's
live-check stack), plus lambda:InvokeFunction for CDK's custom resources. No service-wide or global wildcard: each
action is named.

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
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's kvfleet, not another one installed
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

OUT = REPO / "docs" / "bootstrap"
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


def uncovered(documents: Iterable[Mapping[str, Any]], by_type: Mapping[str, list[str]]) -> list[str]:
    """Each resource type's actions that no statement of ``documents`` allows, as 'type: action'."""
    allowed = {a for d in documents for st in d["Statement"] if st["Effect"] == "Allow" for a in st["Action"]}
    return [f"{t}: {a}" for t, actions in sorted(by_type.items()) for a in actions if a not in allowed]


def policy_documents(by_type: Mapping[str, list[str]]) -> list[dict[str, Any]]:
    """The union of the actions, split into managed policies under IAM's size limit, each action once, in order."""
    actions = sorted({a for acts in by_type.values() for a in acts})
    documents: list[dict[str, Any]] = []
    current: list[str] = []
    for action in actions:
        if current and _size(_document([*current, action])) > MAX_POLICY_CHARS:
            documents.append(_document(current))
            current = []
        current.append(action)
    if current:
        documents.append(_document(current))
    return documents


def _document(actions: list[str]) -> dict[str, Any]:
    # Resource "*": the stacks' resources have generated names, and the actions are the limit.
    return {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}


def _size(document: Mapping[str, Any]) -> int:
    return len(json.dumps(document, separators=(",", ":")))


def example_resource_types() -> dict[str, list[str]]:
    """Every resource type of every example environment's stage stacks -> the templates holding it."""
    import aws_cdk as cdk

    from kvfleet.config.loader import load_located
    from kvfleet.infra.app import add_environment
    from kvfleet.infra.live_check import LiveCheckStack, live_check_stack_name

    flags = json.loads((REPO / "cdk.json").read_text(encoding="utf-8"))["context"]
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "environments").glob("*.yaml")):
        loaded = load_located(path)
        env = loaded.environment
        with tempfile.TemporaryDirectory() as out:
            app = cdk.App(context=flags, outdir=out)
            stacks = add_environment(app, env, traces=loaded.traces)
            # A stage names its account; a file that does not is given the pipeline's (the types are the same).
            staged = env if env.account else env.model_copy(update={"account": PIPELINE_ACCOUNT})
            name = live_check_stack_name(env.name)
            LiveCheckStack(app, name, environment=staged, stacks=stacks, pipeline_account=PIPELINE_ACCOUNT)
            for template in sorted(Path(app.synth().directory).glob("*.template.json")):
                body = json.loads(template.read_text(encoding="utf-8"))
                types = [r["Type"] for r in body.get("Resources", {}).values()]
                types += [
                    SSM_PARAMETER_TYPE for p in body.get("Parameters", {}).values() if SSM_PARAMETER_TYPE in p["Type"]
                ]
                for t in types:
                    found.setdefault(t, set()).add(f"{path.name}: {template.stem}")
    return {t: sorted(where) for t, where in sorted(found.items())}


def render() -> dict[str, str]:
    """The files of docs/bootstrap/, by name."""
    types = example_resource_types()
    by_type = required_actions(types)
    files = {
        f"execution-policy-{i}.json": json.dumps(doc, indent=1) + "\n"
        for i, doc in enumerate(policy_documents(by_type), start=1)
    }
    files["resource-types.json"] = json.dumps(by_type, indent=1) + "\n"
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
