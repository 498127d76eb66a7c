"""Synthetic tasks with verifiable answers, for the quickstart and tests (train / held-out / SFT splits).

- `sort_digits` (the quickstart's): "sort 382 =" -> "238". 1,000 prompts, a quarter held out. A
  2-layer model learns the rule, not a table, so what it learns on the train split shows on the
  held-out split (measured: SFT alone goes from 0 to ~0.9 on both).
- `addition`: "3+5=" -> "8" over single digits. Too few pairs for a tiny model to generalize to
  held-out pairs (it memorizes); kept for tests that only need a verifiable reward.

`python -m miles.rl.tasks KIND OUT_DIR` writes train.jsonl, test.jsonl and sft.jsonl (the SFT rows
are the train rows: prompt + label). The train and test splits share no prompt.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path


def _sort_digits() -> list[tuple[str, str]]:
    return [(f"sort {a}{b}{c} =", "".join(sorted(f"{a}{b}{c}")))
            for a, b, c in itertools.product(range(10), repeat=3)]


def _addition() -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]


TASKS = {"sort_digits": _sort_digits, "addition": _addition}


def make_task(out_dir: str | Path, kind: str = "sort_digits", *, seed: int = 0,
              test_frac: float = 0.25) -> Path:
    if kind not in TASKS:
        raise ValueError(f"data.task = {kind!r}: expected one of {sorted(TASKS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / f".complete-{kind}-{seed}"
    if marker.exists():
        return out
    pairs = TASKS[kind]()
    random.Random(seed).shuffle(pairs)
    n_test = max(1, int(len(pairs) * test_frac))
    splits = {"test": pairs[:n_test], "train": pairs[n_test:], "sft": pairs[n_test:]}
    for name, rows in splits.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for prompt, label in rows:
                f.write(json.dumps({"prompt": prompt, "label": label}) + "\n")
    marker.touch()
    return out


if __name__ == "__main__":
    print(make_task(sys.argv[2], sys.argv[1]))
