"""EC2's construct: the fleet (``fleet.py``), what its instances boot (``user_data.py``, ``user-data.sh``), their
lifecycle hooks (``lifecycle.py``) and the AMI's driver (``hosts.py``)."""

from __future__ import annotations

from kvfleet.infra.context import TargetSpec
from kvfleet.targets.ec2.infra.fleet import Ec2Fleet

# The instances are the fleet's own: they reach Session Manager and Auto Scaling through the VPC's endpoints.
CONSTRUCT = TargetSpec(construct_id="Fleet", build=lambda s, i, c: Ec2Fleet(s, i, context=c), fleet_endpoints=True)
