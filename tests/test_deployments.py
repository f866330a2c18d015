"""From environment to ResolvedDeployment: the plan, the container environment, disks and timeouts."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvfleet import contract
from kvfleet.deployments import ResolvedDeployment, engine_args, plan_requests, resolve_environment
from kvfleet.engines import ENGINES, EngineArgs
from kvfleet.errors import KvfleetError
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.engines import EngineName
from kvfleet.sizing.planner import Candidate, PlanRequest, Workload, plan
from kvfleet.sizing.units import GiB
from kvfleet.targets import TARGETS
from tests.envs import SAGEMAKER_ENV, environment


def resolve(text: str = SAGEMAKER_ENV) -> ResolvedDeployment:
    [r] = resolve_environment(environment(text))
    return r


def test_names() -> None:
    r = resolve()
    assert (r.deployment_id, r.stack_name) == ("test-chat", "kvfleet-test-chat")
    assert r.instance_type == "ml.g6e.xlarge"


def test_checkpoint_is_the_stored_precision() -> None:
    # Llama-3.1-8B: 8.03 B parameters in bf16 (~15 GiB), whatever precision the engine runs it at.
    r = resolve()
    assert r.checkpoint_bytes / GiB == pytest.approx(14.96, abs=0.05)
    fp8 = resolve(
        SAGEMAKER_ENV.replace(
            "      instance_type: ml.g6e.xlarge\n",
            "      instance_type: ml.g6e.xlarge\n      weight_precisions: [fp8]\n",
        )
    )
    assert fp8.candidate.weight_scheme.name == "fp8"
    assert fp8.checkpoint_bytes == r.checkpoint_bytes


def test_timeouts_grow_with_the_model_and_stay_in_sagemakers_bounds() -> None:
    small = resolve()
    big = resolve(
        SAGEMAKER_ENV.replace("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.3-70B-Instruct").replace(
            "instance_type: ml.g6e.xlarge", "instance_type: ml.p4de.24xlarge"
        )
    )
    assert big.startup_timeout_s > small.startup_timeout_s
    assert big.download_timeout_s >= small.download_timeout_s
    for r in (small, big):
        assert 600 <= r.download_timeout_s <= 3600
        assert 600 <= r.startup_timeout_s <= 3600
        assert r.startup_timeout_s % 60 == 0
        # Twice the estimate: a slow start is not killed.
        assert r.startup_timeout_s >= min(3600, 2 * r.startup.container_start_s)


def test_initial_count_is_the_plan_within_the_bounds() -> None:
    assert resolve().initial_instance_count == 1  # no peak load given: one replica
    r = resolve(SAGEMAKER_ENV.replace("min_replicas: 1", "min_replicas: 3"))
    assert r.initial_instance_count == r.candidate.instance_count == 3
    busy = resolve(
        SAGEMAKER_ENV.replace(
            "concurrency_per_replica: 16", "concurrency_per_replica: 16\n      peak_requests_per_s: 1"
        )
    )
    assert busy.initial_instance_count == busy.candidate.instance_count
    assert 1 <= busy.initial_instance_count <= 4


def test_kvfleet_image_environment_is_exact_engine_args() -> None:
    r = resolve()
    env = r.container_environment()
    args = EngineArgs.from_json(env[contract.ENV_ENGINE_ARGS])
    assert args == r.engine_args
    assert (args.max_num_seqs, args.max_model_len) == (r.candidate.concurrency_per_replica, 4096 + 1024)
    assert args.tensor_parallel_size == r.candidate.tensor_parallel_size
    assert env[contract.ENV_CONTRACT_VERSION] == str(contract.CONTRACT_VERSION)
    assert env["KVFLEET_PORT"] == "8080"
    assert env["KVFLEET_PUT_METRIC_DATA"] == "0"
    assert "KVFLEET_HF_TOKEN_SECRET_ARN" not in r.container_environment(isolated=True)


def test_trtllm_dlc_environment_uses_djl_options() -> None:
    text = (
        SAGEMAKER_ENV.replace("name: vllm", "name: trtllm")
        .replace('version: "0.30.0"', 'version: "0.21.0"')
        .replace("max_replicas: 4", "max_replicas: 1")
        .replace("      hf_token_secret: kvfleet/hf-token\n", "")
        + "    image:\n      source: dlc\n"
    )
    r = resolve(text)
    env = r.container_environment()
    opts = ENGINES["trtllm"].settings(r.engine_args)
    assert env["OPTION_ROLLING_BATCH"] == "trtllm"
    assert env["OPTION_MAX_ROLLING_BATCH_SIZE"] == str(opts["max_batch_size"]) == "16"
    assert env["OPTION_MAX_INPUT_LEN"] == "4096"
    assert env["OPTION_MAX_OUTPUT_LEN"] == "1024"
    assert env["OPTION_KV_CACHE_FREE_GPU_MEM_FRACTION"] == str(opts["kv_cache_config"]["free_gpu_memory_fraction"])
    assert env["HF_MODEL_ID"] == "meta-llama/Llama-3.1-8B"


def test_unplannable_deployment_names_it() -> None:
    text = SAGEMAKER_ENV.replace("max_input_tokens: 4096", "max_input_tokens: 120000").replace(
        "instance_type: ml.g6e.xlarge", "instance_type: ml.g5.xlarge"
    )
    with pytest.raises(KvfleetError) as info:
        resolve_environment(environment(text))
    assert str(info.value).startswith("deployments[0]: ")
    assert "\n" not in str(info.value)


def test_local_config_needs_an_s3_model(tmp_path: object) -> None:
    from tests.sizing.conftest import llama_config

    path = tmp_path / "config.json"  # type: ignore[operator]
    path.write_text(json.dumps(llama_config()), encoding="utf-8")
    text = SAGEMAKER_ENV.replace("id: meta-llama/Llama-3.1-8B", f"id: {path}")
    with pytest.raises(KvfleetError, match=r"set model\.s3_uri"):
        resolve_environment(environment(text))


# ---- engine settings from the plan -----------------------------------------------------------------

LLAMA8 = catalog_model("meta-llama/Llama-3.1-8B")
WL = Workload(max_input_tokens=2048, max_output_tokens=512, concurrency_per_replica=16)


def _req(**kw: object) -> PlanRequest:
    base = PlanRequest(model=LLAMA8, workload=WL, hosting=TARGETS["ec2"].hosting)
    return replace(base, **kw)  # type: ignore[arg-type]


def vllm(c: Candidate) -> dict[str, object]:
    return ENGINES["vllm"].settings(engine_args(c))


def test_engine_settings_admit_exactly_what_fits() -> None:
    best = plan(_req()).best
    args = vllm(best)
    assert args["max-num-seqs"] == best.concurrency_per_replica
    assert args["max-model-len"] == 2048 + 512
    assert args["tensor-parallel-size"] == best.tensor_parallel_size
    # The breakdown shown is the one for the emitted max-num-seqs.
    assert best.capacity.max_num_seqs == best.concurrency_per_replica
    trt = plan(_req(engine=EngineName.TRTLLM)).best
    opts = ENGINES["trtllm"].settings(engine_args(trt))
    assert opts["max_batch_size"] == trt.concurrency_per_replica and opts["max_seq_len"] == 2560
    assert opts["kv_cache_config"]["free_gpu_memory_fraction"] == 0.9


def test_quantization_flag_only_for_on_the_fly_quantization() -> None:
    online = plan(_req(weight_precisions=("fp8",), instance_types=("p5.4xlarge",))).best
    assert vllm(online)["quantization"] == "fp8"
    # An FP8 checkpoint carries its method in config.json; vLLM needs no flag.
    ckpt = plan(
        _req(
            model=catalog_model("Qwen/Qwen3-235B-A22B-FP8"),
            weight_precisions=(),
            instance_types=("p5.48xlarge",),
        )
    ).best
    assert ckpt.weight_scheme.name == "fp8" and ckpt.online_quantization is None
    assert "quantization" not in vllm(ckpt)


def test_a_precision_that_only_comes_as_a_checkpoint_names_no_engine_flag() -> None:
    # vLLM has no AWQ method that quantizes at load: --quantization awq on an unquantized checkpoint fails at start
    # (the method and its scales come from the checkpoint's quantization_config). A plan for AWQ weights of a bf16
    # model is sized for an AWQ checkpoint of it, says so, and emits no flag.
    awq = plan(_req(weight_precisions=("awq",))).best
    assert awq.weight_scheme.name == "awq" and awq.online_quantization is None
    assert "quantization" not in vllm(awq)
    assert any("sized for a checkpoint of this model in awq" in n for n in awq.notes)


def test_a_file_that_plans_a_checkpoint_only_precision_for_an_unquantized_model_is_refused() -> None:
    text = SAGEMAKER_ENV.replace(
        "      instance_type: ml.g6e.xlarge\n", "      instance_type: ml.g6e.xlarge\n      weight_precisions: [awq]\n"
    )
    with pytest.raises(KvfleetError, match=r"awq was chosen.*put a checkpoint of this model in awq in model\.id"):
        resolve(text)


def test_buffered_workloads_reach_the_planner() -> None:
    env = environment(
        SAGEMAKER_ENV.replace(
            "      concurrency_per_replica: 16\n", "      concurrency_per_replica: 16\n      streaming: false\n"
        )
    )
    [dr] = plan_requests(env)
    assert dr.request.workload.streaming is False
    assert plan_requests(environment())[0].request.workload.streaming is True


def test_the_agent_admits_what_runs_plus_what_can_start_within_the_ttft_target() -> None:
    """The agent's own settings, read from the container environment the stacks set, admit the plan's figure."""
    from kvfleet.agent.settings import from_env

    r = resolve()
    adm = r.admission
    c, wl = r.candidate, r.workload
    agent = from_env({**r.container_environment(), contract.ENV_MODEL: "m", contract.ENV_REPLICA: "r"})
    assert agent.admitted_tokens is not None
    assert adm.tokens <= agent.admitted_tokens <= adm.tokens + 1  # the factor is rounded up, to a millionth
    assert adm.running == c.concurrency_per_replica and adm.request_tokens == wl.input_tokens + wl.max_output_tokens
    # A batch of the longest requests always fits, whatever the queue.
    assert adm.tokens >= c.concurrency_per_replica * c.capacity.max_model_len
    # Far below what admitting on the KV cache let queue (twice the cache: hundreds of requests behind 16 running).
    assert adm.tokens < r.kv_cache_tokens
    # With a TTFT target, the queue that starts within it at the replica's rate.
    from kvfleet.sizing.planner import admission

    target = replace(wl, ttft_target_s=c.under_load.ttft_s + 3.0)
    queued = admission(c, target).queued
    assert queued == int(3.0 * c.requests_per_s_per_replica)
    assert admission(c, replace(wl, ttft_target_s=c.under_load.ttft_s / 2)).queued == 0


def test_a_rope_scaling_in_the_file_is_sized_and_reaches_the_engine() -> None:
    # Qwen2.5's model cards extend 32,768 tokens to 128K with rope_scaling yarn factor 4; the file says so under
    # model.rope_scaling, the plan sizes the longer context and vLLM starts with the same override.
    long = (
        SAGEMAKER_ENV.replace("id: meta-llama/Llama-3.1-8B", "id: Qwen/Qwen2.5-1.5B-Instruct")
        .replace("max_input_tokens: 4096", "max_input_tokens: 100000")
        .replace("concurrency_per_replica: 16", "concurrency_per_replica: 2")
    )
    with pytest.raises(KvfleetError, match=r"101,024 exceeds vLLM's limit .* 32,768 .*model\.rope_scaling"):
        resolve(long)
    rope = "      rope_scaling: {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}\n"
    r = resolve(
        long.replace("      hf_token_secret: kvfleet/hf-token\n", "      hf_token_secret: kvfleet/hf-token\n" + rope)
    )
    args = EngineArgs.from_json(r.container_environment()[contract.ENV_ENGINE_ARGS])
    assert args.max_model_len == 101024
    assert args.hf_overrides is not None
    overrides = json.loads(args.hf_overrides)
    assert overrides["max_position_embeddings"] == 131072
    assert overrides["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
        "rope_theta": 1000000.0,  # the config's, kept: the override replaces the whole object
    }
    flags = ENGINES["vllm"].flags(args)  # type: ignore[attr-defined]
    assert flags[flags.index("--hf-overrides") + 1] == args.hf_overrides


def test_engine_args_carry_the_candidates_parallel_layout() -> None:
    from kvfleet.sizing.planner import enumerate_candidates

    req = PlanRequest(
        model=catalog_model("Qwen/Qwen2.5-7B"),  # 28 heads: 8 GPUs only as tp=4 x pp=2
        workload=Workload(max_input_tokens=2048, max_output_tokens=512),
        hosting=TARGETS["sagemaker"].hosting,
        instance_types=("p5.48xlarge",),
    )
    c = next(c for c in enumerate_candidates(req).candidates if c.pipeline_parallel_size == 2)
    args = engine_args(c)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.gpus) == (4, 2, 8)
    assert c.gpus_per_replica == c.instance.accelerator_count and c.engines_per_instance == 1
