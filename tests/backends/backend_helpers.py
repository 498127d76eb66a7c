"""Shared by the backend tests and their rank worker: tiny batches, free ports, launching ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from miles.wire.messages import Sample

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("fsdp_worker.py")


def make_samples(*, groups: int = 3, per_group: int = 4, siblings: int = 1, vocab: int = 500,
                 seed: int = 0, prompt=(6, 14), response=(4, 24)) -> list[Sample]:
    """GRPO-style groups; with siblings > 1, consecutive samples share a rollout_id and reward."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        for j in range(per_group):
            rollout = j // siblings
            reward = float(np.random.default_rng(seed * 1000 + g * 100 + rollout).random())
            p, r = int(rng.integers(*prompt)), int(rng.integers(*response))
            mask = np.ones(r, np.uint8)
            if r > 6:
                mask[2:4] = 0  # a tool-output span inside the response
            out.append(Sample(
                tokens=rng.integers(0, vocab, p + r).astype(np.int32), response_length=r,
                loss_mask=mask, rollout_logprobs=(-rng.random(r) * 5).astype(np.float32),
                reward=reward, group_id=f"g{g}",
                rollout_id=f"g{g}-r{rollout}" if siblings > 1 else "", index=j, status="completed"))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, out_dir: Path, *, world_size: int = 2, timeout_s: float = 120,
              cuda: bool = False, worker: Path = WORKER) -> list[dict]:
    """Run `worker` (fsdp_worker.py) as `world_size` ranks (torchrun-style env); return each rank's JSON.

    cuda=False hides GPUs (gloo on CPU); cuda=True gives rank r GPU r (NCCL)."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   MILES_TEST_DEVICE="cuda" if cuda else "cpu")
        if not cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""
        out = out_dir / f"rank{rank}.json"
        procs.append((subprocess.Popen([sys.executable, str(worker), scenario, str(out)], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out))
    results, logs = [], []
    try:
        for proc, _ in procs:
            stdout, _ = proc.communicate(timeout=timeout_s)
            logs.append(stdout)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, ((proc, out), text) in enumerate(zip(procs, logs)):
        if proc.returncode != 0:
            raise AssertionError(f"rank {rank} of {scenario!r} exited {proc.returncode}:\n{text[-6000:]}")
        results.append(json.loads(out.read_text()))
    return results


def logprobs_and_grad(fn, logits, targets, coef_lp, coef_ent, temperature, entropy_weight):
    """(logprobs, entropy, d loss / d logits) of a token-logprob function `fn`, with
    loss = sum c lp + w sum c' H (the fused-kernel tests compare paths with it)."""
    x = logits.clone().requires_grad_()
    lp, ent = fn(x * 1, targets, temperature=temperature)  # "* 1": token_logprobs reuses its input
    loss = (lp * coef_lp).sum()
    if entropy_weight:
        loss = loss + entropy_weight * (ent * coef_ent).sum()
    loss.backward()
    return lp.detach(), ent.detach(), x.grad
