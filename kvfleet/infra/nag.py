"""cdk-nag acknowledgments, written beside what causes them, and the ids its findings quote."""

from __future__ import annotations

from aws_cdk import Acknowledgment, CfnElement, Stack, Validations
from constructs import Construct


def logical_id(c: Construct) -> str:
    """The CloudFormation logical id of ``c``'s resource, as cdk-nag names it in a finding."""
    child = c.node.default_child
    assert isinstance(child, CfnElement)
    stack = Stack.of(c)
    return str(stack.resolve(stack.get_logical_id(child)))


def condition_id(c: object) -> str:
    """The logical id of a CloudFormation element: a condition, or a resource's own Cfn construct (cdk-nag
    quotes them inside findings, e.g. a CodeBuild project's in its log-group grant)."""
    assert isinstance(c, CfnElement)
    stack = Stack.of(c)
    return str(stack.resolve(stack.get_logical_id(c)))


def acknowledge(scope: Construct, finding: str, reason: str) -> None:
    """Accept one cdk-nag finding on ``scope``, with the reason, next to what causes it."""
    Validations.of(scope).acknowledge(Acknowledgment(id=finding, reason=reason))
