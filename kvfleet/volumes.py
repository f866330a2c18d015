"""The EC2 fleet's root volume: what it holds, the gp3 performance it is provisioned with, and what it costs.

Pure: the EC2 construct provisions it (kvfleet/targets/ec2/infra/fleet.py) and the standby comparison prices a stopped
warm pool's instances by it (kvfleet/tuning.py), so both read one size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfleet.deployments import IMAGE_DISK_GIB, ResolvedDeployment
from kvfleet.sizing.startup import DOWNLOAD_BYTES_PER_S
from kvfleet.sizing.units import GiB, MiB

OS_DISK_GIB = 30  # the GPU AMI's own root volume (drivers, CUDA, Docker)
ROOT_WRITE_BUDGET_S = 300  # the root volume writes the image and the weights on it in at most this long
HOURS_PER_MONTH = 730  # EBS bills per GB-month; AWS's pricing examples count a month as 730 hours


@dataclass(frozen=True, kw_only=True)
class Gp3Limits:
    """What a gp3 volume may be provisioned with."""

    baseline_mib_s: int
    max_mib_s: int
    baseline_iops: int
    max_iops: int
    max_mib_s_per_iops: float
    max_iops_per_gib: int
    sources: tuple[str, ...]


# gp3's limits, as AWS documents them (AWS raised the maxima from 16,000 IOPS and 1,000 MiB/s in 2025):
# - EC2 API LaunchTemplateEbsBlockDeviceRequest, in the EC2 service model of the pinned botocore (1.44.8,
#   botocore/data/ec2/2016-11-15/service-2.json): Iops "gp3: 3,000 - 80,000 IOPS" (3,000 is the default),
#   Throughput "with a maximum of 2,000 MiB/s. Valid Range: Minimum value of 125. Maximum value of 2,000";
# - the Amazon EBS User Guide, "General Purpose SSD volumes", gp3 performance: 3,000 IOPS and 125 MiB/s included
#   in the price, at most 500 IOPS per GiB of volume size and 0.25 MiB/s of throughput per provisioned IOPS (the
#   same ratio and the 125-2,000 range are in aws-cdk-lib 2.275's ec2.EbsDeviceOptionsBase.throughput, which links
#   that page).
GP3 = Gp3Limits(
    baseline_mib_s=125,
    max_mib_s=2000,
    baseline_iops=3000,
    max_iops=80000,
    max_mib_s_per_iops=0.25,
    max_iops_per_gib=500,
    sources=(
        "https://docs.aws.amazon.com/ebs/latest/userguide/general-purpose.html#gp3-performance",
        "https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_LaunchTemplateEbsBlockDeviceRequest.html",
    ),
)


@dataclass(frozen=True, kw_only=True)
class RootVolume:
    size_gib: int
    throughput_mib_s: int
    iops: int


def root_volume(r: ResolvedDeployment, *, nvme: bool) -> RootVolume:
    """The root volume: the AMI, the image, and the weights when they do not go to local NVMe; provisioned to write
    what lands on it in ``ROOT_WRITE_BUDGET_S`` and never slower than the download the start-up estimate assumes
    (gp3's baseline 125 MiB/s would make a 140 GB checkpoint take 18 minutes)."""
    written_gib = IMAGE_DISK_GIB if nvme else r.disk_gib
    size = OS_DISK_GIB + written_gib
    need = max(written_gib * GiB / ROOT_WRITE_BUDGET_S, DOWNLOAD_BYTES_PER_S) / MiB
    throughput = min(GP3.max_mib_s, max(GP3.baseline_mib_s, math.ceil(need)))
    iops = math.ceil(throughput / GP3.max_mib_s_per_iops)
    iops = min(GP3.max_iops, size * GP3.max_iops_per_gib, max(GP3.baseline_iops, iops))
    # The IOPS the size allows may cap the throughput the ratio allows.
    throughput = min(throughput, math.floor(iops * GP3.max_mib_s_per_iops))
    return RootVolume(size_gib=size, throughput_mib_s=throughput, iops=iops)


@dataclass(frozen=True, kw_only=True)
class Gp3Price:
    """gp3's list price: storage, and the IOPS and throughput provisioned above the included baseline."""

    usd_per_gb_month: float
    usd_per_iops_month: float
    usd_per_mib_s_month: float
    region: str
    as_of: str
    source: str


# gp3's US East (N. Virginia) list price since its launch at re:Invent on 2020-12-01 (Amazon EBS pricing page):
# $0.08/GB-month with 3,000 IOPS and 125 MB/s included, $0.005 per provisioned IOPS-month and $0.04 per provisioned
# MB/s-month above them. Other regions charge up to about a third more; used for every region, it prices a stopped
# warm pool, which costs a fraction of a percent of the running instance either way.
GP3_PRICE = Gp3Price(
    usd_per_gb_month=0.08,
    usd_per_iops_month=0.005,
    usd_per_mib_s_month=0.04,
    region="us-east-1",
    as_of="2020-12-01",
    source="https://aws.amazon.com/ebs/pricing/",
)


def volume_usd_per_hour(v: RootVolume, price: Gp3Price = GP3_PRICE) -> float:
    """What one root volume costs per hour whether its instance runs or not."""
    month = (
        v.size_gib * price.usd_per_gb_month
        + max(0, v.iops - GP3.baseline_iops) * price.usd_per_iops_month
        + max(0, v.throughput_mib_s - GP3.baseline_mib_s) * price.usd_per_mib_s_month
    )
    return month / HOURS_PER_MONTH
