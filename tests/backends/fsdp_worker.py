"""One trainer rank of the 2-process FSDP tests (launched by backend_helpers.run_ranks).

    python fsdp_worker.py suite:<arch> <out.json>            (or suite+options:<arch>)

Runs every multi-rank check on one tiny model in one process pair (process start-up dominates the
cost on CPU), asserting as it goes; writes the figures the pytest side checks again to <out.json>.
On CPU (gloo) every comparison is exact or at fp32 rounding; with MILES_TEST_DEVICE=cuda (NCCL,
tests/gpu) the ranks use GPUs, whose backward kernels may add in any order, so resumed losses are
compared to a relative 1e-5 instead of bit for bit.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

torch.set_num_threads(1)
ON_CUDA = os.environ.get("MILES_TEST_DEVICE", "cpu") == "cuda"

from backend_helpers import make_samples  # noqa: E402

from miles.algo import LossConfig, compute_advantages, compute_policy_loss, loss_denominators  # noqa: E402
from miles.algo.layout import cu_seqlens_from_lengths  # noqa: E402
from miles.backends import RankInfo, TrainConfig, make_backend  # noqa: E402
from miles.backends.batch import number_batch  # noqa: E402
from miles.backends.fsdp import FSDPBackend  # noqa: E402
from miles.backends.packing import pack_samples  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402
from miles.weights.base import BucketStream, TransportTraits  # noqa: E402


class GradCapture(FSDPBackend):
    """Records the full gradient of every step (collective) before the optimizer runs."""

    grads: list[dict[str, torch.Tensor]]

    def _optimizer_step(self, phase):
        self.grads = getattr(self, "grads", [])
        self.grads.append({n.removeprefix("lm."): p.grad.full_tensor().clone()
                           for n, p in self.policy.named_parameters()})
        return super()._optimizer_step(phase)


class RecordingTransport(BucketStream):
    def __init__(self, is_sender: bool):
        self.traits = TransportTraits(sender=is_sender)
        self.calls: list[str] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.bucket_bytes: list[int] = []

    def connect(self, engine_urls):
        self.calls.append("connect")

    def begin(self, version):
        self.calls.append(f"begin:{version}")

    def send_bucket(self, named_tensors):
        self.calls.append("bucket")
        self.bucket_bytes.append(sum(t.numel() * t.element_size() for _, t in named_tensors))
        for name, t in named_tensors:
            assert name not in self.tensors, f"{name} sent twice"
            self.tensors[name] = t.detach().cpu().clone()

    def finish(self, version):
        self.calls.append(f"finish:{version}")


def reference_grads(path, samples, loss_cfg):
    """The step gradient of the whole batch on a plain (unsharded, unpacked) HF model."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    batch = number_batch(samples, loss=loss_cfg)
    logps = []
    for s in samples:
        n, r = len(s.tokens), s.response_length
        ids = torch.as_tensor(s.tokens, dtype=torch.int64)[None]
        logits = lm(input_ids=ids).logits[0, n - r - 1:n - 1].float()
        logps.append(torch.log_softmax(logits, -1).gather(1, ids[0, n - r:, None]).squeeze(1))
    logp = torch.cat(logps)
    mask = torch.cat([torch.as_tensor(m, dtype=torch.float32) for m in batch.loss_masks])
    cu = cu_seqlens_from_lengths([s.response_length for s in samples])
    adv = compute_advantages(loss_cfg, rewards=torch.as_tensor(batch.rewards, dtype=torch.float32),
                             loss_mask=mask, cu_seqlens=cu,
                             group_ids=torch.as_tensor(batch.group_index),
                             rollout_ids=torch.as_tensor(batch.rollout_index)).advantages
    counts = torch.as_tensor([int(m.sum()) for m in batch.loss_masks])
    den = loss_denominators(counts, reduction=loss_cfg.reduction,
                            rollout_ids=torch.as_tensor(batch.rollout_index),
                            max_response_tokens=loss_cfg.max_response_tokens)
    loss, _ = compute_policy_loss(logp, loss_mask=mask, sample_denominators=den, cfg=loss_cfg,
                                  cu_seqlens=cu, advantages=adv)
    loss.backward()
    return {n: p.grad for n, p in lm.named_parameters()}


def rel_err(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def same_losses(a, b):
    if not ON_CUDA:
        return a == b
    return all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))


def local_checksum(backend):
    return float(sum(p.detach().to_local().double().sum() for p in backend.policy.parameters()))


def expect_refusal(backend, samples, *needles):
    before, step = local_checksum(backend), backend.step
    try:
        backend.train(samples)
    except ValueError as exc:
        msg = str(exc)
        assert all(n in msg for n in needles), f"error {msg!r} should mention {needles}"
        assert backend.step == step and local_checksum(backend) == before, "weights moved"
        return msg
    raise AssertionError(f"batch was not refused (expected {needles})")


def suite(arch: str, out: Path, with_options: bool = False) -> None:
    rank = RankInfo.from_env()
    path = str(build_tiny_model(arch=arch))
    tmp = out.parent  # the test's own temporary directory, shared by both ranks
    result: dict = {"rank": rank.rank}

    # 1. Per-rollout normalization: gradients are the same whatever the micro-batching and DP split,
    #    and equal to one unsharded, unpacked step over the whole batch.
    grpo = LossConfig(advantage_estimator="grpo", loss_reduction="rollout")
    samples = make_samples(groups=3, per_group=4, siblings=2, seed=1)
    cfg = TrainConfig(model_path=path, param_dtype="float32", lr=0.0, max_tokens_per_microbatch=4096)
    backend = GradCapture()
    backend.init(cfg, rank, grpo)
    backend.train(samples)
    backend.cfg.max_tokens_per_microbatch = 40  # every sample alone: siblings in different micro-batches
    backend.train(samples)
    one_mb, many_mb = backend.grads
    result["grad_rel_err_split"] = max(rel_err(many_mb[n], one_mb[n]) for n in one_mb)
    if rank.rank == 0:
        ref = reference_grads(path, samples, grpo)
        assert set(ref) == set(one_mb), sorted(set(ref) ^ set(one_mb))
        result["grad_rel_err_reference"] = max(rel_err(one_mb[n], ref[n]) for n in ref)

    # 2. Bad batches are refused on every rank before any optimizer step.
    bad = copy.deepcopy(samples)
    bad[5].reward = float("nan")
    result["error_nan_reward"] = expect_refusal(backend, bad, "sample 5", "reward")
    bad = copy.deepcopy(samples)
    bad[2].loss_mask = bad[2].loss_mask[:-1]
    result["error_mask"] = expect_refusal(backend, bad, "sample 2", "loss_mask")
    bad = copy.deepcopy(samples)
    bad[7].tokens, bad[7].response_length = bad[7].tokens[:5], 0
    bad[7].loss_mask = bad[7].rollout_logprobs = None
    result["error_empty"] = expect_refusal(backend, bad, "sample 7", "empty response")
    if rank.world_size > 1:
        result["error_ranks"] = expect_refusal(backend, samples[: 6 + rank.rank],
                                               "differs between trainer ranks")

    # 3. SFT training: the loss goes down; the full state dict gathers.
    sft = LossConfig(loss_type="sft", loss_reduction="token")
    cfg = TrainConfig(model_path=path, param_dtype="float32", lr=3e-3, warmup_steps=2,
                      lr_decay_style="cosine", lr_decay_steps=20, min_lr=1e-4,
                      max_tokens_per_microbatch=96, weight_decay=0.01)
    batch = make_samples(groups=2, per_group=3, seed=2)
    trainer = make_backend("fsdp")
    trainer.init(cfg, rank, sft)
    losses = [trainer.train(batch)["loss"] for _ in range(3)]
    assert losses[2] < losses[1] < losses[0], f"SFT loss did not decrease: {losses}"
    result["sft_losses"] = losses

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(trainer.policy, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))
    if rank.rank == 0:
        shapes = {n.removeprefix("lm."): tuple(t.shape) for n, t in full.items()}
        from transformers import AutoModelForCausalLM
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        want = {n: tuple(t.shape) for n, t in plain.state_dict().items()}
        assert shapes == want, f"full state dict differs: {set(shapes) ^ set(want)}"
        result["full_state_dict_tensors"] = len(shapes)

    # 4. Save, then (after a sleep/wake cycle) two more steps; a fresh backend resumes identically.
    #    A no-grad forward first: FSDP leaves the root unsharded after it, and sleep must cope.
    probe = make_samples(groups=1, per_group=3, seed=3)
    mb = pack_samples([s.tokens for s in probe], [s.response_length for s in probe],
                      [np.ones(s.response_length, np.uint8) for s in probe], [None] * 3, [0, 1, 2],
                      trainer.device)
    ckpt = tmp / "ckpt"
    trainer.save_model(ckpt, extra_state={"data_position": 3})
    with torch.no_grad():
        trainer.policy.run(mb.inputs)
    trainer.sleep()
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in trainer.policy.parameters())
    assert all(v.to_local().untyped_storage().nbytes() == 0 for st in trainer.optimizer.state.values()
               for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    try:
        trainer.train(batch)
        raise AssertionError("train() while asleep should fail")
    except RuntimeError as exc:
        assert "asleep" in str(exc)
    trainer.wake_up()
    after = [trainer.train(batch)["loss"] for _ in range(2)]
    resumed = make_backend("fsdp")
    resumed.init(cfg, rank, sft)
    extra = resumed.load_model(ckpt)
    assert extra == {"data_position": 3} and resumed.step == 3, (extra, resumed.step)
    again = [resumed.train(batch)["loss"] for _ in range(2)]
    assert same_losses(again, after), f"resume changed the losses: {after} vs {again}"
    result["resume_losses"] = after

    # 5. HF export: loads in transformers, log-probs and entropies equal the trainer's.
    hf_dir = tmp / "hf"
    trainer.save_model(hf_dir, hf=True)
    with torch.no_grad():
        train_lp, train_ent = trainer.policy.run(mb.inputs)
    if rank.rank == 0:
        from transformers import AutoModelForCausalLM
        exported = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                        attn_implementation="sdpa")
        lps, ents = [], []
        with torch.no_grad():
            for s in probe:
                n, r = len(s.tokens), s.response_length
                ids = torch.as_tensor(s.tokens, dtype=torch.int64)[None]
                logp = torch.log_softmax(exported(input_ids=ids).logits[0, n - r - 1:n - 1].float(), -1)
                lps.append(logp.gather(1, ids[0, n - r:, None]).squeeze(1))
                ents.append(-(logp.exp() * logp).sum(-1))
        result["export_logprob_max_diff"] = float((torch.cat(lps) - train_lp.cpu()).abs().max())
        result["export_entropy_max_diff"] = float((torch.cat(ents) - train_ent.cpu()).abs().max())

    # 6a. The fast dim-0 gather equals DTensor's own, for uneven shards too (5 rows on 2 ranks:
    # 3 + 2; 1 row: 1 + 0).
    from torch.distributed.tensor import Shard, distribute_tensor
    from miles.backends.hf_weights import _full_tensor
    mesh = next(trainer.policy.parameters()).device_mesh
    gen = torch.Generator().manual_seed(5)
    for shape in ((5, 3), (1, 4), (7,), (4, 2)):
        full = torch.randn(*shape, generator=gen).to(mesh.device_type)
        dt = distribute_tensor(full, mesh, [Shard(0)])
        assert torch.equal(_full_tensor(dt, None), full), shape
        assert torch.equal(_full_tensor(dt, torch.bfloat16), full.to(torch.bfloat16)), shape

    # 6. update_weights: HF names (per-expert for MoE), the same tensors as the export, in buckets.
    transport = RecordingTransport(is_sender=rank.rank == 0)
    trainer.cfg.update_bucket_bytes = 64 << 10
    trainer.update_weights(transport, version=7)
    if rank.rank == 0:
        from safetensors.torch import load_file
        on_disk = {}
        for f in sorted(hf_dir.glob("*.safetensors")):
            on_disk.update(load_file(str(f)))
        assert set(transport.tensors) == set(on_disk), sorted(set(transport.tensors) ^ set(on_disk))
        assert all(torch.equal(transport.tensors[n], on_disk[n]) for n in on_disk)
        assert transport.calls[0] == "begin:7" and transport.calls[-1] == "finish:7"
        biggest = max(t.numel() * t.element_size() for t in on_disk.values())
        assert max(transport.bucket_bytes) <= max(64 << 10, biggest)
        result["update_buckets"] = len(transport.bucket_bytes)
        result["update_names"] = sorted(transport.tensors)
    else:
        assert transport.calls == []
    if with_options:
        result["options"] = options(arch)
    dist.barrier()
    out.write_text(json.dumps(result))


def options(arch: str) -> dict:
    """Objective and execution options: ref model + KL loss, entropy, TIS, several optimizer steps per
    batch, REINFORCE++ with KL shaping on a batch smaller than the world, rollout log-probs as the
    old policy, gradient checkpointing, bf16 parameters without an fp32 master."""
    rank = RankInfo.from_env()
    path = str(build_tiny_model(arch=arch))
    result: dict = {}
    samples = make_samples(groups=2, per_group=4, seed=7)

    kl_cfg = LossConfig(kl_loss_coef=0.1, entropy_coef=0.01, use_tis=True)
    backend = make_backend("fsdp")
    backend.init(TrainConfig(model_path=path, param_dtype="float32", lr=1e-3, steps_per_train=2,
                             max_tokens_per_microbatch=64), rank, kl_cfg)
    assert backend.ref is not None
    first, second = backend.train(samples), backend.train(samples)
    assert first["optimizer_steps"] == 2 and backend.step == 4
    assert "kl_loss" in first and "tis" in first and second["kl_loss"] > first["kl_loss"] >= 0
    result["kl"] = [first["kl"], second["kl"]]

    rfpp = LossConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.05)
    backend = make_backend("fsdp")
    backend.init(TrainConfig(model_path=path, param_dtype="float32", lr=1e-3), rank, rfpp)
    one_group = make_samples(groups=1, per_group=3, seed=8)  # rank 1 runs only dummy micro-batches
    metrics = backend.train(one_group)
    assert np.isfinite(metrics["loss"]) and metrics["samples"] == 3
    result["rfpp_microbatches"] = metrics["microbatches"]

    backend = make_backend("fsdp")
    backend.init(TrainConfig(model_path=path, param_dtype="float32", old_logprobs="rollout"), rank,
                 LossConfig())
    metrics = backend.train(samples)
    assert metrics["pg_clipfrac"] > 0  # random rollout log-probs are far from the policy
    result["rollout_old_clipfrac"] = metrics["pg_clipfrac"]

    norms = []
    for checkpointing in (False, True):
        backend = make_backend("fsdp")
        backend.init(TrainConfig(model_path=path, param_dtype="float32", lr=1e-3,
                                 gradient_checkpointing=checkpointing), rank, LossConfig())
        m = backend.train(samples)
        norms.append((m["loss"], m["grad_norm"]))
    assert abs(norms[0][1] - norms[1][1]) <= 1e-6 * norms[0][1], norms
    result["checkpointing_grad_norms"] = norms

    backend = make_backend("fsdp")
    backend.init(TrainConfig(model_path=path, param_dtype="bfloat16", master_weights_fp32=False,
                             lr=1e-3), rank, LossConfig(loss_type="sft", loss_reduction="token"))
    assert all(p.dtype == torch.bfloat16 for p in backend.policy.parameters())
    losses = [backend.train(samples)["loss"] for _ in range(3)]
    assert losses[2] < losses[0], losses
    result["bf16_losses"] = losses
    return result


if __name__ == "__main__":
    scenario, out_path = sys.argv[1], Path(sys.argv[2])
    kind, _, arg = scenario.partition(":")
    if kind == "suite":
        suite(arg, out_path)
    elif kind == "suite+options":  # one process pair for both: start-up dominates on CPU
        suite(arg, out_path, with_options=True)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    # Leave together: a rank tearing gloo down while its peer is still mid-collective or already
    # gone aborted now and then under load ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
