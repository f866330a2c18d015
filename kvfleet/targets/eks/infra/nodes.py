"""The node groups' sizes: the GPU nodes' root disk, and the small untainted group for the cluster's own pods.

Pure (no aws_cdk). The rules and their sources:
- A managed node group without a launch template has one root volume of ``diskSize`` GiB (EKS CreateNodegroup),
  holding the OS, containerd's images and every emptyDir. containerd keeps an image twice: the compressed layers
  in its content store and the unpacked snapshot the container runs from (containerd docs, content flow).
- The kubelet garbage-collects images above imageGCHighThresholdPercent (85) and evicts pods below
  ``imagefs.available`` 15 % / ``nodefs.available`` 10 % (KubeletConfiguration defaults; Kubernetes
  "Node-pressure Eviction"); the images share the root filesystem, so the volume is sized to stay under 85 %.
"""

from __future__ import annotations

import math

from kvfleet.deployments import IMAGE_DISK_GIB

OS_DISK_GIB = 20  # EKS's default diskSize for a Linux node group: the AMI and its logs, with nothing pulled
IMAGE_COPIES = 2  # compressed layers + unpacked snapshot
DISK_HIGH_WATERMARK = 0.85  # kubelet imageGCHighThresholdPercent / imagefs.available<15 %

# The untainted node group of a new cluster, for CoreDNS, KEDA, Prometheus and Cluster Autoscaler (their requests
# add up to well under one vCPU and 2 GiB). Two nodes: CoreDNS runs two replicas, spread by preferred
# anti-affinity, and one node replaced at a time (an AMI update) leaves DNS up. General purpose, x86_64, offered
# in every commercial region.
SYSTEM_INSTANCE_TYPE = "m6i.large"
SYSTEM_NODES = 2
SYSTEM_NODE_LABEL = ("kvfleet.io/system", "true")


def gpu_node_disk_gib(*, model_cache_gib: int, pods_per_node: int, image_gib: int = IMAGE_DISK_GIB) -> int:
    """The root volume of a GPU node: the OS, the serving image twice, and each pod's model-cache emptyDir,
    under the kubelet's 85 % image-GC / eviction line."""
    need = OS_DISK_GIB + IMAGE_COPIES * image_gib + pods_per_node * model_cache_gib
    return math.ceil(need / DISK_HIGH_WATERMARK)
