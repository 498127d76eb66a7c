"""The SFT warm start is judged by what matters: rows reshuffled every epoch, the mean loss of
each epoch (not the last batch), and, under the published weights, greedy reproduction of the
rows and their summed NLL, in metrics.jsonl (kind "sft") and on the console."""

from __future__ import annotations

import json

import pytest

from miles.config import load_recipe
from miles.rl.sft import EpochLoss
from miles.rl.sources import make_source
from tests.rl.test_loop import records, run_recipe


def write_rows(path, n):
    path.write_text("".join(json.dumps({"prompt": f"sort {i:03d} =", "label": "".join(sorted(f"{i:03d}"))})
                            + "\n" for i in range(100, 100 + n)))


def test_sft_rows_are_reshuffled_every_epoch_seeded_by_run_seed_and_epoch(tmp_path):
    write_rows(tmp_path / "sft.jsonl", 20)
    recipe = load_recipe(text=f'[data]\nsft_path = "{tmp_path / "sft.jsonl"}"\npath = "{tmp_path / "sft.jsonl"}"')
    source = make_source(recipe, "sft")
    epochs = [[next(source).prompt for _ in range(20)] for _ in range(3)]
    file_order = [f"sort {i:03d} =" for i in range(100, 120)]
    assert all(sorted(e) == file_order for e in epochs)          # each epoch: every row once
    assert all(e != file_order for e in epochs) and epochs[0] != epochs[1] != epochs[2]
    again = make_source(recipe, "sft")                             # the order is the seed's
    assert [next(again).prompt for _ in range(20)] == epochs[0]
    other = make_source(load_recipe(text=f'[run]\nseed = 1\n[data]\nsft_path = "{tmp_path / "sft.jsonl"}"'),
                        "sft")
    assert [next(other).prompt for _ in range(20)] != epochs[0]


def test_epoch_loss_is_the_mean_over_the_epochs_steps():
    e = EpochLoss()
    assert e.add(0, 3.0) is None and e.add(0, 1.0) is None
    assert e.add(1, 5.0) == {"sft/epoch": 0.0, "sft/loss_epoch": 2.0, "sft/steps_in_epoch": 2.0}
    assert e.close() == {"sft/epoch": 1.0, "sft/loss_epoch": 5.0, "sft/steps_in_epoch": 1.0}


@pytest.mark.slow
def test_a_warm_start_logs_epoch_losses_greedy_reproduction_and_row_nll(tmp_path):
    """The quickstart's warm start on 32 rows (4 steps an epoch, 3 epochs), then one RL step."""
    write_rows(tmp_path / "sft.jsonl", 32)
    code, log, out = run_recipe(tmp_path, "sft", [
        f"data.sft_path={json.dumps(str(tmp_path / 'sft.jsonl'))}", "sft.steps=12", "sft.batch_size=8",
        "loop.num_steps=1", "loop.save_every=0", "loop.eval_every=0", 'eval.mode="off"',
        'buffer.filter="none"'], timeout_s=400)
    assert code == 0, log[-3000:]
    sft = records(out, "sft")
    assert [r["step"] for r in sft] == [4, 8, 12] and [r["sft/epoch"] for r in sft] == [0, 1, 2]
    assert all(r["sft/steps_in_epoch"] == 4 for r in sft)
    assert sft[-1]["sft/loss_epoch"] < sft[0]["sft/loss_epoch"]     # 3 passes over 32 rows learn
    end = sft[-1]
    assert end["sft/rows_checked"] == 32 and 0.0 <= end["sft/greedy_reproduced"] <= 1.0
    # the summed NLL of a 4-token answer (3 digits and the end) is above its token mean
    assert end["sft/row_nll"] > end["sft/loss_epoch"] > 0
    text = next(l for l in log.splitlines() if '{"sft_steps"' in l)   # the node prefixes lines
    line = json.loads(text[text.index('{"sft_steps"'):])
    assert line["sft_greedy_reproduced"] == round(end["sft/greedy_reproduced"], 3)
    assert line["sft_row_nll"] == round(end["sft/row_nll"], 3)
    assert [r["step"] for r in records(out, "train")] == [1]


@pytest.mark.slow
def test_a_warm_start_runs_until_held_out_reaches_its_target_or_its_cap(tmp_path):
    """`sft.until_heldout`: every `sft.check_every` steps from `sft.check_from` the published
    warm-start weights are evaluated on the held-out set; the warm start stops at the first check that reaches the
    target, else at `sft.steps`, and says which."""
    target = 0.2
    code, log, out = run_recipe(tmp_path, "until", [
        "sft.steps=30", "sft.check_every=5", "sft.check_from=20", f"sft.until_heldout={target}",
        "eval.n_prompts=16",
        "loop.num_steps=1", "loop.save_every=0", "loop.eval_every=0", 'buffer.filter="none"'],
        timeout_s=400)
    assert code == 0, log[-3000:]
    sft = records(out, "sft")
    checks = [(r["step"], r["sft/heldout_pass@1"]) for r in sft if "sft/heldout_pass@1" in r]
    end = sft[-1]
    assert checks and all(step % 5 == 0 and 20 <= step < 30 for step, _ in checks)   # from check_from
    seconds = [r["sft/s"] for r in sft if "sft/heldout_pass@1" in r]
    assert seconds == sorted(seconds) and seconds[0] > 0, seconds   # when each check ended
    assert all(solved < target for _, solved in checks[:-1])     # no check before the stop reached it
    if checks[-1][1] >= target:
        assert end["step"] == checks[-1][0] == end["sft/steps"] and "sft.until_heldout" in end["sft/stop"]
    else:
        assert [s for s, _ in checks] == [20, 25] and end["sft/steps"] == 30
        assert end["sft/stop"] == "sft.steps = 30"
    assert f'"sft_steps": {int(end["sft/steps"])}' in log
