"""One engine rank of the P2P weight transfer: holds its TP/EP slices, receives them from the trainers.

    python -m miles.weights.p2p_receiver --plan PLAN.msgpack --rank J --port P --out DIR

Design decisions:
- A real process that keeps only its own shards (the boxes `Plan.engine_boxes[t][J]`), as an
  engine rank's weight loader would after its TP cut; it never sees the full model.
- It learns nothing per bucket but the tensor indices rank 0 broadcasts: from the plan it knows
  which trainer sends which pieces in which order, posts one receive per sender and copies the
  pieces into its shards.
- After each version it writes what it holds (safetensors, the shards under their HF names) and
  what each trainer rank sent it (JSON), so tests read the result back from outside the process.
- The plan arrives as a msgpack file of `Plan` (msgspec; no pickle).
- `EngineRank` is the receiving logic itself, shared with the embedded engine (runner.py's
  `_op_p2p_*`): there the shards are the engine's own weight views, one per TP rank process, and
  one `receive_version` runs per `/update_weights_from_p2p` call.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from miles.weights.p2p import END, STOP, P2PGroup, Plan, region
from miles.weights.process_group import init_custom_process_group


class EngineRank:
    """Engine rank `rank`'s side of the transfer: `shards[t]` is where tensor t's slice lands
    (zeros of the box's shape by default; the embedded engine passes its Weights' views, so the
    bytes go straight into the parameters it serves from)."""

    def __init__(self, plan: Plan, rank: int, dtype: torch.dtype,
                 shards: dict[int, torch.Tensor] | None = None, device: torch.device | None = None):
        self.plan, self.rank, self.dtype = plan, rank, dtype
        self.device = device  # receive buffers there (NCCL); None: host memory (gloo)
        if shards is None:
            shards = {t: torch.zeros([n for _, n in boxes[rank]], dtype=dtype)
                      for t, boxes in enumerate(plan.engine_boxes) if boxes[rank] is not None}
        self.shards = shards
        self.received: dict[int, int] = {}

    def receive_version(self, group: P2PGroup) -> int:
        """One version: its number (or STOP) from rank 0, then buckets until END, then the
        barrier that tells the trainers every engine rank has its bytes in place."""
        (version,) = group.control(0)
        if version == STOP:
            return STOP
        self.received = {}
        while (ids := group.control([0])) != [END]:
            self.receive_bucket(group, ids)
        group.barrier()
        return version

    def receive_bucket(self, group: P2PGroup, ids: list[int]) -> None:
        by_sender: dict[int, list] = {}
        for t in ids:
            for piece in self.plan.pieces[t]:
                if piece.target == self.rank:
                    by_sender.setdefault(piece.sender, []).append(piece)
        bufs, ops = {}, []
        for sender, pieces in by_sender.items():
            n = sum(_numel(p.box) for p in pieces)
            bufs[sender] = buf = torch.empty(n, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, sender, group=group.pg))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        for sender, pieces in by_sender.items():
            buf, off = bufs[sender], 0
            for p in pieces:
                n = _numel(p.box)
                dst = region(self.shards[p.tensor], p.box, self.plan.engine_boxes[p.tensor][self.rank])
                dst.copy_(buf[off:off + n].view(dst.shape))
                off += n
            self.received[sender] = self.received.get(sender, 0) + buf.numel() * buf.element_size()

    def save(self, out: Path, version: int) -> None:
        from safetensors.torch import save_file
        names = {t: self.plan.specs[t].name for t in self.shards}
        save_file({names[t]: s.contiguous() for t, s in self.shards.items()},
                  str(out / f"engine{self.rank}-v{version}.safetensors"))
        (out / f"engine{self.rank}-v{version}.json").write_text(json.dumps(
            {"rank": self.rank, "version": version, "received_bytes": self.received,
             "boxes": {names[t]: self.plan.engine_boxes[t][self.rank] for t in self.shards}}))


def _numel(box) -> int:
    n = 1
    for _, length in box:
        n *= length
    return n


def serve(plan: Plan, rank: int, address: str, port: int, out: Path, dtype: torch.dtype,
          backend: str, timeout_s: float) -> None:
    world = plan.trainer_world + plan.engine.tp
    pg = init_custom_process_group(backend, address, port, world, plan.trainer_world + rank,
                                   "miles-p2p", timeout_s)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    group = P2PGroup(pg, plan.trainer_world, plan.trainer_world + rank, device)
    engine = EngineRank(plan, rank, dtype, device=device)
    while (version := engine.receive_version(group)) != STOP:
        engine.save(out, version)
    dist.destroy_process_group(pg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--rank", type=int, required=True, help="this engine rank (0..tp-1)")
    p.add_argument("--address", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--backend", default="gloo")
    p.add_argument("--timeout-s", type=float, default=120.0)
    a = p.parse_args()
    plan = msgspec.msgpack.decode(a.plan.read_bytes(), type=Plan)
    if not 0 <= a.rank < plan.engine.tp:
        raise SystemExit(f"--rank {a.rank} is outside the plan's engine tp={plan.engine.tp}")
    a.out.mkdir(parents=True, exist_ok=True)
    serve(plan, a.rank, a.address, a.port, a.out, getattr(torch, a.dtype), a.backend, a.timeout_s)


if __name__ == "__main__":
    main()
