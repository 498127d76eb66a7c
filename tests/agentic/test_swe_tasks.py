"""The SWE task set and its verifier, in real sandboxes (subprocess; the sample on bwrap too): the oracle (the known fix through
the harness's edit tool) scores 1.0 and the null agent 0.0 on every task; the visible failing test
fails before the fix and passes after it; the verifier reads only its own tests and runner."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from miles.agentic.swe.harness import SWERunner
from miles.agentic.swe.scripted import null_actions, oracle_actions, play
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
    assert len(templates) == 13 and min(templates.values()) >= 4, templates
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
    assert len(read["sft"]) == 3 * len(SPLITS["train"])          # view, edit, submit per train task
    assert all(r["label"].startswith("<tool_call>") and r["prompt"].endswith("<|im_start|>assistant\n")
               for r in read["sft"])
    held_out = {r["prompt"].split("\n\nThe repository")[0] for r in SPLITS["test"]}   # the whole issue
    assert not any(t in r["prompt"] for r in read["sft"] for t in held_out)   # no held-out issue in SFT


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
    steps = await play(SWERunner(box, 30.0), oracle_actions(meta))   # strict: the visible tests pass
    assert steps[3][0] == "bash" and "[exit code" not in steps[3][1], steps[3]
    return await verify(sample_of(row), sandbox=box), null


SAMPLE = [SPLITS["test"][0], SPLITS["test"][1], *SPLITS["train"][:4]]


@pytest.mark.parametrize("host_backend_name", ["subprocess", "bwrap"])
@pytest.mark.parametrize("row", SAMPLE, ids=[r["metadata"]["task_id"] for r in SAMPLE])
async def test_oracle_scores_one_and_null_zero_on_a_sample(host_sandboxes, row):
    oracle, null = await oracle_and_null(host_sandboxes, row)
    assert oracle == {"resolved": 1.0, "pass_frac": 1.0, "fail_to_pass": 1.0}, (row["metadata"]["task_id"], oracle)
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
