"""The quickstart's synthetic task: small additions with a verifiable answer, plus a held-out split.

`python -m miles.rl.tasks OUT_DIR` writes train.jsonl, test.jsonl and sft.jsonl (prompt + answer
pairs for the supervised warm-start). Prompts are short so a 2-layer model learns them in minutes
on a CPU; the train and test splits share no (a, b) pair.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def make_task(out_dir: str | Path, *, max_operand: int = 9, seed: int = 0, test_frac: float = 0.25) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / ".complete").exists():
        return out
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    n_test = max(1, int(len(pairs) * test_frac))
    splits = {"test": pairs[:n_test], "train": pairs[n_test:]}
    for name, rows in splits.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for a, b in rows:
                f.write(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n")
    with open(out / "sft.jsonl", "w") as f:
        for a, b in splits["train"]:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n")
    (out / ".complete").touch()
    return out


if __name__ == "__main__":
    print(make_task(sys.argv[1]))
