"""The SWE task set: small Python repositories with one bug each, in SWE-bench's shape, from a seed.

    data.task = "miles.agentic.swe.tasks:tasks"       # {"train": rows, "test": rows}

A row is one task instance:

    prompt    the issue, as a user would file it, and how to run the tests
    label     the gold patch (a unified diff of the source file, SWE-bench's `patch`)
    metadata  task_id, template, bug_kind,
              files         {path: text}: the repository, written into the episode's sandbox
              hidden_tests  {path: text}: the verifier's tests, uploaded after the agent is done
              fail_to_pass, pass_to_pass   the hidden tests' ids, as SWE-bench lists them
              difficulty, fn, hint, constants   the spec's grade, the function, the easy
                            bug's (wrong, right), the drawn constants
              eval_groups   [difficulty, template]: the evaluator's per-group pass@1
              fix           {"path", "start", "end", "text"}: the fix as one line-range edit (1-based,
                            inclusive), what the oracle sends through the harness's `edit` tool
              test_command  how the visible tests run

The repository: a package (`<pkg>/__init__.py`, the module with the bug and one more function,
a second module with one or two more), `tests/test_<module>.py` for each module (the bug's
module's tests include the failing test the issue names), and `run_tests.py`, a pytest-free
runner (the sandbox's Python is the host's, without pytest).

Design decisions:
- Every number in a test is computed: the correct code runs on each call at generation time, and
  the buggy code must answer differently on the failing calls and the same on the passing ones
  (`TaskSetError` otherwise), so a task's verifier gives 1.0 for the fix and 0.0 without it by
  construction; `tests/agentic/test_swe_tasks.py` checks it again in real sandboxes.
- Hidden tests = FAIL_TO_PASS (the issue's call and one the issue does not show, so a fix that
  special-cases the issue's input does not pass) + PASS_TO_PASS (every other function of the
  repository: a fix that breaks something else does not pass).
- Variety: 13 bug specs (`miles.agentic.swe.bugs.SPECS`, easy / medium / hard) with their own
  names and constants, in packages and modules of varied names with other specs' functions as
  neighbours, and several wordings of the issue (some name the module, some only the function;
  an easy bug's issue also quotes the wrong token and the right one). The test split draws the
  other half of every name, constant and package pool: no held-out function name or constant is
  in a train task.
- A task is small: the verifier is one `python3` process running ~6-10 asserts (~50 ms).
"""

from __future__ import annotations

import difflib
import random
from typing import Any

from miles.agentic.swe.bugs import SPECS, Bug, _half, instantiate

N_TASKS = 64
TEST_COMMAND = "python3 run_tests.py"
HIDDEN_DIR = ".verifier"     # where the verifier puts its tests and runner (after the agent is done)
# Every package sorts before "tests": `search` lists its hits by path, the source's first.
PACKAGES = ("inventory", "ledger", "payroll", "shipping", "catalog", "scheduler", "billing", "metrics",
            "roster", "orders", "gradebook", "recipes", "library", "pantry", "garden", "fleet")
MODULES = ["core", "utils", "helpers", "ops", "calc", "text", "tables", "rules", "numbers", "records"]

RUNNER = '''"""Run the test_* functions of tests/test_*.py (or of the files and directories given), no pytest.

Prints PASS/FAIL per test and a last line of JSON: {"passed": n, "failed": m, "failures": [...]}.
Exits 0 when every test passed. Each test has 2 seconds.
"""
import importlib.util
import json
import pathlib
import signal
import sys
import traceback


def _timeout(signum, frame):
    raise TimeoutError("test took longer than 2 s")


def main(args):
    sys.path.insert(0, str(pathlib.Path.cwd()))
    files = []
    for target in args or ["tests"]:
        path = pathlib.Path(target)
        files += sorted(path.glob("test_*.py")) if path.is_dir() else [path]
    signal.signal(signal.SIGALRM, _timeout)
    passed, failures = 0, []
    for path in files:
        try:
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except BaseException as e:
            failures.append(f"{path}: import failed: {type(e).__name__}: {e}")
            print("FAIL", failures[-1])
            continue
        for name in sorted(n for n in vars(module) if n.startswith("test_")):
            signal.alarm(2)
            try:
                getattr(module, name)()
                passed += 1
                print("PASS", f"{path}::{name}")
            except BaseException as e:
                failures.append(f"{path}::{name}: {type(e).__name__}: {e}")
                print("FAIL", failures[-1])
                traceback.print_exc(limit=-1, file=sys.stdout)
            finally:
                signal.alarm(0)
    print(json.dumps({"passed": passed, "failed": len(failures), "failures": failures}))
    return 0 if passed and not failures else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


class TaskSetError(ValueError):
    """A template produced a task whose bug the tests would not tell apart from the fix."""


def _run(source: str, call: str) -> tuple[bool, Any]:
    """(ok, value or exception text) of `call` evaluated after `source`."""
    ns: dict[str, Any] = {}
    exec(compile(source, "<task>", "exec"), ns)  # noqa: S102 - our own generated source
    try:
        return True, eval(call, ns)  # noqa: S307
    except Exception as e:  # the buggy code's failure is what the issue reports
        return False, f"{type(e).__name__}: {e}"


def _checked(bug: Bug) -> dict[str, Any]:
    """The expected value of every call, after checking the bug changes exactly the fail calls."""
    expected = {}
    for call in bug.fail + bug.keep:
        ok, want = _run(bug.good, call)
        if not ok or eval(repr(want)) != want:  # noqa: S307 - the test file writes it as repr
            raise TaskSetError(f"template {bug.template}: {call} -> {want!r} on the correct code")
        expected[call] = want
        bad_ok, got = _run(bug.bad, call)
        if (bad_ok and got == want) == (call in bug.fail):
            raise TaskSetError(f"template {bug.template} ({bug.kind}): the bug "
                               f"{'does not change' if call in bug.fail else 'changes'} {call}")
    return expected


def _test_file(imports: dict[str, list[str]], cases: list[tuple[str, str, Any]]) -> str:
    lines = [f"from {module} import {', '.join(sorted(set(names)))}" for module, names in imports.items()]
    for name, call, want in cases:
        lines += ["", "", f"def {name}():", f"    got = {call}", f"    assert got == {want!r}, got"]
    return "\n".join(lines) + "\n"


def _issue(rng: random.Random, bug: Bug, where: str, test_id: str) -> str:
    call = bug.fail[0]
    ok, got = _run(bug.bad, call)
    _, want = _run(bug.good, call)
    seen = f"returns `{got!r}`" if ok else f"raises `{got}`"
    name = rng.choice([f"`{where}.{bug.fn}`", f"`{bug.fn}`"])
    title = rng.choice([f"{name} gives a wrong result", f"Bug in {name}", f"{name}: unexpected output",
                        f"Wrong answer from {name}"])
    body = rng.choice([
        f"I expected that {bug.summary}. But `{call}` {seen} instead of `{want!r}`.",
        f"`{call}` {seen}; it should return `{want!r}`. As far as I can tell {bug.summary}.",
        f"Calling `{call}` {seen}. The expected value is `{want!r}` ({bug.summary}).",
    ])
    if bug.hint is not None:   # easy: the issue names the fix's token exactly
        wrong, right = bug.hint
        body += " " + rng.choice([f"The code says `{wrong}`; it should be `{right}`.",
                                  f"I think `{wrong}` should be `{right}` there."])
    return f"{title}\n\n{body}\n\nThe failing test is `{test_id}`."


def _fix(bad: str, good: str, path: str) -> dict[str, Any]:
    """The change from bad to good as one line-range replacement (an insertion takes its next line)."""
    a, b = bad.splitlines(keepends=True), good.splitlines(keepends=True)
    blocks = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op[0] != "equal"]
    if len(blocks) != 1:
        raise TaskSetError(f"{path}: the bug must change one block of lines, got {len(blocks)}")
    _, i1, i2, j1, j2 = blocks[0]
    if i1 == i2:   # pure insertion: replace the line it goes before
        i2, j2 = i1 + 1, j2 + 1
    return {"path": path, "start": i1 + 1, "end": i2, "text": "".join(b[j1:j2])}


def make_task(rng: random.Random, bug: Bug, neighbours: list[Bug], task_id: str,
              split: str = "train") -> dict[str, Any]:
    pkg, (mod, mod2) = rng.choice(_half(PACKAGES, split)), rng.sample(MODULES, 2)
    first, rest = neighbours[0], neighbours[1:]
    header = '"""{} of the {} package."""\n\n\n'
    path, path2 = f"{pkg}/{mod}.py", f"{pkg}/{mod2}.py"
    order = rng.random() < 0.5   # the bug's function first or second in its module
    parts = [bug, first] if order else [first, bug]
    bad_src = header.format(mod.capitalize(), pkg) + "\n\n".join(b.bad if b is bug else b.good for b in parts)
    good_src = header.format(mod.capitalize(), pkg) + "\n\n".join(b.good for b in parts)
    src2 = header.format(mod2.capitalize(), pkg) + "\n\n".join(b.good for b in rest)
    expected = {id(b): _checked(b) for b in [bug, *neighbours]}

    def cases(b: Bug, calls: list[str], tag: str) -> list[tuple[str, str, Any]]:
        return [(f"test_{b.fn}_{tag}{i}", c, expected[id(b)][c]) for i, c in enumerate(calls)]

    def names(bs: list[Bug]) -> list[str]:
        return [n for b in bs for n in (b.fn, *b.helpers)]

    m1, m2 = f"{pkg}.{mod}", f"{pkg}.{mod2}"
    visible1 = cases(bug, bug.fail[:1] + bug.keep, "") + cases(first, first.keep, "")
    issue_test = f"tests/test_{mod}.py::{visible1[0][0]}"
    f2p = cases(bug, bug.fail, "fix")
    p2p = cases(bug, bug.keep, "keep") + [c for b in neighbours for c in cases(b, b.fail + b.keep, "keep")]
    hidden = _test_file({m1: names(parts), m2: names(rest)}, f2p + p2p)
    files = {f"{pkg}/__init__.py": f'"""The {pkg} package."""\n\n__version__ = "0.{rng.randrange(1, 20)}.0"\n',
             path: bad_src, path2: src2,
             f"tests/test_{mod}.py": _test_file({m1: names(parts)}, visible1),
             f"tests/test_{mod2}.py": _test_file({m2: names(rest)},
                                                 [c for b in rest for c in cases(b, b.keep, "")]),
             "run_tests.py": RUNNER,
             "README.md": f"# {pkg}\n\nRun the tests with `{TEST_COMMAND}`.\n"}
    fix = _fix(bad_src, good_src, path)
    patch = "".join(difflib.unified_diff(bad_src.splitlines(keepends=True), good_src.splitlines(keepends=True),
                                         f"a/{path}", f"b/{path}"))
    issue = _issue(rng, bug, m1, issue_test)
    prompt = (f"{issue}\n\nThe repository is in the working directory. Fix the bug in the source code "
              f"(not in the tests). `{TEST_COMMAND}` runs the tests. Call submit when you are done.")
    hidden_ids = [f"{HIDDEN_DIR}/test_hidden.py::{name}" for name, _, _ in f2p + p2p]
    return {"prompt": prompt, "label": patch, "metadata": {
        "task_id": task_id, "template": bug.template, "bug_kind": bug.kind, "difficulty": bug.difficulty,
        "fn": bug.fn, "hint": list(bug.hint) if bug.hint else None, "constants": bug.constants,
        "eval_groups": [bug.difficulty, bug.template], "files": files,
        "hidden_tests": {"test_hidden.py": hidden}, "fail_to_pass": hidden_ids[:len(f2p)],
        "pass_to_pass": hidden_ids[len(f2p):], "fix": fix, "test_command": TEST_COMMAND}}


def generate(seed: int = 0, n: int = N_TASKS, split: str = "train") -> list[dict[str, Any]]:
    """`n` tasks of `split` (its half of every name and constant pool); the specs take turns
    (in an order from the seed), so each appears about n/len(SPECS) times."""
    if n < 1:
        raise ValueError(f"n: expected at least 1 task, got {n}")
    rng = random.Random(f"{seed}-{split}")
    order = list(SPECS)
    rng.shuffle(order)
    rows = []
    for i in range(n):
        spec = order[i % len(order)]
        others = rng.sample([t for t in SPECS if t is not spec], rng.randrange(2, 4))
        bug = instantiate(spec, rng, split)
        neighbours = [instantiate(t, rng, split) for t in others]
        rows.append(make_task(rng, bug, neighbours, f"swe-{seed}-{split}-{i:03d}-{bug.template}", split))
    return rows


def tasks(seed: int = 0, test_frac: float = 0.25, n: int = N_TASKS,
          declare_tools: bool = True) -> dict[str, list[dict[str, Any]]]:
    """The `data.task` entry point: train and held-out tasks from disjoint halves of the name and
    constant pools; "sft" is the oracle's transcripts of the train tasks
    (`miles.agentic.swe.scripted.sft_rows`), a recovery from a malformed call among them."""
    if not 0.0 < test_frac < 1.0:
        raise ValueError(f"test_frac: expected a fraction in (0, 1), got {test_frac}")
    from miles.agentic.swe.scripted import sft_rows
    n_test = max(1, int(n * test_frac))
    train, test = generate(seed, n - n_test, "train"), generate(seed, n_test, "test")
    for r in train + test:
        r["metadata"]["declare_tools"] = declare_tools
    sft = sft_rows(train)
    random.Random(seed + 2).shuffle(sft)   # the SFT source is read in file order
    return {"train": train, "test": test, "sft": sft}


def tasks_compact(seed: int = 0, test_frac: float = 0.25) -> dict[str, list[dict[str, Any]]]:
    """`tasks` without the tool schemas in the prompt (`metadata["declare_tools"] = False`): the
    model learns its tools from the SFT transcripts, and every prompt is ~1200 tokens shorter with
    the tiny tokenizer (what a CPU run pays for at every turn and every SFT row)."""
    return tasks(seed, test_frac, declare_tools=False)
