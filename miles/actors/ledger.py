"""The prompt ledger: every prompt the rollout read, and what became of it, exactly once.

`<output_dir>/buffer/ledger.bin` is the buffer's second journal (`miles.wire.journal`: whole
records, a torn tail cut), written beside the slot journal by the same handlers:

    LedgerJob       a job started (format, job number, the checkpoint step it resumed from)
    LedgerEntry     one prompt's event: read | trained | filtered | dropped | stale | rolled_back

`check(records)` proves the invariant from the file alone: every prompt read ends exactly once
as trained, or filtered / dropped with a recorded reason, or is still pending; none is trained
twice. `miles ledger RUN` prints it; `miles status RUN` prints its totals; bench/chaos.py's
report runs it on every chaos run.

Design decisions:
- Its own file, not the slot journal: that one is compacted into one snapshot and started empty
  by every job, so it holds what a restarted buffer needs, not the run's history. The ledger is
  never compacted and outlives job restarts (a `loop.resume = false` start begins a new one).
- Each event is appended before the buffer journals the transition it comes with: a buffer
  killed between the two writes an event twice at worst (the restarted one repeats it), so a
  `trained` fact (prompt, step, job) counts once, and a prompt's fate is its last event.
- A prompt's fate is its last event (a stale group's prompt is re-issued: `stale`, then `read`
  again); `trained` is counted, net of `rolled_back`, and must be at most 1.
- A job restart from disk resumes at a checkpoint step S; the steps after S that the dead job
  trained are trained again, so the new job appends `rolled_back` for each prompt trained after
  S by the jobs before (`start_job`), and the checker counts them once.
- Versioned: the first record of every job carries `LEDGER_FORMAT`; a reader refuses another.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import msgspec

from miles.wire.journal import Journal
from miles.wire.messages import Message

LEDGER_FORMAT = 1
FATES = ("read", "trained", "filtered", "dropped", "stale", "rolled_back")
WITH_REASON = ("filtered", "dropped", "stale")


class LedgerJob(Message):
    format: int
    job: int
    resumed_step: int = 0        # the checkpoint step it resumed from (0: from the start)
    driver: str = ""             # the driver's run id: a re-sent start is the same job


class LedgerEntry(Message):
    prompt: int
    fate: str
    reason: str = ""
    step: int = 0                # trained / rolled_back: the training step
    job: int = 0


class Ledger:
    """The buffer's writer of the ledger file."""

    def __init__(self, path: str | Path):
        self.journal = Journal(path, "ledger", 1)
        self.job = max((r.job for r in self.records() if isinstance(r, LedgerJob)), default=0)

    def records(self) -> list[Message]:
        return self.journal.read()

    def start_job(self, resumed_step: int, fresh: bool, driver: str = "") -> int:
        """A new job: `fresh` starts a new ledger; else the trained prompts of steps after
        `resumed_step` are rolled back (they are trained again from the checkpoint)."""
        records = [] if fresh else self.records()
        jobs = [r for r in records if isinstance(r, LedgerJob)]
        if driver and jobs and jobs[-1].driver == driver:
            return self.job  # re-sent by the driver after a buffer restart
        if fresh:
            self.journal.remove()
            self.job = 0
        self.job += 1
        self.journal.append(LedgerJob(format=LEDGER_FORMAT, job=self.job, resumed_step=resumed_step,
                                      driver=driver))
        for prompt, step in net_trained(records).items():
            if step > resumed_step:
                self.note(prompt, "rolled_back", f"trained at step {step}, after the checkpoint of "
                                                 f"step {resumed_step} this job resumed from", step)
        return self.job

    def note(self, prompt: int, fate: str, reason: str = "", step: int = 0) -> None:
        if prompt >= 0:
            self.journal.append(LedgerEntry(prompt=prompt, fate=fate, reason=reason, step=step,
                                            job=self.job))

    def close(self) -> None:
        self.journal.close()


def net_trained(records: list[Message]) -> dict[int, int]:
    """prompt -> the step it is trained at, net of roll-backs (the last training that stands)."""
    out: dict[int, list[int]] = {}
    for r in records:
        if isinstance(r, LedgerEntry) and r.fate == "trained":
            out.setdefault(r.prompt, []).append(r.step)
        elif isinstance(r, LedgerEntry) and r.fate == "rolled_back" and r.prompt in out:
            steps = out[r.prompt]
            steps.remove(r.step) if r.step in steps else steps.pop()
    return {p: s[-1] for p, s in out.items() if s}


class LedgerReport(msgspec.Struct, kw_only=True):
    """What the checker found; `ok` when every prompt read has exactly one fate."""
    format: int = LEDGER_FORMAT
    jobs: int = 0
    prompts_read: int = 0
    trained: int = 0
    filtered: int = 0
    dropped: int = 0
    pending: int = 0
    rolled_back: int = 0            # trainings undone by job restarts (counted once, not twice)
    trained_twice: list[int] = []   # prompts trained more than once, net of roll-backs
    no_reason: list[int] = []       # filtered / dropped / stale without a reason
    lost: list[int] = []            # pending prompts that no checkpoint will regenerate
    problems: list[str] = []

    @property
    def ok(self) -> bool:
        return not (self.trained_twice or self.no_reason or self.lost or self.problems)

    def line(self) -> str:
        verdict = "holds" if self.ok else "BROKEN: " + "; ".join(self.problems)
        return (f"ledger (format {self.format}, {self.jobs} job(s)): {self.prompts_read} prompts read: "
                f"{self.trained} trained, {self.filtered} filtered, {self.dropped} dropped, "
                f"{self.pending} pending; {self.rolled_back} rolled back by job restarts; "
                f"trained twice {len(self.trained_twice)}; invariant {verdict}")


def check(records: list[Message], replay: set[int] | None = None,
          read_on_from: int | None = None) -> LedgerReport:
    """The invariant over a ledger's records. `replay`: the prompts the newest checkpoint will
    generate again (its `replay_prompts`), and `read_on_from`: its data position (a resume reads
    every prompt from there on again); a pending prompt in neither is lost. None: not checked
    (a live run, or no checkpoint yet)."""
    rep = LedgerReport()
    last: dict[int, LedgerEntry] = {}
    trained: Counter = Counter()
    seen: set[tuple] = set()  # (prompt, step, job) trained: a fact written twice is one
    for r in records:
        if isinstance(r, LedgerJob):
            if r.format != LEDGER_FORMAT:
                rep.problems.append(f"job {r.job}: ledger format {r.format}, this checker reads "
                                    f"{LEDGER_FORMAT}")
            rep.jobs += 1
            continue
        if not isinstance(r, LedgerEntry) or r.fate not in FATES:
            rep.problems.append(f"not a ledger record: {r!r}")
            continue
        if r.fate == "trained":
            if (r.prompt, r.step, r.job) in seen:
                continue
            seen.add((r.prompt, r.step, r.job))
            trained[r.prompt] += 1
        elif r.fate == "rolled_back":
            trained[r.prompt] -= 1
            rep.rolled_back += 1
            continue  # the prompt's fate is what the new job makes of it
        elif r.fate in WITH_REASON and not r.reason:
            rep.no_reason.append(r.prompt)
        last[r.prompt] = r
    rep.prompts_read = len(last)
    rep.trained_twice = sorted(p for p, n in trained.items() if n > 1)
    for prompt, r in last.items():
        if trained[prompt] >= 1:
            rep.trained += 1
        elif r.fate in ("filtered", "dropped"):
            setattr(rep, r.fate, getattr(rep, r.fate) + 1)
        else:  # read, stale (re-issued), or a training rolled back and not yet redone
            rep.pending += 1
            again = prompt in replay if replay is not None else True
            if read_on_from is not None and prompt >= read_on_from:
                again = True
            if replay is not None and not again:
                rep.lost.append(prompt)
    if rep.trained_twice:
        rep.problems.append(f"prompts trained twice: {rep.trained_twice[:10]}")
    if rep.no_reason:
        rep.problems.append(f"filtered/dropped without a reason: {sorted(set(rep.no_reason))[:10]}")
    if rep.lost:
        rep.problems.append(f"pending prompts no checkpoint regenerates (lost): {sorted(rep.lost)[:10]}")
    return rep


def check_run(run_dir: str | Path) -> LedgerReport:
    """`check` on a run directory's ledger, with its newest checkpoint's replay list."""
    import json

    run = Path(run_dir)
    path = run / "buffer" / "ledger.bin"
    if not path.exists():
        return LedgerReport(problems=[f"no ledger at {path}"])
    done = sorted((p for p in (run / "checkpoints").glob("step_*") if (p / "loop_state.json").exists()),
                  key=lambda p: int(p.name.split("_")[1]))
    replay, position = None, None
    if done:
        state = json.loads((done[-1] / "loop_state.json").read_text())
        replay = set(state.get("replay_prompts", []))
        position = state.get("data_state", {}).get("position")
    # a torn tail (the last buffer killed mid-write) is one event short, never a wrong one
    return check(Journal(path).read(cut_torn_tail=False), replay,
                 position if isinstance(position, int) else None)
