"""Per-token log-probs and entropies of sampled tokens from LM-head logits: fused Triton kernels on
CUDA, a chunked torch path elsewhere.

Design decisions:
- The logits of a packed micro-batch ([tokens, vocab], 8k x 152k) are the largest activation of an
  RL step. They are materialized once, in the compute dtype, by the LM head matmul; everything in
  fp32 (temperature scaling, log-softmax, entropy) happens on the fly, never as an fp32 copy of the
  whole [tokens, vocab] tensor.
- A custom autograd Function instead of autograd through log_softmax: autograd would keep an fp32
  copy of the logits for backward. Here backward recomputes the softmax from the saved
  compute-dtype logits and each row's saved normalizer, and writes d(loss)/d(logits) into the
  logits buffer itself (the logits are not needed after that), so backward allocates no
  [tokens, vocab] tensor either.
- On CUDA, two Triton kernels, one program per row, make this one read of the logits in forward
  and one read plus one in-place write in backward; the torch path makes about eight passes over
  fp32 chunks, and the op is memory-bound. The forward kernel is an online softmax over vocab
  blocks that carries, besides the running max m and S = sum e^(z-m), T = sum e^(z-m) (m-z), so
  H = log S + T/S: two non-negative terms, no cancellation. It saves m and log S apart (not
  lse = m + log S), so backward's log p = (z - m) - log S keeps 1 - p exact where p ~ 1, the
  common case for sampled tokens. Triton is imported on first use, so machines without it (CPU
  CI) run the torch path; `FUSED` forces either path.
- The torch path (CPU, fp64, no Triton, logits not row-major) works one chunk of tokens at a
  time, so at most `chunk_bytes` of fp32 temporaries exist at once.
- Entropy is always returned (it is a metric); its gradient is formed only when the caller's loss
  uses it (a None incoming gradient skips the term).
  d lp_t / d z_k = 1[k = target] - p_k;  d H / d z_k = -p_k (log p_k + H).
- Only rows that predict a trained (response) token are passed in: prompt positions never reach the
  LM head, which saves its flops for long prompts.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import torch

FUSED: bool | None = None
"""None: the Triton kernels for CUDA logits when triton imports, else the torch path. False: always
the torch path. True: always Triton (CPU tensors too, which only its interpreter runs:
TRITON_INTERPRET=1; an error if triton does not import), except for fp64 logits, which keep the
fp64 torch path, and logits whose vocab dim is strided."""

# Vocab columns per loop step and warps per row program: 4096 bf16 columns are 16 per thread at 8
# warps, two 16-byte loads each. Only the speed depends on them.
FUSED_BLOCK_V = 4096
FUSED_NUM_WARPS = 8


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


@functools.cache
def _triton_kernels() -> SimpleNamespace | None:
    """The two jitted kernels, or None without triton. Defined on first use, so importing this
    module never imports triton and TRITON_INTERPRET is read when a kernel is first needed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def forward_kernel(logits_ptr, targets_ptr, max_ptr, log_sum_ptr, logprobs_ptr, entropy_ptr,
                       vocab, row_stride, inv_t, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * row_stride passes 2^31 from 14k rows of 152k
        row_ptr = logits_ptr + row * row_stride
        cols = tl.arange(0, BLOCK_V)
        # A finite floor instead of -inf: m_new - m and exp(z - m_new) stay defined when a block is
        # all -inf (masked vocab); S and T start at 0, so the floor never reaches a result.
        m = -1e30
        s = 0.0
        t = 0.0
        for start in range(0, vocab, BLOCK_V):
            idx = start + cols
            z = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(z, axis=0))
            scale = tl.exp(m - m_new)
            u = z - m_new  # <= 0
            e = tl.exp(u)
            # Rebase T on the new max: sum e^(u - d) (d - u) = e^-d (T + d S), with d = m_new - m.
            t = scale * (t + (m_new - m) * s) + tl.sum(tl.where(e > 0.0, -u, 0.0) * e, axis=0)
            s = s * scale + tl.sum(e, axis=0)
            m = m_new
        log_s = tl.log(s)
        target = tl.load(targets_ptr + row)
        valid = (target >= 0) & (target < vocab)  # out of range: NaN, not a stray read
        z_target = tl.load(row_ptr + target, mask=valid, other=float("nan")).to(tl.float32) * inv_t
        # m and log S kept apart, not as lse = m + log S: (z - m) - log S is exact where p ~ 1
        # (z - m ~ 0, log S ~ 0), while z - lse loses the digits of 1 - p to the rounding of lse.
        tl.store(max_ptr + row, m)
        tl.store(log_sum_ptr + row, log_s)
        tl.store(logprobs_ptr + row, (z_target - m) - log_s)
        tl.store(entropy_ptr + row, log_s + t / s)

    @triton.jit
    def backward_kernel(logits_ptr, targets_ptr, max_ptr, log_sum_ptr, entropy_ptr, grad_lp_ptr,
                        grad_ent_ptr, vocab, row_stride, inv_t, HAS_ENT: tl.constexpr,
                        BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * row_stride
        cols = tl.arange(0, BLOCK_V)
        target = tl.load(targets_ptr + row)
        m = tl.load(max_ptr + row)
        log_s = tl.load(log_sum_ptr + row)
        g_lp = tl.load(grad_lp_ptr + row)
        if HAS_ENT:
            g_ent = tl.load(grad_ent_ptr + row)
            entropy = tl.load(entropy_ptr + row)
        for start in range(0, vocab, BLOCK_V):
            idx = start + cols
            mask = idx < vocab
            z = tl.load(row_ptr + idx, mask=mask, other=0.0).to(tl.float32) * inv_t
            log_p = (z - m) - log_s
            p = tl.exp(log_p)
            if HAS_ENT:
                # A -inf logit has p = 0 and log p = -inf: its gradient is 0, not 0 * inf = NaN.
                g = -p * (g_lp + g_ent * (tl.where(p > 0.0, log_p, 0.0) + entropy))
            else:
                g = -p * g_lp
            g = tl.where(idx == target, g + g_lp, g)
            # In place: this program has read this block and no other program touches the row.
            tl.store(row_ptr + idx, (g * inv_t).to(logits_ptr.dtype.element_ty), mask=mask)

    return SimpleNamespace(forward=forward_kernel, backward=backward_kernel)


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it the tensor's."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


class _FusedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, inv_temperature: float,
                kernels: SimpleNamespace):
        n, vocab = logits.shape
        row_max, log_sum, logprobs, entropy = (
            torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(4))
        if n:
            with _on_device(logits):
                kernels.forward[(n,)](logits, targets, row_max, log_sum, logprobs, entropy, vocab,
                                      logits.stride(0), inv_temperature, BLOCK_V=FUSED_BLOCK_V,
                                      num_warps=FUSED_NUM_WARPS)
        ctx.save_for_backward(logits, targets, row_max, log_sum, entropy)
        ctx.set_materialize_grads(False)  # an unused output (usually entropy) arrives as None
        ctx.inv_temperature = inv_temperature
        ctx.kernels = kernels
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, targets, row_max, log_sum, entropy = ctx.saved_tensors
        n, vocab = logits.shape
        # contiguous: the incoming gradient of a sum() is a stride-0 expand
        g_lp = (grad_logprobs.float().contiguous() if grad_logprobs is not None
                else torch.zeros_like(entropy))
        use_ent = grad_entropy is not None
        g_ent = grad_entropy.float().contiguous() if use_ent else g_lp
        if n:
            with _on_device(logits):
                ctx.kernels.backward[(n,)](logits, targets, row_max, log_sum, entropy, g_lp, g_ent,
                                           vocab, logits.stride(0), ctx.inv_temperature,
                                           HAS_ENT=use_ent, BLOCK_V=FUSED_BLOCK_V,
                                           num_warps=FUSED_NUM_WARPS)
        return logits, None, None, None  # the logits buffer now holds its gradient


def _fused_kernels(logits: torch.Tensor) -> SimpleNamespace | None:
    """The Triton kernels when this call should use them, else None (the torch path)."""
    if FUSED is False or logits.dtype == torch.float64 or logits.stride(1) != 1:
        return None
    if FUSED is None and not logits.is_cuda:
        return None
    kernels = _triton_kernels()
    if kernels is None and FUSED:
        raise RuntimeError("token_logprobs: FUSED is True but triton does not import")
    return kernels


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   chunk_bytes: int = 1 << 30) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per row, both float32 [rows], of softmax(logits / temperature).

    The logits buffer is reused for its own gradient: do not use `logits` after backward.
    `chunk_bytes` bounds the fp32 temporaries of the torch path; the Triton path has none.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"token_logprobs: logits {tuple(logits.shape)} and targets "
                         f"{tuple(targets.shape)} must be [rows, vocab] and [rows]")
    kernels = _fused_kernels(logits)
    if kernels is not None:
        return _FusedTokenLogprobs.apply(logits, targets.long().contiguous(), 1.0 / temperature,
                                         kernels)
    rows = chunk_rows(logits.shape[1], chunk_bytes)
    return _TokenLogprobs.apply(logits, targets.long(), 1.0 / temperature, rows)


def reference_token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain autograd version of `token_logprobs` (for tests and as the definition)."""
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return log_p.gather(1, targets.long()[:, None]).squeeze(1), entropy
