"""PackedPolicy: a transformers causal LM whose forward takes a packed row and returns token log-probs.

Design decisions:
- The wrapper is the FSDP root. Its forward runs the decoder (`lm.model`), picks the rows that
  predict response tokens, applies the LM head and the chunked log-prob function. Calling
  `lm.model` directly on an FSDP-wrapped `lm` would skip the root's pre-forward hook, leaving the
  embedding, final norm and LM head un-gathered; making the wrapper the root avoids that and keeps
  tied embeddings in one FSDP unit.
- The HF module stays untouched at `self.lm`, so its parameter names are the HF checkpoint names
  (what weight sync and export want) without any prefix surgery.
- Sample boundaries travel as keyword arguments to the attention function (see attention.py); with
  attention="sdpa"/"eager", transformers derives a block-diagonal mask from the restarting
  position_ids instead (slower: a dense [T, T] mask; kept for checking and for odd models).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from miles.backends.logprobs import token_logprobs


@dataclass
class PackedInputs:
    """One packed micro-batch as the model sees it (all tensors on the compute device)."""
    input_ids: torch.Tensor        # int64 [1, T]
    position_ids: torch.Tensor     # int64 [1, T], restarting at 0 for each sample
    cu_seqlens: torch.Tensor       # int32 [n + 1] over the packed row (attention)
    seq_bounds: tuple[int, ...]    # the same boundaries as host ints
    max_seqlen: int
    logprob_rows: torch.Tensor     # int64 [R]: positions whose next token is a response token
    targets: torch.Tensor          # int64 [R]: those response tokens


class PackedPolicy(nn.Module):
    def __init__(self, lm: nn.Module, *, packed_attention: bool, temperature: float = 1.0,
                 chunk_bytes: int = 1 << 30):
        super().__init__()
        self.lm = lm
        self.packed_attention = packed_attention
        self.temperature = temperature
        self.chunk_bytes = chunk_bytes

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                seq_bounds: tuple[int, ...], max_seqlen: int, logprob_rows: torch.Tensor,
                targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (log-probs, entropies), float32 [R] each, of the response tokens under this policy."""
        kwargs = {}
        if self.packed_attention:
            kwargs = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen,
                          max_length_k=max_seqlen, miles_seq_bounds=seq_bounds)
        out = self.lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        hidden = out.last_hidden_state[0].index_select(0, logprob_rows)
        logits = self.lm.lm_head(hidden)
        return token_logprobs(logits, targets, temperature=self.temperature,
                              chunk_bytes=self.chunk_bytes)

    def run(self, batch: PackedInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return self(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.seq_bounds,
                    batch.max_seqlen, batch.logprob_rows, batch.targets)
