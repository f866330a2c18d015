"""Where `kvfleet bench` sends its requests: a URL, a SageMaker endpoint, or where a planned stack says."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvfleet.errors import KvfleetError
from kvfleet.targets import TARGETS

if TYPE_CHECKING:
    from kvfleet.bench.client import Endpoint
    from kvfleet.bench.sagemaker import SageMakerTarget
    from kvfleet.deployments import ResolvedDeployment


def deployed_url(r: ResolvedDeployment) -> str:
    """Where the deployment's stack says clients reach it (its CloudFormation outputs)."""
    from kvfleet.bench.aws import stack_outputs

    key = TARGETS[r.deployment.target.platform].address_output
    if key is None:
        raise KvfleetError(
            f"deployment {r.deployment.name} runs behind a ClusterIP Service with no address outside the cluster; "
            "port-forward to it (kubectl port-forward) and give http://127.0.0.1:<port>",
            field="url",
        )
    region = r.environment.region
    if region is None:
        raise KvfleetError("the environment file names no region to find its stacks in; set region", field="region")
    outputs = stack_outputs(r.stack_name, region)
    if key not in outputs:
        raise KvfleetError(f"stack {r.stack_name} has no output {key}; redeploy it with this kvfleet", field="env")
    return r.deployment.target.client_address(outputs[key])


def planned_deployment(env_file: str, deployment: str | None) -> ResolvedDeployment:
    """A deployment of an environment file as planned."""
    from kvfleet.config.loader import environment_path, load_located
    from kvfleet.deployments import config_error, plan_requests, resolve

    loaded = load_located(environment_path(env_file))
    try:
        drs = plan_requests(loaded.environment)
    except KvfleetError as err:
        raise loaded.problem(err) from None
    names = [dr.deployment.name for dr in drs]
    if deployment is None and len(drs) == 1:
        deployment = names[0]
    matching = [dr for dr in drs if dr.deployment.name == deployment]
    if not matching:
        raise KvfleetError(
            f"no deployment {deployment!r} in {loaded.source}; it has {', '.join(names)}", field="deployment"
        )
    try:
        return resolve(loaded.environment, matching[0])
    except KvfleetError as err:
        raise loaded.problem(config_error(err, matching[0].index)) from None


def bench_target(a: argparse.Namespace, planned: ResolvedDeployment | None) -> tuple[Endpoint, SageMakerTarget | None]:
    """The endpoint `kvfleet bench` sends to: an http(s) URL with its headers, or a SageMaker endpoint by name."""
    import os
    import re
    from urllib.parse import urlsplit

    from kvfleet.bench.client import Endpoint

    sagemaker = None
    if a.url.startswith("sagemaker:"):
        from kvfleet.bench.sagemaker import SageMakerTarget

        name, _, component = a.url.removeprefix("sagemaker:").partition("/")
        # SageMaker's EndpointName and InferenceComponentName pattern (CreateEndpoint, CreateInferenceComponent API
        # reference); the component follows a slash where the endpoint hosts one.
        for value in (name, component) if component else (name,):
            if not re.fullmatch(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}", value):
                raise KvfleetError(
                    f"{value!r} is not a SageMaker endpoint or inference component name (letters, digits, '-', 63 at "
                    "most)",
                    field="url",
                )
        region = a.region or (planned.environment.region if planned is not None else None)
        sagemaker = SageMakerTarget(
            endpoint_name=name, inference_component=component or None, region=region, endpoint_url=a.endpoint_url
        )
    else:
        parts = urlsplit(a.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise KvfleetError(
                f"{a.url!r} is not an http(s) URL or sagemaker:<endpoint name>; e.g. http://127.0.0.1:8080", field="url"
            )
        for flag in ("region", "endpoint_url"):
            if getattr(a, flag) is not None:
                raise KvfleetError(
                    f"--{flag.replace('_', '-')} is for a SageMaker endpoint (sagemaker:<name>); drop it", field=flag
                )
    headers = []
    for h in a.header:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise KvfleetError(f"{h!r} is not NAME:VALUE", field="header")
        headers.append((name.strip(), value.strip()))
    api_key = a.api_key or os.environ.get("KVFLEET_BENCH_API_KEY")
    return Endpoint(url=a.url, model=a.model, api_key=api_key, headers=tuple(headers)), sagemaker
