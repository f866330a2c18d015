"""EKS's construct: the service (``service.py``): the cluster or the existing one, the add-ons (``addons.py``), the
GPU node group (``nodes.py``, ``scheduling.py``, ``access.py``), the manifests (``manifests.py``, checked by
``checks.py`` against ``schemas/``) and the nodes' driver (``hosts.py``)."""

from __future__ import annotations

from kvfleet.infra.context import TargetSpec
from kvfleet.targets.eks.infra.service import EksService

CONSTRUCT = TargetSpec(construct_id="Eks", build=lambda s, i, c: EksService(s, i, context=c))
