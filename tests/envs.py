"""Environment files for tests, as text, and the parsed objects (no CDK)."""

from __future__ import annotations

import json
from pathlib import Path

from kvfleet.config.loader import parse_environment
from kvfleet.config.schema import Environment

REPO = Path(__file__).resolve().parents[1]
FEATURE_FLAGS = json.loads((REPO / "cdk.json").read_text(encoding="utf-8"))["context"]

# One SageMaker deployment; tests replace parts of it. Llama-3.1-8B on an L40S instance (local NVMe). It makes the
# choices synth asks for: nobody is subscribed to its alarms, and its one tenant shares the prefix cache.
# SERVING_CHOICE is that block, for tests that write a serving section of their own.
SAGEMAKER_ENV = """\
name: test
region: us-east-1
notifications: none
deployments:
  - name: chat
    model:
      id: meta-llama/Llama-3.1-8B
      hf_token_secret: kvfleet/hf-token
    engine:
      name: vllm
      version: "0.30.0"
    workload:
      max_input_tokens: 4096
      max_output_tokens: 1024
      concurrency_per_replica: 16
    target:
      platform: sagemaker
    scaling:
      min_replicas: 1
      max_replicas: 4
      drain_budget_s: 420
    sizing:
      instance_type: ml.g6e.xlarge
    serving:
      tenancy: single
"""


SERVING_CHOICE = "    serving:\n      tenancy: single\n"


def with_serving(block: str, text: str = SAGEMAKER_ENV) -> str:
    """``text`` with its serving section replaced by ``block`` (a deployment key, indented four spaces)."""
    assert SERVING_CHOICE in text, "the text has the base's serving section"
    return text.replace(SERVING_CHOICE, block)


def environment(text: str = SAGEMAKER_ENV) -> Environment:
    return parse_environment(text, source="test.yaml")
