"""Per-token log-probs and entropies of sampled tokens from LM-head logits, chunked over tokens.

Design decisions:
- The logits of a packed micro-batch ([tokens, vocab], 8k x 152k) are the largest activation of an
  RL step. They are materialized once, in the compute dtype, by the LM head matmul; everything in
  fp32 (temperature scaling, log-softmax, entropy) happens one chunk of tokens at a time, so at most
  `chunk_bytes` of fp32 logits exist at once.
- A custom autograd Function instead of autograd through log_softmax: autograd would keep an fp32
  copy of every chunk for backward. Here backward recomputes the chunk's softmax from the saved
  compute-dtype logits and the saved log-sum-exp, and writes d(loss)/d(logits) into the logits
  buffer itself (the logits are not needed after that), so backward allocates no [tokens, vocab]
  tensor either.
- Entropy is always returned (it is a metric); its gradient is formed only when the caller's loss
  uses it (a None or zero incoming gradient skips the term).
  d lp_t / d z_k = 1[k = target] - p_k;  d H / d z_k = -p_k (log p_k + H).
- Only rows that predict a trained (response) token are passed in: prompt positions never reach the
  LM head, which saves its flops for long prompts.
"""

from __future__ import annotations

import torch


def chunk_rows(vocab_size: int, chunk_bytes: int) -> int:
    """Rows per chunk so that about three fp32 [rows, vocab] temporaries fit in chunk_bytes."""
    return max(1, chunk_bytes // (3 * 4 * max(1, vocab_size)))


def _scaled(logits: torch.Tensor, dtype: torch.dtype, inv_temperature: float) -> torch.Tensor:
    z = logits.to(dtype)
    return z * inv_temperature if inv_temperature != 1.0 else z


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, inv_temperature: float,
                rows_per_chunk: int):
        n = logits.shape[0]
        work = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 when given fp64
        logprobs = torch.empty(n, dtype=work, device=logits.device)
        entropy = torch.empty(n, dtype=work, device=logits.device)
        lse = torch.empty(n, dtype=work, device=logits.device)
        for s in range(0, n, rows_per_chunk):
            e = min(n, s + rows_per_chunk)
            z = _scaled(logits[s:e], work, inv_temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s:e] = lse_c
            logprobs[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse_c
            neg_log_p = lse_c[:, None] - z
            # H = sum p * (-log p): non-negative terms, no cancellation (lse - sum p z has it)
            entropy[s:e] = (torch.exp(-neg_log_p) * neg_log_p).sum(dim=-1)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.set_materialize_grads(False)  # an unused output (usually entropy) arrives as None
        ctx.inv_temperature = inv_temperature
        ctx.rows_per_chunk = rows_per_chunk
        return logprobs.float(), entropy.float()

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, targets, lse, entropy = ctx.saved_tensors
        inv_t, rows = ctx.inv_temperature, ctx.rows_per_chunk
        work = torch.promote_types(logits.dtype, torch.float32)
        use_ent = grad_entropy is not None
        g_lp = grad_logprobs.to(work) if grad_logprobs is not None else torch.zeros_like(lse)
        g_ent = grad_entropy.to(work) if use_ent else None
        grad = logits  # overwritten chunk by chunk: the logits are not needed afterwards
        for s in range(0, logits.shape[0], rows):
            e = min(logits.shape[0], s + rows)
            z = _scaled(logits[s:e], work, inv_t)
            log_p = z - lse[s:e, None]
            p = torch.exp(log_p)
            coeff = g_lp[s:e, None].expand_as(p)
            if use_ent:
                # -p * (g_lp + g_ent * (log p + H)); the one-hot term is added below.
                coeff = coeff + g_ent[s:e, None] * (log_p + entropy[s:e, None])
            g = -p * coeff
            g.scatter_add_(1, targets[s:e, None], g_lp[s:e, None])
            grad[s:e] = (g * inv_t if inv_t != 1.0 else g).to(grad.dtype)
        return grad, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   chunk_bytes: int = 1 << 30) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per row, both float32 [rows], of softmax(logits / temperature).

    The logits buffer is reused for its own gradient: do not use `logits` after backward.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"token_logprobs: logits {tuple(logits.shape)} and targets "
                         f"{tuple(targets.shape)} must be [rows, vocab] and [rows]")
    rows = chunk_rows(logits.shape[1], chunk_bytes)
    return _TokenLogprobs.apply(logits, targets.long(), 1.0 / temperature, rows)


def reference_token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain autograd version of `token_logprobs` (for tests and as the definition)."""
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return log_p.gather(1, targets.long()[:, None]).squeeze(1), entropy
