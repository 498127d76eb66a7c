"""Backends by name: a recipe says `sandbox.backend = "bwrap"` and gets one.

Design decisions:
- Entries are import paths (the built-ins of `sandbox.backend` in `miles.plugins`), resolved
  and checked against the contract on first use, so `import miles.sandboxes` never imports a
  cloud SDK (or fails because one is missing).
- Users add their own with `register_backend("mine", "my_pkg.sandbox:MyBackend")`, the same
  import-path convention as every other plug-in point.
- Unknown names and unknown options fail with the accepted values listed.
"""

from __future__ import annotations

import inspect
from typing import Any

from miles import plugins
from miles.sandboxes.base import Backend, SandboxSpecError

# the names of `sandbox.backend`: the built-ins of its contract, and what register_backend adds
_BACKENDS: dict[str, Any] = plugins.builtins("sandbox.backend")


def register_backend(name: str, target: str | type[Backend]) -> None:
    """Add or replace a backend. `target` is a Backend subclass or "module:Class"."""
    if isinstance(target, str) and ":" not in target:
        raise SandboxSpecError(f"register_backend({name!r}, {target!r}): expected "
                               "'package.module:ClassName'")
    _BACKENDS[name] = target  # type: ignore[assignment]


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def backend_class(name: str) -> type[Backend]:
    if name not in _BACKENDS:
        raise SandboxSpecError(f"sandbox backend {name!r} is unknown: expected one of "
                               f"{backend_names()}")
    return plugins.load("sandbox.backend", name)


def accepted_options(cls: type) -> list[str] | None:
    """Option names `cls(**opts)` takes, following `**opts` pass-through up the class chain;
    None when some class in the chain accepts anything."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        params = inspect.signature(init).parameters
        names.update(n for n, p in params.items() if n != "self" and p.kind in (
            inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return sorted(names)
    return None


def get_backend(name: str, **opts: Any) -> Backend:
    """Construct backend `name` with its options (e.g. base_dir=..., api_url=...)."""
    cls = backend_class(name)
    accepted = accepted_options(cls)
    if accepted is not None:
        unknown = sorted(set(opts) - set(accepted))
        if unknown:
            raise SandboxSpecError(f"sandbox backend {name!r} got unknown option(s) {unknown}: "
                                   f"accepted options are {accepted}")
    return cls(**opts)
