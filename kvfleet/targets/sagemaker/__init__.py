"""SageMaker: a real-time endpoint, one production variant of the plan's instances.

Its parts: ``config`` (the ``target:`` section and its checks), ``infra`` (the endpoint construct and the inference
AMIs it runs on), ``live`` (`kvfleet check`: the endpoint's status and one streamed generation), ``pipeline`` (the
live-check role's grants).
"""

from __future__ import annotations

from kvfleet.scaling.kinds import AutoscalerKind
from kvfleet.sizing.hosting import Hosting, PriceList, Routing
from kvfleet.targets import Target

# EC2 instances in a Kubernetes node group or an Auto Scaling group: the shape the nothing-fits message suggests.
_WIDER = Hosting(price_list=PriceList.EC2, routing=Routing.RANDOM)

TARGET = Target(
    name="sagemaker",
    summary="a SageMaker real-time endpoint",
    hosting=Hosting(
        price_list=PriceList.SAGEMAKER,
        endpoint_types_only=True,
        one_engine_per_instance=True,  # a production variant runs one container per instance
        max_volume_gib=512,  # ProductionVariant VolumeSizeInGB: 1-512
        # InvokeEndpoint (API reference): "A customer's model containers must respond to requests within 60
        # seconds." Streamed answers (InvokeEndpointWithResponseStream) are not bound by it.
        buffered_response_limit_s=60,
        # ProductionVariant RoutingConfig LEAST_OUTSTANDING_REQUESTS (kvfleet.targets.sagemaker.infra.endpoint).
        routing=Routing.LEAST_OUTSTANDING,
        wider=_WIDER,
        wider_label="platform ec2 or eks (more instance types)",
    ),
    autoscaler=AutoscalerKind.TARGET_TRACKING,
    address_output="EndpointName",
    # Application Auto Scaling takes a variant to zero only for endpoints built from inference components
    # (SageMaker Developer Guide, "Scale an endpoint to zero instances"); kvfleet deploys variants.
    no_scale_to_zero="a real-time endpoint's production variant keeps at least one instance",
)
