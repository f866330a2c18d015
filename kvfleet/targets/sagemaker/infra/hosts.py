"""The inference AMI versions a production variant runs on (``hosts.json``, with its sources), picked by
``target.inference_ami_version`` or, without one, for the image's CUDA."""

from __future__ import annotations

from kvfleet.infra.cuda import HostRule
from kvfleet.targets.sagemaker import TARGET

HOSTS = HostRule(platform=TARGET.name, package=__name__.rpartition(".")[0], field="target.inference_ami_version")
