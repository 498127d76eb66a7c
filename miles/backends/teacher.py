"""On-policy distillation: a frozen teacher scores every response token the student sampled.

Design decisions:
- The teacher lives on the trainer ranks (`train.teacher_model_path`): an HF causal LM built like
  the reference model (frozen, sharded, no optimizer state) and run in the same no-grad pass
  layout, so its log-probs line up token for token with the student's. It must share the student's
  tokenizer; a different vocabulary size is refused at init.
- Reverse KL is estimated on the student's own samples: per token, log pi_student - log pi_teacher
  (k1). The student side is pi_old: the rollout's log-probs with `train.old_logprobs = "rollout"`,
  else the no-grad pass of the current weights (the backend runs it whenever a teacher is used).
- Two modes (`miles.algo`): reward shaping, A_t -= opd_kl_coef * (log pi_s - log pi_t) on top of the
  estimator's advantages; and pure distillation, `algo.opd_only = true`, where the reward is
  ignored and A_t = -opd_kl_coef * (log pi_s - log pi_t) (each token's own reverse KL, no
  discounting: the per-token form of on-policy distillation).
- The teacher's log-probs may come with the samples instead (`Sample.teacher_logprobs`, filled by
  a teacher engine on the rollout side): when EVERY sample of the batch carries them, both
  backends use them as they are and skip the trainer-side teacher pass (`carried_teacher_logprobs`);
  a batch where only some samples carry them is scored by the trainer's teacher as a whole, so one
  batch never mixes two teachers. With the teacher only on the rollout side (`[teacher]`, which
  sets `train.teacher_from_samples`) no trainer-side teacher is built, and a batch whose samples
  do not all carry them is refused by name.
- `teacher_reverse_kl` is the token mean of that estimate over every rank's trained tokens, measured
  before the update: the quantity distillation drives down.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from miles.algo import LossConfig
from miles.backends.config import TrainConfig


def uses_teacher(loss: LossConfig) -> bool:
    return loss.loss_type == "policy" and loss.opd_kl_coef > 0


def builds_teacher(cfg: TrainConfig, loss: LossConfig) -> bool:
    """Whether init builds the trainer-side teacher (not when the rollout side scores the samples)."""
    return uses_teacher(loss) and not cfg.teacher_from_samples


def check_teacher_config(cfg: TrainConfig, loss: LossConfig) -> None:
    if builds_teacher(cfg, loss) and not cfg.teacher_model_path:
        raise ValueError(f"algo.opd_kl_coef = {loss.opd_kl_coef} distils from a teacher, but "
                         "train.teacher_model_path is empty; name the teacher's HF directory "
                         "(or serve the teacher on the rollout side: [teacher])")


def check_teacher_vocab(teacher_vocab: int, student_vocab: int, path: str) -> None:
    if teacher_vocab != student_vocab:
        raise ValueError(f"train.teacher_model_path = {path!r}: vocab_size {teacher_vocab} differs from "
                         f"the student's {student_vocab}; distillation needs the same tokenizer")


def teacher_reverse_kl(student: list[torch.Tensor], teacher: list[torch.Tensor], masks: list[torch.Tensor],
                       device: torch.device) -> float:
    """Token mean of log pi_s - log pi_t over every rank's trained tokens (one all-reduce)."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for s, t, m in zip(student, teacher, masks):
        keep = m != 0
        sums += torch.stack([(s[keep] - t[keep]).double().sum(), keep.sum().double()])
    dist.all_reduce(sums)
    total, count = sums.tolist()
    return total / count if count else 0.0


def carried_teacher_logprobs(batch, mbs, device: torch.device,
                             required: bool = False) -> list[torch.Tensor] | None:
    """The samples' own teacher log-probs laid out like each micro-batch's response tokens (float32;
    zeros for a dummy micro-batch), or None unless every sample of `batch` carries them (`required`:
    there is no trainer-side teacher to fall back on, so that is an error). The model-parallel
    peers of a rank hold the same samples and decide alike; the teacher pass has no data-parallel
    collective, so DP ranks may decide differently."""
    samples = batch.samples
    missing = [s for s in samples if s.teacher_logprobs is None]
    if required and missing:
        raise ValueError(f"{len(missing)} of {len(samples)} samples carry no teacher_logprobs (the "
                         f"first: {missing[0].rollout_id!r}), and there is no trainer-side teacher "
                         "(train.teacher_from_samples = true: the rollout's teacher engines score "
                         "every sample)")
    if not samples or missing:
        return None
    out = []
    for mb in mbs:
        if mb.is_dummy:
            out.append(torch.zeros(mb.loss_mask.shape[0], dtype=torch.float32, device=device))
            continue
        parts = [np.asarray(samples[i].teacher_logprobs, dtype=np.float32) for i in mb.sample_indices]
        out.append(torch.as_tensor(np.concatenate(parts), dtype=torch.float32, device=device))
    return out
