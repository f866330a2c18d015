"""Environment files parse into frozen objects; each problem is one line with file:line: field."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from kvfleet import contract
from kvfleet.config.loader import load_environment, load_located, parse_environment
from kvfleet.config.schema import Environment
from kvfleet.deployments import plan_requests
from kvfleet.errors import ConfigError, KvfleetError
from kvfleet.sizing.engines import EngineName
from kvfleet.sizing.precision import KvDtype
from kvfleet.targets import TARGETS

REPO = Path(__file__).resolve().parents[2]
ENV_FILES = sorted((REPO / "environments").glob("*.yaml"))

# Line numbers below are those of this text (line 1 is "name: test").
BASE = """\
name: test
region: eu-west-1
deployments:
  - name: chat
    model:
      id: meta-llama/Llama-3.1-8B
    engine:
      name: vllm
      version: "0.11.0"
    workload:
      max_input_tokens: 4096
      max_output_tokens: 1024
      concurrency_per_replica: 16
      ttft_ms: 2500
      itl_ms: 40
    target:
      platform: sagemaker
    scaling:
      min_replicas: 1
      max_replicas: 3
    sizing:
      kv_cache_dtypes: [auto, fp8]
"""
SOURCE = "envs/test.yaml"


def line_of(text: str, needle: str) -> int:
    """1-based number of the only line containing ``needle``."""
    hits = [n for n, line in enumerate(text.splitlines(), 1) if needle in line]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_environment(text, source=SOURCE)
    err = info.value
    assert isinstance(err, KvfleetError)  # the CLI prints it and exits 2
    assert str(err) == "\n".join(err.lines)
    assert all("\n" not in line for line in err.lines)
    return err.lines


def test_base_text_parses() -> None:
    env = parse_environment(BASE, source=SOURCE)
    assert env.name == "test"
    assert env.region == "eu-west-1"
    (d,) = env.deployments
    assert d.name == "chat"
    assert d.workload.max_input_tokens == 4096
    assert d.sizing.kv_cache_dtypes == ("auto", "fp8")
    assert d.scaling.min_replicas == 1
    assert d.scaling.saturation_target == 0.75  # default
    assert d.target.platform == "sagemaker"


@pytest.mark.parametrize("path", ENV_FILES, ids=[p.stem for p in ENV_FILES])
def test_every_environment_file_parses(path: Path) -> None:
    env = load_environment(path)
    assert isinstance(env, Environment)
    assert env.name == path.stem
    assert env.deployments
    requests = plan_requests(env)
    assert [dr.deployment.name for dr in requests] == [d.name for d in env.deployments]
    for req, d in zip((dr.request for dr in requests), env.deployments, strict=True):
        assert req.region == env.region
        assert req.workload.max_input_tokens == d.workload.max_input_tokens
        assert req.engine_version == d.engine.version


def test_environment_files_exist() -> None:
    assert {p.stem for p in ENV_FILES} >= {"dev", "staging", "prod"}


def test_unknown_key_names_file_line_and_path() -> None:
    text = BASE.replace("      itl_ms: 40\n", "      itl_ms: 40\n      bogus: 1\n")
    assert line_of(text, "bogus:") == 16
    lines = problems(text)
    assert lines[0] == (
        "envs/test.yaml:16: deployments[0].workload.bogus: unknown key; remove it or check its spelling"
    )


def test_a_repeated_key_is_an_error_not_a_silent_override() -> None:
    text = BASE.replace("      max_replicas: 3\n", "      max_replicas: 3\n      max_replicas: 8\n")
    assert problems(text) == [
        "envs/test.yaml:21: deployments[0].scaling.max_replicas: key repeated; keep one (a loader would silently "
        "use the last)"
    ]


def test_unknown_top_level_key() -> None:
    lines = problems(BASE + "colour: blue\n")
    assert lines == ["envs/test.yaml:23: colour: unknown key; remove it or check its spelling"]


def test_wrong_type() -> None:
    lines = problems(BASE.replace("max_input_tokens: 4096", "max_input_tokens: lots"))
    assert lines[0].startswith("envs/test.yaml:11: deployments[0].workload.max_input_tokens: ")
    assert "expected a whole number" in lines[0]


def test_rope_scaling_names_its_key() -> None:
    rope = "      id: meta-llama/Llama-3.1-8B\n      rope_scaling: {rope_type: longrope, factor: 0.5}\n"
    lines = problems(BASE.replace("      id: meta-llama/Llama-3.1-8B\n", rope))
    assert [line.split(": ")[1] for line in lines] == [
        "deployments[0].model.rope_scaling.rope_type",
        "deployments[0].model.rope_scaling.factor",
    ]
    assert all(line.startswith("envs/test.yaml:7: ") for line in lines)


def test_negative_value() -> None:
    lines = problems(BASE.replace("max_output_tokens: 1024", "max_output_tokens: -3"))
    assert lines[0] == "envs/test.yaml:12: deployments[0].workload.max_output_tokens: must be greater than 0"


def test_missing_required_field_points_at_its_parent() -> None:
    text = BASE.replace("      max_input_tokens: 4096\n", "")
    lines = problems(text)
    assert line_of(text, "workload:") == 10
    assert lines[0] == (
        "envs/test.yaml:10: deployments[0].workload.max_input_tokens: required field is missing; give it, or a "
        "workload.trace to read it from"
    )


def test_missing_top_level_field() -> None:
    lines = problems(BASE.replace("name: test\n", "", 1))
    assert lines == ["envs/test.yaml:1: name: required field is missing"]


def test_two_problems_two_lines_in_file_order() -> None:
    text = BASE.replace("max_input_tokens: 4096", "max_input_tokens: lots").replace(
        "max_replicas: 3", "max_replicas: 0"
    )
    lines = problems(text)
    assert lines[0].startswith("envs/test.yaml:11: deployments[0].workload.max_input_tokens: ")
    assert lines[1] == ("envs/test.yaml:20: deployments[0].scaling.max_replicas: must be at least 1")


def test_problem_in_a_list_item() -> None:
    lines = problems(BASE.replace("[auto, fp8]", "[auto, int4]"))
    assert lines[0].startswith("envs/test.yaml:22: deployments[0].sizing.kv_cache_dtypes[1]: ")
    assert "'fp8'" in lines[0]


def test_unknown_platform() -> None:
    lines = problems(BASE.replace("platform: sagemaker", "platform: lambda"))
    assert lines[0].startswith("envs/test.yaml:16: deployments[0].target: ")
    assert "'lambda'" in lines[0]
    assert lines[0].endswith("use one of: sagemaker, ec2, eks")


def test_bad_region_pattern() -> None:
    assert problems(BASE.replace("region: eu-west-1", "region: mars")) == [
        "envs/test.yaml:2: region: not an AWS region; give one like us-east-1 (area af, ap, ca, cn, eu, il, me, mx, "
        "sa or us, a direction, a number)"
    ]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("max_input_tokens: 4096", "max_input_tokens: lots"),
        ("max_output_tokens: 1024", "max_output_tokens: -3"),
        ("      max_input_tokens: 4096\n", ""),
        ("      itl_ms: 40\n", "      itl_ms: 40\n      bogus: 1\n"),
    ],
    ids=["wrong-type", "negative", "missing", "unknown-key"],
)
def test_exactly_one_line_per_problem(old: str, new: str) -> None:
    assert len(problems(BASE.replace(old, new))) == 1


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (BASE.replace("    engine:\n", "    engine: [\n"), 9),  # unclosed flow sequence: seen at the next ':'
        ("name: dev\n  deployments: x\n", 2),  # bad indentation
        ('name: dev\nregion: "eu-west-1\naccount: x\n', 2),  # unterminated string: where the quote opens
    ],
    ids=["flow", "indent", "quote"],
)
def test_malformed_yaml_one_line_with_line_number(text: str, line: int) -> None:
    lines = problems(text)
    assert len(lines) == 1
    assert lines[0].startswith(f"envs/test.yaml:{line}: not valid YAML: ")


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just text\n"], ids=["empty", "list", "scalar"])
def test_not_a_mapping(text: str) -> None:
    assert problems(text) == ["envs/test.yaml:1: expected a mapping with 'name' and 'deployments'"]


def test_duplicate_deployment_names_rejected() -> None:
    text = BASE + BASE[BASE.index("  - name: chat") :]
    lines = problems(text)
    assert lines == ["envs/test.yaml:3: deployments: deployment names must be unique; repeated: chat"]


def test_empty_deployments_rejected() -> None:
    lines = problems("name: test\ndeployments: []\n")
    assert len(lines) == 1
    assert lines[0].startswith("envs/test.yaml:2: deployments: ")


def test_min_replicas_above_max_rejected() -> None:
    lines = problems(BASE.replace("min_replicas: 1", "min_replicas: 5"))
    assert lines[0] == "envs/test.yaml:18: deployments[0].scaling: min_replicas must not exceed max_replicas"


def test_average_above_max_rejected() -> None:
    text = BASE.replace("      itl_ms: 40\n", "      itl_ms: 40\n      avg_input_tokens: 5000\n")
    lines = problems(text)
    assert lines[0].startswith("envs/test.yaml:10: deployments[0].workload: ")
    assert "avg_input_tokens must not exceed max_input_tokens" in lines[0]


def test_objects_are_frozen() -> None:
    env = parse_environment(BASE, source=SOURCE)
    d = env.deployments[0]
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        env.name = "other"  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        d.workload.max_input_tokens = 1  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        d.scaling.max_replicas = 100  # type: ignore[misc]
    assert isinstance(env.deployments, tuple)
    with pytest.raises(TypeError):
        env.deployments[0] = d  # type: ignore[index]
    assert d.workload.max_input_tokens == 4096
    assert env.name == "test"


def test_load_environment_prefixes_the_path(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BASE.replace("max_output_tokens: 1024", "max_output_tokens: 0"), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_environment(path)
    assert info.value.lines[0] == f"{path}:12: deployments[0].workload.max_output_tokens: must be greater than 0"


def test_load_environment_missing_file_lists_neighbours(tmp_path: Path) -> None:
    (tmp_path / "dev.yaml").write_text(BASE, encoding="utf-8")
    (tmp_path / "prod.yaml").write_text(BASE, encoding="utf-8")
    with pytest.raises(KvfleetError) as info:
        load_environment(tmp_path / "nope.yaml")
    assert not isinstance(info.value, ConfigError)
    assert str(info.value) == f"environment: no environment file at {tmp_path / 'nope.yaml'}; found: dev, prod"


# ---- plan_requests -------------------------------------------------------------------------------


def test_plan_requests_maps_fields() -> None:
    text = (
        BASE.replace("name: vllm", "name: trtllm")
        .replace('version: "0.11.0"', 'version: "1.0.0"')
        .replace(
            "      itl_ms: 40\n", "      itl_ms: 40\n      peak_requests_per_s: 2.5\n      avg_output_tokens: 300\n"
        )
        .replace(
            "      kv_cache_dtypes: [auto, fp8]\n",
            "      kv_cache_dtypes: [fp8]\n"
            "      weight_precisions: [bf16, fp8]\n"
            "      families: [g5, g6e]\n"
            "      instance_type: ml.g5.12xlarge\n"
            "      max_fleet_usd_per_hour: 40\n"
            "      gpu_memory_utilization: 0.85\n",
        )
    )
    env = parse_environment(text, source=SOURCE)
    [dr] = plan_requests(env)
    req = dr.request
    assert dr.deployment.name == "chat"
    assert req.model.model_id == "meta-llama/Llama-3.1-8B"
    assert req.engine is EngineName.TRTLLM
    assert req.engine_version == "1.0.0"
    assert req.hosting is TARGETS["sagemaker"].hosting
    assert req.region == "eu-west-1"
    wl = req.workload
    assert (wl.max_input_tokens, wl.max_output_tokens, wl.concurrency_per_replica) == (4096, 1024, 16)
    assert wl.ttft_target_s == pytest.approx(2.5)
    assert wl.itl_target_s == pytest.approx(0.040)
    assert wl.peak_requests_per_s == 2.5
    assert wl.avg_input_tokens is None
    assert wl.avg_output_tokens == 300
    assert req.instance_types == ("ml.g5.12xlarge",)
    assert req.kv_cache_dtypes == (KvDtype.FP8,)
    assert req.weight_precisions == ("bf16", "fp8")
    assert req.families == ("g5", "g6e")
    assert req.max_fleet_usd_per_hour == 40
    assert req.gpu_memory_utilization == 0.85
    assert req.min_replicas == 1
    assert req.max_replicas == 3


def test_scale_to_zero_still_plans_one_replica() -> None:
    text = BASE.replace("platform: sagemaker", "platform: ec2").replace("min_replicas: 1", "min_replicas: 0")
    [dr] = plan_requests(parse_environment(text, source=SOURCE))
    req = dr.request
    assert req.min_replicas == 1


def test_eks_refuses_scale_to_zero_where_keda_would_map_it_to_one() -> None:
    lines = problems(BASE.replace("platform: sagemaker", "platform: eks").replace("min_replicas: 1", "min_replicas: 0"))
    assert lines == [
        "envs/test.yaml:19: deployments[0].scaling.min_replicas: eks cannot scale to zero (KEDA scales on the pods' "
        "own signals, and with no pod there is none to wake on); set 1 or more (scale to zero is for target.platform "
        "ec2)"
    ]


def test_a_sagemaker_variant_needs_one_instance_and_points_at_the_field() -> None:
    text = BASE.replace("platform: sagemaker", "platform: sagemaker\n      shape: variant")
    lines = problems(text.replace("min_replicas: 1", "min_replicas: 0"))
    assert lines == [
        "envs/test.yaml:20: deployments[0].scaling.min_replicas: sagemaker cannot scale to zero (a real-time "
        "endpoint's production variant keeps at least one instance; leave target.shape out, or set "
        "inference_components, to scale to zero); set 1 or more (scale to zero is for target.platform ec2)"
    ]


@pytest.mark.parametrize("shape", ["", "\n      shape: inference_components"], ids=["default", "components"])
def test_sagemaker_inference_components_scale_to_zero(shape: str) -> None:
    text = BASE.replace("platform: sagemaker", f"platform: sagemaker{shape}")
    env = parse_environment(text.replace("min_replicas: 1", "min_replicas: 0"), source=SOURCE)
    assert env.deployments[0].scaling.min_replicas == 0


def test_cross_field_problems_each_get_a_line() -> None:
    text = (
        BASE.replace(
            "platform: sagemaker", "platform: sagemaker\n      shape: variant\n      network_isolation: true"
        ).replace("min_replicas: 1", "min_replicas: 0")
    ) + "    image:\n      source: dlc\n"
    lines = problems(text)
    assert [line.split(": ")[1] for line in lines] == [
        "deployments[0].scaling.min_replicas",
        "deployments[0].model.s3_uri",
        "deployments[0].engine.version",  # AWS publishes no vLLM 0.11.0 container (as synth would find)
        "deployments[0].image.source",
    ]
    assert lines[2].startswith("envs/test.yaml:9: deployments[0].engine.version: no AWS vLLM container for vLLM 0.11.0")
    assert "use source kvfleet, or set scaling.max_replicas equal to min_replicas" in lines[3]


def test_network_isolation_with_s3_model_is_accepted() -> None:
    text = BASE.replace("platform: sagemaker", "platform: sagemaker\n      network_isolation: true").replace(
        "      id: meta-llama/Llama-3.1-8B\n",
        "      id: meta-llama/Llama-3.1-8B\n      s3_uri: s3://models-bucket/llama/\n",
    )
    env = parse_environment(text, source=SOURCE)
    assert env.deployments[0].model.s3_uri == "s3://models-bucket/llama/"


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ("{source: uri}", "source uri needs `uri`"),
        ("{source: dlc, tag: x}", "`repository` and `tag` are only used with source kvfleet"),
        ("{source: kvfleet, uri: 123456789012.dkr.ecr.us-east-1.amazonaws.com/x:1}", "only used with source uri"),
    ],
)
def test_image_fields_must_match_source(image: str, message: str) -> None:
    lines = problems(BASE + f"    image: {image}\n")
    assert any(message in line and "deployments[0].image" in line for line in lines), lines


def test_existing_vpc_needs_subnets_and_azs() -> None:
    text = BASE.replace("deployments:\n", "network:\n  vpc_id: vpc-0123456789abcdef0\ndeployments:\n", 1)
    lines = problems(text)
    assert lines[0].startswith("envs/test.yaml:3: network: ")
    assert "private_subnet_ids in at least two AZs" in lines[0]


def test_plan_requests_defaults() -> None:
    text = BASE.replace("      ttft_ms: 2500\n      itl_ms: 40\n", "").replace("region: eu-west-1\n", "")
    text = text.replace("    sizing:\n      kv_cache_dtypes: [auto, fp8]\n", "").replace(
        "platform: sagemaker", "platform: eks"
    )
    env = parse_environment(text, source=SOURCE)
    [dr] = plan_requests(env)
    req = dr.request
    assert req.region is None
    assert req.hosting is TARGETS["eks"].hosting
    assert req.workload.ttft_target_s is None
    assert req.workload.itl_target_s is None
    assert req.instance_types == ()
    assert req.kv_cache_dtypes == (KvDtype.AUTO,)
    assert req.weight_precisions == ()
    assert req.gpu_memory_utilization is None


def test_plan_requests_unknown_model_names_the_deployment() -> None:
    env = parse_environment(BASE.replace("id: meta-llama/Llama-3.1-8B", "id: no/such-model"), source=SOURCE)
    with pytest.raises(KvfleetError) as info:
        plan_requests(env)
    assert str(info.value).startswith("deployments[0].model.id: unknown model 'no/such-model'")


def test_committed_schema_is_in_sync() -> None:
    # `kvfleet schema -o environments/schema.json` regenerates it; editors read it to check the YAML.
    from kvfleet.config.loader import environment_schema_json

    committed = (Path(__file__).parents[2] / "environments" / "schema.json").read_text(encoding="utf-8")
    assert committed == environment_schema_json(), "run: kvfleet schema -o environments/schema.json"


def test_schema_documents_every_field() -> None:
    import json

    from kvfleet.config.loader import environment_schema_json

    schema = json.loads(environment_schema_json())
    for name, definition in schema["$defs"].items():
        for field, spec in definition.get("properties", {}).items():
            if "$ref" in spec or "discriminator" in spec or "oneOf" in spec:
                continue
            assert spec.get("description"), f"{name}.{field} has no description"


def test_scale_in_waits_fifteen_minutes_or_twice_the_drain_budget() -> None:
    env = parse_environment(BASE, source=SOURCE)
    scaling = env.deployments[0].scaling
    assert scaling.scale_in_wait_s == max(900, 2 * scaling.drain_budget_s)
    longer = BASE.replace("      max_replicas: 3\n", "      max_replicas: 3\n      drain_budget_s: 600\n")
    assert parse_environment(longer, source=SOURCE).deployments[0].scaling.scale_in_wait_s == 1200


def test_a_longer_scale_in_wait_is_kept_and_one_below_the_floor_is_refused_at_its_line() -> None:
    wait = BASE.replace("      max_replicas: 3\n", "      max_replicas: 3\n      scale_in_after_s: 1800\n")
    scaling = parse_environment(wait, source=SOURCE).deployments[0].scaling
    assert scaling.scale_in_wait_s == 1800 and "scale_in_after_s" in scaling.pinned
    short = BASE.replace(
        "      max_replicas: 3\n", "      max_replicas: 3\n      drain_budget_s: 600\n      scale_in_after_s: 900\n"
    )
    [line] = problems(short)
    assert line.startswith(f"{SOURCE}:") and "scale_in_after_s: at least 1200 (twice drain_budget_s 600" in line
    [line] = problems(wait.replace("scale_in_after_s: 1800", "scale_in_after_s: 7200"))
    assert f"{SOURCE}:{line_of(wait, 'scale_in_after_s')}:" in line and "3600" in line


# ---- the image speaks this kvfleet's contract ---------------------------------------------------------

DIGEST = "@sha256:" + "0" * 64
CV = contract.CONTRACT_VERSION
ECR = "123456789012.dkr.ecr.eu-west-1.amazonaws.com/kvfleet-vllm"


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ("{tag: v1}", "tag v1 does not say which contract the image speaks"),
        ("{tag: 0.11.0-kvfleet999}", "the image speaks contract 999, this kvfleet speaks"),
        (f"{{tag: 0.10.0-kvfleet{CV}}}", "the image runs vllm 0.10.0, engine.version is 0.11.0"),
        ("{tag: 0.11.0-kvfleet1}", f"the image speaks contract 1, this kvfleet speaks {CV}"),  # before the bump
        (f"{{source: uri, uri: {ECR}:latest}}", "tag latest does not say which contract"),
        (f"{{source: uri, uri: {ECR}{DIGEST}}}", "expected an ECR image URI"),  # a digest alone has no tag
    ],
)
def test_image_tags_must_name_this_contract_and_the_engine_release(image: str, message: str) -> None:
    [line] = problems(BASE + f"    image: {image}\n")
    assert message in line
    assert line.startswith(f"{SOURCE}:{BASE.count(chr(10)) + 1}: deployments[0].image.")


@pytest.mark.parametrize(
    "image",
    [
        f"{{tag: 0.11.0-kvfleet{CV}}}",
        f"{{tag: 0.11.0-kvfleet{CV}-build42}}",
        f"{{source: uri, uri: {ECR}:0.11.0-kvfleet{CV}{DIGEST}}}",
    ],
)
def test_image_tags_for_this_contract_are_accepted(image: str) -> None:
    env = parse_environment(BASE + f"    image: {image}\n", source=SOURCE)
    assert env.deployments[0].image.source in ("kvfleet", "uri")


def test_engine_names_come_from_the_engine_registry() -> None:
    [line] = problems(BASE.replace("name: vllm", "name: sglang"))
    assert "engine.name" in line and "'vllm' or 'trtllm'" in line


def test_the_renamed_kv_target_says_what_replaced_it(tmp_path: Path) -> None:
    text = (REPO / "environments" / "dev.yaml").read_text()
    assert "scaling:" in text
    f = tmp_path / "old.yaml"
    f.write_text(text.replace("scaling:", "scaling:\n      kv_cache_utilization_target: 0.75", 1))
    with pytest.raises(KvfleetError) as err:
        load_located(f)
    assert "renamed to saturation_target" in str(err.value) and f"{f}:" in str(err.value)


def test_derive_needs_a_ttft_target_and_arrivals() -> None:
    """scaling.derive searches for the cheapest policy meeting a TTFT goal on a replay: without a target or an
    arrival rate there is nothing to search for, which the file hears at load, not at synth."""
    text = BASE.replace("      max_replicas: 3\n", "      max_replicas: 3\n      derive: true\n")
    [line] = problems(text)
    assert line == (
        f"{SOURCE}:{line_of(text, 'derive: true')}: deployments[0].scaling.derive: nothing to replay; set "
        "workload.trace or workload.peak_requests_per_s, or derive: false"
    )
    no_ttft = text.replace("      ttft_ms: 2500\n", "      peak_requests_per_s: 2\n")
    [line] = problems(no_ttft)
    assert "scaling.derive: the thresholds are derived for a TTFT target; set workload.ttft_ms" in line
    ok = no_ttft.replace("      peak_requests_per_s: 2\n", "      peak_requests_per_s: 2\n      ttft_ms: 2500\n")
    s = parse_environment(ok, source=SOURCE).deployments[0].scaling
    assert s.derive and s.pinned == frozenset({"min_replicas"})  # what the file sets, not what defaults fill
    assert s.slo_attainment == 0.95
