"""Fused Triton kernels of the decode step (`Model.decode_fused`): four kernels where the torch
path launches about twenty per layer.

Design decisions:
- A profile of the bf16 0.5B decode step at batch 64 on an H100 (inside a CUDA graph, so host
  cost is gone) found the step GPU-bound on ~470 small kernels: elementwise ops 1.6 ms, the KV
  gathers 0.55 ms, the GEMMs only 0.65 ms of 4.9. The GEMMs stay cuBLAS; everything between them
  becomes one kernel each:
  - `rms_norm`: the residual add and the RMSNorm after it (x += delta; h = w * norm(x));
  - `rope_store`: q/k head norms (Qwen3), RoPE on q and k, and the new token's k and v written
    into the KV pool at its slot (no separate index_copy);
  - `decode_attention`: paged attention that reads each request's keys where they live, through
    `req_to_token`, up to that request's own length (no gathered copy, no padding to a kv bucket,
    so one CUDA graph per batch size serves every context length). Split-K (flash-decoding)
    keeps the card busy when batch x kv heads is small; a second kernel merges the splits;
  - `silu_mul`: SiLU(gate) * up.
- Rounding follows the torch path op for op where it is cheap to: the residual sum, the normed
  activations and the weight product are rounded to the activation dtype at the same points
  (HF's RMSNorm: normalise in fp32, cast, then scale), RoPE rounds x*cos and rot*sin before their
  sum as torch does. Attention differs in summation order (online softmax); the tests bound it.
- Triton is imported on first use (like `miles/backends/logprobs.py`): CPU machines without a GPU
  run these kernels in Triton's interpreter (TRITON_INTERPRET=1, set by the test suite), which is
  how the CPU tests check them against the torch path.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernels() -> SimpleNamespace | None:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rms_kernel(x_ptr, delta_ptr, w_ptr, h_ptr, N, eps, HAS_DELTA: tl.constexpr,
                   BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * N + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + row * N + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / N
        hn = (xf * tl.rsqrt(var + eps)).to(h_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        h = (w.to(tl.float32) * hn.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * N + cols, h, mask=mask)

    @triton.jit
    def rope_store_kernel(qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr,
                          q_ptr, k_pool_ptr, v_pool_ptr, eps,
                          H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                          QK_NORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        HALF: tl.constexpr = D // 2
        width: tl.constexpr = (H + 2 * KVH) * D
        c = tl.arange(0, HALF)
        base = qkv_ptr + t * width + head * D
        slot = tl.load(slot_ptr + t)
        dt = q_ptr.dtype.element_ty
        if head >= H + KVH:  # a value head: stored as it is
            vh = head - H - KVH
            v1 = tl.load(base + c)
            v2 = tl.load(base + HALF + c)
            dst = v_pool_ptr + (slot * KVH + vh) * D
            tl.store(dst + c, v1.to(v_pool_ptr.dtype.element_ty))
            tl.store(dst + HALF + c, v2.to(v_pool_ptr.dtype.element_ty))
        else:
            x1 = tl.load(base + c).to(tl.float32)
            x2 = tl.load(base + HALF + c).to(tl.float32)
            if QK_NORM:
                var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D
                r = tl.rsqrt(var + eps)
                x1 = (x1 * r).to(dt).to(tl.float32)
                x2 = (x2 * r).to(dt).to(tl.float32)
                if head < H:
                    w1 = tl.load(qn_ptr + c).to(tl.float32)
                    w2 = tl.load(qn_ptr + HALF + c).to(tl.float32)
                else:
                    w1 = tl.load(kn_ptr + c).to(tl.float32)
                    w2 = tl.load(kn_ptr + HALF + c).to(tl.float32)
                x1 = (x1 * w1).to(dt).to(tl.float32)
                x2 = (x2 * w2).to(dt).to(tl.float32)
            pos = tl.load(pos_ptr + t)
            c1 = tl.load(cos_ptr + pos * D + c).to(tl.float32)
            c2 = tl.load(cos_ptr + pos * D + HALF + c).to(tl.float32)
            s1 = tl.load(sin_ptr + pos * D + c).to(tl.float32)
            s2 = tl.load(sin_ptr + pos * D + HALF + c).to(tl.float32)
            # torch: x * cos + cat(-x2, x1) * sin, each product rounded, then the sum
            o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
            o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
            if head < H:
                dst = q_ptr + (t * H + head) * D
                tl.store(dst + c, o1)
                tl.store(dst + HALF + c, o2)
            else:
                dst = k_pool_ptr + (slot * KVH + head - H) * D
                tl.store(dst + c, o1.to(k_pool_ptr.dtype.element_ty))
                tl.store(dst + HALF + c, o2.to(k_pool_ptr.dtype.element_ty))

    @triton.jit
    def attention_split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, lens_ptr,
                               mid_o_ptr, mid_m_ptr, mid_l_ptr, scale, table_stride,
                               H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
                               D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                               SPLITS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        row = tl.load(rows_ptr + b)
        n = tl.load(lens_ptr + b)
        per = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
        start = sp * per
        end = tl.minimum(start + per, n)
        g = tl.arange(0, BLOCK_G)
        gmask = g < G
        dd = tl.arange(0, D)
        heads = kh * G + g
        q = tl.load(q_ptr + (b * H + heads)[:, None] * D + dd[None, :], mask=gmask[:, None],
                    other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for s0 in range(start, end, BLOCK_N):
            offs = s0 + tl.arange(0, BLOCK_N)
            nmask = offs < end
            slots = tl.load(table_ptr + row * table_stride + offs, mask=nmask, other=0)
            kv_off = (slots * KVH + kh)[:, None] * D + dd[None, :]
            k = tl.load(k_ptr + kv_off, mask=nmask[:, None], other=0.0)
            # the torch path's scores are a matmul in the activation dtype, then fp32
            s = tl.dot(q, tl.trans(k), input_precision="ieee").to(q_ptr.dtype.element_ty).to(tl.float32) * scale
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m = m_new
        out = (b * H + heads) * SPLITS + sp
        tl.store(mid_o_ptr + out[:, None] * D + dd[None, :], acc, mask=gmask[:, None])
        tl.store(mid_m_ptr + out, m, mask=gmask)
        tl.store(mid_l_ptr + out, l, mask=gmask)

    @triton.jit
    def attention_merge_kernel(mid_o_ptr, mid_m_ptr, mid_l_ptr, o_ptr, H: tl.constexpr,
                               D: tl.constexpr, SPLITS: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)  # b * H + h
        sp = tl.arange(0, SPLITS)
        dd = tl.arange(0, D)
        m = tl.load(mid_m_ptr + bh * SPLITS + sp)
        l = tl.load(mid_l_ptr + bh * SPLITS + sp)
        top = tl.max(m, 0)  # finite: every row has a key (its own new token)
        w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
        total = tl.sum(l * w, 0)
        acc = tl.load(mid_o_ptr + (bh * SPLITS + sp)[:, None] * D + dd[None, :])
        o = tl.sum(acc * w[:, None], 0) / total
        tl.store(o_ptr + bh * D + dd, o.to(o_ptr.dtype.element_ty))

    @triton.jit
    def silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        gate = tl.load(gu_ptr + t * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + t * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        tl.store(out_ptr + t * I + cols, (act * up).to(dt), mask=mask)

    return SimpleNamespace(rms=rms_kernel, rope_store=rope_store_kernel,
                           attention_split=attention_split_kernel,
                           attention_merge=attention_merge_kernel, silu_mul=silu_mul_kernel)


def available() -> bool:
    """Whether Triton imports (on CUDA it compiles the kernels; on CPU its interpreter runs them)."""
    return _kernels() is not None


def supports(head_dim: int) -> bool:
    """The kernels tile a head as two power-of-two halves (and tl.dot wants >= 16 columns)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> torch.Tensor:
    """h = weight * RMSNorm(x) after `x += delta` in place (x is the residual stream, [T, N])."""
    T, N = x.shape
    h = torch.empty_like(x)
    _kernels().rms[(T,)](x, delta if delta is not None else x, weight, h, N, eps,
                         HAS_DELTA=delta is not None, BLOCK=_pow2(N))
    return h


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
               k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int, eps: float) -> torch.Tensor:
    """q [T, H, d] (normed when q_norm is given, rotated) from the fused qkv projection; the
    rotated k and the v of each token are written to the pools at `slots`."""
    T = qkv.shape[0]
    q = torch.empty(T, num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    norm = q_norm is not None
    _kernels().rope_store[(T, num_heads + 2 * num_kv_heads)](
        qkv, positions, slots, cos, sin, q_norm if norm else cos, k_norm if norm else cos,
        q, k_pool, v_pool, eps, H=num_heads, KVH=num_kv_heads, D=head_dim, QK_NORM=norm)
    return q


def attention_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Split-K factor: enough programs to fill the card twice over (at most 16 splits)."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 8)
    return min(16, _pow2(max(1, -(-2 * sms // (batch * num_kv_heads)))))


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, splits: int | None = None) -> torch.Tensor:
    """Attention of each row's one query over its `seq_lens[b]` keys at `req_to_token[rows[b]]`:
    q [B, H, d] -> [B, H * d]."""
    B, H, D = q.shape
    KVH = k_pool.shape[1]
    G = H // KVH
    splits = splits or attention_splits(B, KVH, q.device)
    mid_o = torch.empty(B * H * splits, D, device=q.device, dtype=torch.float32)
    mid_m = torch.empty(B * H * splits, device=q.device, dtype=torch.float32)
    mid_l = torch.empty_like(mid_m)
    k = _kernels()
    k.attention_split[(B, KVH, splits)](
        q, k_pool, v_pool, req_to_token, rows, seq_lens, mid_o, mid_m, mid_l, scale,
        req_to_token.stride(0), H=H, KVH=KVH, G=G, D=D, BLOCK_G=max(16, _pow2(G)), BLOCK_N=32,
        SPLITS=splits)
    o = torch.empty(B, H * D, device=q.device, dtype=q.dtype)
    k.attention_merge[(B * H,)](mid_o, mid_m, mid_l, o, H=H, D=D, SPLITS=splits)
    return o


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a fused [T, 2I] gate|up projection -> [T, I]."""
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(T, inter, device=gate_up.device, dtype=gate_up.dtype)
    block = min(1024, _pow2(inter))
    _kernels().silu_mul[(T, -(-inter // block))](gate_up, out, inter, BLOCK=block)
    return out
