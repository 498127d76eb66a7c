"""Per-turn cost of the TITO session server with 1k and 64k tokens of history, vs a full re-render.

    python bench/tito.py [--repeats 20]

Prints one JSON line:
  {"bench": "tito", "turn_ms_1k", "turn_ms_64k", "retokenize_ms_64k", "machine", ...}

Design decisions:
- Real Qwen vocabulary (151,643 BPE ranks, built offline) and the qwen3 family: merge costs and
  token counts are those of a production model, not of a toy vocabulary.
- The history is an agent transcript: a system prompt with tools, then turns of (assistant reply
  with reasoning and a tool call, tool result) of ~500 tokens each, until 1k or 64k tokens. The
  engine's outputs are the canonical tokenization of each reply (what a model following the
  template emits), fed through `Session.complete` as an engine answer would be.
- `turn_ms` is everything the server does for a turn except waiting for the engine: decode the
  request JSON, normalize the messages, hash the prefix chain, find the checkpoint, tokenize the
  appended tool message, assemble the input ids. The request bodies are pre-encoded.
  `tito_ms` is the TITO part alone (lookup + tokenize + assemble). Median of `--repeats` turns,
  each with a different new message (so nothing is reused).
- `retokenize_ms_64k` is what a server without TITO does per turn: render the whole conversation
  with the Jinja chat template (transformers' `apply_chat_template` path) and tokenize it all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402

from miles.tito.families import get_family  # noqa: E402
from miles.tito.messages import parse_openai_messages, parse_openai_tools  # noqa: E402
from miles.tito.request import ChatRequest  # noqa: E402
from miles.tito.session import EngineTurn, Session  # noqa: E402
from miles.tito.template import render_template  # noqa: E402
from miles.tito.tokenizer import load_tokenizer  # noqa: E402
from miles.hostinfo import machine

TOOLS = [{"type": "function", "function": {"name": "shell", "description": "Run a shell command and return stdout.",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                          "required": ["cmd"]}}}]
LINES = ["drwxr-xr-x  2 user user  4096 Jan  1 12:00 src", "-rw-r--r--  1 user user  1832 Jan  1 12:00 setup.py",
         "def tokenize(text: str) -> list[int]:", "    return [ord(c) for c in text]  # TODO: real BPE",
         "FAILED tests/test_io.py::test_roundtrip - AssertionError: 3 != 4", "Traceback (most recent call last):"]


def build_history(session: Session, tokenizer, family, target_tokens: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a coding agent working in a repository."},
            {"role": "user", "content": "The test suite fails; find out why and fix it."}]
    t = 0
    while True:
        plan = session.prepare(parse_openai_messages(msgs), TOOLS)
        if len(plan.input_ids) >= target_tokens:
            session.abandon(plan)
            return msgs
        reply = {"role": "assistant", "content": f"Step {t}: let me inspect more.",
                 "reasoning_content": " ".join(LINES[(t + k) % len(LINES)] for k in range(8)),
                 "tool_calls": [{"id": f"c{t}", "type": "function",
                                 "function": {"name": "shell", "arguments": json.dumps({"cmd": f"cat file_{t}.py"})}}]}
        text = family.generation_text(parse_openai_messages([reply])[0])
        ids = tokenizer.encode(text[:-len(family.end_of_turn)]) + [tokenizer.token_id(family.end_of_turn)]
        session.complete(plan, EngineTurn(output_ids=ids, logprobs=[-1.0] * len(ids),
                                          finish_reason={"type": "stop", "matched": ids[-1]}))
        output = "\n".join(LINES[(t * 7 + k) % len(LINES)] + f" #{k}" for k in range(40))
        msgs += [reply, {"role": "tool", "tool_call_id": f"c{t}", "content": output}]
        t += 1


def time_turns(session: Session, history: list[dict], repeats: int) -> tuple[float, float, int, int]:
    bodies = [msgspec.json.encode({"messages": history + [{"role": "user", "content": f"Now run test #{r}."}],
                                   "tools": TOOLS}) for r in range(repeats + 2)]
    turn_ms, tito_ms = [], []
    for body in bodies:
        t0 = time.perf_counter()
        raw = msgspec.json.decode(body)
        req = ChatRequest(messages=parse_openai_messages(raw["messages"]), tools=parse_openai_tools(raw["tools"]))
        t1 = time.perf_counter()
        loc = session.locate(req.messages, req.tools)
        plan = session.commit_prompt(loc, session.tokenize(loc), 64)
        t2 = time.perf_counter()
        turn_ms.append((t2 - t0) * 1e3)
        tito_ms.append((t2 - t1) * 1e3)
        session.abandon(plan)
    # the first two turns warm caches up
    return statistics.median(turn_ms[2:]), statistics.median(tito_ms[2:]), len(plan.input_ids), plan.appended_tokens


def retokenize_ms(tokenizer, family, history: list[dict], repeats: int) -> tuple[float, int]:
    times = []
    for r in range(max(3, repeats // 4)):
        msgs = parse_openai_messages(history + [{"role": "user", "content": f"Now run test #{r}."}])
        t0 = time.perf_counter()
        text = render_template(family.chat_template, [m.to_template_dict() for m in msgs], TOOLS, True)
        ids = tokenizer.encode(text)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tokenizer", default="qwen")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    family = get_family("qwen3")
    out = {"bench": "tito"}
    for label, target in (("1k", 1024), ("64k", 65536)):
        session = Session(f"bench-{label}", family, tokenizer, max_context_tokens=1 << 20)
        history = build_history(session, tokenizer, family, target)
        turn, tito, n_tokens, appended = time_turns(session, history, args.repeats)
        out[f"turn_ms_{label}"] = round(turn, 3)
        out[f"tito_ms_{label}"] = round(tito, 3)
        out[f"history_tokens_{label}"] = n_tokens
        out[f"appended_tokens_{label}"] = appended
        if label == "64k":
            ms, n = retokenize_ms(tokenizer, family, history, args.repeats)
            out["retokenize_ms_64k"] = round(ms, 3)
            out["retokenize_tokens_64k"] = n
    out["speedup_64k"] = round(out["retokenize_ms_64k"] / out["turn_ms_64k"], 1)
    out["tokenizer"] = "qwen (151,643 BPE ranks)" if args.tokenizer == "qwen" else args.tokenizer
    out["machine"] = machine()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
