"""The extra models of PPO and on-policy distillation around the Megatron policy's step.

Design decisions:
- Built at init only when init's loss uses them (`critic.uses_critic`, `teacher.uses_teacher`),
  like FSDP: the critic is megatron_critic.py's; the teacher is a frozen GPTModel with the
  policy's layout, built from `train.teacher_model_path` (same vocabulary, checked by name).
- The passes run after the policy's old / ref passes and before advantages: the critic's
  pre-update values (copying the policy's weights into it at the first RL call when it has no
  checkpoint of its own), and the teacher's log-probs, the samples' own when every sample carries
  `teacher_logprobs` (no teacher pass), else the frozen teacher's forward-only pass.
- Their metrics are reduced over every rank with one contributor per DP rank (the last pipeline
  stage, TP rank 0): TP / PP peers hold the same samples and must not count twice.
"""

from __future__ import annotations

from typing import Any

from miles.algo import LossConfig
from miles.backends.batch import CheckedBatch
from miles.backends.config import TrainConfig
from miles.backends.critic import explained_variance, uses_critic
from miles.backends.packing import PackedMicroBatch
from miles.backends.teacher import (builds_teacher, carried_teacher_logprobs, check_teacher_config,
                                    check_teacher_vocab, teacher_reverse_kl, uses_teacher)


def build_aux_models(backend, config: TrainConfig, loss: LossConfig):
    """-> (critic or None, teacher chunks or None)."""
    from miles.backends.megatron_critic import MegatronCritic
    from miles.backends.megatron_model import load_hf_config

    check_teacher_config(config, loss)
    critic = MegatronCritic(backend, config) if uses_critic(loss) else None
    teacher = None
    if builds_teacher(config, loss):
        check_teacher_vocab(int(load_hf_config(config.teacher_model_path).vocab_size), backend.vocab_size,
                            config.teacher_model_path)
        teacher = backend._build(config.teacher_model_path, trainable=False)
    return critic, teacher


def aux_passes(backend, batch: CheckedBatch, flat: list[PackedMicroBatch], lengths: list[int],
               old, loss_cfg: LossConfig) -> dict[str, Any]:
    """The critic's pre-update values (PPO) and the teacher's and student's log-probs (OPD), each a
    list over `flat` on the last stage (absent elsewhere)."""
    from megatron.core import parallel_state as ps

    aux: dict[str, Any] = {}
    last = ps.is_pipeline_last_stage()
    if uses_critic(loss_cfg):
        backend.critic.start_from(backend.chunks)
        values = backend.critic.values([(k, mb, lengths[k]) for k, mb in enumerate(flat)])
        if last:
            aux["values"] = values
    if uses_teacher(loss_cfg):
        teacher = carried_teacher_logprobs(batch, flat, backend.device,   # the rollout's teacher engine
                                           required=backend.teacher_chunks is None)
        if teacher is None:
            teacher = backend._no_grad_logprobs(backend.teacher_chunks, flat, lengths)
        if last:
            aux["teacher"] = teacher
            aux["student"] = old if old is not None else [mb.rollout_logprobs for mb in flat]
    return aux


def aux_metrics(backend, aux: dict[str, Any], returns, flat: list[PackedMicroBatch],
                loss_cfg: LossConfig) -> dict[str, float]:
    """explained_variance / critic_step (PPO) and teacher_reverse_kl (OPD); collective."""
    from megatron.core import parallel_state as ps

    counts = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    masks = [mb.loss_mask for mb in flat] if counts else []
    out: dict[str, float] = {}
    if backend.critic is not None and uses_critic(loss_cfg):
        out["explained_variance"] = explained_variance(aux["values"] if counts else [],
                                                       returns if counts else [], masks, backend.device)
        out["critic_step"] = float(backend.critic.step)
    if uses_teacher(loss_cfg):
        out["teacher_reverse_kl"] = teacher_reverse_kl(aux["student"] if counts else [],
                                                       aux["teacher"] if counts else [], masks, backend.device)
    return out
