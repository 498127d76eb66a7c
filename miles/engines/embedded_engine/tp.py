"""Tensor parallelism for the embedded engine: one process per TP rank, rank 0 drives.

    rank 0:      python -m miles.engines.embedded --tp-size N ...   (HTTP server + scheduler)
    ranks 1..N-1: python -m miles.engines.embedded_engine.tp --tp-rank r --tp-port P <same flags>

Design decisions:
- Rank 0 owns everything that is not arithmetic: HTTP, the scheduler, the KV slot and row free
  lists, the prefix cache, sampling. The workers own only their slices of the weights and a KV
  pool for their KV heads, addressed by the same slot numbers rank 0 hands out.
- Every operation that touches weights or KV (prefill, decode, a row's slot fix-up, a load from
  disk, a checksum gather, the P2P join / receive) is one *command*: rank 0 broadcasts a small
  msgpack header (the op and its int arrays, never pickle) on a gloo group, then every rank runs
  the same `ModelRunner._op_<op>`; the collectives inside it (all-reduce after o_proj, down_proj
  and the experts, the vocab-parallel embedding's all-reduce, the logits' all-gather) keep the
  ranks in lockstep. Rank 0 samples from the gathered fp32 logits.
- Forward collectives use the default group of the TP ranks (gloo on CPU, NCCL on CUDA by the
  same code); the commands go over a gloo group of their own on CUDA (host bytes).
- Supervision: rank 0 starts the workers (miles.supervise.SupervisedProcess, a process group,
  output to a log file) and watches them; a worker that exits takes the server down at once
  (os._exit, after logging the worker's log tail), so the fleet's restart rules apply to the whole
  engine. A worker whose rank 0 is gone fails its next receive (the peer closed) and exits; the
  PDEATHSIG shim of SupervisedProcess ends it if rank 0 is killed outright.
- CUDA graphs are off at tp > 1 (a captured all-reduce is not worth its risk here): decode is eager.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from miles.engines.embedded_engine.args import build_parser
from miles.supervise import SupervisedProcess

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0   # every rank joins the TP group (each loads the checkpoint first)
FRAME_BYTES = 4096          # a command frame: a decode step's header fits in one broadcast


@dataclass
class TPGroup:
    rank: int
    size: int
    pg: object      # forward collectives (device tensors)
    ctrl: object    # command broadcasts (host bytes, gloo)

    def all_reduce(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, group=self.pg)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim (the vocab-parallel logits)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.pg)
        return torch.cat(parts, dim=-1)

    def send(self, command: list) -> None:
        """One broadcast of a fixed-size frame (length + payload) for a step's command; a longer
        one (a big prefill) sends its rest in a second broadcast."""
        data = msgspec.msgpack.encode(command)
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        frame[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        head = data[:FRAME_BYTES - 8]
        frame[8:8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.broadcast(frame, src=0, group=self.ctrl)
        if len(data) > len(head):
            rest = torch.frombuffer(bytearray(data[len(head):]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.ctrl)

    def recv(self) -> list:
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        dist.broadcast(frame, src=0, group=self.ctrl)
        n = int(frame[:8].view(torch.int64))
        data = frame[8:8 + n].numpy().tobytes()
        if n > FRAME_BYTES - 8:
            rest = torch.empty(n - (FRAME_BYTES - 8), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.ctrl)
            data += rest.numpy().tobytes()
        return msgspec.msgpack.decode(data)


def join_tp_group(rank: int, size: int, port: int, device: str) -> TPGroup:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    ctrl = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    return TPGroup(rank, size, dist.group.WORLD, ctrl)


def rank_device(device: str, rank: int) -> str:
    """`cuda` at TP rank r is cuda:r (each rank its own GPU); an explicit index is offset by r."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def worker_argv(argv: list[str], rank: int, port: int) -> list[str]:
    return [sys.executable, "-m", "miles.engines.embedded_engine.tp", "--tp-rank", str(rank),
            "--tp-port", str(port), *argv]


class Workers:
    """Rank 0's TP workers: started, watched (a dead one ends the server), stopped."""

    def __init__(self, argv: list[str], size: int, port: int):
        self.procs = [SupervisedProcess(f"embedded-tp{r}", worker_argv(argv, r, port),
                                        env={**os.environ, "OMP_NUM_THREADS": "1"})
                      for r in range(1, size)]
        self._stopping = False

    def start(self) -> "Workers":
        for p in self.procs:
            p.start()
            log.info("TP worker %s started (pid %s), log %s", p.name, p.pid, p.log_path)
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        return self

    def _watch(self) -> None:
        while not self._stopping:
            for p in self.procs:
                code = p.proc.poll() if p.proc is not None else None
                if code is not None and not self._stopping:
                    tail = ""
                    try:
                        tail = p.log_path.read_text(errors="replace")[-3000:]
                    except OSError:
                        pass
                    log.critical("TP worker %s (pid %s) exited with code %s: the engine cannot "
                                 "run without it and stops now. Its log (%s) ends:\n%s", p.name,
                                 p.pid, code, p.log_path, tail)
                    self.stop()
                    logging.shutdown()
                    os._exit(70)
            time.sleep(0.2)

    def stop(self) -> None:
        self._stopping = True
        for p in self.procs:
            try:
                p.stop(2.0)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass


def serve_worker(runner) -> None:
    """A worker's life: run rank 0's commands until it says stop (or goes away)."""
    tp = runner.tp
    while True:
        op, *args = tp.recv()
        if op == "stop":
            return
        if op == "p2p_join":  # a failed join fails on every rank alike: rank 0 reports it
            try:
                runner._op_p2p_join(*args)
            except Exception:  # noqa: BLE001 - logged; the engine keeps serving its weights
                log.exception("TP rank %d: joining the P2P group failed", tp.rank)
            continue
        getattr(runner, f"_op_{op}")(*args)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from miles.engines.embedded_engine.runner import ModelRunner, runner_config

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--tp-rank", type=int, required=True)
    pre.add_argument("--tp-port", type=int, required=True)
    ours, rest = pre.parse_known_args(argv)
    args = build_parser().parse_args(rest)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s tp{ours.tp_rank} %(name)s: %(message)s")
    torch.set_num_threads(max(1, args.torch_threads))
    device = rank_device(args.device, ours.tp_rank)
    tp = join_tp_group(ours.tp_rank, args.tp_size, ours.tp_port, device)
    runner = ModelRunner(args.model_path, runner_config(args, device), tp=tp)
    log.info("TP rank %d/%d ready", ours.tp_rank, args.tp_size)
    try:
        serve_worker(runner)
    except RuntimeError as e:  # rank 0 went away (the peer closed): nothing left to serve
        log.error("TP rank %d: %s; exiting", ours.tp_rank, e)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
