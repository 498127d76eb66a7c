"""Round-trip verifier: incremental (TITO) token ids must equal a full re-render at every turn boundary.

    python -m miles.tito.verify --family qwen3 [--tokenizer qwen|DIR|tokenizer.json]
                                [--template FILE.jinja] conversations.jsonl

Each JSONL line is `{"messages": [...], "tools": [...]}` in OpenAI format. For every assistant
message the verifier builds the ids the session server would send (first render, then the
"engine's" output = the assistant message as the template writes it, tokenized on its own, then
bridge + appended messages) and compares them with the family's Jinja template (or `--template`)
rendered over the whole history and tokenized in one piece. The last boundary also covers the
final assistant turn (no generation prompt).

Design decisions (after Miles' `TokenSeqComparator`):
- Both sequences are split at the family's structural tokens. The structural skeleton must match
  exactly: the first divergence is reported (`special`) and the comparison stops there, because
  alignment is lost. Text between structural tokens is compared as decoded text (`text`, with the
  token position and the first differing character) and, when the text is equal but the ids
  differ, as `tokens` (a non-canonical tokenization of the same text).
- A text mismatch whose first differing character lies in text the engine generated is not
  critical (a re-render cannot know how the model spelled its own text); every other mismatch is. The exit code is 1 on any critical one.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec

from miles.tito.families import Family, get_family
from miles.tito.messages import ChatMessage, RequestError, parse_openai_messages, parse_openai_tools
from miles.tito.template import render_template
from miles.tito.tokenizer import ChatTokenizer, load_tokenizer


class Mismatch(msgspec.Struct, kw_only=True):
    kind: str                 # special | text | tokens | length
    position: int             # token index in the incremental sequence
    expected: str
    actual: str
    char: int = -1            # first differing character inside the segment (text)
    critical: bool = True
    boundary: int = -1        # message index of the turn boundary (verify_conversation)


def _segments(ids: list[int], structural: set[int]) -> list[tuple[int, int, bool]]:
    out, start = [], 0
    for i, t in enumerate(ids):
        if t in structural:
            if start < i:
                out.append((start, i, False))
            out.append((i, i + 1, True))
            start = i + 1
    if start < len(ids):
        out.append((start, len(ids), False))
    return out


def structural_ids(family: Family, tokenizer: ChatTokenizer) -> set[int]:
    return {tokenizer.token_id(t) for t in family.structural_tokens if t in tokenizer.added_ids}


def compare(tokenizer: ChatTokenizer, family: Family, actual: list[int], expected: list[int],
            generated: list[int] | None = None) -> list[Mismatch]:
    """Mismatches of `actual` (incremental) against `expected` (full re-render); [] when equal."""
    if actual == expected:
        return []
    structural = structural_ids(family, tokenizer)
    sa, se = _segments(actual, structural), _segments(expected, structural)
    out: list[Mismatch] = []
    for (a0, a1, a_sp), (e0, e1, e_sp) in zip(sa, se):
        a_ids, e_ids = actual[a0:a1], expected[e0:e1]
        if a_ids == e_ids:
            continue
        a_text, e_text = tokenizer.decode(a_ids), tokenizer.decode(e_ids)
        if a_sp or e_sp:
            out.append(Mismatch(kind="special", position=a0, expected=e_text, actual=a_text))
            return out   # the skeletons diverged: later positions no longer line up
        if a_text == e_text:
            out.append(Mismatch(kind="tokens", position=a0, expected=str(e_ids), actual=str(a_ids),
                                critical=False))
            continue
        char = next((k for k, (x, y) in enumerate(zip(a_text, e_text)) if x != y), min(len(a_text), len(e_text)))
        out.append(Mismatch(kind="text", position=a0, expected=e_text, actual=a_text, char=char,
                            critical=not _in_generated(tokenizer, actual, a0, a1, generated, char)))
    if len(sa) != len(se):
        pos = sa[len(se)][0] if len(sa) > len(se) else len(actual)
        rest_a = tokenizer.decode(actual[pos:]) if len(sa) > len(se) else ""
        rest_e = tokenizer.decode(expected[se[len(sa)][0]:]) if len(se) > len(sa) else ""
        out.append(Mismatch(kind="length", position=pos, expected=rest_e, actual=rest_a))
    return out


def _in_generated(tokenizer: ChatTokenizer, ids: list[int], start: int, end: int,
                  generated: list[int] | None, char: int) -> bool:
    """Does the first differing character of segment ids[start:end] lie in engine-generated text?"""
    if generated is None:
        return False
    first_gen = next((i for i in range(start, end) if generated[i]), None)
    if first_gen is None or not all(generated[first_gen:end]):
        return False
    return char >= len(tokenizer.decode(ids[start:first_gen]))


def verify_conversation(family: Family, tokenizer: ChatTokenizer, messages: list[ChatMessage],
                        tools: list[dict] | None = None, template: str | None = None,
                        options: dict[str, Any] | None = None) -> dict[str, Any]:
    template = template or family.chat_template
    kwargs = {**family.template_kwargs, **(options or {})}
    dicts = [m.to_template_dict() for m in messages]
    ids: list[int] = []
    generated: list[int] = []
    mismatches: list[Mismatch] = []
    start, bridge, boundaries = 0, "", 0
    turn_ends = [i for i, m in enumerate(messages) if m.role == "assistant"]
    if not turn_ends or turn_ends[-1] != len(messages) - 1:
        turn_ends.append(len(messages))        # a trailing prompt is a boundary too
    for a in turn_ends:
        new = tokenizer.encode(bridge + family.render(messages[:a], tools, start, True, options))
        ids += new
        generated += [0] * len(new)
        expected = tokenizer.encode(render_template(template, dicts[:a], tools, True, **kwargs))
        for m in compare(tokenizer, family, ids, expected, generated):
            m.boundary = a
            mismatches.append(m)
        boundaries += 1
        if a == len(messages):
            break
        out = tokenizer.encode(family.generation_text(messages[a]))   # stands in for the engine
        ids += out
        generated += [1] * len(out)
        bridge = family.bridge(family.end_of_turn)
        start = a + 1
    else:  # ended on an assistant turn: compare the finished conversation too
        final = ids + tokenizer.encode(bridge)
        expected = tokenizer.encode(render_template(template, dicts, tools, False, **kwargs))
        for m in compare(tokenizer, family, final, expected, generated + [0] * (len(final) - len(ids))):
            m.boundary = len(messages)
            mismatches.append(m)
        boundaries += 1
    return {"ok": not any(m.critical for m in mismatches), "boundaries": boundaries,
            "tokens": len(ids), "mismatches": [msgspec.to_builtins(m) for m in mismatches]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m miles.tito.verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("conversations", help="JSONL file: one {messages, tools} object per line")
    ap.add_argument("--family", required=True)
    ap.add_argument("--tokenizer", default=None, help="qwen | model dir | tokenizer.json (default: qwen for qwen3)")
    ap.add_argument("--model-path", default=None, help="model directory (its tokenizer.json)")
    ap.add_argument("--template", default=None, help="Jinja file to re-render with instead of the family's")
    ap.add_argument("--options", default="{}", help='template options as JSON, e.g. {"enable_thinking": false}')
    args = ap.parse_args(argv)
    family = get_family(args.family)
    source = args.tokenizer or args.model_path or ("qwen" if family.name == "qwen3" else None)
    if source is None:
        ap.error(f"--tokenizer: required for family {family.name!r}")
    tokenizer = load_tokenizer(source)
    template = open(args.template).read() if args.template else None
    options = json.loads(args.options)
    failed = total = 0
    with open(args.conversations) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                messages = parse_openai_messages(row.get("messages"))
                tools = parse_openai_tools(row.get("tools"))
            except (json.JSONDecodeError, RequestError) as e:
                print(json.dumps({"line": lineno, "ok": False, "error": str(e)}))
                failed += 1
                total += 1
                continue
            report = verify_conversation(family, tokenizer, messages, tools, template, options)
            total += 1
            failed += not report["ok"]
            print(json.dumps({"line": lineno, **report}, ensure_ascii=False))
    print(json.dumps({"family": family.name, "tokenizer": source, "conversations": total, "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
