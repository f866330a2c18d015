"""The Run Command document `kvfleet check` sends one instance of the fleet: it reads the agent's ``/ping`` and the
KV-cache lines of ``/metrics`` on the instance itself, and nothing else.

Why a document of its own: the GPU hosts hold the Hugging Face token and the tenant secret, and AWS-RunShellScript
runs whatever its caller passes, as root. This document takes no parameters, so whoever may send it can only read
those two routes (Systems Manager User Guide, "Creating SSM document content": a Command document's
``aws:runShellScript`` step runs its ``runCommand`` lines; the caller supplies only the declared ``parameters``).
It lives in the fleet's own stack, tagged with the environment like the instances, so `kvfleet check` finds it
through the stack's outputs with or without the release pipeline, and the pipeline's live-check role is allowed
this document only (``kvfleet.targets.ec2.pipeline``).
"""

from __future__ import annotations

from typing import Any

from aws_cdk import aws_ssm as ssm
from constructs import Construct

from kvfleet import contract
from kvfleet.targets.ec2 import PROBE_MARK as MARK
from kvfleet.targets.ec2 import PROBE_OUTPUT

__all__ = ["MARK", "PROBE_OUTPUT", "probe_commands", "probe_content", "probe_document"]

# Run Command's document schema for Command documents (Systems Manager User Guide, "Schema version 2.2").
SCHEMA_VERSION = "2.2"
# The document's own time limit for its step, beside the check's Run Command timeout.
EXECUTION_TIMEOUT_S = 60


def probe_commands(*, port: int = contract.SERVING_PORT) -> list[str]:
    """The step's shell lines: /ping's status and the agent's KV-cache gauges from /metrics, each after a marker
    line. Only those gauges are printed: Run Command returns at most 24,000 characters of output."""
    base = f"http://127.0.0.1:{port}"
    names = "|".join((contract.PROM_ENGINE_KV_BLOCKS, contract.PROM_ENGINE_KV_BLOCK_TOKENS))
    curl = "curl -sS --max-time 10"
    return [
        f"echo {MARK}-ping $({curl} -o /dev/null -w '%{{http_code}}' {base}{contract.HEALTH_ROUTE})",
        f"echo {MARK}-metrics",
        f"{curl} {base}{contract.METRICS_ROUTE} | grep -E '^({names})' || true",
    ]


def probe_content(*, port: int = contract.SERVING_PORT) -> dict[str, Any]:
    """The document's content: one shell step, no parameters."""
    return {
        "schemaVersion": SCHEMA_VERSION,
        "description": "kvfleet check: read the serving agent's /ping and its KV cache on /metrics",
        "parameters": {},
        "mainSteps": [
            {
                "action": "aws:runShellScript",
                "name": "probe",
                "inputs": {"timeoutSeconds": str(EXECUTION_TIMEOUT_S), "runCommand": probe_commands(port=port)},
            }
        ],
    }


def probe_document(scope: Construct) -> ssm.CfnDocument:
    """The document, named by CloudFormation (no fixed physical name); the stack's tags reach it."""
    return ssm.CfnDocument(scope, "ProbeDocument", document_type="Command", content=probe_content())
