"""CUDA IPC handles as plain data: what `reduce_tensor` yields, written out field by field.

SGLang ships colocated weights as pickled `reduce_tensor` tuples (MultiprocessingSerializer).
Miles never unpickles bytes from a socket, so this module names every field instead: the IPC
memory handle, the ref-counter handle and the event handle are bytes (base64 in JSON), the rest
are ints, a dtype name and the device's UUID. The receiver rebuilds the tensor with torch's own
`rebuild_cuda_tensor`, so the memory semantics (ref counting, the producer's event) are torch's.

Design decisions:
- Only the fields are trusted, never a class: the storage class and tensor class are fixed
  (`torch.UntypedStorage`, `torch.Tensor`), the dtype comes from an allow-list.
- The device is named by UUID, not index: CUDA_VISIBLE_DEVICES differs between processes, so
  "cuda:0" in the trainer may be "cuda:3" in the engine. An engine that cannot see the GPU gets a
  clear error saying the transport needs the trainer and engine on the same GPU.
- One handle per bucket: a bucket is one flat tensor (miles/weights/buckets.py), so a 1 GB bucket
  is one `cudaIpcOpenMemHandle` on the engine and one device copy per weight.
- The other direction (`IpcTargets`, load_format "miles_cuda_ipc_direct"): the engine shares its
  own weight storages once, each as one flat uint8 tensor, plus where every checkpoint name lies
  in them (`IpcView`: storage, byte offset, shape, dtype; contiguous views only). The trainer maps
  them once per engine instance (`token`) and writes each exported tensor straight into its view:
  one device copy per byte, the HBM-speed floor. Engine weights are allocated once and never
  freed while the engine lives, so holding the mapping never keeps freed memory alive.
"""

from __future__ import annotations

import math

import msgspec
import torch

FORMAT = "miles_cuda_ipc"   # the `load_format` of /update_weights_from_tensor that carries this

_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64",
    "float8_e4m3fn", "float8_e5m2", "bool") if hasattr(torch, name)}


class IpcTensor(msgspec.Struct, forbid_unknown_fields=True):
    """The arguments of torch.multiprocessing.reductions.rebuild_cuda_tensor, by name."""
    size: list[int]
    stride: list[int]
    offset: int                 # the tensor's offset in its storage (elements)
    dtype: str
    device_uuid: str
    device_index: int           # the sender's index; only a hint
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    requires_grad: bool = False


class IpcBucket(msgspec.Struct, forbid_unknown_fields=True):
    """One flat bucket: the flat tensor's handle and how to cut it into named weights."""
    flat: IpcTensor
    names: list[str]
    shapes: list[list[int]]
    format: str = FORMAT


DIRECT_FORMAT = "miles_cuda_ipc_direct"  # the trainer wrote into the engine's IpcTargets


class IpcView(msgspec.Struct, array_like=True):
    """Where one checkpoint name lies in a shared engine storage (a contiguous view)."""
    name: str
    storage: int                # index into IpcTargets.storages
    offset_bytes: int
    shape: list[int]
    dtype: str


class IpcTargets(msgspec.Struct, forbid_unknown_fields=True):
    """An engine's weight storages and views, for a trainer on the same GPU to write into."""
    token: str                  # this engine instance's; a write names it (DirectWrite)
    storages: list[IpcTensor] = []   # each a 1-D uint8 tensor over one whole storage
    views: list[IpcView] = []
    unchanged: bool = False     # asked with this token: the caller's mapping is still valid


class DirectWrite(msgspec.Struct, forbid_unknown_fields=True):
    """`serialized_named_tensors[0]` of a miles_cuda_ipc_direct update: the trainer is writing
    into the views of the IpcTargets that carry this token (posted as the writes start)."""
    token: str


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def fields_from_reduction(reduced, uuid: str) -> IpcTensor:
    """`reduce_tensor(t)` -> IpcTensor (split out so it can be tested without a GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    fn, args = reduced
    if fn is not rebuild_cuda_tensor:
        raise ValueError(f"CUDA IPC: the tensor is not a CUDA tensor (torch would rebuild it with "
                         f"{getattr(fn, '__name__', fn)!r}); the colocated transport shares GPU memory only")
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size, storage_offset,
     requires_grad, ref_handle, ref_offset, event_handle, event_sync) = args
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"CUDA IPC: dtype {name!r} is not one of {sorted(_DTYPES)}")
    return IpcTensor(size=list(size), stride=list(stride), offset=int(offset), dtype=name,
                     device_uuid=uuid, device_index=int(device), storage_handle=bytes(handle),
                     storage_size_bytes=int(storage_size), storage_offset_bytes=int(storage_offset),
                     ref_counter_handle=bytes(ref_handle), ref_counter_offset=int(ref_offset),
                     event_handle=None if event_handle is None else bytes(event_handle),
                     event_sync_required=bool(event_sync), requires_grad=bool(requires_grad))


def share(t: torch.Tensor) -> IpcTensor:
    """The IPC description of CUDA tensor `t` (keep `t` alive until the receiver is done)."""
    if not t.is_cuda:
        raise ValueError(f"CUDA IPC: the tensor is on {t.device}, not on a GPU; the colocated "
                         "transport needs the trainer's weights on CUDA")
    from torch.multiprocessing.reductions import reduce_tensor
    return fields_from_reduction(reduce_tensor(t), device_uuid(t.device.index))


def rebuild_args(d: IpcTensor, local_index: int) -> tuple:
    """The positional arguments of rebuild_cuda_tensor for `d` on local device `local_index`."""
    if d.dtype not in _DTYPES:
        raise ValueError(f"CUDA IPC: dtype {d.dtype!r} is not one of {sorted(_DTYPES)}")
    if len(d.size) != len(d.stride) or d.offset < 0 or d.storage_size_bytes < 0:
        raise ValueError(f"CUDA IPC: inconsistent tensor geometry size={d.size} stride={d.stride} "
                         f"offset={d.offset}")
    return (torch.Tensor, torch.Size(d.size), tuple(d.stride), d.offset, torch.UntypedStorage,
            _DTYPES[d.dtype], local_index, d.storage_handle, d.storage_size_bytes,
            d.storage_offset_bytes, d.requires_grad, d.ref_counter_handle, d.ref_counter_offset,
            d.event_handle, d.event_sync_required)


def local_device_index(uuid: str) -> int:
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA IPC: this process has no CUDA; the colocated transport needs the "
                           "trainer and the engine on the same GPU")
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise RuntimeError(f"CUDA IPC: the weights live on GPU {uuid}, which this process cannot see "
                       f"(it sees {[device_uuid(i) for i in range(torch.cuda.device_count())]}); the "
                       "colocated transport needs the trainer and the engine on the same GPU")


def open_tensor(d: IpcTensor) -> torch.Tensor:
    """Map the sender's memory into this process (no copy)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    return rebuild_cuda_tensor(*rebuild_args(d, local_device_index(d.device_uuid)))


def encode_bucket(flat: torch.Tensor, names: list[str], shapes: list[list[int]]) -> str:
    """The `serialized_named_tensors[0]` string for one flat bucket (JSON)."""
    return msgspec.json.encode(IpcBucket(share(flat), list(names), [list(s) for s in shapes])).decode()


def decode_bucket(payload: str) -> IpcBucket:
    try:
        bucket = msgspec.json.decode(payload, type=IpcBucket)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"serialized_named_tensors[0]: not a {FORMAT} bucket: {e}") from None
    if len(bucket.names) != len(bucket.shapes):
        raise ValueError(f"serialized_named_tensors[0]: {len(bucket.names)} names but "
                         f"{len(bucket.shapes)} shapes")
    return bucket


def open_targets(targets: IpcTargets) -> dict[str, torch.Tensor]:
    """Map an engine's IpcTargets (each storage once): checkpoint name -> a writable view of the
    engine's own weight. The views keep the mappings; drop them to unmap."""
    bases = [open_tensor(d) for d in targets.storages]
    out = {}
    for v in targets.views:
        if v.dtype not in _DTYPES or not 0 <= v.storage < len(bases):
            raise ValueError(f"CUDA IPC targets: view {v.name!r} names dtype {v.dtype!r} and storage "
                             f"{v.storage} of {len(bases)}")
        dtype = _DTYPES[v.dtype]
        nbytes = math.prod(v.shape) * dtype.itemsize
        base = bases[v.storage]
        if v.offset_bytes < 0 or v.offset_bytes + nbytes > base.numel() or v.offset_bytes % dtype.itemsize:
            raise ValueError(f"CUDA IPC targets: view {v.name!r} ({nbytes} bytes at {v.offset_bytes}) "
                             f"does not fit storage {v.storage} ({base.numel()} bytes)")
        out[v.name] = base[v.offset_bytes:v.offset_bytes + nbytes].view(dtype).view(v.shape)
    return out
