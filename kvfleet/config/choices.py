"""What an environment file must decide before it deploys, though it can be planned without: who hears the alarms,
who shares each deployment's prefix cache, and what each deployment's target asks of it (``TargetSection.undecided``:
on EKS, who may call the serving pods).

``kvfleet plan`` prints what is left undecided (``undecided``); synth refuses it (``refuse_undecided``), one
``file:line: field: what to write`` per choice. The prefix cache's sharing is known only once the release's default
is resolved (``engine.enable_prefix_caching`` left out is on for almost every model and release), so both take
each deployment's resolved setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.config.schema import NOTIFICATIONS_CHOICES, Deployment, Environment
from kvfleet.errors import KvfleetError


@dataclass(frozen=True, kw_only=True)
class Undecided:
    """One choice the file has not made: the key path to write and what to write there."""

    field: str
    message: str


class UndecidedError(KvfleetError):
    """Choices synth needs made; the loader gives each its own ``file:line`` (``LoadedEnvironment.problem``)."""

    def __init__(self, problems: Sequence[Undecided]) -> None:
        self.problems = tuple(problems)
        first = self.problems[0]
        super().__init__(first.message, field=first.field)


def _tenancy_message(d: Deployment) -> str:
    """Why the prefix cache's callers must be named, and what to write for this deployment's image."""
    why = (
        "prefix caching is on, so every caller of this deployment shares the prefix cache and can time whether "
        "another's prompt is cached; say who shares it: serving.tenancy: single (one tenant)"
    )
    if d.image.source == "dlc":  # no agent to salt the cache per tenant (the schema refuses tenant_header there)
        return f"{why}, or engine.enable_prefix_caching: false (image.source dlc has no agent to isolate tenants)"
    return (
        f"{why}, serving.tenant_header and serving.tenant_secret (the agent salts each tenant's cache), or "
        "engine.enable_prefix_caching: false"
    )


def undecided(env: Environment, prefix_caching: Sequence[bool]) -> tuple[Undecided, ...]:
    """The choices ``env`` leaves open; ``prefix_caching`` is each deployment's resolved setting, in file order."""
    if len(prefix_caching) != len(env.deployments):
        raise ValueError("one prefix-caching setting per deployment")
    out = []
    if not env.notifications_chosen:
        out.append(
            Undecided(field="notifications", message=f"nobody is told when an alarm fires; {NOTIFICATIONS_CHOICES}")
        )
    for i, (d, caching) in enumerate(zip(env.deployments, prefix_caching, strict=True)):
        if caching and d.serving.declared_tenancy is None:
            out.append(Undecided(field=f"deployments[{i}].serving.tenancy", message=_tenancy_message(d)))
        # The target's own, named from the deployment's top: this module never names a target.
        out.extend(Undecided(field=f"deployments[{i}].{f}", message=m) for f, m in d.target.undecided(d))
    return tuple(out)


def refuse_undecided(env: Environment, prefix_caching: Sequence[bool]) -> None:
    """Raise ``UndecidedError`` naming every choice ``env`` leaves open (what synth and a pipeline's stage call)."""
    if problems := undecided(env, prefix_caching):
        raise UndecidedError(problems)
