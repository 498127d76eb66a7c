"""Running megatron-core on a CPU-only host (gloo): the few places it assumes CUDA, made explicit.

megatron-core is written for GPUs and reaches for CUDA in a handful of places even when every
tensor is on the CPU. CI and the laptop quickstart have no GPU, so `apply_cpu_shims()` deals with
exactly those places, and nothing else. It is a no-op when CUDA is available: the GPU run uses
megatron-core as shipped.

Design decisions:
- Knobs before patches. Where megatron offers a switch we set it when the model is built
  (`megatron_model.py`): `use_cpu_initialization=True`, the "allgather" MoE token dispatcher (the
  alltoall one creates a `torch.cuda.Stream()` in its constructor), no fused kernels, and our own
  core attention (`PackedCoreAttention`, which never builds megatron's CUDA causal mask). The RNG
  tracker has a knob too: `initialize_rng_tracker(inference_rng_tracker=True)` installs megatron's
  own tracker whose `fork()` is a plain context; RL training runs with dropout 0, so a forked
  model-parallel RNG stream has nothing to do.
- What remains is patched, and the list is short (each entry says what it replaces):
  1. `torch.cuda.current_device()`: megatron uses it as "this rank's device" in some sixty places
     (communication buffers in tensor_parallel.mappings/layers, pipeline p2p shapes, DDP grad
     buffers, rotary tables, MoE routers). On a host without CUDA the original can only raise,
     so here it returns the CPU device; this is the one process-wide patch, and it changes no
     behaviour that could have worked before.
  2. `Router.gating` (MoE): its `router_gating_linear` reads `te_general_gemm`, a name 0.16.1
     leaves undefined without Transformer Engine. The replacement is the same product in the
     router dtype (fp32).
  3. `tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`: activation
     recompute (megatron's CheckpointFunction, selective or full) saves the CUDA generator's
     state with the CPU one and restores both before recomputing. There is no CUDA generator
     here: the getter returns None and the setter ignores it; the CPU state is still saved and
     restored by megatron's own code.
  4. `LanguageModule.setup_embeddings_and_output_layer` (tied embeddings with PP > 1): moves the
     last stage's copy of the embedding with `.cuda()` before all-reducing it with the first
     stage. During that one call `Tensor.cuda` returns the tensor itself (it is already where
     gloo needs it).
  5. `torch.cuda.synchronize` while dist_checkpointing saves (`cuda_sync_is_noop`, scoped to the
     save): its torch_dist writer stages tensors to the host with `non_blocking=True` and then
     synchronizes CUDA unconditionally. The tensors are on the host already; there is nothing to
     wait for.
- Patches are applied once (idempotent, guarded by a module flag) and are reversible in tests via
  `_restore()`, so a test can prove they are needed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

_applied = False
_originals: list[tuple[object, str, object]] = []


def cpu_only() -> bool:
    """True when this process must run megatron-core without CUDA."""
    return not torch.cuda.is_available()


def apply_cpu_shims() -> bool:
    """Patch megatron-core's CUDA-only spots when CUDA is absent; returns whether anything is patched.

    Safe to call many times; on a CUDA host it does nothing and returns False."""
    global _applied
    if not cpu_only():
        return False
    if _applied:
        return True
    from megatron.core.models.common.language_module import language_module
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import router

    _patch(torch.cuda, "current_device", _cpu_device)
    _patch(router.Router, "gating", _router_gating_without_te)
    _patch(tp_random, "_get_cuda_rng_state", _no_cuda_rng_state)
    _patch(tp_random, "_set_cuda_rng_state", _no_cuda_rng_state)
    setup = language_module.LanguageModule.__dict__["setup_embeddings_and_output_layer"]
    _patch(language_module.LanguageModule, "setup_embeddings_and_output_layer",
           _without_tensor_cuda(setup))
    install_cpu_rng_tracker()
    _applied = True
    log.info("megatron CPU shims applied: torch.cuda.current_device, router gating, tied-embedding "
             "setup, CUDA RNG state, RNG tracker")
    return True


def install_cpu_rng_tracker() -> None:
    """Megatron's own no-op-fork RNG tracker (its inference tracker); see the module docstring."""
    from megatron.core.tensor_parallel import random as tp_random
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _patch(owner: object, name: str, replacement: object) -> None:
    _originals.append((owner, name, owner.__dict__[name] if isinstance(owner, type)
                       else getattr(owner, name)))
    setattr(owner, name, replacement)


def _restore() -> None:
    """Undo every patch (tests only: a fresh process is the normal way to get megatron unpatched)."""
    global _applied
    while _originals:
        owner, name, original = _originals.pop()
        setattr(owner, name, original)
    _applied = False


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _router_gating_without_te(self, input: torch.Tensor) -> torch.Tensor:
    router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype,
                                                                      input.dtype)
    bias = None if self.bias is None else self.bias.to(router_dtype)
    return torch.nn.functional.linear(input.to(router_dtype), self.weight.to(router_dtype), bias)


def _no_cuda_rng_state(*args, **kwargs) -> None:
    # There is no CUDA generator to read or restore on a CPU-only host.
    return None


def _without_tensor_cuda(fn):
    def wrapper(*args, **kwargs):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = saved  # type: ignore[method-assign]
    wrapper.__wrapped__ = fn
    return wrapper


@contextlib.contextmanager
def cuda_sync_is_noop() -> Iterator[None]:
    """Within the block, `torch.cuda.synchronize()` does nothing on a CPU-only host (entry 5)."""
    if not cpu_only():
        yield
        return
    saved = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.synchronize = saved
