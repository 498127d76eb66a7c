"""One trainer rank of the multi-rank Megatron backend tests (launched by backend_helpers.run_ranks).

    python megatron_worker.py layout:<arch>:<tp>,<pp>,<ep>[,sp][,cp2] <out.json>   (sequence / context parallel)
    python megatron_worker.py engine:<arch>:<tp>,<pp>,<ep> <out.json>     (ENGINE_URL in env)

Runs every check of one parallel layout in one process group (start-up dominates on CPU), asserting
as it goes, and writes the figures the pytest side checks again:
1. one step's loss, grad norm and every gradient (exported under HF names through the weight
   bridge) against one unsharded, unpacked step of a plain HF model on the whole batch (fp32);
2. bad batches refused on every rank, weights untouched;
3. update_weights: HF names and tensors equal to the hf=True export, begin/finish on the sender;
4. save -> sleep/wake -> one step (loss A); load -> one step: loss A again, bit for bit.
`engine`: one SFT step, then the weights go to a running embedded engine over the nccl transport
(gloo) with check_weights (the engine's sha256 of every tensor equals what rank 0 sent); an engine
loaded from the trainer's hf=True export has the same weights checksum and greedy tokens.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

torch.set_num_threads(1)

from backend_helpers import make_samples  # noqa: E402
from fsdp_worker import RecordingTransport, rel_err  # noqa: E402

from miles.algo import LossConfig, compute_advantages, compute_policy_loss, loss_denominators  # noqa: E402
from miles.algo.layout import cu_seqlens_from_lengths  # noqa: E402
from miles.backends import RankInfo, TrainConfig  # noqa: E402
from miles.backends.batch import number_batch  # noqa: E402
from miles.backends.config import MegatronConfig  # noqa: E402
from miles.backends.megatron import MegatronBackend  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402


class GradCapture(MegatronBackend):
    """Records each step's full gradient under HF names (collective) before the optimizer runs.

    The bridge exports parameters; pointing every parameter at its main_grad for one export turns
    it into a gradient export with the same TP/PP/EP gathers and QKV / gate-up splits."""

    grads: list[dict[str, torch.Tensor]]

    def _optimizer_step(self, phase):
        params = [p for c in self.chunks for p in c.parameters()]
        saved = [p.data for p in params]
        for p in params:
            p.data = p.main_grad
        try:
            bucket_iter = self.iter_hf_weight_buckets()
            grads = {n: t.detach().cpu().clone() for bucket in bucket_iter for n, t in bucket}
        finally:
            for p, data in zip(params, saved):
                p.data = data
        self.grads = getattr(self, "grads", []) + [grads]
        return super()._optimizer_step(phase)


def reference_step(path, samples, loss_cfg):
    """(loss, grad norm, gradients) of the whole batch on a plain HF model, unpacked, unsharded."""
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
                             loss_mask=mask, cu_seqlens=cu, group_ids=torch.as_tensor(batch.group_index),
                             rollout_ids=torch.as_tensor(batch.rollout_index)).advantages
    counts = torch.as_tensor([int(m.sum()) for m in batch.loss_masks])
    den = loss_denominators(counts, reduction=loss_cfg.reduction, rollout_ids=torch.as_tensor(batch.rollout_index),
                            max_response_tokens=loss_cfg.max_response_tokens)
    loss, _ = compute_policy_loss(logp, loss_mask=mask, sample_denominators=den, cfg=loss_cfg,
                                  cu_seqlens=cu, advantages=adv)
    loss.backward()
    grads = {}
    for n, p in lm.named_parameters():
        grads.update(_hf_checkpoint_names(n, p.grad))
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in lm.parameters()))
    return float(loss), norm, grads


def _hf_checkpoint_names(name, tensor):
    from miles.backends.hf_weights import to_hf_names
    return dict(to_hf_names(name, tensor))


def weights_checksum(backend) -> float:
    return float(sum(p.detach().double().sum() for c in backend.chunks for p in c.parameters()))


def expect_refusal(backend, samples, *needles):
    before, step = weights_checksum(backend), backend.step
    try:
        backend.train(samples)
    except ValueError as exc:
        msg = str(exc)
        assert all(n in msg for n in needles), f"error {msg!r} should mention {needles}"
        assert backend.step == step and weights_checksum(backend) == before, "weights moved"
        return msg
    raise AssertionError(f"batch was not refused (expected {needles})")


def layout(arch: str, tp: int, pp: int, ep: int, out: Path, sp: bool = False, cp: int = 1) -> None:
    rank = RankInfo.from_env()
    path = str(build_tiny_model(arch=arch))
    tmp = out.parent
    result: dict = {"rank": rank.rank}
    mcfg = MegatronConfig(tp=tp, pp=pp, ep=ep, cp=cp, sequence_parallel=sp)
    grpo = LossConfig(advantage_estimator="grpo", loss_reduction="rollout")
    samples = make_samples(groups=3, per_group=4, siblings=2, seed=1)
    # The pad token in prompts and responses: HF's padding_idx gives its input embedding no gradient.
    pad = json.loads((Path(path) / "config.json").read_text())["pad_token_id"]
    for i in (0, 5, 9):
        samples[i].tokens[[1, -2]] = pad

    # 1. One step against the unsharded reference (several micro-batches per DP rank).
    cfg = TrainConfig(backend="megatron", model_path=path, param_dtype="float32", lr=1e-3,
                      max_tokens_per_microbatch=96, megatron=mcfg)
    backend = GradCapture()
    backend.init(cfg, rank, grpo)
    metrics = backend.train(samples)
    grads = backend.grads[0]
    result["metrics"] = {k: v for k, v in metrics.items() if k not in ("step_s", "tokens_per_s", "microbatches")}
    if rank.rank == 0:
        ref_loss, ref_norm, ref = reference_step(path, samples, grpo)
        assert set(ref) == set(grads), sorted(set(ref) ^ set(grads))
        errors = {n: rel_err(grads[n], ref[n]) for n in ref}
        result["grad_rel_err_max"] = max(errors.values())
        result["grad_rel_err_worst"] = max(errors, key=errors.get)
        result["loss_abs_err"] = abs(metrics["loss"] - ref_loss)
        result["grad_norm_rel_err"] = abs(metrics["grad_norm"] - ref_norm) / ref_norm
        result["ref_loss"] = ref_loss

    # 2. Bad batches are refused on every rank before any optimizer step.
    bad = copy.deepcopy(samples)
    bad[5].reward = float("nan")
    result["error_nan_reward"] = expect_refusal(backend, bad, "sample 5", "reward")
    bad = copy.deepcopy(samples)
    bad[2].loss_mask = bad[2].loss_mask[:-1]
    result["error_mask"] = expect_refusal(backend, bad, "sample 2", "loss_mask")
    result["error_ranks"] = expect_refusal(backend, samples[: 6 + rank.rank], "differs between trainer ranks")

    # 3. update_weights: the same HF tensors as the hf=True export, in buckets, sent by rank 0.
    hf_dir = tmp / "hf"
    backend.save_model(hf_dir, hf=True)
    transport = RecordingTransport(is_sender=rank.rank == 0)
    backend.cfg.update_bucket_bytes = 64 << 10
    backend.update_weights(transport, version=7)
    if rank.rank == 0:
        from safetensors.torch import load_file
        on_disk = {}
        for f in sorted(hf_dir.glob("*.safetensors")):
            on_disk.update(load_file(str(f)))
        assert set(transport.tensors) == set(on_disk), sorted(set(transport.tensors) ^ set(on_disk))
        assert all(torch.equal(transport.tensors[n], on_disk[n]) for n in on_disk)
        assert transport.calls[0] == "begin:7" and transport.calls[-1] == "finish:7"
        result["update_buckets"] = len(transport.bucket_bytes)
        result["update_tensors"] = len(transport.tensors)
    else:
        assert transport.calls == []

    # 4. Resume and sleep/wake: save, sleep, wake, one step -> A; load, one step -> A.
    sft = LossConfig(loss_type="sft", loss_reduction="token")
    cfg = TrainConfig(backend="megatron", model_path=path, param_dtype="float32", lr=3e-3, warmup_steps=2,
                      lr_decay_style="cosine", lr_decay_steps=20, min_lr=1e-4, weight_decay=0.01,
                      max_tokens_per_microbatch=96, megatron=mcfg)
    trainer = MegatronBackend()
    trainer.init(cfg, rank, sft)
    batch = make_samples(groups=2, per_group=3, seed=2)
    losses = [trainer.train(batch)["loss"] for _ in range(2)]
    assert losses[1] < losses[0], f"SFT loss did not decrease: {losses}"
    ckpt = tmp / "ckpt"
    trainer.save_model(ckpt, extra_state={"data_position": 3})
    trainer.sleep()
    freed = all(p.untyped_storage().nbytes() == 0 for c in trainer.chunks for p in c.parameters())
    assert freed, "sleep left parameters on the device"
    try:
        trainer.train(batch)
        raise AssertionError("train() while asleep should fail")
    except RuntimeError as exc:
        assert "asleep" in str(exc)
    trainer.wake_up()
    after = [trainer.train(batch)["loss"] for _ in range(2)]
    extra = trainer.load_model(ckpt)
    assert extra == {"data_position": 3} and trainer.step == 2, (extra, trainer.step)
    again = [trainer.train(batch)["loss"] for _ in range(2)]
    assert again == after, f"resume changed the losses: {after} vs {again}"
    result["sft_losses"] = losses + after
    result["options"] = options(path, mcfg, rank)
    dist.barrier()
    out.write_text(json.dumps(result))


def options(path: str, mcfg: MegatronConfig, rank: RankInfo) -> dict:
    """Objective options through the forward-only schedule: a reference model with a KL loss,
    entropy and TIS over two optimizer steps per batch (old log-probs recomputed); REINFORCE++
    with KL shaping on one group (a DP rank with only dummy micro-batches when DP > 1); full
    activation recompute (the same gradient norm); bf16 parameters with fp32 main params."""
    result: dict = {}
    samples = make_samples(groups=2, per_group=4, seed=7)
    base = dict(backend="megatron", model_path=path, param_dtype="float32", lr=1e-3,
                max_tokens_per_microbatch=64, megatron=mcfg)
    backend = MegatronBackend()
    backend.init(TrainConfig(**base, steps_per_train=2), rank,
                 LossConfig(kl_loss_coef=0.1, entropy_coef=0.01, use_tis=True))
    assert backend.ref_chunks is not None
    first, second = backend.train(samples), backend.train(samples)
    assert first["optimizer_steps"] == 2 and backend.step == 4
    assert "kl_loss" in first and "tis" in first and second["kl_loss"] > first["kl_loss"] >= 0
    result["kl"] = [first["kl"], second["kl"]]

    backend = MegatronBackend()
    backend.init(TrainConfig(**base), rank, LossConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.05))
    metrics = backend.train(make_samples(groups=1, per_group=3, seed=8))
    assert math.isfinite(metrics["loss"]) and metrics["samples"] == 3
    result["rfpp_loss"] = metrics["loss"]

    norms = []
    for recompute in ("none", "full"):
        backend = MegatronBackend()
        m = msgspec.structs.replace(mcfg, recompute=recompute)
        backend.init(TrainConfig(**{**base, "megatron": m}), rank, LossConfig())
        norms.append(backend.train(samples)["grad_norm"])
    assert abs(norms[0] - norms[1]) <= 1e-6 * norms[0], norms
    result["recompute_grad_norms"] = norms

    backend = MegatronBackend()
    backend.init(TrainConfig(**{**base, "param_dtype": "bfloat16"}), rank,
                 LossConfig(loss_type="sft", loss_reduction="token"))
    assert all(p.dtype == torch.bfloat16 for c in backend.chunks for p in c.parameters())
    losses = [backend.train(samples)["loss"] for _ in range(3)]
    assert losses[2] < losses[0], losses
    result["bf16_losses"] = losses
    return result


def engine(arch: str, tp: int, pp: int, ep: int, out: Path) -> None:
    import asyncio

    import msgspec

    from miles.weights import WeightPublisher, WeightsConfig, make_transport

    rank = RankInfo.from_env()
    path = str(build_tiny_model(arch=arch))
    cfg = TrainConfig(backend="megatron", model_path=path, param_dtype="float32", lr=1e-3,
                      max_tokens_per_microbatch=4096,
                      megatron=MegatronConfig(tp=tp, pp=pp, ep=ep, sequence_parallel=False))
    backend = MegatronBackend()
    backend.init(cfg, rank, LossConfig(loss_type="sft", loss_reduction="token"))
    backend.train(make_samples(groups=2, per_group=2, seed=4))
    wcfg = WeightsConfig(transport="nccl", check_weights=True, bucket_bytes=256 << 10, direct_min_bytes=0,
                         connect_timeout_s=60, bucket_timeout_s=60, control_timeout_s=60)
    transport = make_transport(wcfg, rank=rank)
    export = out.parent / "export"
    result: dict = {"rank": rank.rank}
    if rank.rank != 0:
        backend.update_weights(transport, 0)  # the gathers are collective; rank 0 sends
        backend.save_model(export, hf=True)
        out.write_text(json.dumps(result))
        return

    async def publish_and_compare() -> None:
        from miles.engines.client import EngineClient
        from miles.engines.embedded import launch_embedded_engine

        url = os.environ["ENGINE_URL"]
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weights"))
        from weights_worker import wait_healthy

        await wait_healthy([url], timeout_s=240)
        publisher = WeightPublisher(wcfg, [url], transport)
        await publisher.connect()
        report = await publisher.publish(1, lambda: backend.update_weights(transport, 1))
        result["report"] = msgspec.to_builtins(report)
        await asyncio.to_thread(backend.save_model, export, True)
        twin = await launch_embedded_engine(export, extra_args=["--torch-threads", "1", "--log-level",
                                                                "warning", "--random-seed", "0"])
        greedy = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        try:
            async with EngineClient(url) as published, EngineClient(twin.url) as loaded:
                result["checksums_equal_export"] = (await published.weights_checksum()) == (
                    await loaded.weights_checksum())
                result["greedy_published"] = (await published.generate([3, 14, 15, 92], greedy)).output_ids
                result["greedy_export"] = (await loaded.generate([3, 14, 15, 92], greedy)).output_ids
                result["version"] = (await published.model_info())["weight_version"]
        finally:
            await twin.stop_async()
        await publisher.close()

    asyncio.run(publish_and_compare())
    out.write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    scenario, out_path = sys.argv[1], Path(sys.argv[2])
    kind, arch, sizes = scenario.split(":")
    if kind not in ("layout", "engine"):
        raise SystemExit(f"unknown scenario {scenario!r}")
    tp, pp, ep, *flags = sizes.split(",")
    kw = {"sp": "sp" in flags, "cp": 2 if "cp2" in flags else 1} if kind == "layout" else {}
    {"layout": layout, "engine": engine}[kind](arch, int(tp), int(pp), int(ep), Path(out_path), **kw)
    dist.barrier()
    from miles.backends.megatron_model import destroy_parallel
    destroy_parallel()
