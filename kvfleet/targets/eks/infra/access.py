"""Who may reach the VPC interface endpoints: every compute resource that calls an AWS API through one is
admitted by that endpoint's security group on 443.

With private DNS on (network.py turns it on), the service's regional hostname resolves to the endpoint's
addresses inside the VPC, so a caller its security group does not admit has no other way to the API: its
connections time out (AWS PrivateLink, "Control access to interface endpoints using security groups"). Pure data
and a check; the EKS construct reads the endpoints and rules out of the stack and names the callers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

HTTPS = 443

# Interface-endpoint services (the part of com.amazonaws.<region>.<service> after the region) the nodes call.
# kubelet and containerd pull the serving image from ECR: the registry API (GetAuthorizationToken) and the
# Docker endpoint (manifests, layer URLs; the layers come from S3 through the gateway endpoint). The serving pods
# share the node's security groups (the VPC CNI puts pods on the node's ENIs unless Security Groups for Pods is
# set up) and call CloudWatch (PutMetricData, the agent's signals) and Secrets Manager (the Hugging Face token).
NODE_SERVICES = frozenset({"ecr.api", "ecr.dkr", "monitoring", "secretsmanager"})


@dataclass(frozen=True, kw_only=True)
class Caller:
    name: str
    security_groups: tuple[str, ...]  # each group as a resolved CloudFormation value, JSON
    services: frozenset[str]


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    name: str
    service: str
    security_groups: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class IngressRule:
    group: str  # the group the rule is on
    source_group: str | None  # the group it admits (None: a CIDR rule)
    protocol: str  # "tcp", "6" or "-1" (all)
    from_port: int | None
    to_port: int | None

    def admits_https_from(self, group: str) -> bool:
        if self.source_group != group:
            return False
        if self.protocol == "-1":
            return True
        if self.protocol not in ("tcp", "6"):
            return False
        return (self.from_port or 0) <= HTTPS <= (self.to_port if self.to_port is not None else 65535)


def check_endpoint_access(
    callers: Sequence[Caller], endpoints: Sequence[Endpoint], rules: Sequence[IngressRule]
) -> list[str]:
    """One problem per caller and endpoint it calls that no ingress rule admits on 443."""
    problems = []
    for c in callers:
        for e in endpoints:
            if e.service not in c.services:
                continue
            admitted = any(
                r.group in e.security_groups and r.admits_https_from(g) for r in rules for g in c.security_groups
            )
            if not admitted:
                problems.append(
                    f"{c.name} call {e.service} through VPC endpoint {e.name}, whose security groups do not admit "
                    f"theirs on {HTTPS}: with private DNS the calls time out"
                )
    return problems
