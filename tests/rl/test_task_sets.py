"""`data.task = "module:function"`: a task set from an import path, written reproducibly from the seed."""

import json
import sys
from pathlib import Path

import pytest

from miles.rl.tasks import make_task

sys.path.insert(0, str(Path(__file__).parent))


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_task_set_from_an_import_path_is_written_per_seed(tmp_path):
    a = make_task(tmp_path / "a", "plugins.task_set:tasks", seed=1)
    b = make_task(tmp_path / "b", "plugins.task_set:tasks", seed=1)
    c = make_task(tmp_path / "c", "plugins.task_set:tasks", seed=2)
    assert read(a / "train.jsonl") == read(b / "train.jsonl") != read(c / "train.jsonl")
    assert len(read(a / "test.jsonl")) == 5 and len(read(a / "train.jsonl")) == 15
    assert not (a / "sft.jsonl").exists()


def test_a_task_set_without_a_test_split_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"plugins.task_set:no_test_split.*missing \['test'\]"):
        make_task(tmp_path, "plugins.task_set:no_test_split", seed=0)
