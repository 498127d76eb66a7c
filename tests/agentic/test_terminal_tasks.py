"""The terminal task set: Harbor-layout directories the loader reads, seeded and split by task, and
every task validated as Terminal-Bench validates its own: the oracle scores 1.0 and the null agent
0.0, on a fresh sandbox made the way the episode runner makes it (the `[sandbox]` section, the
row's files, `LazySandbox`), the verifier uploading the hidden tests only after the agent is done.
A sample runs in CI; every task runs under `slow`; a sample also runs through Harbor's own path
(environment/Dockerfile replayed into a template) on both host backends."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from miles.agentic.terminal import agent as term
from miles.agentic.terminal.families import (COINED, COINED_HELDOUT, COINED_TRAIN, CPU_FAMILIES, DIFFICULTY,
                                             FAMILIES, HELDOUT_CITIES, HELDOUT_SERVICES, HELDOUT_WORDS, WORK,
                                             TaskRng)
from miles.agentic.terminal.tasks import (N_TASKS, N_TASKS_CPU, ensure_task, generate, terminal_tasks,
                                          terminal_tasks_brief, terminal_tasks_cpu, transcript)
from miles.envs.context import EpisodeStats, LazySandbox, sandbox_spec
from miles.sandboxes.config import SandboxConfig
from miles.sandboxes import SandboxPool, get_backend
from miles.sandboxes.harbor import load_task, run_verifier, task_spec
from miles.sandboxes.hostfs import default_base_dir

pytestmark = pytest.mark.timeout(240)
LABELS = {"miles.test": "terminal-tasks"}


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    return terminal_tasks(seed=0, test_frac=0.25, out_dir=tmp_path_factory.mktemp("terminal-tasks"))


def all_rows(splits):
    return splits["train"] + splits["test"]


@pytest.fixture
def base_dir():
    # Not pytest's tmp_path: its parents are 0700 and sandboxes run under their own uid.
    path = tempfile.mkdtemp(prefix="miles-term-test-", dir=os.path.dirname(default_base_dir()))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_tasks_are_harbor_dirs_seeded_and_split_by_task(splits, tmp_path):
    rows = all_rows(splits)
    assert len(rows) == N_TASKS >= 40
    families = {r["metadata"]["family"] for r in rows}
    assert len(families) == len(FAMILIES) >= 12
    names = [r["metadata"]["task_name"] for r in rows]
    assert len(set(names)) == len(names)
    assert len(splits["test"]) == 12 and not {r["label"] for r in splits["test"]} & {r["label"] for r in splits["train"]}
    assert len({r["metadata"]["family"] for r in splits["test"]}) >= 8   # the held-out split is varied
    for r in rows:
        task = load_task(r["metadata"]["task_dir"])
        assert task.name == r["metadata"]["task_name"] and task.instruction.strip() == r["prompt"]
        assert (task.workdir, task.network, task.verifier_timeout_s, task.agent_timeout_s) == (WORK, False, 30.0, 120.0)
        assert task.dockerfile and os.path.isfile(os.path.join(task.path, "solution", "solve.sh"))
        env = Path(task.path) / "environment" / "workspace"
        on_disk = {f"{WORK}/{p.relative_to(env)}": p.read_text() for p in env.rglob("*") if p.is_file()}
        assert on_disk == r["metadata"]["files"]   # what the Dockerfile copies = what episodes get
        tests = task.test_files()["test.sh"].decode()
        assert "/logs/verifier/reward.txt" in tests and tests not in r["prompt"]
    # the same seed writes the same tasks; another seed other ones
    again = generate(tmp_path / "again", seed=0, n=N_TASKS)
    assert [(t.name, t.parts.files, t.parts.checks) for t in again] == \
        [(t.name, t.parts.files, t.parts.checks) for t in generate(tmp_path / "again2", seed=0, n=N_TASKS)]
    other = generate(tmp_path / "other", seed=1, n=N_TASKS)
    assert sum((a.parts.files, a.parts.instruction) != (b.parts.files, b.parts.instruction)
               for a, b in zip(again, other)) == N_TASKS
    # instructions differ within a family: seeded names and numbers, not one template
    by_family = {}
    for r in rows:
        by_family.setdefault(r["metadata"]["family"], set()).add(r["prompt"])
    assert all(len(p) >= 3 for p in by_family.values()), {f: len(p) for f, p in by_family.items()}


def test_sft_rows_are_the_oracle_transcripts(splits):
    from miles.envs.tool_agent import PARSE_ERROR
    sft = splits["sft"]
    again = [r for r in sft if PARSE_ERROR in r["prompt"]]   # the recovery from an unparsed call
    assert 0 < len(again) < len(sft) / 2 and len(again) % 2 == 0
    assert len(sft) - len(again) == 2 * len(splits["train"])          # the bash call, then submit
    bash = [r for r in sft if '"name": "bash"' in r["label"]]
    assert len(bash) == len(splits["train"]) + len(again) // 2
    assert all(json.loads(r["label"].split("\n")[1]) for r in sft)   # no label is the unparsed call
    assert all(r["label"].startswith("<tool_call>") and "<|im_start|>system" in r["prompt"] for r in sft)


TOKEN = re.compile(r"[A-Za-z]+|[0-9]+")


def family_vocabulary(family, draws: int = 60, attr: str = "solve") -> set[str]:
    """The words of a family's commands that do not depend on the task: those in at least a
    quarter of its solve.sh over many draws (awk, sort, a flag). A task's own names and numbers
    are rarer (each pool word is in a few percent)."""
    seen = collections.Counter(t for i in range(draws)
                               for t in set(TOKEN.findall(getattr(family(TaskRng(f"vocab-{i}")), attr))))
    return {t for t, c in seen.items() if c >= draws / 4}


def test_every_transcript_argument_is_in_the_prompt_or_an_earlier_result(splits):
    """What SFT teaches can be copied: each tool argument's words are the family's command words
    or occur in the prompt or an earlier tool result of the same episode (nothing memorised)."""
    vocab = {f(TaskRng("name")).family: family_vocabulary(f) for f in FAMILIES}
    for r in all_rows(splits):
        seen = set()
        for m in transcript(r):
            for call in m.get("tool_calls") or []:
                args = json.loads(call["function"]["arguments"])
                words = {t for v in args.values() for t in TOKEN.findall(v)}
                unseen = words - seen - vocab[r["metadata"]["family"]] - {"done"}
                assert not unseen, (r["metadata"]["task_name"], sorted(unseen), args)
            if m["role"] != "assistant":
                seen |= set(TOKEN.findall(m["content"] or ""))


def test_held_out_tasks_name_nothing_a_train_task_names(splits):
    from miles.agentic.terminal.families import CITIES, SERVICES, WORDS
    pools = set(WORDS) | set(SERVICES) | set(CITIES)
    held = set(HELDOUT_WORDS) | set(HELDOUT_SERVICES) | set(HELDOUT_CITIES)
    assert not pools & held

    def names(rows):
        return {t for r in rows for text in [r["prompt"], *r["metadata"]["files"].values()]
                for t in TOKEN.findall(text)} & (pools | held)
    train, test = names(splits["train"]), names(splits["test"])
    assert train and test and not train & test, sorted(train & test)
    assert test <= held and train <= pools
    assert {r["metadata"]["family"] for r in splits["test"]} <= {r["metadata"]["family"] for r in splits["train"]}


def test_a_missing_task_dir_is_rewritten_and_bad_rows_are_refused(splits, tmp_path):
    r = splits["test"][0]
    meta = {**r["metadata"], "task_dir": str(tmp_path / "elsewhere" / r["metadata"]["task_name"])}
    path = ensure_task(meta)
    assert load_task(path).instruction == load_task(r["metadata"]["task_dir"]).instruction
    with pytest.raises(ValueError, match="metadata\\['task_seed'\\] is missing"):
        ensure_task({"task_dir": path, "task_index": 0})
    with pytest.raises(ValueError, match="test_frac=1.5"):
        terminal_tasks(seed=0, test_frac=1.5, out_dir=tmp_path / "x")
    with pytest.raises(ValueError, match="who='someone'"):
        asyncio.run(term.check_task(None, r["metadata"], who="someone"))


async def check_rows(rows, backend_name: str, base_dir: str) -> list[tuple]:
    """(task, agent, reward, verifier output) of every row and agent that scored wrong."""
    pool = SandboxPool(get_backend(backend_name, base_dir=base_dir), max_concurrent=4, run_id="term-test")
    cfg = SandboxConfig(backend=backend_name)
    wrong = []
    try:
        for r in rows:
            m = r["metadata"]
            for who, want in (("oracle", 1.0), ("null", 0.0)):
                sandbox = LazySandbox(pool, sandbox_spec(cfg, m, {}), m["files"], EpisodeStats(), 10.0)
                try:
                    reward, output = await term.check_task(sandbox, m, who)
                finally:
                    await sandbox.destroy()
                if reward != want:
                    wrong.append((m["task_name"], who, reward, output[-300:]))
        assert pool.stats.live == 0 and pool.stats.created == pool.stats.destroyed == 2 * len(rows)
    finally:
        await pool.close()
        left = await pool.sweep()
        await pool.backend.close()
    assert left == 0, f"{left} sandboxes outlived the check"
    return wrong


def sample(splits, k: int = 6) -> list[dict]:
    """k tasks of k different families, from both splits."""
    seen, out = set(), []
    for r in splits["test"][:3] + splits["train"]:
        if r["metadata"]["family"] not in seen and len(out) < k:
            seen.add(r["metadata"]["family"])
            out.append(r)
    return out


@pytest.mark.parametrize("backend_name", ["subprocess", "bwrap"])
async def test_oracle_scores_one_and_null_zero_on_a_sample(splits, base_dir, backend_name):
    if backend_name == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed")
    assert await check_rows(sample(splits), backend_name, base_dir) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_oracle_scores_one_and_null_zero_on_every_task(splits, base_dir):
    assert await check_rows(all_rows(splits), "subprocess", base_dir) == []


@pytest.mark.parametrize("backend_name", ["subprocess", "bwrap"])
async def test_harbor_path_builds_the_environment_and_verifies(splits, base_dir, backend_name):
    """Harbor's own way: task_spec -> environment/Dockerfile replayed into a template; the tree
    the agent starts in holds exactly the row's files; the oracle passes; an agent that reads
    /tests during the episode finds nothing, and one that forges the reward scores 0."""
    if backend_name == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed")
    backend = get_backend(backend_name, base_dir=base_dir)
    try:
        for r in sample(splits, 3):
            m = r["metadata"]
            task = load_task(m["task_dir"])
            async with await backend.create(task_spec(task, labels=LABELS)) as sb:
                assert sb.workdir == WORK
                listing = await sb.exec(f"find {WORK} -type f | LC_ALL=C sort")
                assert listing.stdout.split() == sorted(m["files"]), listing
                for path, text in m["files"].items():
                    assert (await sb.download(path)).decode() == text
                assert (await sb.exec("ls /tests /solution")).exit_code != 0   # hidden from the agent
                await term.oracle(sb, m)
                result = await run_verifier(sb, task)
                assert (result.status, result.reward) == ("ok", 1.0), result
            async with await backend.create(task_spec(task, labels=LABELS)) as sb:
                await sb.exec("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt")
                result = await run_verifier(sb, task)
                assert (result.status, result.reward) == ("ok", 0.0), result
                assert "FAIL" in result.output
    finally:
        assert await backend.sweep(LABELS) == 0
        await backend.close()


@pytest.fixture(scope="module", params=["cpu", "brief"])
def cpu_splits(request, tmp_path_factory):
    """The CPU set, and the same tasks told briefly (`terminal_tasks_brief`)."""
    out = tmp_path_factory.mktemp(f"terminal-tasks-{request.param}")
    if request.param == "brief":   # its first 400 (the split is by task: 300 / 100 as well)
        return terminal_tasks_brief(seed=0, out_dir=out, n=N_TASKS_CPU)
    return terminal_tasks_cpu(seed=0, out_dir=out)


def test_cpu_set_is_graded_and_its_transcripts_copy_what_was_shown(cpu_splits):
    """The CPU recipe's set: the ten fixed-shape families, each in both splits, every row graded,
    and every transcript argument a family command word or copied from the prompt."""
    rows = all_rows(cpu_splits)
    task_set = rows[0]["metadata"]["task_set"]
    assert (len(cpu_splits["train"]), len(cpu_splits["test"])) == (N_TASKS_CPU - 100, 100)
    assert {r["metadata"]["family"] for r in cpu_splits["test"]} == set(DIFFICULTY) == \
        {f(TaskRng("name")).family for f in CPU_FAMILIES}
    assert all(r["metadata"]["eval_groups"] == [r["metadata"]["family"], DIFFICULTY[r["metadata"]["family"]]]
               and r["metadata"]["task_set"] == task_set and not r["metadata"]["declare_tools"] for r in rows)
    attr = "brief_solve" if task_set == "brief" else "solve"
    vocab = {f(TaskRng("name")).family: family_vocabulary(f, attr=attr) for f in CPU_FAMILIES}
    for r in rows:
        seen = set()
        for m in transcript(r):
            for call in m.get("tool_calls") or []:
                args = json.loads(call["function"]["arguments"])
                unseen = {t for v in args.values() for t in TOKEN.findall(v)} - seen \
                    - vocab[r["metadata"]["family"]] - {"done"}
                assert not unseen, (r["metadata"]["task_name"], sorted(unseen), args)
            if m["role"] != "assistant":
                seen |= set(TOKEN.findall(m["content"] or ""))


def test_cpu_set_held_out_tasks_name_only_held_out_coined_names(cpu_splits, tmp_path):
    """Coined names split by a hash: no held-out name occurs in a train task, and a held-out task's
    names all come from the held-out side (the model must copy names it never trained on)."""
    assert not set(COINED_TRAIN) & set(COINED_HELDOUT) and len(COINED_HELDOUT) > 900

    def names(rows):
        return {t for r in rows for text in [r["prompt"], *r["metadata"]["files"].values()]
                for t in TOKEN.findall(text)} & set(COINED)
    train, test = names(cpu_splits["train"]), names(cpu_splits["test"])
    assert len(test) > 100 and len(train) > 1000
    assert test <= set(COINED_HELDOUT) and train <= set(COINED_TRAIN)
    prompts = {r["prompt"] for r in cpu_splits["train"]}
    assert not prompts & {r["prompt"] for r in cpu_splits["test"]}
    # a row names its set: a node without the directory writes the same task again
    r = cpu_splits["test"][0]
    path = ensure_task({**r["metadata"], "task_dir": str(tmp_path / r["metadata"]["task_name"])})
    assert load_task(path).instruction.strip() == r["prompt"]
    with pytest.raises(ValueError, match="task_set='gpu'"):
        ensure_task({**r["metadata"], "task_dir": str(tmp_path / "x" / "y"), "task_set": "gpu"})


async def test_cpu_set_oracle_scores_one_and_null_zero_on_a_sample(cpu_splits, base_dir):
    families = {r["metadata"]["family"]: r for r in cpu_splits["test"][:40] + cpu_splits["train"][:40]}
    assert await check_rows(list(families.values()), "subprocess", base_dir) == []


def test_brief_set_is_the_cpu_sets_tasks_in_a_few_words(tmp_path):
    """The brief set: the CPU set's tasks (same files, checks, split), each prompt a few words and a
    one-line system prompt (~100 tokens with the tiny tokenizer, against ~340); 2,000 of them by
    default (1,500 train)."""
    brief = terminal_tasks_brief(seed=0, out_dir=tmp_path / "b")
    assert (len(brief["train"]), len(brief["test"])) == (1500, 500)
    cpu, brief = terminal_tasks_cpu(seed=0, out_dir=tmp_path / "c"), terminal_tasks_brief(seed=0, out_dir=tmp_path / "b",
                                                                                          n=N_TASKS_CPU)
    for split in ("train", "test"):
        assert [(r["metadata"]["task_name"], r["metadata"]["files"]) for r in cpu[split]] == \
            [(r["metadata"]["task_name"], r["metadata"]["files"]) for r in brief[split]]
    assert max(len(r["prompt"]) for r in brief["train"] + brief["test"]) <= 90
    assert len(brief["train"][0]["metadata"]["system"]) < 60
    for c, b in zip(cpu["train"], brief["train"]):
        checks = lambda r: (Path(r["metadata"]["task_dir"]) / "tests" / "test.sh").read_text()
        assert checks(c) == checks(b) and len(b["prompt"]) < len(c["prompt"]) / 2


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_brief_set_oracle_scores_one_and_null_zero_on_every_task(tmp_path, base_dir):
    brief = terminal_tasks_brief(seed=0, out_dir=tmp_path / "b", n=N_TASKS_CPU)
    assert await check_rows(brief["train"] + brief["test"], "subprocess", base_dir) == []
