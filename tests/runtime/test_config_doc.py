"""docs/configuration.md is the recipe schema as rendered by `python -m miles.config_doc`."""

from pathlib import Path

import msgspec

from miles.config import Recipe
from miles.config_doc import render

ROOT = Path(__file__).resolve().parents[2]


def leaf_keys(cls, prefix=""):
    for field in msgspec.structs.fields(cls):
        tp = field.type
        inner = next((t for t in (tp, *getattr(tp, "__args__", ())) if isinstance(t, type)
                      and issubclass(t, msgspec.Struct)), None)
        if inner is None:
            yield prefix, field.encode_name
        else:
            yield from leaf_keys(inner, f"{prefix}{field.encode_name}.")


def test_the_committed_reference_is_the_schema():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), ("docs/configuration.md is out of date: run "
                                   "`python -m miles.config_doc > docs/configuration.md`")


def test_every_key_of_every_section_is_in_the_reference():
    text = render()
    keys = list(leaf_keys(Recipe))
    assert len(keys) > 150
    for prefix, key in keys:
        assert f"| `{key}` |" in text, f"{prefix}{key} missing"
    assert "## `[train.megatron]`" in text and "## `[actors.<name>.restart]`" in text
    # every key says what it means (a comment beside it, or the comment lines above it)
    unexplained = [row.split("|")[1].strip() for row in text.splitlines()
                   if row.startswith("| `") and not row.split("|")[4].strip()]
    assert not unexplained, f"keys with no meaning in docs/configuration.md: {unexplained}"
    assert "`rollout.temperature`: expected > 0" in text       # a cross-key rule, read from the check
