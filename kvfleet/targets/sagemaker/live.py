"""`kvfleet check` on SageMaker: the endpoint is InService (DescribeEndpoint), and streams one generation through
InvokeEndpointWithResponseStream, the path its clients use. SageMaker's runtime reaches the container's
``/invocations`` only, so the KV cache the engine allocated is not readable from outside."""

from __future__ import annotations

from kvfleet.bench.client import PROMPT_TOKEN_IDS
from kvfleet.bench.live import CHECK_OUTPUT_TOKENS, GENERATION_TIMEOUT_S, Check, Deployed
from kvfleet.bench.sagemaker import SageMakerTarget, SageMakerTransport
from kvfleet.targets.sagemaker import COMPONENT_SEPARATOR, TARGET


def run(d: Deployed, check: Check) -> None:
    name, _, component = d.outputs[TARGET.address_output or ""].partition(COMPONENT_SEPARATOR)
    desc = d.session.client("sagemaker").describe_endpoint(EndpointName=name)
    status = desc.get("EndpointStatus")
    if status != "InService":
        reason = f": {desc['FailureReason']}" if desc.get("FailureReason") else ""
        check.fail(f"endpoint {name} is {status}{reason}")
        return
    variants = desc.get("ProductionVariants", [])
    count = sum(int(v.get("CurrentInstanceCount", 0)) for v in variants)
    check.ok(f"endpoint {name} is InService with {count} instance(s)")
    if not d.generation:
        return
    transport = SageMakerTransport(
        SageMakerTarget(endpoint_name=name, inference_component=component or None, region=d.session.region_name),
        workers=1,
        timeout_s=GENERATION_TIMEOUT_S,
        session=d.session,
    )
    try:
        res = transport.invoke(None, list(PROMPT_TOKEN_IDS[:8]), CHECK_OUTPUT_TOKENS)
    finally:
        transport.close()
    if res.ok and res.output_tokens > 0:
        check.ok(f"one generation streamed {res.output_tokens} tokens, first after {res.ttft_s or 0:.2f} s")
    else:
        check.fail(f"the generation failed: {res.error or 'no token came back'}")
    check.note(
        "the KV cache is not read on SageMaker (its runtime reaches /invocations only); kvfleet bench against a "
        "replica's agent checks it"
    )
