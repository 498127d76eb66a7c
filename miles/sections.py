"""The base of every recipe section and the constrained number types the sections share.

Each section lives next to the code it configures (`miles/engines/config.py`,
`miles/sandboxes/config.py`, ...); `miles.config.Recipe` mounts them all, and is the one place a
recipe is decoded. A section module imports only msgspec and this module, so loading a recipe
imports no engine, sandbox or torch. Every numeric field declares its range next to it
(`Annotated[int, Meta(ge=1)]`), so msgspec refuses a bad value at decode with the key path and the
bound; `miles.config` words the message.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

Count = Annotated[int, Meta(ge=0)]            # 0 is meaningful (none / off / the default)
Positive = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(gt=0.0)]      # every wait has a deadline; finiteness: config._check
NonNegative = Annotated[float, Meta(ge=0.0)]


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass
