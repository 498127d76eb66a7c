"""The terminal task set: seeded Harbor-layout task directories, and the rows a recipe trains on.

    [data]
    task = "miles.agentic.terminal.tasks:terminal_tasks"     # 48 tasks, a quarter held out
    task = "miles.agentic.terminal.tasks:terminal_tasks_cpu" # the CPU recipe's: 400, 100 held out

    generate(out_dir, seed=0, n=48)  -> [TaskRecord]: writes out_dir/<name>/ in Harbor layout
    terminal_tasks(seed, test_frac)  -> {"train", "test", "sft"} rows (the `data.task` contract)
    ensure_task(metadata)            -> the row's task directory, rewritten if this node lacks it

Each task directory:

    task.toml          [agent]/[verifier] timeouts, [environment] workdir, no network, 1 cpu
    instruction.md     the prompt
    environment/       Dockerfile (`WORKDIR /workspace`, `COPY workspace/ /workspace/`) + files
    tests/test.sh      the hidden checks; writes /logs/verifier/reward.txt (1 or 0)
    solution/solve.sh  the oracle's commands

Design decisions:
- Task `i` of seed `s` depends only on (s, i): its family is `FAMILIES[i % len]` (every family
  appears n / 15 times), its parameters come from `Random(f"...{s}-{i}")`. So any node can rewrite
  any task from the row's metadata (`ensure_task`), and n = 48 and n = 96 share their first 48.
- The rows carry the environment's files as `metadata["files"]` (what the episode runner writes
  into each fresh sandbox) and the task directory (what the verifier reads its hidden tests from,
  through `miles.sandboxes.harbor`). The Dockerfile copies the same files, so a Harbor runner that
  builds environment/ gets the same tree: a test checks both paths.
- The split is by task (a seeded sample, drawn before the tasks): a held-out task draws its names
  from held-out pools (`families.HELDOUT_WORDS`, ...), so none of its words, services or cities
  occurs in a train task (a test checks it); its family's train siblings teach the commands.
- Rows name their family in `metadata["eval_groups"]`: the evaluator reports held-out pass@1
  per family (`eval/<family>/pass@1`).
- Every argument of an SFT transcript's tool call is in the prompt or a family-wide word of its
  commands (a test checks it over every family): a solve.sh never uses a constant that only the
  files show (a column's position, a tar's top directory), which no model could copy.
- `terminal_tasks_compact` sends no tool schemas (as `find_file` does): a tiny model learns the two
  tools in the warm-start and each prompt is ~5x shorter, which is what a CPU run pays for.
- The SFT rows are the oracle's transcripts of the train tasks (bash with solve.sh's commands, then
  submit), rendered through the session family's template with the tool schemas, one row per
  assistant turn, by `miles.rl.tasks.sft_rows` (as for `find_file`). A quarter of the tasks also
  come with their first call unparsed, the tool agent's `PARSE_ERROR` and the right call after it
  (labels: the recovery only): the reply a sampled model meets most, which SFT must have shown.
- Directories are written to a temporary name and renamed: a reader never sees half a task.
- Task sets (`TASK_SETS`, a row's `metadata["task_set"]`): "all" is the 15 families over the fixed
  name pools, as it always was; "cpu" is the one-command families (`families.CPU_FAMILIES`) over
  coined names split by a hash, graded (`eval_groups = [family, difficulty]`), written under its
  own directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from miles.agentic.terminal.families import CPU_FAMILIES, DIFFICULTY, FAMILIES, WORK, TaskParts, TaskRng

VERSION = "1"
N_TASKS = 48
TOOLS = ["bash", "submit"]
SYSTEM = ("You are working in a Linux shell. Run commands with the bash tool (the working directory "
          "is /workspace). When the task is done, call submit with a one-line summary.")
# the brief set's: with its few-word instructions a prompt is ~100 tokens of the tiny tokenizer
SYSTEM_BRIEF = "Work in /workspace with bash, then submit."
AGENT_TIMEOUT_S = 120.0
VERIFIER_TIMEOUT_S = 30.0
PARSE_ERROR_FRAC = 0.25    # train tasks whose SFT also shows an unparsed call and the recovery
# task set -> (families, names coined: `TaskRng(coined=)`); a row's metadata["task_set"]
# "brief": the "cpu" set's very tasks (same draws, files and checks), each instruction and command
# in a few words with paths relative to the workdir (`TaskParts.brief`, `brief_solve`)
TASK_SETS = {"all": (FAMILIES, False), "cpu": (CPU_FAMILIES, True), "brief": (CPU_FAMILIES, True)}

TEST_HEAD = """#!/bin/bash
# Hidden verifier of {name} ({family}): reward 1 when every check passes, else 0.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
fail() {{ echo "FAIL: $*"; exit 0; }}
# same FILE <<EOF: the file's text is stdin's (trailing newlines aside)
same() {{
  [ -f "$1" ] || fail "$1 is missing"
  want=$(cat); got=$(cat "$1")
  [ "$got" = "$want" ] || fail "$1: got '${{got:0:200}}'"
}}
# same_word FILE WORD: the file holds WORD (whitespace aside)
same_word() {{
  [ -f "$1" ] || fail "$1 is missing"
  got=$(tr -d '[:space:]' < "$1")
  [ "$got" = "$2" ] || fail "$1: got '${{got:0:200}}', want '$2'"
}}
"""
TEST_TAIL = "echo PASS\necho 1 > /logs/verifier/reward.txt\n"
DOCKERFILE = "FROM ubuntu:24.04\nWORKDIR /workspace\nCOPY workspace/ /workspace/\n"


@dataclass
class TaskRecord:
    name: str
    path: str
    index: int
    seed: int
    parts: TaskParts
    heldout: bool = False
    task_set: str = "all"


def default_root(seed: int, task_set: str = "all") -> Path:
    """Where `terminal_tasks` writes its directories: $MILES_TERMINAL_TASKS, else the miles cache."""
    from miles.tiny import default_cache_dir
    base = os.environ.get("MILES_TERMINAL_TASKS")
    name = f"v{VERSION}-seed{seed}" if task_set == "all" else f"v{VERSION}-{task_set}-seed{seed}"
    return (Path(base) if base else default_cache_dir() / "terminal-tasks") / name


def heldout_indices(seed: int, n: int, test_frac: float) -> set[int]:
    """Which of the n tasks are held out: a seeded sample, decided before any task is drawn (a
    held-out task draws its names from the held-out pools)."""
    if not 0.0 < test_frac < 1.0:
        raise ValueError(f"test_frac={test_frac}: expected a fraction in (0, 1)")
    return set(random.Random(f"split-{seed}").sample(range(n), max(1, int(round(n * test_frac)))))


def make_parts(seed: int, index: int, heldout: bool = False, task_set: str = "all") -> TaskParts:
    if task_set not in TASK_SETS:
        raise ValueError(f"task_set={task_set!r}: expected one of {sorted(TASK_SETS)}")
    families, coined = TASK_SETS[task_set]
    family = families[index % len(families)]
    tag = {"all": "", "brief": "cpu-"}.get(task_set, f"{task_set}-")   # "all": as they always were
    parts = family(TaskRng(f"miles-terminal-{VERSION}-{tag}{seed}-{index}", heldout, coined))
    if task_set == "brief":
        parts.instruction, parts.solve = parts.brief, parts.brief_solve
    outside = [p for p in parts.files if not p.startswith(WORK + "/")]
    if outside:
        raise ValueError(f"family {parts.family}: files {outside} are outside {WORK}")
    return parts


def task_name(parts: TaskParts, index: int) -> str:
    return f"{parts.family}-{index:03d}"


def task_files(parts: TaskParts, name: str, seed: int, index: int) -> dict[str, str]:
    """The task directory's files, {relative path: text}."""
    toml = "\n".join([
        'version = "1.0"', "", "[metadata]", 'author_name = "miles.agentic.terminal"',
        f'category = "{parts.family}"', f"tags = {json.dumps(parts.tags)}",
        f"generator_seed = {seed}", f"generator_index = {index}", "", "[agent]",
        f"timeout_sec = {AGENT_TIMEOUT_S}", "", "[verifier]", f"timeout_sec = {VERIFIER_TIMEOUT_S}", "",
        "[environment]", f'workdir = "{WORK}"', 'network_mode = "no-network"', "cpus = 1",
        "memory_mb = 512", "storage_mb = 1024", "build_timeout_sec = 120.0", ""])
    out = {"task.toml": toml, "instruction.md": parts.instruction + "\n",
           "environment/Dockerfile": DOCKERFILE,
           "tests/test.sh": TEST_HEAD.format(name=name, family=parts.family) + "\n".join(parts.checks)
           + "\n" + TEST_TAIL,
           "solution/solve.sh": "#!/bin/bash\n" + parts.solve + "\n"}
    for path, text in parts.files.items():
        out["environment/workspace/" + path.removeprefix(WORK + "/")] = text
    return out


def write_task(root: str | Path, seed: int, index: int, heldout: bool = False,
               task_set: str = "all") -> TaskRecord:
    """Write task `index` of `seed` under root (kept if already there with the same content)."""
    parts = make_parts(seed, index, heldout, task_set)
    name = task_name(parts, index)
    files = task_files(parts, name, seed, index)
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    target = Path(root) / name
    stamp = target / ".miles-digest"
    if not (stamp.is_file() and stamp.read_text() == digest):
        tmp = Path(root) / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for rel, text in files.items():
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
            os.chmod(p, 0o755 if rel.endswith(".sh") and "/workspace/" not in rel else 0o644)
        (tmp / ".miles-digest").write_text(digest)
        shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:   # another process wrote the same task first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    return TaskRecord(name, str(target), index, seed, parts, heldout, task_set)


def generate(out_dir: str | Path, seed: int = 0, n: int = N_TASKS,
             heldout: set[int] = frozenset(), task_set: str = "all") -> list[TaskRecord]:
    if n < 1:
        raise ValueError(f"n={n}: expected at least one task")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return [write_task(out_dir, seed, i, i in heldout, task_set) for i in range(n)]


def row(rec: TaskRecord, declare_tools: bool = True) -> dict:
    groups = [rec.parts.family] + ([DIFFICULTY[rec.parts.family]] if rec.task_set != "all" else [])
    return {"prompt": rec.parts.instruction, "label": rec.name, "metadata": {
        "task_dir": rec.path, "task_name": rec.name, "family": rec.parts.family, "task_seed": rec.seed,
        "task_index": rec.index, "task_heldout": rec.heldout, "task_set": rec.task_set,
        "eval_groups": groups, "files": dict(rec.parts.files), "tools": TOOLS,
        "system": SYSTEM_BRIEF if rec.task_set == "brief" else SYSTEM,
        "declare_tools": declare_tools}}


def ensure_task(metadata: dict) -> str:
    """The task directory of a row; written again (from seed and index) where it is missing."""
    for key in ("task_dir", "task_seed", "task_index"):
        if key not in metadata:
            raise ValueError(f"metadata[{key!r}] is missing: not a terminal task row "
                             f"(keys: {sorted(metadata)})")
    path = Path(metadata["task_dir"])
    if not (path / "task.toml").is_file():
        write_task(path.parent, int(metadata["task_seed"]), int(metadata["task_index"]),
                   bool(metadata.get("task_heldout", False)), metadata.get("task_set", "all"))
    return str(path)


def oracle_command(task_dir: str | Path) -> str:
    """What the oracle sends to the bash tool: solution/solve.sh's commands (POSIX sh)."""
    lines = (Path(task_dir) / "solution" / "solve.sh").read_text().splitlines()
    return "\n".join(line for line in lines if not line.startswith("#!"))


def transcript(r: dict) -> list[dict]:
    """The oracle's episode of a row as OpenAI messages (its commands print nothing)."""
    def call(i: int, name: str, args: dict) -> dict:
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}
    return [{"role": "system", "content": r["metadata"]["system"]}, {"role": "user", "content": r["prompt"]},
            call(0, "bash", {"command": oracle_command(r["metadata"]["task_dir"])}),
            {"role": "tool", "tool_call_id": "call_0", "content": ""},
            call(1, "submit", {"answer": "done"})]


def sft_rows(rows: list[dict], family: str = "qwen3") -> list[dict]:
    """One row per assistant turn of each train row's transcript, and of a seeded
    `PARSE_ERROR_FRAC` of them again with the first call unparsed first and the recovery."""
    from miles.rl.tasks import sft_rows as rows_of, with_parse_error
    again = [{**r, "mistake": True} for r in rows
             if random.Random(f"mistake-{r['metadata']['task_name']}").random() < PARSE_ERROR_FRAC]
    return rows_of(rows + again, family,
                   transcript=lambda r: with_parse_error(transcript(r)) if r.get("mistake") else transcript(r))


def terminal_tasks(seed: int = 0, test_frac: float = 0.25, n: int = N_TASKS,
                   out_dir: str | Path | None = None, declare_tools: bool = True,
                   task_set: str = "all") -> dict[str, list[dict]]:
    """The `data.task` function: train / held-out rows by task, and the oracle's SFT transcripts.
    `declare_tools=False` sends no tool schemas (each row's `metadata["declare_tools"]`)."""
    heldout = heldout_indices(seed, n, test_frac)
    records = generate(out_dir or default_root(seed, task_set), seed, n, heldout, task_set)
    rows = [row(r, declare_tools) for r in records]
    train = [r for r in rows if not r["metadata"]["task_heldout"]]
    test = [r for r in rows if r["metadata"]["task_heldout"]]
    sft = sft_rows(train)
    random.Random(seed).shuffle(sft)
    return {"train": train, "test": test, "sft": sft}


def terminal_tasks_compact(seed: int = 0, test_frac: float = 0.25) -> dict[str, list[dict]]:
    """The same tasks without tool schemas in the prompt (~150 instead of ~800 tokens with the tiny
    tokenizer): for a model that learns its two tools in the warm-start (the CPU recipe)."""
    return terminal_tasks(seed, test_frac, declare_tools=False)


N_TASKS_CPU = 400


def terminal_tasks_cpu(seed: int = 0, test_frac: float = 0.25, out_dir: str | Path | None = None
                       ) -> dict[str, list[dict]]:
    """The CPU recipe's set: 400 tasks of the ten families of `families.CPU_FAMILIES` (one command
    of a fixed shape, graded easy / medium / hard: `eval_groups`), names coined and split by a hash
    (held-out names never occur in a train task), no tool schemas; a recipe's `data.task` gets
    test_frac 0.25: 300 train, 100 held out. ~30 train tasks a family, to teach the shape and the
    copying, not commands to memorise."""
    return terminal_tasks(seed, test_frac, n=N_TASKS_CPU, out_dir=out_dir, declare_tools=False,
                          task_set="cpu")


N_TASKS_BRIEF = 2000


def terminal_tasks_brief(seed: int = 0, test_frac: float = 0.25, out_dir: str | Path | None = None,
                         n: int = N_TASKS_BRIEF) -> dict[str, list[dict]]:
    """The CPU set's families told in a few words ("Replace fuvu-db7 with beve-db52 in
    etc/*.conf."), a one-line system prompt, commands with relative paths: a prompt is ~100 tokens
    of the tiny tokenizer instead of ~340. And 1,500 train tasks, not 300: with 300 the 2-layer model
    learned every command's shape and memorised the names of the train set (greedy held-out and
    train commands alike carried train names after 200 warm-start steps) instead of copying
    them; find_file, which it learns to copy, has 3,000 (task i is the CPU set's task i)."""
    return terminal_tasks(seed, test_frac, n=n, out_dir=out_dir, declare_tools=False, task_set="brief")
