"""The GPU node group's AMI type (``hosts.json``, with its source): the driver the nodes run. kvfleet picks it, so
no key of the environment file changes it."""

from __future__ import annotations

from kvfleet.infra.cuda import HostRule
from kvfleet.targets.eks import TARGET

HOSTS = HostRule(platform=TARGET.name, package=__name__.rpartition(".")[0], field="the node group's AMI type")
