"""Synthetic tasks with verifiable answers, for the quickstarts and tests (train / held-out / SFT splits).

- `sort_digits` (the quickstart's): "sort 382 =" -> "238". 1,000 prompts, a quarter held out. A
  2-layer model learns the rule, not a table, so what it learns on the train split shows on the
  held-out split (measured: SFT alone goes from 0 to ~0.9 on both).
- `addition`: "3+5=" -> "8" over single digits. Too few pairs for a tiny model to generalize to
  held-out pairs (it memorizes); kept for tests that only need a verifiable reward.
- `find_file` (the agent quickstart's): three files with one-letter names and 3-digit contents
  are put in the episode's sandbox (`metadata["files"]`); the prompt names the one holding the
  answer ("Submit the number in k.txt."). The model must `read_file` it and `submit` what it read;
  the verifier (`miles.envs.tool_agent:verify_submission`) reads the submission from the sandbox.
  Both steps copy text the model has seen (the name from the prompt, the digits from the tool
  result), which a 2-layer model can learn. The held-out split's answers are a quarter of all
  3-digit strings that no train row has as its answer. 10% of the train rows' SFT transcripts
  start with an unparsed call and the tool agent's `PARSE_ERROR` (`with_parse_error`), so the
  model has seen that reply and the recovery from it.
- `find_file_graded`: five files, graded levels (`metadata["level"]`, row i has level i % 3, and
  `eval_groups` gives the evaluator's per-level pass@1): level 0 as `find_file`; at levels 1 and
  2 the prompt names the start of a chain of one or two pointer files ("Start at k.txt and
  submit the number it leads to."), with a pointer among the distractors. Measured: after 200
  SFT steps the tiny model solves almost none of it at temperature 0.7 (held-out pass@1 0.005,
  level 0 included): a task for a larger model or a longer warm start.
- The episodes send no tool schemas (`declare_tools = False`): the
  model learns its two tools in the warm-start, and a turn's prompt is ~25 tokens instead of ~500
  with the tiny tokenizer (the tool system prompt), which is what makes the CPU run fit in minutes.
  `find_file_declared` is the same task with the schemas sent (measured: 5x slower SFT steps).

`python -m miles.rl.tasks KIND OUT_DIR` writes train.jsonl, test.jsonl and sft.jsonl. The train and
test splits share no prompt (no answer, for `find_file`). For the plain tasks the SFT rows are the
train rows (prompt + label). For `find_file` they are correct tool-call transcripts of train rows,
one row per assistant turn: `prompt` is the conversation so far rendered through the session
family's chat template, tools included (exactly the text the session server renders, so the SFT
tokens equal the RL prompts'), and `label` is the assistant turn as the model must write it, without
its end-of-turn token (the warm-start appends the tokenizer's EOS, `<|im_end|>` for ChatML).
"""

from __future__ import annotations

import itertools
import json
import random
import string
import sys
from pathlib import Path

from miles import plugins


def _sort_digits() -> list[tuple[str, str]]:
    return [(f"sort {a}{b}{c} =", "".join(sorted(f"{a}{b}{c}")))
            for a, b, c in itertools.product(range(10), repeat=3)]


def _addition() -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]


FIND_FILE_TOOLS = ["read_file", "submit"]   # the tools an episode offers (metadata["tools"])
FIND_FILE_FILES = 3                         # files in each sandbox: the chain, the rest distractors
GRADED_FILES, GRADED_LEVELS = 5, 3          # find_file_graded: 0: the file named, 1, 2: pointers
FIND_FILE_MISTAKES = 0.1                    # SFT episodes that recover from an unparsed call


def find_file_rows(seed: int, n_train: int = 3000, test_frac: float = 0.25,
                   declare_tools: bool = False, levels: int = 1,
                   n_files: int = FIND_FILE_FILES) -> tuple[list[dict], list[dict]]:
    """(train, test) rows of `find_file`; test answers never occur as a train answer.
    `declare_tools` is each row's `metadata["declare_tools"]`: whether the agent sends the schemas.
    Row `i` has level `i % levels` (`metadata["level"]`, `metadata["chain"]` the paths
    read in order); train rows draw `metadata["mistake"]` with probability `FIND_FILE_MISTAKES`."""
    rng = random.Random(seed)
    values = [f"{i:03d}" for i in range(1000)]
    rng.shuffle(values)
    n_test = int(len(values) * test_frac)
    test_values, train_values = values[:n_test], values[n_test:]

    def row(i: int, answer: str, train: bool) -> dict:
        level = i % levels
        names = [n + ".txt" for n in rng.sample(string.ascii_lowercase, n_files)]
        chain, others = names[:level + 1], names[level + 1:]
        files = {a: b for a, b in zip(chain, chain[1:])}
        files[chain[-1]] = answer
        for k, p in enumerate(others):   # distractors: numbers, and a pointer to a number
            pointer = levels > 1 and k and rng.random() < 0.3
            files[p] = others[0] if pointer else f"{rng.randrange(1000):03d}"
        files = dict(sorted(files.items()))
        prompt = (f"Submit the number in {chain[0]}." if level == 0 else
                  f"Start at {chain[0]} and submit the number it leads to.")
        return {"prompt": prompt, "label": answer,
                "metadata": {"files": files, "tools": FIND_FILE_TOOLS, "target": chain[-1],
                             "chain": chain, "level": level, "eval_groups": [f"level{level}"],
                             "declare_tools": declare_tools,
                             "mistake": train and rng.random() < FIND_FILE_MISTAKES}}

    train = [row(i, rng.choice(train_values), True) for i in range(n_train)]
    return train, [row(i, v, False) for i, v in enumerate(test_values)]


def with_parse_error(messages: list[dict]) -> list[dict]:
    """The episode with its first tool call written wrong first (its JSON cut short, marked
    `"unparsed"`: no SFT label), answered with `PARSE_ERROR` as the tool agent answers it, then
    as it was: what SFT shows of the harness's reply and the recovery from it."""
    from miles.envs.tool_agent import PARSE_ERROR
    k = next(i for i, m in enumerate(messages) if m.get("tool_calls"))
    fn = messages[k]["tool_calls"][0]["function"]
    text = ('<tool_call>\n{"name": ' + json.dumps(fn["name"]) + ', "arguments": '
            + fn["arguments"] + '}\n</tool_call>')
    wrong = text.replace("}\n</tool_call>", "\n</tool_call>")   # the closing brace missing
    return [*messages[:k], {"role": "assistant", "content": wrong, "unparsed": True},
            {"role": "user", "content": PARSE_ERROR}, *messages[k:]]


def transcript(row: dict) -> list[dict]:
    """The correct episode of a `find_file` row, as OpenAI messages (tool call ids are not
    rendered): read each file of the chain, submit what the last held. With
    `metadata["mistake"]` the first call comes unparsed first (`with_parse_error`)."""
    meta, answer = row["metadata"], row["label"]
    chain = meta.get("chain") or [meta["target"]]

    def call(i: int, name: str, args: dict) -> dict:
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}

    out = [{"role": "user", "content": row["prompt"]}]
    for i, p in enumerate(chain):
        out += [call(i, "read_file", {"path": p}),
                {"role": "tool", "tool_call_id": f"call_{i}", "content": meta["files"][p]}]
    out.append(call(len(chain), "submit", {"answer": answer}))
    return with_parse_error(out) if meta.get("mistake") else out


def sft_rows(rows: list[dict], family: str = "qwen3", transcript=transcript) -> list[dict]:
    """One prompt/label row per assistant turn of each row's correct transcript (`transcript(row)`
    -> OpenAI messages; turns marked `"unparsed"` are context, never a label), through the one
    transcript->SFT path (`miles.tito.sft`). The terminal task set passes its own transcripts."""
    from miles.envs.tool_agent import tool_specs
    from miles.tito.sft import transcript_rows

    return transcript_rows(((transcript(row), tool_specs(row["metadata"]["tools"])
                             if row["metadata"].get("declare_tools", True) else None) for row in rows),
                           family)


TASKS = {"sort_digits": _sort_digits, "addition": _addition, "find_file": find_file_rows,
         "find_file_declared": find_file_rows, "find_file_graded": find_file_rows}


def make_task(out_dir: str | Path, kind: str = "sort_digits", *, seed: int = 0,
              test_frac: float = 0.25) -> Path:
    """Write the task's splits (train/test, and sft where it has one) as .jsonl under out_dir.

    `kind` is a built-in name, or "module:function" for a task set kept elsewhere (the agentic
    recipes' SWE and terminal sets): `function(seed=, test_frac=) -> {"train": rows, "test": rows,
    "sft": rows (optional)}`, each row a dict with prompt/label/metadata, made reproducibly from
    the seed."""
    if ":" in kind:
        return _write_splits(Path(out_dir), kind, seed, lambda: plugins.load("data.task", kind)(seed=seed, test_frac=test_frac))
    if kind not in TASKS:
        raise ValueError(f"data.task = {kind!r}: expected one of {sorted(TASKS)}")
    return _write_splits(Path(out_dir), kind, seed, lambda: _builtin_splits(kind, seed, test_frac))


def _builtin_splits(kind: str, seed: int, test_frac: float) -> dict[str, list[dict]]:
    if kind.startswith("find_file"):
        graded = {"levels": GRADED_LEVELS, "n_files": GRADED_FILES} if kind == "find_file_graded" else {}
        train, test = find_file_rows(seed, test_frac=test_frac, declare_tools=kind == "find_file_declared",
                                     **graded)
        sft = sft_rows(train)
        random.Random(seed).shuffle(sft)   # the SFT source is read in file order
        splits = {"test": test, "train": train, "sft": sft}
    else:
        pairs = TASKS[kind]()
        random.Random(seed).shuffle(pairs)
        n_test = max(1, int(len(pairs) * test_frac))
        rows = [{"prompt": p, "label": label} for p, label in pairs]
        splits = {"test": rows[:n_test], "train": rows[n_test:], "sft": rows[n_test:]}
    return splits


def _write_splits(out: Path, kind: str, seed: int, build) -> Path:
    marker = out / f".complete-{kind.replace(':', '.')}-{seed}"
    if marker.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    splits = build()
    missing = {"train", "test"} - set(splits)
    if missing:
        raise ValueError(f"data.task = {kind!r}: the task set returned splits {sorted(splits)}; "
                         f"missing {sorted(missing)}")
    for name, split in splits.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for row in split:
                f.write(json.dumps(row) + "\n")
    marker.touch()
    return out


if __name__ == "__main__":
    print(make_task(sys.argv[2], sys.argv[1]))
