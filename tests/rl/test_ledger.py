"""The prompt ledger (miles/actors/ledger.py): a real buffer writes every prompt's fate, the
checker proves exactly-once from the file alone, and job restarts roll back, never count twice."""

from __future__ import annotations

import json

from test_buffer_journal import fill, group

from miles.actors.buffer import Buffer
from miles.actors.ledger import (LEDGER_FORMAT, Ledger, LedgerEntry, LedgerJob, check, check_run)
from miles.cli import main as miles_main
from miles.wire.journal import Journal
from miles.wire.messages import ConfirmBatch, GetBatch, PutGroup, ReleaseSlot, StartJob


def _buffer(run):
    b = Buffer()
    b.configure(groups_per_step=2, max_staleness=2, filter_spec="nonzero_std")
    b.open_journal(run / "buffer" / "journal.bin", restore=False)
    b.ledger = Ledger(run / "buffer" / "ledger.bin")
    return b


async def test_a_buffer_records_every_fate_and_the_checker_proves_the_invariant(tmp_path):
    b = _buffer(tmp_path)
    b.on_start_job(StartJob(resumed_step=0, fresh=True, driver="d1"))
    await fill(b)                                   # prompts 0-4: one out, one queued, retry, filtered
    await b.on_confirm_batch(ConfirmBatch(request_id="step1", step=1))
    await b.on_release_slot(ReleaseSlot(slot=3, reason="the agent's sandbox failed"))
    await b.on_put_group(PutGroup(group=group("g2b", 2), slot=2, owner=0))  # the retry, kept
    rep = check(Journal(tmp_path / "buffer" / "ledger.bin").read())
    assert (rep.prompts_read, rep.trained, rep.filtered, rep.dropped, rep.pending) == (5, 1, 1, 1, 2)
    assert rep.ok and rep.jobs == 1 and rep.format == LEDGER_FORMAT, rep.line()
    # a live run is not checked for lost prompts; an ended one is, against its checkpoint's list
    assert check(Journal(tmp_path / "buffer" / "ledger.bin").read(), replay={1, 2}).ok
    lost = check(Journal(tmp_path / "buffer" / "ledger.bin").read(), replay={1})
    assert lost.lost == [2] and "lost" in lost.line()


def test_trained_twice_and_a_drop_without_reason_break_it():
    records = [LedgerJob(format=LEDGER_FORMAT, job=1),
               LedgerEntry(prompt=0, fate="read", job=1), LedgerEntry(prompt=0, fate="trained", step=1, job=1),
               LedgerEntry(prompt=0, fate="trained", step=1, job=1),   # one fact written twice: once
               LedgerEntry(prompt=1, fate="read", job=1), LedgerEntry(prompt=1, fate="trained", step=1, job=1),
               LedgerEntry(prompt=1, fate="trained", step=2, job=1),   # a second training
               LedgerEntry(prompt=2, fate="dropped", job=1)]
    rep = check(records)
    assert rep.trained_twice == [1] and rep.no_reason == [2] and not rep.ok
    assert check([LedgerJob(format=99, job=1)]).problems == ["job 1: ledger format 99, this checker reads 1"]


def test_a_job_restart_rolls_back_the_steps_after_its_checkpoint_and_counts_them_once(tmp_path):
    path = tmp_path / "buffer" / "ledger.bin"
    job1 = Ledger(path)
    job1.start_job(0, fresh=True, driver="a")
    for step, prompts in ((1, [0, 1]), (2, [2, 3]), (3, [4, 5])):
        for p in prompts:
            job1.note(p, "read")
            job1.note(p, "trained", step=step)
    job1.note(6, "read")                            # in flight when the job died
    job2 = Ledger(path)                             # resumed from the step-1 checkpoint
    assert job2.start_job(1, fresh=False, driver="b") == 2
    assert job2.start_job(1, fresh=False, driver="b") == 2   # re-sent after a buffer restart
    for step, prompts in ((2, [2, 3]), (3, [4, 5])):
        for p in prompts:
            job2.note(p, "read")
            job2.note(p, "trained", step=step)
    rep = check(Journal(path).read())
    assert rep.ok and rep.rolled_back == 4 and rep.trained == 6 and rep.pending == 1, rep.line()
    assert rep.jobs == 2
    # a fresh start (loop.resume = false) begins a new ledger
    assert Ledger(path).start_job(0, fresh=True) == 1 and check(Journal(path).read()).prompts_read == 0


def test_miles_ledger_prints_the_totals_and_fails_on_a_broken_run(tmp_path, capsys):
    path = tmp_path / "buffer" / "ledger.bin"
    led = Ledger(path)
    led.start_job(0, fresh=True)
    led.note(0, "read")
    led.note(0, "trained", step=1)
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000001" / "loop_state.json").write_text(json.dumps({"replay_prompts": []}))
    assert check_run(tmp_path).ok
    assert miles_main(["ledger", str(tmp_path)]) == 0
    assert "1 prompts read: 1 trained" in capsys.readouterr().out
    led.note(0, "trained", step=2)
    assert miles_main(["ledger", str(tmp_path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["trained_twice"] == [0]
