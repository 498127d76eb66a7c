"""The SWE task set and its verifier, in real sandboxes (subprocess; the sample on bwrap too): the oracle (the known fix through
the harness's edit tool) scores 1.0 and the null agent 0.0 on every task; the visible failing test
fails before the fix and passes after it; the verifier reads only its own tests and runner."""

from __future__ import annotations

import json
from collections import Counter

import pytest

import keyword
import re

from miles.agentic.swe.bugs import SPECS
from miles.agentic.swe.harness import SWERunner
from miles.agentic.swe.scripted import RECOVERY_EVERY, episode, null_actions, oracle_actions, play, transcript
from miles.agentic.swe.tasks import HIDDEN_DIR, N_TASKS, TEST_COMMAND, tasks
from miles.agentic.swe.verify import run_hidden_tests, verify
from miles.wire.messages import Sample

SPLITS = tasks(seed=0)
ALL = SPLITS["train"] + SPLITS["test"]


def test_the_task_set_is_seeded_varied_and_split():
    assert tasks(seed=0) == SPLITS and tasks(seed=1) != SPLITS
    assert len(ALL) == N_TASKS >= 40 and len(SPLITS["test"]) == N_TASKS // 4
    ids = [r["metadata"]["task_id"] for r in ALL]
    assert len(set(ids)) == len(ids)
    assert not {r["metadata"]["task_id"] for r in SPLITS["test"]} & {r["metadata"]["task_id"] for r in SPLITS["train"]}
    templates = Counter(r["metadata"]["template"] for r in ALL)
    assert len(templates) == len(SPECS) == 13 and min(templates.values()) >= 4, templates
    for split in ("train", "test"):   # every grade in both splits: some solvable, not all
        assert {r["metadata"]["difficulty"] for r in SPLITS[split]} == {"easy", "medium", "hard"}
    assert len({r["metadata"]["bug_kind"] for r in ALL}) >= 7
    assert len({r["prompt"] for r in ALL}) == len(ALL)   # no two issues read the same
    for r in ALL:
        meta = r["metadata"]
        hidden = meta["hidden_tests"]["test_hidden.py"]
        assert not any(hidden == text for text in meta["files"].values())   # never in the repository
        assert not any(path.startswith(HIDDEN_DIR) for path in meta["files"])
        assert r["label"].startswith(f"--- a/{meta['fix']['path']}")       # the gold patch
        assert len(meta["fail_to_pass"]) >= 2 and len(meta["pass_to_pass"]) >= 4
        assert meta["fail_to_pass"][0].endswith("fix0") and TEST_COMMAND in r["prompt"]


def test_data_task_writes_the_splits_and_the_oracle_transcripts(tmp_path):
    from miles.rl.tasks import make_task
    out = make_task(tmp_path, "miles.agentic.swe.tasks:tasks", seed=0)
    read = {n: [json.loads(x) for x in (out / f"{n}.jsonl").read_text().splitlines()] for n in ("train", "test", "sft")}
    assert read["train"] == json.loads(json.dumps(SPLITS["train"])) and len(read["test"]) == len(SPLITS["test"])
    recoveries = -(-len(SPLITS["train"]) // RECOVERY_EVERY)
    # search, view, edit, submit per train task, once more for each recovery transcript
    assert len(read["sft"]) == 4 * (len(SPLITS["train"]) + recoveries)
    assert all(r["label"].startswith("<tool_call>") and r["prompt"].endswith("<|im_start|>assistant\n")
               for r in read["sft"])
    held_out = {r["prompt"].split("\n\nThe repository")[0] for r in SPLITS["test"]}   # the whole issue
    assert not any(t in r["prompt"] for r in read["sft"] for t in held_out)   # no held-out issue in SFT


def _defs(rows: list[dict]) -> set[str]:
    """The functions the tasks' code defines (run_tests.py, the same runner in every task, aside)."""
    return {n for r in rows for path, text in r["metadata"]["files"].items() if path != "run_tests.py"
            for n in re.findall(r"def (\w+)", text)}


def test_held_out_tasks_share_no_function_name_or_constant_with_the_train_tasks():
    train, test = SPLITS["train"], SPLITS["test"]
    assert not _defs(train) & _defs(test), _defs(train) & _defs(test)
    for spec in SPECS:
        seen = {"train": {}, "test": {}}
        for split in seen:
            for r in SPLITS[split]:
                if r["metadata"]["template"] == spec.template:
                    for slot, value in r["metadata"]["constants"].items():
                        seen[split].setdefault(slot, set()).add(value)
        for slot in spec.slots:
            both = seen["train"].get(slot, set()) & seen["test"].get(slot, set())
            assert not both, (spec.template, slot, both)
    assert not {r["metadata"]["fn"] for r in train} & {r["metadata"]["fn"] for r in test}


def _known(value: str, seen: list[str], prompt: str, difficulty: str, hint) -> bool:
    """Whether one line of an edit's text can be written from what the episode showed: a line an
    earlier result showed; for an easy bug that line with the issue's quoted wrong fragment
    replaced by its quoted right one; for the others, words all shown (or Python's own)."""
    shown = [line.split("| ", 1)[1] for text in seen for line in text.splitlines() if "| " in line]
    if value in shown:
        return True
    if difficulty == "easy":
        wrong, right = hint
        return f"`{wrong}`" in prompt and f"`{right}`" in prompt and any(
            line.replace(wrong, right) == value for line in shown if wrong in line)
    words = set(re.findall(r"\w+", "\n".join([prompt, *seen])))
    return all(w in words or keyword.iskeyword(w) for w in re.findall(r"\w+", value))


def test_every_argument_of_every_transcript_was_shown_before_it_was_used():
    for row in ALL:
        meta = row["metadata"]
        for recover in (False, True):
            messages = transcript(row, recover)
            prompt, seen = messages[0]["content"], []
            for m in messages[1:]:
                if m["role"] != "assistant" or not m.get("tool_calls"):
                    seen.append(m["content"])   # a tool result, or the harness's parse error
                    continue
                args = json.loads(m["tool_calls"][0]["function"]["arguments"])
                for key, value in args.items():
                    where = (meta["task_id"], key, value)
                    if key in ("start", "end"):     # a line number the view printed
                        assert any(re.search(rf"^\s*{value}\| ", t, re.M) for t in seen), where
                    elif key == "text":
                        assert all(_known(line, seen, prompt, meta["difficulty"], meta["hint"])
                                   for line in value.splitlines()), where
                    else:                            # the symbol, a path a result named
                        assert any(value in t for t in [prompt, *seen]), where
            # no argument is read off the answer: the transcript uses neither path nor lines unseen
            assert [name for name, _, _ in episode(meta)] == ["search", "view", "edit", "submit"]


def sample_of(row: dict) -> Sample:
    import numpy as np
    return Sample(tokens=np.zeros(1, np.int32), prompt=row["prompt"], label=row["label"],
                  metadata=row["metadata"])


async def oracle_and_null(host_sandboxes, row: dict) -> tuple[dict, dict]:
    meta = row["metadata"]
    null_box = await host_sandboxes(meta["files"])
    before = await null_box.exec(TEST_COMMAND, timeout_s=30)
    assert before.exit_code == 1 and json.loads(before.stdout.splitlines()[-1])["failed"] == 1, before
    await play(SWERunner(null_box, 30.0), null_actions(meta))
    null = await verify(sample_of(row), sandbox=null_box)
    box = await host_sandboxes(meta["files"])
    steps = await play(SWERunner(box, 30.0), oracle_actions(meta))
    # the sandbox answers what the transcript says it answered (search, view, edit)
    assert [text for _, text, _ in steps[:3]] == [result for _, _, result in episode(meta)[:3]]
    after = await box.exec(TEST_COMMAND, timeout_s=30)
    assert after.exit_code == 0, after
    return await verify(sample_of(row), sandbox=box), null


SAMPLE = [SPLITS["test"][0], SPLITS["test"][1], *SPLITS["train"][:4]]


@pytest.mark.parametrize("host_backend_name", ["subprocess", "bwrap"])
@pytest.mark.parametrize("row", SAMPLE, ids=[r["metadata"]["task_id"] for r in SAMPLE])
async def test_oracle_scores_one_and_null_zero_on_a_sample(host_sandboxes, row):
    oracle, null = await oracle_and_null(host_sandboxes, row)
    assert oracle == {"resolved": 1.0, "pass_frac": 1.0, "fail_to_pass": 1.0, "format": 1.0}, \
        (row["metadata"]["task_id"], oracle)
    assert null["resolved"] == 0.0 and null["fail_to_pass"] == 0.0 and 0.0 < null["pass_frac"] < 1.0, null


@pytest.mark.slow
async def test_oracle_scores_one_and_null_zero_on_every_task(host_sandboxes):
    results = {}
    for row in ALL:
        results[row["metadata"]["task_id"]] = await oracle_and_null(host_sandboxes, row)
    wrong = {k: v for k, v in results.items() if v[0]["resolved"] != 1.0 or v[1]["resolved"] != 0.0}
    assert len(results) == N_TASKS and not wrong, wrong


async def test_the_verifier_reads_its_own_tests_and_runner_not_the_agents(host_sandboxes):
    row = SPLITS["train"][5]
    meta = row["metadata"]
    box = await host_sandboxes(meta["files"])
    pkg = meta["fix"]["path"].split("/")[0]
    forged = json.dumps({"passed": 99, "failed": 0, "failures": []})
    # the agent "fixes" the tests and the runner, plants forged results and a fake hidden dir
    await box.upload("run_tests.py", f"print({forged!r})\n".encode())
    await box.upload(f"{HIDDEN_DIR}/test_hidden.py", b"def test_ok():\n    pass\n")
    await box.upload(f"{pkg}/__init__.py", f"import os\nprint({forged!r})\nos._exit(0)\n".encode())
    assert (await box.exec(TEST_COMMAND, timeout_s=30)).exit_code == 0   # its own runner says all pass
    assert await run_hidden_tests(box, meta) == {"resolved": 0.0, "pass_frac": 0.0, "fail_to_pass": 0.0}
    # a hang in the agent's code costs its tests, not the verifier's deadline
    box2 = await host_sandboxes(meta["files"])
    await play(SWERunner(box2, 30.0), oracle_actions(meta))
    await box2.upload(f"{pkg}/__init__.py", b"import time\ntime.sleep(60)\n")
    got = await run_hidden_tests(box2, meta, timeout_s=10)
    assert got["resolved"] == 0.0, got


async def test_verify_names_what_it_is_missing():
    with pytest.raises(ValueError, match="hidden_tests"):
        await verify(sample_of({"prompt": "", "label": "", "metadata": {"files": {}}}), sandbox=object())
    with pytest.raises(ValueError, match=r"\[sandbox\] backend"):
        await verify(sample_of(SPLITS["train"][0]), sandbox=None)
