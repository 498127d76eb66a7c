"""The SWE verifier: the task's hidden tests, run in the episode's sandbox after the agent is done.

    [rollout]
    reward = "miles.agentic.swe.verify:verify"
    [train]
    reward_key = "resolved"

`verify(sample, sandbox)` returns {"resolved": 1.0 when every hidden test passed else 0.0,
"pass_frac": the fraction that passed, "fail_to_pass": the fraction of the FAIL_TO_PASS tests that
passed, "format": 0.0 when a tool call of the episode did not parse, else 1.0}: SWE-bench's
RESOLVED_FULL as the trained reward, the partial credit and the format as figures to watch. An
unparseable call is the model's mistake: the sample is scored (0 unless it recovered and fixed the
bug) and trained on, never `failed`.

Design decisions:
- The hidden tests and the verifier's own copy of the runner go into a freshly wiped
  `.verifier/` only now: the agent never saw them, and an agent that edited `run_tests.py` or the
  visible tests changed nothing the reward reads.
- The runner is told a nonce through a file it reads and deletes before it imports any test (so
  before any of the agent's code runs), and only a result line carrying the nonce counts: code
  that prints a forged summary and exits cannot pass. (A process the agent left running in the
  sandbox could still race for the file; the reward trusts the sandbox as far as that.)
- The result must account for every hidden test by count: a runner that ran fewer is a failure
  of the repository (an import error, a crash), and the reward is 0.0 for it, as for a timeout
  (each test has 2 s inside the runner; the whole run `timeout_s`): the agent's code did that.
  A sandbox that cannot run `python3` at all (exit 126/127) is the infrastructure's failure: it
  raises, so the episode is `failed`, never a reward 0 that training would learn from.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from miles.agentic.swe.tasks import HIDDEN_DIR, RUNNER

VERIFY_TIMEOUT_S = 30.0
NONCE_FILE = f"{HIDDEN_DIR}/nonce"

# The runner, reading its nonce before anything else: the result line is "<nonce> <json>".
_NONCE_RUNNER = RUNNER.replace(
    'if __name__ == "__main__":\n    sys.exit(main(sys.argv[1:]))\n',
    'if __name__ == "__main__":\n'
    '    import os\n'
    f'    with open({NONCE_FILE!r}) as f:\n'
    '        nonce = f.read().strip()\n'
    f'    os.unlink({NONCE_FILE!r})\n'
    '    _print = print\n'
    '    def print(*args, **kwargs):\n'
    '        if len(args) == 1 and isinstance(args[0], str) and args[0].startswith("{"):\n'
    '            args = (nonce + " " + args[0],)\n'
    '        _print(*args, **kwargs, flush=True)\n'
    '    sys.exit(main(sys.argv[1:]))\n')


class VerifierError(RuntimeError):
    """The sandbox could not run the verifier at all (not the agent's doing)."""


def _metadata(sample: Any) -> dict[str, Any]:
    meta = getattr(sample, "metadata", None) or {}
    for key in ("hidden_tests", "fail_to_pass", "pass_to_pass"):
        if key not in meta:
            raise ValueError(f"swe verify: the sample's metadata has no {key!r} (is data.task "
                             f"'miles.agentic.swe.tasks:tasks'?); keys: {sorted(meta)}")
    return meta


async def run_hidden_tests(sandbox: Any, meta: dict[str, Any],
                           timeout_s: float = VERIFY_TIMEOUT_S) -> dict[str, float]:
    """Upload and run the hidden tests in `sandbox`; the reward dict (see the module docstring)."""
    wipe = await sandbox.exec(f"rm -rf {HIDDEN_DIR}", timeout_s=10.0)
    if not wipe.ok:
        raise VerifierError(f"swe verify: could not clear {HIDDEN_DIR}: {wipe.stderr[-300:]}")
    nonce = secrets.token_hex(16)
    files = {name: text.encode() for name, text in meta["hidden_tests"].items()}
    files.update({"run_tests.py": _NONCE_RUNNER.encode(), "nonce": nonce.encode()})
    await sandbox.upload_dir(HIDDEN_DIR, files)
    r = await sandbox.exec(f"python3 -B -I {HIDDEN_DIR}/run_tests.py {HIDDEN_DIR}", timeout_s=timeout_s)
    if r.exit_code in (126, 127) and not r.timed_out:
        raise VerifierError(f"swe verify: the sandbox cannot run python3 (exit {r.exit_code}): "
                            f"{(r.stderr or r.stdout)[-300:]}")
    f2p, total = list(meta["fail_to_pass"]), len(meta["fail_to_pass"]) + len(meta["pass_to_pass"])
    result = None
    for line in r.stdout.splitlines():
        if line.startswith(nonce + " "):
            result = json.loads(line[len(nonce) + 1:])
    if r.timed_out or result is None or result["passed"] + len(result["failures"]) < total:
        return {"resolved": 0.0, "pass_frac": float(result["passed"]) / total if result else 0.0,
                "fail_to_pass": 0.0}
    failed = {f.split(": ", 1)[0] for f in result["failures"]}
    return {"resolved": float(result["passed"] == total and not failed),
            "pass_frac": result["passed"] / total,
            "fail_to_pass": sum(t not in failed for t in f2p) / len(f2p)}


async def verify(sample: Any, sandbox: Any = None) -> dict[str, float]:
    """`rollout.reward`: the hidden tests of the sample's task, in the episode's sandbox, and
    `format` (1.0 when every tool call of the episode parsed)."""
    meta = _metadata(sample)
    if sandbox is None:
        raise ValueError("swe verify runs the hidden tests in the episode's sandbox: set [sandbox] "
                         "backend (e.g. \"subprocess\")")
    reward = await run_hidden_tests(sandbox, meta)
    agent = meta.get("agent") if isinstance(meta.get("agent"), dict) else {}
    reward["format"] = 0.0 if agent.get("parse_errors") else 1.0
    return reward
