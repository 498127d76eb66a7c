"""The trainer's side of the weight-update process group (trainer rank 0 + every engine rank).

Design decisions:
- Built exactly like SGLang's `init_custom_process_group` (and the embedded engine's copy): a
  tcp:// rendezvous, a `PrefixStore(group_name, store)`, `_new_process_group_helper`. Both sides
  must build it the same way or they never meet. It is independent of the trainer's default
  group, which FSDP/Megatron already use.
- The trainer is rank 0 and hosts the store. Creating the group blocks until every engine rank has
  joined, so it runs on a helper thread while the engines are asked to join over HTTP; whichever
  fails first (an engine refusing, the rendezvous timing out) is reported at once, naming the
  engines that did not answer. A missing peer costs `timeout_s`, not a watchdog's ten minutes.
- NCCL communicators are created lazily by the first collective on both sides (neither passes a
  `device_id`), because the engines only post their first receive when the first bucket comes.
- A trainer whose default group is bound to a device (FSDP's eager NCCL init) would otherwise get
  this group *split off the trainers' communicator* (torch does that for every new NCCL group
  then): the engines are not in that communicator, so the first broadcast hangs. The binding is
  hidden while the group is created (`_fresh_communicator`), so it gets a communicator of its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_custom_process_group(backend: str, master_address: str, master_port: int, world_size: int,
                              rank: int, group_name: str, timeout_s: float,
                              collective_timeout_s: float | None = None):
    """A process group of `world_size` ranks that does not touch the default group.

    `timeout_s` bounds the rendezvous (every rank joining); `collective_timeout_s` (default the
    same) each collective afterwards.
    """
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                    _world, rendezvous)
    join = timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size,
                                              timeout=join))
    store.set_timeout(join)
    store = PrefixStore(group_name, store)
    with _fresh_communicator():
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                          group_name=group_name,
                                          timeout=timedelta(seconds=collective_timeout_s or timeout_s))
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@contextlib.contextmanager
def _fresh_communicator():
    """Hide the default group's device binding, so torch does not split the new group from it."""
    default = dist.group.WORLD if dist.is_initialized() else None
    bound = getattr(default, "bound_device_id", None)
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def create_group_with_engines(*, backend: str, master_address: str, master_port: int,
                              world_size: int, group_name: str, timeout_s: float,
                              engine_joins: list[cf.Future], engine_urls: list[str],
                              collective_timeout_s: float | None = None):
    """Create the group as rank 0 while `engine_joins` (their /init_weights_update_group calls)
    run; returns the group or raises RuntimeError naming what went wrong."""
    box: dict = {}

    def create():
        try:
            box["pg"] = init_custom_process_group(backend, master_address, master_port, world_size,
                                                  0, group_name, timeout_s, collective_timeout_s)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = e

    # A daemon thread: if an engine refuses, we report at once and let the rendezvous time out
    # on its own rather than wait for it.
    thread = threading.Thread(target=create, name="weights-group", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s + 5.0
    where = f"weight-update group {group_name!r} ({backend}, tcp://{master_address}:{master_port}, " \
            f"world_size {world_size})"
    while True:
        for url, fut in zip(engine_urls, engine_joins):
            if fut.done() and fut.exception() is not None:
                e = fut.exception()
                raise RuntimeError(f"{where}: engine {url} did not join: "
                                   f"{getattr(e, 'message', None) or e}")
            if fut.done() and isinstance(fut.result(), dict) and fut.result().get("success") is False:
                raise RuntimeError(f"{where}: engine {url} refused to join: "
                                   f"{fut.result().get('message')}")
        if not thread.is_alive():
            if "error" in box:
                pending = [u for u, f in zip(engine_urls, engine_joins) if not f.done()]
                who = (f"still joining: {pending}" if pending else
                       "every engine answered /init_weights_update_group, so check that they can "
                       f"reach {master_address}:{master_port} (weights.master_address)")
                raise RuntimeError(f"{where}: not every engine joined within {timeout_s} s ({who}): "
                                   f"{box['error']}")
            if all(f.done() for f in engine_joins):
                return box["pg"]
        if time.monotonic() > deadline:
            pending = [u for u, f in zip(engine_urls, engine_joins) if not f.done()]
            raise RuntimeError(f"{where}: engines {pending} did not answer "
                               f"/init_weights_update_group within {timeout_s} s")
        time.sleep(0.02)


def destroy_group(pg) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 - the peers may be gone already
        pass


class _Works:
    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def broadcast_all(tensors: list[torch.Tensor], pg):
    """Broadcast `tensors` from rank 0 in order, as one NCCL group (one launch) when there are
    several on NCCL; returns one waitable. Both ends of a bucket call this (the trainer in
    nccl.py, the engine in embedded_engine/weights.py), so they post the same sequence."""
    if len(tensors) == 1:
        return dist.broadcast(tensors[0], src=0, group=pg, async_op=True)
    if dist.get_backend(pg) == "nccl":
        from torch.distributed.distributed_c10d import _coalescing_manager
        with _coalescing_manager(group=pg, device=tensors[0].device, async_ops=True) as cm:
            for t in tensors:
                dist.broadcast(t, src=0, group=pg, async_op=True)
        return cm
    return _Works([dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors])
