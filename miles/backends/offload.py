"""Sleep / wake-up: move the bytes of parameters, gradients and optimizer state to host and back.

Design decisions:
- The bytes move, the tensor objects stay. Each tensor's storage is copied to a host buffer and then
  resized to zero (the same trick FSDP2 uses to free unsharded parameters); waking resizes it back
  and copies the bytes in. Every Python object (FSDP's DTensor shards and the flat buffers they view,
  optimizer state keyed by parameter) keeps its identity, so nothing needs re-registering, and the
  code path is the same on CPU (where "host" is simply another buffer) as on CUDA.
- Storages are de-duplicated by address: FSDP2's shards are views into one padded buffer per
  parameter, and tied weights share one storage.
- Host buffers are pinned (on CUDA) and kept after the first sleep, so later sleeps neither allocate
  nor pin again; device memory is returned to the driver (`empty_cache`) so a colocated inference
  engine can claim it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class HostOffload:
    def __init__(self) -> None:
        self._moved: list[tuple[torch.UntypedStorage, torch.Tensor, int]] = []
        self._host_buffers: dict[int, torch.Tensor] = {}   # slot -> reusable host bytes
        self.asleep = False

    def sleep(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy every distinct storage to host and free it on the device; returns bytes moved."""
        if self.asleep:
            return 0
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes() > 0:
                storages.setdefault(st.data_ptr(), st)
        moved = []
        cuda = False
        for slot, st in enumerate(storages.values()):
            n = st.nbytes()
            cuda = cuda or st.device.type == "cuda"
            host = self._host_buffers.get(slot)
            if host is None or host.numel() != n:
                host = torch.empty(n, dtype=torch.uint8, device="cpu",
                                   pin_memory=st.device.type == "cuda")
                self._host_buffers[slot] = host
            host.copy_(_bytes(st), non_blocking=True)
            moved.append((st, host, n))
        if cuda:
            torch.cuda.synchronize()
        for st, _, _ in moved:
            st.resize_(0)
        if cuda:
            # cuBLAS keeps a workspace per handle and stream in the caching allocator (32 MiB each
            # on Hopper); torch makes new ones on the next matmul.
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()
        self._moved = moved
        self.asleep = True
        return sum(n for _, _, n in moved)

    def wake_up(self) -> int:
        """Give every storage its bytes back; returns bytes moved."""
        if not self.asleep:
            return 0
        cuda = False
        for st, host, n in self._moved:
            st.resize_(n)
            _bytes(st).copy_(host, non_blocking=True)
            cuda = cuda or st.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        total = sum(n for _, _, n in self._moved)
        self._moved = []
        self.asleep = False
        return total


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (tensor copies work across devices; storages may not)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
