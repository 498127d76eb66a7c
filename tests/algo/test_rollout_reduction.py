"""Gradient scale of trajectory trees: one rollout as 1 sample, or the same tokens as 5 samples.

Through the real FSDP backend's train step (one gloo rank in this process, a tiny random Qwen3 on
CPU): under `loss_reduction = "rollout"` the step gradient is the same parameter by parameter
(`reduce.loss_denominators` has the proof), and under "sample" it is not, which shows the
comparison can fail.

The split is what a harness that compacts or forks produces: sample k holds the whole history up
to its chunk as its prompt, and its response is chunk k of the rollout's response, so every
trained token keeps its context (the same log-prob) and the five loss masks partition the
rollout's trained tokens. A masked tool-output span stays untrained in both forms. Two other
rollouts of the same group (single samples, different rewards) give GRPO a nonzero baseline.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.algo import LossConfig
from miles.backends import RankInfo, TrainConfig, TrainPhase
from miles.backends.fsdp import FSDPBackend
from miles.tiny import build_tiny_model
from miles.wire.messages import Sample

PROMPT, RESPONSE = 9, 60
CHUNK_ENDS = (11, 23, 36, 47, 60)  # five samples of uneven length
TOOL_SPAN = (14, 20)               # environment tokens inside the response: never trained
# The two forms differ only in packing (sequence lengths, hence float summation order): on CPU in
# float32 the measured per-parameter relative error is at most 4e-7 ("token", also split-invariant,
# gives 6e-7; "sample" gives 0.8 to 1.1); the bound leaves room for other BLAS builds.
SAME_TOL = 1e-5
# Under "sample" the split rollout counts 5 times: the gradient moves by a large fraction.
DIFFERENT_AT_LEAST = 0.05


class GradCapture(FSDPBackend):
    """The real backend; records each optimizer step's full gradient before the update."""

    def _optimizer_step(self, phase):
        self.grads = getattr(self, "grads", [])
        self.grads.append({n: p.grad.full_tensor().detach().clone()
                           for n, p in self.policy.named_parameters() if p.grad is not None})
        return super()._optimizer_step(phase)


def _rollout_samples(vocab: int, *, split: bool) -> list[Sample]:
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, vocab, PROMPT + RESPONSE).astype(np.int32)
    mask = np.ones(RESPONSE, np.uint8)
    mask[TOOL_SPAN[0]:TOOL_SPAN[1]] = 0
    logprobs = (-rng.random(RESPONSE) * 3).astype(np.float32)

    def sample(start: int, end: int, index: int, rollout_id: str, reward: float, toks=tokens) -> Sample:
        return Sample(tokens=toks[:PROMPT + end].copy(), response_length=end - start,
                      loss_mask=mask[start:end].copy(), rollout_logprobs=logprobs[start:end].copy(),
                      reward=reward, group_id="g0", rollout_id=rollout_id, index=index, status="completed")

    if split:
        starts = (0, *CHUNK_ENDS[:-1])
        tree = [sample(a, b, i, "g0/0", 1.0) for i, (a, b) in enumerate(zip(starts, CHUNK_ENDS))]
    else:
        tree = [sample(0, RESPONSE, 0, "g0/0", 1.0)]
    others = []
    for j, (reward, length) in enumerate([(0.0, 17), (0.25, 29)], start=1):
        other = rng.integers(0, vocab, PROMPT + length).astype(np.int32)
        others.append(Sample(tokens=other, response_length=length, loss_mask=np.ones(length, np.uint8),
                             rollout_logprobs=np.full(length, -1.0, np.float32), reward=reward,
                             group_id="g0", rollout_id=f"g0/{j}", index=len(tree) + j - 1,
                             status="completed"))
    return tree + others


@pytest.fixture(scope="module")
def backend():
    torch.set_num_threads(1)
    path = str(build_tiny_model(arch="qwen3"))
    # lr = 0: the weights never move, so every train() call sees the same model.
    cfg = TrainConfig(model_path=path, param_dtype="float32", lr=0.0, min_lr=0.0, weight_decay=0.0,
                      grad_clip=0.0, max_tokens_per_microbatch=4096)
    b = GradCapture()
    b.init(cfg, RankInfo(), LossConfig(advantage_estimator="grpo", loss_reduction="rollout"))
    yield b
    b.close()


def _step_grads(backend: GradCapture, samples: list[Sample], reduction: str) -> dict[str, torch.Tensor]:
    loss = LossConfig(advantage_estimator="grpo", loss_reduction=reduction)
    backend.train(samples, TrainPhase(f"grads-{reduction}", loss, backend.cfg))
    return backend.grads[-1]


def _rel_errors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    assert set(a) == set(b) and a, sorted(set(a) ^ set(b))
    return {n: float((a[n].double() - b[n].double()).norm() / b[n].double().norm().clamp_min(1e-30))
            for n in a}


def test_split_samples_partition_the_rollouts_trained_tokens(backend):
    whole, split = (_rollout_samples(backend.vocab_size, split=s) for s in (False, True))
    assert len(whole) == 3 and len(split) == 7
    trained = lambda samples: sum(int(s.loss_mask.sum()) for s in samples if s.rollout_id == "g0/0")
    assert trained(split) == trained(whole) == RESPONSE - (TOOL_SPAN[1] - TOOL_SPAN[0])
    # the last chunk's context is the whole rollout: the same tokens as the single sample
    assert np.array_equal(split[4].tokens, whole[0].tokens)


def test_rollout_reduction_gives_the_same_gradient_for_1_or_5_samples(backend):
    whole = _step_grads(backend, _rollout_samples(backend.vocab_size, split=False), "rollout")
    split = _step_grads(backend, _rollout_samples(backend.vocab_size, split=True), "rollout")
    assert any(float(g.norm()) > 0 for g in whole.values()), "a zero gradient would prove nothing"
    errors = _rel_errors(split, whole)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= SAME_TOL, f"{worst}: relative error {errors[worst]:.3g} > {SAME_TOL}"


def test_sample_reduction_changes_the_gradient_when_a_rollout_is_split(backend):
    whole_rollout = _step_grads(backend, _rollout_samples(backend.vocab_size, split=False), "rollout")
    whole = _step_grads(backend, _rollout_samples(backend.vocab_size, split=False), "sample")
    split = _step_grads(backend, _rollout_samples(backend.vocab_size, split=True), "sample")
    # one sample per rollout: "sample" and "rollout" are the same reduction, bit for bit
    assert all(torch.equal(whole[n], whole_rollout[n]) for n in whole)
    errors = _rel_errors(split, whole)
    assert max(errors.values()) >= DIFFERENT_AT_LEAST, (
        f"'sample' reduction: splitting a rollout moved the gradient by only {max(errors.values()):.3g}")
