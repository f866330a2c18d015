"""The GPU AMI the default ``target.ami_parameter`` resolves to (``hosts.json``, with its source): the driver the
fleet's instances run."""

from __future__ import annotations

from kvfleet.infra.cuda import HostRule
from kvfleet.targets.ec2 import TARGET

HOSTS = HostRule(platform=TARGET.name, package=__name__.rpartition(".")[0], field="target.ami_parameter")
