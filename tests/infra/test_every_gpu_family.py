"""Every NVIDIA GPU family in the instance catalog synthesizes on every target that offers it, with cdk-nag on, and
its templates pass cfn-lint: the plan picks from the whole catalog, so a family one target's constructs (or CDK under
them) cannot build is a synth failure waiting for the first user who plans onto it (CDK's eks-v2 refused the NVIDIA
AMI type for p5 and newer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from aws_cdk.assertions import Template

from kvfleet.sizing.hardware import instances
from tests.infra.helpers import REPO, props, synth_all
from tests.infra.test_cfn_lint import cfn_lint

# One example environment per target, its first deployment re-pointed at each family.
EXAMPLES = {"sagemaker": "dev.yaml", "ec2": "staging.yaml", "eks": "platform.yaml"}
# A model each family's smallest type holds whole (EC2 and SageMaker run one engine per instance), so the family
# alone decides the plan: a small one where a GPU has under 24 GiB, a 70B one where the smallest type has 8 GPUs.
SMALL_MODEL, MODEL, LARGE_MODEL = "Qwen/Qwen2.5-0.5B", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B"
# Families the planner never picks because the catalog lacks a figure its sizing needs: nothing to synthesize until
# the figure is added (then this test asks for the family's synth).
NOT_PLANNED = {
    "g7": "no memory bandwidth",
    "g7e": "no memory bandwidth",
    "p6-b300": "no memory bandwidth",
    "p6e-gb200": "no AWS-reported GPU memory",
    "p5e": "no on-demand price",
}


def _smallest_per_family() -> dict[str, tuple[str, bool]]:
    """family -> (its instance type with the fewest GPUs, whether SageMaker endpoints offer that family)."""
    out: dict[str, tuple[str, bool, int]] = {}
    for it in instances().values():
        if it.accelerator.kind.value != "gpu" or it.gpu_fraction:
            continue
        family = it.name.split(".")[0]
        best = out.get(family)
        if best is None or it.accelerator_count < best[2]:
            out[family] = (
                it.name,
                any(o.sagemaker_endpoint for o in instances().values() if o.name.split(".")[0] == family),
                it.accelerator_count,
            )
    return {f: (name, sm) for f, (name, sm, _) in sorted(out.items())}


FAMILIES = _smallest_per_family()
CASES = [
    (target, family)
    for family, (_, on_sagemaker) in FAMILIES.items()
    for target in EXAMPLES
    if (target != "sagemaker" or on_sagemaker) and family not in NOT_PLANNED
]


def _environment(target: str, family: str) -> str:
    doc: dict[str, Any] = yaml.safe_load((REPO / "environments" / EXAMPLES[target]).read_text(encoding="utf-8"))
    d = doc["deployments"][0]
    doc["deployments"] = [d]
    it = instances()[FAMILIES[family][0]]
    model = LARGE_MODEL if it.accelerator_count >= 8 else MODEL if (it.gpu_memory_gib or 0.0) >= 24 else SMALL_MODEL
    d["model"] = {"id": model}
    d["sizing"] = {"instance_type": it.name}
    d.pop("speculative", None)
    d["workload"] = {"max_input_tokens": 2048, "max_output_tokens": 256, "peak_requests_per_s": 1}
    d["scaling"] = {"min_replicas": 1, "max_replicas": 2}
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where each case's templates are written, to be linted together (cfn-lint starts once, not thirty times)."""
    return tmp_path_factory.mktemp("families")


@pytest.mark.parametrize(("target", "family"), CASES, ids=[f"{t}-{f}" for t, f in CASES])
def test_the_family_synthesizes(target: str, family: str, written: Path) -> None:
    templates = synth_all(_environment(target, family), nag=True)  # fails on any unacknowledged finding
    [t] = [t for name, t in templates.items() if not name.endswith("-alerts")]
    assert f"{family}." in str(t.to_json()), f"{family} is not in the {target} template"
    if target == "eks":
        [gpu] = [n for n in props(t, "AWS::EKS::Nodegroup") if n["AmiType"] == "AL2023_x86_64_NVIDIA"]
        assert gpu["InstanceTypes"][0].split(".")[0] == family
    _write(t, written / f"{target}-{family}.template.json")


def _write(t: Template, path: Path) -> None:
    path.write_text(json.dumps(t.to_json()), encoding="utf-8")


def test_every_familys_template_lints_clean(written: Path) -> None:
    templates = sorted(written.glob("*.template.json"))
    if len(templates) != len(CASES):
        pytest.skip("runs after every case's synth (the whole module)")
    files = [REPO / "environments" / f for f in EXAMPLES.values()]
    regions = {yaml.safe_load(f.read_text(encoding="utf-8"))["region"] for f in files}
    [region] = regions  # the examples' one region, where cfn-lint checks each type is offered
    result = cfn_lint(templates, region)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("family", sorted(NOT_PLANNED))
def test_a_family_the_catalog_cannot_size_is_never_planned(family: str) -> None:
    from kvfleet.deployments import workload
    from kvfleet.sizing.catalog import resolve_model
    from kvfleet.sizing.planner import PlanRequest, plan
    from kvfleet.targets import TARGETS

    wl = workload(max_input_tokens=2048, max_output_tokens=256)
    model = resolve_model(LARGE_MODEL if family == "p5e" else MODEL)  # p5e: 8 GPUs, one engine per instance
    p = plan(PlanRequest(model=model, workload=wl, hosting=TARGETS["ec2"].hosting, region="us-east-2"))
    assert not [c for c in p.candidates if c.name.startswith(f"{family}.")]
    reasons = {r.reason for r in p.rejections if r.instance_type.startswith(f"{family}.")}
    assert any(NOT_PLANNED[family] in r for r in reasons), reasons


def test_the_cases_cover_the_catalog() -> None:
    assert {"g5", "g6e", "p4d", "p5", "p5en", "p6-b200"} <= set(FAMILIES)
    assert ("sagemaker", "g5") in CASES and ("eks", "p5") in CASES
