"""Model families: a registry from name to a `Family` (renderer + parser + Jinja template).

Adding a family takes one file: subclass `Family` and call `register_family(MyFamily())` at import,
then run the server with `--family my_pkg.my_family:MyFamily` (an import path) or add the module
to `_BUILTIN` below. Names are looked up explicitly; there is no auto-detection from a model
directory (a wrong guess would silently produce wrong tokens).
"""

from __future__ import annotations

import importlib

from miles.tito.families.base import Family, Reply

_FAMILIES: dict[str, Family] = {}
_BUILTIN = {"qwen3": "miles.tito.families.qwen3", "llama3": "miles.tito.families.llama3"}


def register_family(family: Family) -> Family:
    if not family.name:
        raise ValueError(f"family {type(family).__name__}: `name` is empty")
    prior = _FAMILIES.get(family.name)
    if prior is not None and type(prior) is not type(family):
        raise ValueError(f"family {family.name!r} is already registered by {type(prior).__qualname__}")
    _FAMILIES[family.name] = family
    return family


def get_family(name: str) -> Family:
    """A registered name (`qwen3`, `llama3`) or an import path `module:attribute`."""
    if name in _FAMILIES:
        return _FAMILIES[name]
    if name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
        return _FAMILIES[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        obj = getattr(importlib.import_module(module), attr)
        family = obj() if isinstance(obj, type) else obj
        if not isinstance(family, Family):
            raise TypeError(f"family {name!r}: {type(family).__name__} is not a Family")
        return register_family(family)
    raise KeyError(f"family: unknown family {name!r}; expected one of {sorted(set(_BUILTIN) | set(_FAMILIES))} "
                   f"or an import path 'module:Class'")


def family_names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_FAMILIES))


__all__ = ["Family", "Reply", "family_names", "get_family", "register_family"]
