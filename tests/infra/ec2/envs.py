"""The EC2 environment the fleet tests start from, and the variants they compare (text only, no CDK)."""

from __future__ import annotations

from kvfleet.deployments import ResolvedDeployment, resolve_environment
from tests.envs import environment

# Llama-3.1-8B from S3 on g6e (local NVMe), a stopped warm pool, scaling 1..4 with a 7-minute drain budget.
EC2_ENV = """\
name: test
region: us-east-1
notifications: none
deployments:
  - name: chat
    model:
      id: meta-llama/Llama-3.1-8B
      s3_uri: s3://model-bucket/llama/8b/
    engine:
      name: vllm
      version: "0.30.0"
    workload:
      max_input_tokens: 4096
      max_output_tokens: 1024
      concurrency_per_replica: 16
    target:
      platform: ec2
      warm_pool:
        enabled: true
        min_size: 1
    scaling:
      min_replicas: 1
      max_replicas: 4
      drain_budget_s: 420
    sizing:
      families: [g6e]
    serving:
      tenancy: single
"""
MODEL_S3_URI = "s3://model-bucket/llama/8b/"
HF_TOKEN_SECRET = "kvfleet/hf-token"


def without_warm_pool(text: str = EC2_ENV) -> str:
    return text.replace("        enabled: true\n", "        enabled: false\n")


def from_hugging_face(text: str = EC2_ENV) -> str:
    """The engine downloads the model itself, with a token from Secrets Manager."""
    return text.replace(f"      s3_uri: {MODEL_S3_URI}\n", f"      hf_token_secret: {HF_TOKEN_SECRET}\n")


def resolved(text: str = EC2_ENV) -> ResolvedDeployment:
    [r] = resolve_environment(environment(text))
    return r
