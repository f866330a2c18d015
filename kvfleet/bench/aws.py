"""Where a deployed stack says its deployment is reached: its CloudFormation outputs (DescribeStacks)."""

from __future__ import annotations

from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from kvfleet.bench.client import BenchError

# Stack states in which the outputs describe what is running (CloudFormation User Guide, "Stack status codes").
SERVING_STATES = frozenset({"CREATE_COMPLETE", "UPDATE_COMPLETE", "UPDATE_ROLLBACK_COMPLETE", "IMPORT_COMPLETE"})


def stack_outputs(stack_name: str, region: str, *, client: Any = None) -> dict[str, str]:
    """The outputs of a deployed stack, or a one-line BenchError saying why there are none to read."""
    try:
        cfn = client or boto3.client("cloudformation", region_name=region)
        resp = cfn.describe_stacks(StackName=stack_name)
    except NoCredentialsError:
        raise BenchError(
            f"no AWS credentials to read stack {stack_name}; set AWS_PROFILE or the usual AWS variables", field="env"
        ) from None
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        message = err.response.get("Error", {}).get("Message", str(err))
        if code == "ValidationError" and "does not exist" in message:
            raise BenchError(
                f"stack {stack_name} is not deployed in {region}; deploy it (cdk deploy {stack_name}) or give the URL",
                field="env",
            ) from None
        raise BenchError(f"cannot read stack {stack_name} in {region}: {code}: {message}", field="env") from None
    except BotoCoreError as err:
        raise BenchError(f"cannot read stack {stack_name} in {region}: {err}", field="env") from None
    [stack] = resp["Stacks"]
    status = stack.get("StackStatus", "")
    if status not in SERVING_STATES:
        raise BenchError(f"stack {stack_name} is {status}; wait until it is deployed", field="env")
    return {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
