"""The sharded data plane: each trainer DP rank receives only its share of the batch plus a small
`BatchIndex` (`miles.loop.shard_batch`), so bytes per rank shrink with DP size, and training from
the shards equals training from the whole batch on every rank, bit for bit (FSDP and Megatron, real
gloo process groups, the tiny model); a bad sample on one rank's shard refuses on every rank.

The process tests run sharded_worker.py as two ranks; it asserts nothing itself but writes what
each path gave, checked here so a failure names what broke.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
from backend_helpers import REPO, make_samples, run_ranks

from miles.algo import LossConfig
from miles.algo.routing import pack_routing
from miles.backends import TrainConfig
from miles.backends.batch import batch_arrays, find_shard_error
from miles.backends.batch_plan import sample_owners
from miles.loop import shard_batch
from miles.wire.codec import Codec
from miles.wire.messages import BatchIndex, Sample, TrainStep
from tests.ports import cluster_port

WORKER = Path(__file__).with_name("sharded_worker.py")
LAYERS, TOP_K, EXPERTS = 8, 8, 64


def rollout_batch(samples: int = 64, per_group: int = 4, seed: int = 0) -> list[Sample]:
    """A realistic MoE step: 1.2k-2k tokens per sample, log-probs, loss masks, R3 uint8 routing."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(samples):
        p, r = int(rng.integers(200, 500)), int(rng.integers(1000, 1500))
        n = p + r
        routed = np.argsort(rng.random((n - 1, LAYERS, EXPERTS)), axis=-1)[..., :TOP_K].astype(np.int32)
        out.append(Sample(tokens=rng.integers(0, 32000, n).astype(np.int32), response_length=r,
                          loss_mask=np.ones(r, np.uint8), rollout_logprobs=-rng.random(r).astype(np.float32),
                          routed_experts=pack_routing(routed), reward=float(rng.random()),
                          group_id=f"g{i // per_group}", status="completed"))
    return out


def wire_bytes(step: TrainStep) -> int:
    return sum(len(memoryview(f)) for f in Codec().encode("call", step))


def test_bytes_per_rank_shrink_with_dp_size():
    samples = rollout_batch()
    cfg = TrainConfig(max_tokens_per_microbatch=4096)
    whole = wire_bytes(TrainStep(samples=samples))
    figures = {}
    for dp in (1, 2, 4):
        steps = shard_batch(samples, cfg, dp)
        index_bytes = wire_bytes(TrainStep(samples=[], index=steps[0].index))
        per_rank = [wire_bytes(s) for s in steps]
        figures[dp] = per_rank
        assert max(per_rank) <= whole / dp * 1.1 + index_bytes, (dp, per_rank, whole)
        # the old plane sent every rank the whole batch: world x batch; now ~ the batch once
        assert sum(per_rank) <= whole + dp * index_bytes, (dp, sum(per_rank), whole)
        assert index_bytes < 2000 + 20 * len(samples)                      # a few bytes per sample
        assert sorted(i for s in steps for i in s.index.positions.tolist()) == list(range(len(samples)))
    print(f"whole batch {whole} B; bytes per rank by DP size: {figures}")
    assert max(figures[4]) < 0.3 * whole


def test_the_index_travels_as_raw_int32_frames():
    samples = make_samples(groups=3, per_group=2)
    step = shard_batch(samples, TrainConfig(max_tokens_per_microbatch=64), 2)[1]
    codec = Codec()
    frames = codec.encode("call", step)
    _, back = codec.decode([bytes(memoryview(f)) for f in frames])
    for name in ("lengths", "group_index", "rollout_index", "trained_tokens", "positions"):
        got, want = getattr(back.index, name), getattr(step.index, name)
        assert got.dtype == np.int32 and np.array_equal(got, want), name
    assert back.index.all_rollout_logprobs is True
    assert [s.tokens.tolist() for s in back.samples] == [samples[i].tokens.tolist()
                                                         for i in step.index.positions.tolist()]


def test_a_batch_the_plan_refuses_goes_whole_to_every_rank():
    cfg = TrainConfig(steps_per_train=4)
    few = make_samples(groups=2, per_group=2)                  # fewer groups than optimizer steps
    assert all(s.index is None and s.samples == few for s in shard_batch(few, cfg, 2))
    assert all(s.index is None and s.samples == [] for s in shard_batch([], TrainConfig(), 3))


def shard_error(samples, index, dp_rank, world=2, steps=1, max_tokens=64):
    owners_of = lambda g, n: sample_owners(g, n, world_size=world, steps=steps, max_tokens=max_tokens)
    return find_shard_error(samples, index, owners_of=owners_of, dp_rank=dp_rank, vocab_size=500,
                            loss=LossConfig())


def test_a_shard_is_checked_against_its_index():
    samples = make_samples(groups=4, per_group=2, siblings=2)
    steps = shard_batch(samples, TrainConfig(max_tokens_per_microbatch=64), 2)
    mine, index = steps[1].samples, steps[1].index
    assert shard_error(mine, index, 1) is None
    # the shard of the other DP rank is not this rank's
    assert "the batch plan gives it" in shard_error(steps[0].samples, steps[0].index, 1)
    p = int(index.positions[0])
    wrong = msgspec.structs.replace(index, trained_tokens=index.trained_tokens + 1)
    assert f"sample {p}" in shard_error(mine, wrong, 1) and "trained_tokens" in shard_error(mine, wrong, 1)
    # both siblings of group 0 claim the name of another group of the shard: numbers disagree
    renamed = [msgspec.structs.replace(s, group_id=mine[2].group_id) for s in mine[:2]] + mine[2:]
    assert "group_index" in shard_error(renamed, index, 1)
    short = msgspec.structs.replace(index, rollout_index=index.rollout_index[:-1])
    assert "rollout_index has" in shard_error(mine, short, 1)
    empty = BatchIndex(positions=np.zeros(0, np.int32), **{k: v[:0] for k, v in batch_arrays(samples).items()})
    assert "lengths is empty" in shard_error([], empty, 0)
    bad = [msgspec.structs.replace(mine[0], reward=float("nan"))] + mine[1:]
    assert f"sample {p}" in shard_error(bad, index, 1) and "reward" in shard_error(bad, index, 1)


def check_parity(ranks: list[dict]) -> None:
    for name in ("groups4", "one_group"):
        for r in ranks:
            got = r["parity"][name]
            assert got["same_names"] and got["weights_moved"]
            assert got["metrics_sharded"] == got["metrics_whole"], (name, r["rank"])
            assert got["weights_max_abs_diff"] == 0.0, (name, r["rank"], got["weights_max_abs_diff"])
            assert got["metrics_sharded"][0]["samples"] == (16.0 if name == "groups4" else 3.0)


def check_refusals(ranks: list[dict]) -> None:
    zero, one = ranks[0]["refusals"], ranks[1]["refusals"]
    p = one["first_position"]
    assert f"sample {p}" in one["nan_reward"] and "reward" in one["nan_reward"], one["nan_reward"]
    assert f"sample {p}" in one["length"] and f"index lengths[{p}]" in one["length"], one["length"]
    for name in ("nan_reward", "length"):
        assert zero[name] is not None and ("trainer rank 1" in zero[name] or zero[name] == one[name]), zero[name]
    assert zero["weights_unchanged"] and one["weights_unchanged"]


@pytest.mark.slow
def test_fsdp_trains_the_same_from_shards_as_from_the_whole_batch(tmp_path):
    ranks = run_ranks("fsdp:qwen3", tmp_path, world_size=2, timeout_s=280, worker=WORKER)
    check_parity(ranks)
    assert ranks[1]["parity"]["one_group"]["shard_size"] == 0     # an empty shard trains too
    assert ranks[0]["parity"]["groups4"]["shard_size"] == ranks[1]["parity"]["groups4"]["shard_size"] == 8
    check_refusals(ranks)
    assert "refused by trainer rank 1" in ranks[0]["refusals"]["nan_reward"]


@pytest.mark.slow
@pytest.mark.parametrize("sizes", ["1,1,1", "2,1,1"], ids=["dp2", "tp2"])
def test_megatron_trains_the_same_from_shards_as_from_the_whole_batch(sizes, tmp_path):
    ranks = run_ranks(f"megatron:qwen3:{sizes}", tmp_path, world_size=2, timeout_s=380, worker=WORKER)
    check_parity(ranks)
    check_refusals(ranks)
    if sizes == "2,1,1":   # one DP index: both ranks hold the whole batch, and must hold the same
        assert ranks[0]["parity"]["groups4"]["positions"] == ranks[1]["parity"]["groups4"]["positions"]
        for r in ranks:
            assert "received different shards" in r["refusals"]["peer_shard"], r["refusals"]["peer_shard"]
    else:
        assert not set(ranks[0]["parity"]["groups4"]["positions"]) & set(ranks[1]["parity"]["groups4"]["positions"])


def run_quickstart(tmp_path: Path, name: str, trainer_ranks: int, timeout_s: float = 300) -> list[dict]:
    out = tmp_path / name
    sets = ["loop.num_steps=3", "sft.steps=5", "loop.eval_every=0", "loop.save_every=0", 'eval.mode="off"',
            "loop.groups_per_step=4", 'buffer.filter="none"', 'loop.mode="sync"',
            f"run.output_dir={json.dumps(str(out))}", f"run.name={json.dumps(name)}",
            "logging.progress=false", f"cluster.head_port={cluster_port()}",
            'actors.trainer.class="miles.actors.trainer:Trainer"', "actors.trainer.distributed=true",
            f"actors.trainer.procs_per_node={trainer_ranks}"]
    args = [sys.executable, "-m", "miles.cli", "run", str(REPO / "recipes" / "quickstart.toml")]
    for s in sets:
        args += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MILES_", "NODE_RANK", "NNODES"))}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"miles run {name} ({trainer_ranks} trainer ranks) still running after "
                             f"{timeout_s} s:\n{proc.communicate()[0].decode(errors='replace')[-3000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, log.decode(errors="replace")[-3000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"kind": "train"' in line]


@pytest.mark.slow
@pytest.mark.timeout(900)  # two real runs, each up to its own 300 s deadline on a loaded machine
def test_the_loop_sends_shards_to_two_trainer_ranks(tmp_path):
    """The real driver, actors and wire: two FSDP ranks trained from their shards report the
    global batch, the same batches as one rank trained whole (sync mode is deterministic)."""
    one, two = run_quickstart(tmp_path, "dp1", 1), run_quickstart(tmp_path, "dp2", 2)
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):
        assert b["train/samples"] == 4 * 8                          # groups_per_step x samples per prompt
        for key in ("train/samples", "train/tokens", "rollout/reward"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4, abs=1e-6)


def test_whole_batch_puts_the_shards_back_together():
    from miles.loop import whole_batch

    samples = make_samples(groups=5, per_group=3)
    steps = shard_batch(samples, TrainConfig(max_tokens_per_microbatch=64), 3)
    assert whole_batch(steps) == samples
    assert whole_batch([TrainStep(samples=samples)]) == samples
    with pytest.raises(ValueError, match="every DP rank's shard is needed"):
        whole_batch(steps[:2])
