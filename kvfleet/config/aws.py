"""AWS naming rules an environment file's values must follow, as pure checks that return what to change.

Each rule is the platform's own, with its source; a value that breaks one would be refused only at deploy time
(or worse, at run time), so the loader refuses it with the fix instead.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

# S3 general purpose bucket naming rules:
# https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html
_BUCKET_CHARS = re.compile(r"[a-z0-9.-]{3,63}")
_BUCKET_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_BUCKET_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")


def bucket_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be an S3 bucket, or None."""
    if not _BUCKET_CHARS.fullmatch(name):
        return f"bucket {name!r}: 3 to 63 lowercase letters, digits, '.' and '-'"
    if not (name[0].isalnum() and name[-1].isalnum()):
        return f"bucket {name!r}: begins and ends with a letter or digit"
    if ".." in name:
        return f"bucket {name!r}: no two adjacent periods"
    try:
        ipaddress.IPv4Address(name)
        return f"bucket {name!r}: a bucket name is not an IP address"
    except ValueError:
        pass
    if name.startswith(_BUCKET_PREFIXES) or name.endswith(_BUCKET_SUFFIXES):
        reserved = ", ".join((*_BUCKET_PREFIXES, *(f"...{x}" for x in _BUCKET_SUFFIXES)))
        return f"bucket {name!r}: AWS reserves names like {reserved}"
    return None


def s3_uri_problem(uri: str) -> str | None:
    """Why ``uri`` is not ``s3://<bucket>[/<prefix>]``, or None."""
    if not uri.startswith("s3://"):
        return "expected s3://<bucket>/<prefix>"
    bucket, _, key = uri[len("s3://") :].partition("/")
    if (problem := bucket_name_problem(bucket)) is not None:
        return problem
    if any(ord(c) < 32 for c in key):
        return "the prefix has a control character; remove it"
    return None


# Secrets Manager: a name is 1-512 of letters, digits and /_+=.@- (CreateSecret, Name); an ARN adds a region,
# account and the name with a 6-character suffix AWS appends
# (https://docs.aws.amazon.com/secretsmanager/latest/apireference/API_CreateSecret.html).
_SECRET_NAME = re.compile(r"[A-Za-z0-9/_+=.@-]{1,512}")
_SECRET_ARN = re.compile(
    r"arn:aws[-a-z]*:secretsmanager:(?P<region>[a-z0-9-]+):[0-9]{12}:secret:(?P<name>[A-Za-z0-9/_+=.@-]{1,512})"
)


def secret_problem(value: str) -> str | None:
    """Why ``value`` is neither a Secrets Manager secret name nor a secret ARN, or None."""
    if value.startswith("arn:"):
        if _SECRET_ARN.fullmatch(value) is None:
            return (
                "not a Secrets Manager secret ARN; expected arn:aws:secretsmanager:<region>:<12-digit account>:"
                "secret:<name>"
            )
        return None
    if _SECRET_NAME.fullmatch(value) is None:
        return "a secret name is 1 to 512 letters, digits and / _ + = . @ -"
    return None


def arn_region(arn: str) -> str | None:
    """The region of a regional ARN (arn:partition:service:region:...), None for a global one."""
    parts = arn.split(":")
    return parts[3] or None if len(parts) > 3 else None


def oidc_region(arn: str) -> str | None:
    """The region in an EKS cluster's IAM OIDC provider ARN (.../oidc.eks.<region>.amazonaws.com/id/...)."""
    m = re.search(r"/oidc\.eks\.([a-z0-9-]+)\.amazonaws\.com", arn)
    return m[1] if m else None


# Availability zones: a name is the region and a letter (us-east-1a); a zone id is the region's short code, "az"
# and a number (use1-az1), the code being area, direction initials and number: us-east-1 -> use1, ap-northeast-1
# -> apne1, us-gov-west-1 -> usgw1 (https://docs.aws.amazon.com/ram/latest/userguide/working-with-az-ids.html).
# A zone's name differs per account for the same id, so an id is recognised and the name asked for.
_DIRECTIONS = {
    "central": "c",
    "north": "n",
    "south": "s",
    "east": "e",
    "west": "w",
    "northeast": "ne",
    "northwest": "nw",
    "southeast": "se",
    "southwest": "sw",
}


def zone_id_prefix(region: str) -> str | None:
    """The zone-id prefix of ``region`` (us-east-1 -> use1), None for a form kvfleet does not know."""
    m = re.fullmatch(r"([a-z]{2})(-gov)?-([a-z]+)-([0-9])", region)
    if m is None or m[3] not in _DIRECTIONS:
        return None
    return f"{m[1]}{'g' if m[2] else ''}{_DIRECTIONS[m[3]]}{m[4]}"


def zone_problem(zone: str, region: str | None) -> str | None:
    """Why ``zone`` is not the name of an availability zone (of ``region``, when given), or None."""
    if m := re.fullmatch(r"([a-z]{3,6}[0-9])-az[0-9]{1,2}", zone):
        # Subnets and the VPC's templates take zone names (AvailabilityZone), not zone ids.
        other = "" if region is None or zone_id_prefix(region) in (None, m[1]) else f", and not one of {region}'s"
        return (
            f"{zone} is a zone id{other}; give the zone's name, e.g. {region or 'us-east-1'}a (`aws ec2 "
            f"describe-availability-zones --zone-ids {zone}` names it)"
        )
    if not re.fullmatch(r"[a-z]{2}(-gov)?-[a-z]+-[0-9][a-z]", zone):
        return f"{zone} is not an availability zone; give its name, e.g. {region or 'us-east-1'}a"
    if region is not None and zone[:-1] != region:
        return f"{zone} is not in region {region}; give one of {region}a, {region}b, ..."
    return None


def port_problem(url: str) -> str | None:
    """Why the port in ``url`` is not a TCP port (1-65535), or None."""
    try:
        port = urlsplit(url).port  # ValueError past 65535
    except ValueError:
        port = 0
    return "the port must be a number from 1 to 65535" if port == 0 else None


# Kubernetes object names kvfleet derives (environment-deployment) are DNS-1123 labels
# (https://kubernetes.io/docs/concepts/overview/working-with-objects/names/#dns-label-names).
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
