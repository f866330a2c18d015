"""The base of every config object: frozen, unknown keys rejected, numbers finite.

Numbers and flags are strict: YAML's ``true`` is not the number 1, ``"4"`` is not 4, and 2.5 is not a whole
number. A float field still takes a whole number (``2`` for 2.0).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Strict

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
