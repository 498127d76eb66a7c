"""Packed (varlen) causal attention for transformers models: several samples in one row, no padding.

Design decisions:
- Registered with transformers' `AttentionInterface` under the name "miles_packed", and loaded with
  `attn_implementation="miles_packed"`. transformers builds no mask for an implementation it does
  not know, so no [T, T] mask is ever materialized; the sample boundaries arrive as keyword
  arguments that the decoder layers pass through to attention unchanged: `cu_seq_lens_q` (int32
  device tensor, FlashAttention's name), `max_length_q`, and `miles_seq_bounds` (the same
  boundaries as host ints, so the fallback loop needs no device-to-host sync per layer).
- Two kernels. `torch.nn.attention.varlen.varlen_attn` (FlashAttention varlen, CUDA only) is used
  when it exists and a probe at start-up shows it matches the reference path in value and
  gradient; its signature changed between torch releases, so the call adapts to what it finds.
  Otherwise each sample runs `scaled_dot_product_attention(is_causal=True)` on its own slice: exact,
  uses the flash kernel on CUDA, and costs one launch per sample per layer.
- Called without boundaries (a plain forward, e.g. a user's eval), each row is one causal sequence.
- Sliding-window attention is refused, not silently ignored.
- Should a transformers version build a mask anyway, it is ignored when boundaries are given (they
  define the pattern completely, and packed rows are never padded); a plain call with a padding
  mask goes to transformers' own sdpa function.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "miles_packed"

_varlen_fn = None       # set by enable_varlen_kernel() after a successful probe
_varlen_qk = False      # ... and whether it is bottom-right causal for unequal q/k (context parallel)
_varlen_params: set[str] = set()


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float | None = None, dropout: float = 0.0,
                             sliding_window: int | None = None, **kwargs):
    """transformers attention function: q [B, Hq, T, D], k/v [B, Hkv, T, D] -> ([B, T, Hq, D], None)."""
    if sliding_window is not None:
        raise NotImplementedError(f"{ATTN_IMPLEMENTATION}: sliding_window={sliding_window} is not "
                                  "supported; set use_sliding_window=false in the model config")
    if dropout:
        raise NotImplementedError(f"{ATTN_IMPLEMENTATION}: attention dropout={dropout} is not supported")
    bounds: Sequence[int] | None = kwargs.get("miles_seq_bounds")
    if bounds is None:
        if attention_mask is not None:  # an ordinary padded call: let transformers' sdpa do it
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          scaling=scaling, dropout=dropout, **kwargs)
        out = _sdpa_causal(query, key, value, scaling)
        return out.transpose(1, 2).contiguous(), None
    # With boundaries, the attention pattern is fully defined by them (causal within each sample,
    # rows are never padded); a mask some transformers version built anyway adds nothing.
    if query.shape[0] != 1:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: packed rows need batch size 1, got {query.shape[0]}")
    if _varlen_fn is not None and query.is_cuda:
        out = _varlen(query, key, value, kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"]), scaling)
        return out.unsqueeze(0), None
    return segment_attention(query, key, value, bounds, scaling).transpose(1, 2).contiguous(), None


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      bounds: Sequence[int], scaling: float | None) -> torch.Tensor:
    """Causal attention within each [bounds[i], bounds[i+1]) slice of the row; [1, Hq, T, D]."""
    parts = [_sdpa_causal(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], scaling)
             for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _sdpa_causal(query, key, value, scaling):
    rep = query.shape[1] // key.shape[1]
    if rep > 1 and query.is_cuda:
        # Explicit copies keep the flash kernel eligible whatever the torch version's GQA support;
        # k/v are 1/rep of q's size, so this is cheap next to the attention itself.
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        rep = 1
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                          enable_gqa=rep > 1)


def _varlen(query, key, value, cu_seqlens, max_len, scaling):
    # varlen_attn wants [T, H, D]; transformers' q/k/v are [1, T, H, D] transposed, so this is
    # normally a free view and .contiguous() a no-op.
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    return varlen_causal(q, k, v, cu_seqlens, max_len, scaling)


def varlen_causal(q, k, v, cu_seqlens, max_len, scaling):
    """Causal attention within each sequence of a packed batch: q [T, Hq, D], k/v [T, Hkv, D],
    `cu_seqlens` int32 [B + 1] -> [T, Hq, D]. Only after `enable_varlen_kernel` returned True."""
    return _varlen_call(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scaling)


def varlen_qk_ready() -> bool:
    """Whether `varlen_causal_qk` may run: the varlen kernel is in use and the start-up probe found
    it causal bottom-right for queries shorter than their keys."""
    return _varlen_fn is not None and _varlen_qk


def varlen_causal_qk(q, k, v, cu_q, cu_k, max_q, max_k, scaling):
    """Causal attention of each query segment against its key segment, the queries being the LAST
    positions of their keys (bottom-right aligned): q [Tq, Hq, D], k/v [Tk, Hkv, D] -> [Tq, Hq, D]."""
    return _varlen_call(q, k, v, cu_q, cu_k, max_q, max_k, scaling)


def lower_right_causal(q, k, v, scaling):
    """The reference for one segment of `varlen_causal_qk`: q [nq, Hq, D], k/v [nk, Hkv, D]."""
    nq, nk = q.shape[0], k.shape[0]
    mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=nk - nq)
    qh, kh, vh = (x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))   # [1, H, n, D]
    rep = qh.shape[1] // kh.shape[1]
    if rep > 1:
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scaling)[0].permute(1, 0, 2)


def _varlen_call(q, k, v, cu_q, cu_k, max_q, max_k, scaling):
    kw = {"scale": scaling}
    if "window_size" in _varlen_params:
        kw["window_size"] = (-1, 0)   # (-1, 0) is causal in the window_size form
    else:
        kw["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _varlen_params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return _varlen_fn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def register() -> str:
    """Register the attention function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention_forward)
    return ATTN_IMPLEMENTATION


def enable_varlen_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Use torch's FlashAttention varlen kernel if it exists here and matches the reference path."""
    global _varlen_fn, _varlen_params, _varlen_qk
    _varlen_fn, _varlen_qk = None, False
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        log.info("packed attention: torch has no varlen_attn; using per-sample sdpa")
        return False
    candidate_params = set(inspect.signature(varlen_attn).parameters)
    try:
        ok = _probe(varlen_attn, candidate_params, device, dtype)
    except Exception as exc:  # any failure means "do not use it", never a crash
        log.warning("packed attention: varlen_attn probe failed (%s: %s); using per-sample sdpa",
                    type(exc).__name__, exc)
        return False
    if ok:
        _varlen_fn, _varlen_params = varlen_attn, candidate_params
        log.info("packed attention: using torch varlen_attn")
        try:
            _varlen_qk = _probe_qk(device, dtype)
        except Exception as exc:
            log.warning("packed attention: varlen_attn with unequal q/k lengths failed its probe "
                        "(%s: %s); context parallel attention uses per-segment sdpa",
                        type(exc).__name__, exc)
            _varlen_qk = False
    else:
        log.warning("packed attention: varlen_attn disagrees with sdpa; using per-sample sdpa")
    return ok


def _probe(fn, params, device, dtype) -> bool:
    global _varlen_fn, _varlen_params
    gen = torch.Generator(device="cpu").manual_seed(0)
    bounds = [0, 37, 100, 164]
    shape_q, shape_kv = (1, 4, bounds[-1], 64), (1, 2, bounds[-1], 64)
    q, k, v = (torch.randn(s, generator=gen).to(device, dtype).requires_grad_()
               for s in (shape_q, shape_kv, shape_kv))
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    ref = segment_attention(q, k, v, bounds, None).transpose(1, 2)[0]
    _varlen_fn, _varlen_params = fn, params
    try:
        got = _varlen(q, k, v, cu, max(b - a for a, b in zip(bounds, bounds[1:])), None)
    finally:
        _varlen_fn, _varlen_params = None, set()
    return _agrees(got, ref, (q, k, v), dtype)


def _probe_qk(device, dtype) -> bool:
    """Whether the varlen kernel computes `lower_right_causal` per segment (value and gradient)."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    seg_q, seg_k = [0, 16, 40, 41], [0, 48, 80, 130]   # queries are the last positions of their keys
    q = torch.randn(seg_q[-1], 4, 64, generator=gen).to(device, dtype).requires_grad_()
    k, v = (torch.randn(seg_k[-1], 2, 64, generator=gen).to(device, dtype).requires_grad_()
            for _ in range(2))
    ref = torch.cat([lower_right_causal(q[a:b], k[c:e], v[c:e], None)
                     for a, b, c, e in zip(seg_q, seg_q[1:], seg_k, seg_k[1:])])
    cu_q, cu_k = (torch.tensor(x, dtype=torch.int32, device=device) for x in (seg_q, seg_k))
    got = varlen_causal_qk(q, k, v, cu_q, cu_k, 24, 50, None)
    return _agrees(got, ref, (q, k, v), dtype)


def _agrees(got, ref, inputs, dtype) -> bool:
    """`got` matches `ref` in value and in the gradient of a loss on it, within dtype tolerance."""
    grads_ref = torch.autograd.grad(ref.float().square().sum(), inputs)
    grads_got = torch.autograd.grad(got.float().square().sum(), inputs)
    tol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))

    return rel(got, ref) < tol and all(rel(a, b) < tol for a, b in zip(grads_got, grads_ref))
