"""SageMaker's construct: the endpoint (``endpoint.py``) on the inference AMI that runs the image (``hosts.py``)."""

from __future__ import annotations

from kvfleet.infra.context import TargetSpec
from kvfleet.targets.sagemaker.infra.endpoint import SageMakerEndpoint

CONSTRUCT = TargetSpec(construct_id="Endpoint", build=lambda s, i, c: SageMakerEndpoint(s, i, context=c))
