"""The base of every recipe section and the constrained number types the sections share.

Each section lives next to the code it configures (`miles/engines/config.py`,
`miles/sandboxes/config.py`, ...); `miles.config.Recipe` mounts them all, and is the one place a
recipe is decoded. A section module imports only msgspec and this module, so loading a recipe
imports no engine, sandbox or torch. Every numeric field declares its range next to it
(`Annotated[int, Meta(ge=1)]`), so msgspec refuses a bad value at decode with the key path and the
bound; `miles.config` words the message.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

Count = Annotated[int, Meta(ge=0)]            # 0 is meaningful (none / off / the default)
Positive = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(gt=0.0)]      # every wait has a deadline; finiteness: config._check
NonNegative = Annotated[float, Meta(ge=0.0)]


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the key path, value and expectation."""


def show(value: Any) -> str:
    """A recipe value as the recipe spells it (`true`, `'abc'`, `-1.0`)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def bad_value(source: str, key: str, value: Any, expected: str) -> RecipeError:
    """The one shape of a recipe error: `<source>: <key.path> = <value>: <what was expected>`."""
    return RecipeError(f"{source}: {key} = {show(value)}: {expected}")


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass
