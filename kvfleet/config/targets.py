"""The environment file's ``target:`` section: what every target's section is, and their union.

Each target's own section is ``SECTION`` in its folder's ``config`` module (``kvfleet/targets/<name>/config.py``): a
``TargetSection`` whose ``platform`` literal is its name in ``kvfleet.targets.TARGET_MODULES``. The schema's
``Target`` field is the union of the registered sections, discriminated on ``platform`` and built from the registry
when a model using it is built (``rebuild`` builds them again after the registry changes). What only a target
checks (its settings against the rest of the file) are the section's methods below, which the schema calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, Field, GetCoreSchemaHandler
from pydantic_core import CoreSchema

from kvfleet.config.base import Frozen
from kvfleet.sizing.hosting import Hosting
from kvfleet.targets import TARGET_MODULES, TARGETS, part

if TYPE_CHECKING:
    from kvfleet.config.schema import Deployment, Environment
    from kvfleet.sizing.planner import Candidate

# An EC2 Auto Scaling warm pool's instance state (WarmPoolConfiguration PoolState).
PoolState = Literal["Stopped", "Running", "Hibernated"]


class TargetSection(Frozen):
    """A target's ``target:`` section. The methods are the target's say on the rest of the file; by default it has
    none."""

    platform: str
    # What each pattern-checked field of the section (or of a mapping in it) takes, in words: the loader says this
    # for a value that does not match, never the regular expression.
    pattern_words: ClassVar[Mapping[str, str]] = {}

    @property
    def hosting(self) -> Hosting:
        return TARGETS[self.platform].hosting

    def no_scale_to_zero(self) -> str | None:
        """Why this deployment cannot scale to zero (scaling.min_replicas 0), None where it can: the target record's
        reason, unless the section's own shape allows it."""
        return TARGETS[self.platform].no_scale_to_zero

    def hosting_note(self, deployment: Deployment, candidate: Candidate | None) -> str | None:
        """How the target hosts the planned ``candidate`` where it has more than one way, and why (`kvfleet plan`
        prints it); None: one way only."""
        return None

    def deployment_problems(self, deployment: Deployment) -> list[str]:
        """What this target cannot do with the rest of its deployment, each problem ``field.path: what to change``
        (the deployment's own keys)."""
        return []

    def region_problems(self, region: str, at: str) -> list[str]:
        """This section's ARNs that name another region than the environment's; ``at`` is the section's key path
        (``deployments.<i>.target``)."""
        return []

    @classmethod
    def environment_problems(cls, environment: Environment) -> list[str]:
        """What this target's deployments need of the environment (its network, each other), each problem with its
        key path from the environment's top."""
        return []

    def client_address(self, output: str) -> str:
        """Where clients reach the deployment, from the stack output the target's record names (``address_output``):
        what `kvfleet bench --env` sends to."""
        return f"http://{output}"

    def warm_pool_kept(self) -> tuple[PoolState, int] | None:
        """The warm pool this section keeps (its state and its instances); None: none."""
        return None

    def undecided(self, deployment: Deployment) -> list[tuple[str, str]]:
        """The choices this target needs the file to make before synth, each ``(field, what to write)`` with the
        field's path from the deployment's top (``target.clients``); ``kvfleet plan`` prints them, synth refuses
        them (``kvfleet.config.choices``)."""
        return []


def target_sections() -> tuple[type[TargetSection], ...]:
    """Every registered target's section, in registry order."""
    found = []
    for name in TARGET_MODULES:
        section = part(name, "config").SECTION
        if not (isinstance(section, type) and issubclass(section, TargetSection)):
            raise TypeError(f"{TARGET_MODULES[name]}.config.SECTION is not a TargetSection")
        found.append(section)
    return tuple(found)


class _RegisteredSections:
    """Pydantic's schema for ``Target``: the union of the registered sections, made each time a model is built."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        union: Any = Union[target_sections()]  # noqa: UP007 (a union of a tuple of classes made at run time)
        return handler.generate_schema(Annotated[union, Field(discriminator="platform")])


# The targets an environment file may name: whichever the registry holds.
Target = Annotated[TargetSection, _RegisteredSections()]


def rebuild(*models: type[BaseModel]) -> None:
    """Build ``models`` again (the ones holding a ``Target``, then those holding them) after the registry changed."""
    for model in models:
        model.model_rebuild(force=True)
