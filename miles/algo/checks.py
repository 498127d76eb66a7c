"""Input validation shared by the algo functions: one clear ValueError naming the argument and value.

Design decisions:
- Checks run at every public entry point, because a wrong shape or a NaN reward silently turns into
  a wrong gradient. Each finite/mask check costs one device sync; that is negligible next to a
  forward/backward pass and is the price of never training on garbage.
- Messages name the argument, the offending value and, for tensors, the first bad index.
"""

from __future__ import annotations

import torch


def require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_1d(name: str, value: object, length: int | None = None) -> torch.Tensor:
    t = require_tensor(name, value)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} has length {t.shape[0]}, expected {length}")
    return t


def require_float(name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating point tensor, got dtype {t.dtype}")


def require_integer(name: str, t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")


def require_finite(name: str, t: torch.Tensor) -> None:
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name} has a non-finite value {t[index].item()} at index {index}")


def require_mask(name: str, t: torch.Tensor) -> None:
    """A loss mask holds only 0 and 1 (any dtype)."""
    bad = (t != 0) & (t != 1)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name} must hold only 0 and 1, got {t[index].item()} at index {index}")


def require_cu_seqlens(cu_seqlens: object, num_tokens: int, name: str = "cu_seqlens") -> torch.Tensor:
    """cu_seqlens: int tensor [num_samples + 1], starts at 0, non-decreasing, ends at num_tokens."""
    cu = require_1d(name, cu_seqlens)
    require_integer(name, cu)
    if cu.shape[0] < 2:
        raise ValueError(f"{name} must have at least 2 entries (one sample), got shape {tuple(cu.shape)}")
    first, last = int(cu[0]), int(cu[-1])
    if first != 0:
        raise ValueError(f"{name}[0] must be 0, got {first}")
    if last != num_tokens:
        raise ValueError(f"{name}[-1]={last} does not match the number of tokens {num_tokens}")
    steps = cu[1:] - cu[:-1]
    if bool((steps < 0).any()):
        index = int((steps < 0).nonzero()[0, 0])
        raise ValueError(f"{name} must be non-decreasing, got {int(cu[index])} then {int(cu[index + 1])}")
    return cu
