"""One trainer rank of the Megatron PPO / OPD tests (launched by backend_helpers.run_ranks).

    python megatron_algo_worker.py ppo:<tp>,<pp> <out.json>
    python megatron_algo_worker.py opd:<tp>,<pp> <out.json>

ppo: a few PPO steps on one batch (the critic learns the returns), a checkpoint of policy + critic
resumed into a fresh backend (the next step's value loss equal), then one FSDP PPO run on the same
2 ranks and batch: the first steps' critic figures compared on the pytest side.
opd: pure distillation from a peaked teacher GPTModel (reverse KL falls), then a fresh backend fed
the teacher's log-probs on the samples (`Sample.teacher_logprobs`, no teacher pass): the same
first-step reverse KL.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from backend_helpers import make_samples  # noqa: E402

from miles.algo import LossConfig  # noqa: E402
from miles.backends import RankInfo, TrainConfig  # noqa: E402
from miles.backends.config import MegatronConfig  # noqa: E402
from miles.backends.megatron import MegatronBackend  # noqa: E402
from miles.tiny import build_tiny_model  # noqa: E402

PPO = LossConfig(advantage_estimator="ppo", loss_reduction="token")


def ppo(tp: int, pp: int, out: Path) -> None:
    rank = RankInfo.from_env()
    path = str(build_tiny_model(arch="qwen3"))
    base = dict(model_path=path, param_dtype="float32", lr=1e-6, critic_lr=2e-3, max_tokens_per_microbatch=256)
    cfg = TrainConfig(backend="megatron", megatron=MegatronConfig(tp=tp, pp=pp, sequence_parallel=False), **base)
    samples = make_samples(groups=2, per_group=4, vocab=400)
    keys = ("value_loss", "value_clipfrac", "explained_variance", "critic_grad_norm", "critic_lr", "critic_step",
            "pg_loss", "loss")
    backend = MegatronBackend()
    backend.init(cfg, rank, PPO)
    history = []
    for _ in range(6):
        m = backend.train(samples)
        history.append({k: m[k] for k in keys})
    ckpt = out.parent / "ckpt"
    backend.save_model(ckpt)
    nxt = backend.train(samples)
    resumed = MegatronBackend()
    resumed.init(cfg, rank, PPO)
    resumed.load_model(ckpt)
    again = resumed.train(samples)
    result = {"history": history, "after_save": {k: nxt[k] for k in keys}, "after_load": {k: again[k] for k in keys}}
    backend.close = lambda: None   # the process group stays for FSDP below
    from miles.backends.fsdp import FSDPBackend
    fsdp = FSDPBackend()
    fsdp.init(TrainConfig(backend="fsdp", **base), rank, PPO)
    result["fsdp"] = [{k: m[k] for k in keys} for m in (fsdp.train(samples), fsdp.train(samples))]
    dist.barrier()
    out.write_text(json.dumps(result))


def peaked_teacher(folder: Path) -> Path:
    """The student's 4-layer sibling with its final norm scaled by 8 (as test_teacher.py builds it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = build_tiny_model(arch="qwen3", seed=7, num_hidden_layers=4)
    if dist.get_rank() == 0:
        lm = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        with torch.no_grad():
            lm.model.norm.weight.mul_(8.0)
        lm.save_pretrained(folder)
        AutoTokenizer.from_pretrained(str(src)).save_pretrained(folder)
    dist.barrier()
    return folder


def teacher_logprobs(path: Path, samples) -> None:
    """Each sample's teacher log-probs over its response, from a plain HF model (fp32, unpacked)."""
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for s in samples:
            n, r = len(s.tokens), s.response_length
            ids = torch.as_tensor(s.tokens, dtype=torch.int64)[None]
            logits = lm(input_ids=ids).logits[0, n - r - 1:n - 1].float()
            s.teacher_logprobs = torch.log_softmax(logits, -1).gather(1, ids[0, n - r:, None])[:, 0].numpy()


def opd(tp: int, pp: int, out: Path) -> None:
    rank = RankInfo.from_env()
    # init_parallel joins the process group; the teacher is written before that by rank 0 alone
    student = str(build_tiny_model(arch="qwen3"))
    teacher = out.parent / "teacher"
    loss = LossConfig(opd_kl_coef=1.0, opd_only=True, loss_reduction="token")
    cfg = TrainConfig(backend="megatron", model_path=student, teacher_model_path=str(teacher), param_dtype="float32",
                      lr=1e-3, max_tokens_per_microbatch=256,
                      megatron=MegatronConfig(tp=tp, pp=pp, sequence_parallel=False))
    samples = make_samples(groups=2, per_group=4, vocab=400)
    from miles.backends.megatron_model import init_parallel
    init_parallel(cfg, rank)
    peaked_teacher(teacher)
    backend = MegatronBackend()
    backend.init(cfg, rank, loss)
    kls = [backend.train(samples)["teacher_reverse_kl"] for _ in range(5)]
    carried = copy.deepcopy(samples)
    teacher_logprobs(teacher, carried)
    fresh = MegatronBackend()
    fresh.init(cfg, rank, loss)
    fresh.teacher_chunks = None   # proves no teacher pass runs: it would fail on None
    kl_carried = fresh.train(carried)["teacher_reverse_kl"]
    dist.barrier()
    out.write_text(json.dumps({"kls": kls, "kl_carried": kl_carried}))


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    kind, spec = scenario.split(":")
    tp, pp = (int(x) for x in spec.split(","))
    {"ppo": ppo, "opd": opd}[kind](tp, pp, out)


if __name__ == "__main__":
    main()
