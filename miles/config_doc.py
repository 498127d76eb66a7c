"""The configuration reference (`docs/configuration.md`), generated from the recipe schema.

    python -m miles.config_doc > docs/configuration.md      (tests/runtime/test_config_doc.py keeps it in sync)
    python -m miles.config_doc --extending                  (the plug-in table of docs/extending.md)

Design decisions:
- The schema is the source: every key, its type and its default come from the msgspec Structs
  that load a recipe (`miles.config.Recipe` and the sections it mounts), so a key cannot exist
  without being documented, and a default cannot drift from the docs.
- A key's meaning is the comment written beside (or just above) its field in the Struct's source,
  and a section's introduction is its docstring: the code's own comments, read with `tokenize`,
  so there is one place to write them.
- The rules between keys are read from the checks themselves: every `bad_value(source, key, ...,
  reason)` call in `miles.config` and `miles.recipe_checks` is listed with its key and reason,
  and every warning `miles check` can print comes from `loop_warnings`, so the "refused" and
  "warned" lists are the code's.
- The plug-in table of `docs/extending.md` is `miles.plugins.CONTRACTS` rendered between two
  markers; the prose around it is written by hand.
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from pathlib import Path

import msgspec

HEADER = """# Configuration reference

A recipe is one TOML file; `miles check recipe.toml` validates it and `--set key=value` overrides
any key on the command line (`--set train.lr=5e-4`, `--set 'loop.mode="sync"'`). Unknown keys,
wrong types and values out of range are refused with the key path, the value and what was
expected. This page is generated from the schema (`python -m miles.config_doc`); do not edit it
by hand.
"""


def _comments(cls: type) -> dict[str, str]:
    """field name -> the comment beside it (with the `#   ` lines that continue it below), or the
    comment lines just above it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        text = [by_line[node.end_lineno]] if node.end_lineno in by_line else []
        below = node.end_lineno + 1
        while text and below <= len(lines) and lines[below - 1].strip().startswith("#   "):
            text.append(by_line.get(below, ""))
            below += 1
        above, k = [], node.lineno - 1
        while k >= 1 and lines[k - 1].strip().startswith("#") and not lines[k - 1].strip().startswith("# ---"):
            if lines[k - 1].strip().startswith("#   "):  # continues the field above
                break
            above.insert(0, by_line.get(k, ""))
            k -= 1
        out[node.target.id] = " ".join(above + text).strip()
    return out


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        base, bounds = _type_name(args[0]), []
        for meta in args[1:]:
            if isinstance(meta, msgspec.Meta):
                for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                    if getattr(meta, attr, None) is not None:
                        bounds.append(f"{sign} {getattr(meta, attr)}")
        return f"{base} ({', '.join(bounds)})" if bounds else base
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " \\| ".join(_type_name(a) for a in args)
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        return "(required)"
    if isinstance(value, msgspec.Struct):
        return "(table)"
    text = repr(value).replace("|", "\\|")
    return f"`{text}`"


def _struct_of(tp) -> type | None:
    """The Struct a field holds (itself, or a dict's values): it is documented as a sub-table."""
    for t in (tp, *typing.get_args(tp)):
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            return t
    return None


def _section(prefix: str, cls: type, out: list[str]) -> None:
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")   # its own, never msgspec's
    out += [f"## `[{prefix}]`", ""]
    if doc:
        out += [doc, ""]
    hints = typing.get_type_hints(cls, include_extras=True)
    comments = _comments(cls)
    nested: list[tuple[str, type]] = []
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for field in msgspec.structs.fields(cls):
        sub = _struct_of(hints.get(field.name))
        if sub is not None:
            key = f"{prefix}.{field.encode_name}"
            if typing.get_origin(hints[field.name]) is dict:
                key += ".<name>"
            nested.append((key, sub))
            continue
        meaning = comments.get(field.name, "").replace("|", "\\|")
        rows.append(f"| `{field.encode_name}` | {_type_name(hints.get(field.name))} | "
                    f"{_default(field)} | {meaning} |")
    if len(rows) > 2:
        out += rows + [""]
    for key, sub in nested:
        _section(key, sub, out)


def _rules(module) -> list[tuple[str, str]]:
    """(key, reason) of every `bad_value(source, key, value, reason)` call in a module."""
    tree = ast.parse(Path(module.__file__).read_text())
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "bad_value"
                and len(node.args) >= 4 and isinstance(node.args[1], (ast.Constant, ast.JoinedStr))):
            key, reason = (ast.unparse(a) for a in (node.args[1], node.args[3]))
            found.append((_literal(key), _literal(reason)))
    return found


def _literal(text: str) -> str:
    """A source expression as a reader sees it: string quotes and f-prefixes dropped."""
    for prefix in ("f'", 'f"', "'", '"'):
        if text.startswith(prefix) and text.endswith(prefix[-1]):
            return text[len(prefix):-1]
    return text


def render() -> str:
    import miles.config as config
    import miles.recipe_checks as checks
    out = [HEADER]
    for field in msgspec.structs.fields(config.Recipe):
        tp = typing.get_type_hints(config.Recipe, include_extras=True)[field.name]
        sub = _struct_of(tp)
        key = field.encode_name + (".<name>" if typing.get_origin(tp) is dict else "")
        _section(key, sub, out)
    out += ["## Refused at load (`miles check` exits 2 naming the key)", "",
            "Besides types and ranges, these rules between keys are checked (from `miles/config.py` "
            "and `miles/recipe_checks.py`; `{...}` is filled in from the recipe). Every plug-in key is "
            "checked against its contract in `miles/plugins.py` "
            "([extending.md](extending.md#every-plug-in-key)).", ""]
    seen = set()
    for module in (config, checks):
        for key, reason in _rules(module):
            if (key, reason) not in seen:
                seen.add((key, reason))
                out.append(f"- `{key}`: {reason}")
    source = inspect.getsource(checks.loop_warnings)
    warned = [_literal(ast.unparse(n.args[0])) for n in ast.walk(ast.parse(textwrap.dedent(source)))
              if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "append"]
    out += ["", "## Warned (the run starts; `miles check` prints the warning)", ""]
    out += [f"- {w}" for w in warned]
    return "\n".join(out).rstrip() + "\n"


PLUGINS_BEGIN, PLUGINS_END = "<!-- plugins: generated by python -m miles.config_doc --extending -->", \
    "<!-- plugins: end -->"


def render_extending(text: str) -> str:
    """docs/extending.md with its plug-in table rendered from `miles.plugins.CONTRACTS`."""
    from miles.plugins import doc_table
    head, begin, rest = text.partition(PLUGINS_BEGIN)
    _, end, tail = rest.partition(PLUGINS_END)
    if not begin or not end:
        raise ValueError(f"docs/extending.md: expected the markers {PLUGINS_BEGIN!r} and {PLUGINS_END!r}")
    return f"{head}{PLUGINS_BEGIN}\n{doc_table()}{PLUGINS_END}{tail}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--extending"]:
        page = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
        page.write_text(render_extending(page.read_text()))
    else:
        sys.stdout.write(render())
