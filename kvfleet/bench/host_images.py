"""The AWS side of ``kvfleet plan --refresh-host-images``: boto3 clients for the host lock's lookups
(kvfleet.config.host_lock.resolve: SSM GetParameter, EC2 DescribeImages). The only AWS calls the lock makes; synth
reads the lock offline."""

from __future__ import annotations

from functools import cache
from typing import Any

import boto3


@cache
def aws_client(service: str, region: str) -> Any:
    """One client per service and region, from the caller's credentials (a host_lock.Clients)."""
    return boto3.client(service, region_name=region)
