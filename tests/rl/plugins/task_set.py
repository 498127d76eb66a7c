"""A task set kept outside Miles (`data.task = "plugins.task_set:tasks"`), made from the seed."""

import random


def tasks(seed: int, test_frac: float) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a, b in
            ((rng.randrange(10), rng.randrange(10)) for _ in range(20))]
    n_test = int(len(rows) * test_frac)
    return {"train": rows[n_test:], "test": rows[:n_test]}


def no_test_split(seed: int, test_frac: float) -> dict[str, list[dict]]:
    return {"train": [{"prompt": "1+1=", "label": "2"}]}
