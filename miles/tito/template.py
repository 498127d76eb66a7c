"""Full re-render of a conversation through a Jinja chat template, the way transformers does it.

This is the ground truth the round-trip verifier compares incremental tokenization against, so
it copies transformers' environment (`apply_chat_template`): a sandboxed Jinja environment with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that is
`json.dumps(..., ensure_ascii=False)` and a `raise_exception` global. It is not on the per-turn
path of the session server: rendering the whole history is exactly what TITO avoids.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


@lru_cache(maxsize=16)
def compile_template(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def render_template(source: str, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                    add_generation_prompt: bool = False, **kwargs: Any) -> str:
    return compile_template(source).render(messages=messages, tools=tools,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
