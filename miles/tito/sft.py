"""Transcripts -> supervised warm-start rows, rendered exactly as the session server renders.

The one transcript->SFT path of the task sets (the built-in `find_file` tasks, the terminal and
SWE-style sets): each transcript is OpenAI messages and the tools declared to the model, and
each assistant turn becomes one row: `prompt` is everything before it rendered by the model
family with the generation prompt, `label` is that turn as the model generates it, without the
end-of-turn token (the warm start appends it).

Design decisions:
- A turn marked `"unparsed": True` is context (a malformed call the harness answered with a
  parse error), never a label: training on it would teach the mistake the transcript recovers
  from.
- The render is the family's own (`miles.tito.families`), so a warm-start prompt is token for
  token the prompt the policy sees at rollout.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from miles.tito.families import get_family
from miles.tito.messages import parse_openai_messages, parse_openai_tools

Transcript = tuple[list[dict[str, Any]], "list[dict[str, Any]] | None"]  # (messages, OpenAI tools)


def transcript_rows(transcripts: Iterable[Transcript], family: str = "qwen3") -> list[dict[str, str]]:
    """One prompt/label row per assistant turn (not marked unparsed) of each transcript."""
    fam = get_family(family)
    out = []
    for turns, tools in transcripts:
        messages = parse_openai_messages([{k: v for k, v in m.items() if k != "unparsed"} for m in turns])
        declared = parse_openai_tools(tools) if tools is not None else None
        for k, m in enumerate(messages):
            if m.role != "assistant" or turns[k].get("unparsed"):
                continue
            label = fam.generation_text(m)
            if not label.endswith(fam.end_of_turn):
                raise ValueError(f"family {family!r}: an assistant turn does not end with {fam.end_of_turn!r}")
            out.append({"prompt": fam.render(messages[:k], declared, 0, True),
                        "label": label[: -len(fam.end_of_turn)]})
    return out
