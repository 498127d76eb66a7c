"""Optimizer-state offload: step time, bandwidth and device memory of AdamW with its moments on
the device ("none"), in pinned host memory ("cpu") or in files ("nvme"), miles/backends/optim_offload.py.

Prints one JSON line per (model, mode):
  {"bench": "offload", "model", "mode", "params", "state_bytes", "step_s", "overhead_s",
   "overhead_x", "read_GBps", "write_GBps", "limit_read_GBps", "limit_write_GBps",
   "link_frac", "peak_device_bytes", "resident_state_device_bytes", "device_saved_bytes", ...}

- Models: the parameter shapes of Qwen2-1.5B and Qwen2-7B (fp32 master weights, as FSDP keeps
  them on one rank), built as bare tensors with random gradients; the bench times the optimizer
  step alone, which is all the offload changes (forward and backward are the same in every mode).
- `step_s`: median of --rounds steps after one warm-up (which creates the files / host buffers).
  `overhead_s` = step_s - the same step with mode none; `overhead_x` their ratio.
- Bandwidth: every step moves each moment byte in (`read`) and back out (`write`);
  `read_GBps`/`write_GBps` are those bytes over step_s. The limits are measured in the same run:
  "cpu" against one pinned host -> device and device -> host copy of a bucket-sized buffer
  (repeated, the PCIe figure), "nvme" against rewriting (in place, as the step does: the file is
  written once untimed first) and reading the same number of bytes in files under --offload-dir
  with fdatasync and the page cache dropped (the disk figure).
  `link_frac` = min(read, write) GBps / its limit; with the reads and writes on separate streams
  or threads, both directions overlap each other and the Adam arithmetic. A disk serves both
  directions at once during a streamed step, so "nvme" also reports `limit_duplex_GBps` (each way,
  reading one file while writing another) and `duplex_frac` against it: the link's real ceiling.
- Device memory: `peak_device_bytes` is torch.cuda.max_memory_allocated during the step (params
  and grads included); `resident_state_device_bytes` is what the moments keep on the device
  between steps (mode none: all of them; cpu/nvme: 0); `device_saved_bytes` = none's peak - this
  mode's peak.
- CPU (`--tiny`, the default without CUDA): tiny shapes, "device" is host memory; a smoke test
  of the code path, not a measurement of any link. `--models qwen2-1.5b --modes nvme` on a CPU
  host does measure the disk: the moments stream from and to files as on a GPU host, with the
  Adam arithmetic on one CPU thread in place of the device.

Usage: .venv/bin/python bench/offload.py [--models qwen2-1.5b,qwen2-7b] [--modes none,cpu,nvme]
       [--offload-dir DIR] [--bucket-mb 256] [--rounds 3] [--nvme-max-gb 40] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.backends.optim_offload import OffloadedAdamW  # noqa: E402
from miles.hostinfo import machine

MODELS = {  # hidden, layers, heads, kv heads, intermediate, vocab, tied
    "qwen2-1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "qwen2-7b": (3584, 28, 28, 4, 18944, 152064, False),
    "tiny": (256, 4, 4, 2, 512, 4096, True),
}


def shapes(name: str) -> list[tuple[int, ...]]:
    h, layers, heads, kv, inter, vocab, tied = MODELS[name]
    kv_dim = kv * (h // heads)
    layer = [(h, h), (h,), (kv_dim, h), (kv_dim,), (kv_dim, h), (kv_dim,), (h, h),
             (inter, h), (inter, h), (h, inter), (h,), (h,)]
    return [(vocab, h)] + layer * layers + [(h,)] + ([] if tied else [(vocab, h)])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pcie_limits(nbytes: int, device: torch.device, repeat: int = 5) -> tuple[float, float]:
    """(host -> device, device -> host) GB/s of one pinned copy of `nbytes`, best of `repeat`."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        for i, (dst, src) in enumerate(((dev, host), (host, dev))):
            sync(device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            best[i] = min(best[i], time.perf_counter() - t)
    return nbytes / best[0] / 1e9, nbytes / best[1] / 1e9


def _fill(fd: int, buf: memoryview, total: int) -> None:
    """Write `total` bytes once, synced, pages dropped: a first write to a fresh file also pays
    for allocating its blocks (on one virtual disk here 0.39 GB/s fresh against 6.5 GB/s
    rewriting in place), which a streamed optimizer step, rewriting its files every step, never
    does."""
    pos = 0
    while pos < total:
        pos += os.pwrite(fd, buf[:min(len(buf), total - pos)], pos)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, total, os.POSIX_FADV_DONTNEED)


def disk_limits(root: Path, total: int, chunk: int) -> tuple[float, float]:
    """(read, write) GB/s of `total` bytes in `chunk`-sized positional I/O, synced, cache dropped."""
    path = root / "disk-probe.bin"
    buf = memoryview(bytearray(os.urandom(1 << 20)) * (chunk >> 20 or 1))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _fill(fd, buf, total)   # untimed: the step rewrites its files in place, blocks allocated
        t = time.perf_counter()
        pos = 0
        while pos < total:
            pos += os.pwrite(fd, buf[:min(len(buf), total - pos)], pos)
        os.fdatasync(fd)
        write_s = time.perf_counter() - t
        os.posix_fadvise(fd, 0, total, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        pos = 0
        while pos < total:
            pos += os.preadv(fd, [buf[:min(len(buf), total - pos)]], pos)
        read_s = time.perf_counter() - t
    finally:
        os.close(fd)
        path.unlink()
    return total / read_s / 1e9, total / write_s / 1e9


def disk_duplex_limit(root: Path, total: int, chunk: int) -> float:
    """GB/s each way when `total` bytes are read from one file while `total` are written to another
    (synced, cache dropped): what a streamed step asks of the disk, both directions at once."""
    import threading

    src, dst = root / "duplex-src.bin", root / "duplex-dst.bin"
    buf = memoryview(bytearray(os.urandom(1 << 20)) * (chunk >> 20 or 1))
    fd_src = os.open(src, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    fd_dst = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        pos = 0
        while pos < total:
            pos += os.pwrite(fd_src, buf[:min(len(buf), total - pos)], pos)
        os.fdatasync(fd_src)
        os.posix_fadvise(fd_src, 0, total, os.POSIX_FADV_DONTNEED)
        _fill(fd_dst, buf, total)   # untimed, as in disk_limits
        rbuf = memoryview(bytearray(len(buf)))

        def read_all():
            at = 0
            while at < total:
                at += os.preadv(fd_src, [rbuf[:min(len(rbuf), total - at)]], at)

        reader = threading.Thread(target=read_all)
        t = time.perf_counter()
        reader.start()
        pos = 0
        while pos < total:
            pos += os.pwrite(fd_dst, buf[:min(len(buf), total - pos)], pos)
        os.fdatasync(fd_dst)
        reader.join()
        seconds = time.perf_counter() - t
    finally:
        os.close(fd_src)
        os.close(fd_dst)
        src.unlink()
        dst.unlink()
    return total / seconds / 1e9


def run_mode(name: str, mode: str, args, device: torch.device, work: Path) -> dict:
    # drawn on the device: a 7B's weights and gradients drawn on the host took minutes per mode
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in shapes(name):
        p = torch.nn.Parameter(torch.randn(*shape, generator=gen, device=device) * 0.02)
        p.grad = torch.randn(*shape, generator=gen, device=device) * 1e-3
        params.append(p)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kw = dict(lr=1e-6, betas=(0.9, 0.98), eps=1e-8,
              **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    if mode == "none":
        opt = torch.optim.AdamW(groups, **kw)
    else:
        opt = OffloadedAdamW(groups, offload=mode, offload_dir=str(work / "nvme"),
                             bucket_bytes=args.bucket_mb << 20, **kw)
    n = sum(p.numel() for p in params)
    times = []
    peak = 0
    for r in range(args.rounds + 1):
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        opt.step()
        sync(device)
        if r:
            times.append(time.perf_counter() - t)
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(device))
    resident = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.device == device and v.dim() > 0)
    step_s = statistics.median(times)
    state_bytes = 2 * n * 4
    out = {"bench": "offload", "model": name, "mode": mode, "params": n, "state_bytes": state_bytes,
           "step_s": step_s, "step_s_all": times, "peak_device_bytes": peak,
           "resident_state_device_bytes": resident, "bucket_bytes": args.bucket_mb << 20,
           "machine": machine(), "rounds": args.rounds}
    if mode != "none":
        out["buckets"] = len(opt._buckets)
        out["read_GBps"] = state_bytes / step_s / 1e9
        out["write_GBps"] = state_bytes / step_s / 1e9
        opt.close()
    del opt, params, groups
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None)
    p.add_argument("--modes", default="none,cpu,nvme")
    p.add_argument("--offload-dir", type=Path, default=None, help="for nvme (default: a temp dir)")
    p.add_argument("--bucket-mb", type=int, default=256, help="moments per bucket (each of m, v)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nvme-max-gb", type=float, default=40.0,
                   help="skip nvme for models whose moments exceed this (disk space)")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    tiny = args.tiny or not torch.cuda.is_available()
    device = torch.device("cpu" if tiny else "cuda:0")
    args.models = args.models or ("tiny" if tiny else "qwen2-1.5b,qwen2-7b")
    if args.models == "tiny":
        args.bucket_mb = min(args.bucket_mb, 1)
    if tiny:
        # intra-op threads on a shared 2-core host made plain AdamW 30x slower (spinning), not
        # a figure of anything
        torch.set_num_threads(1)
    base = args.offload_dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="miles-bench-offload-", dir=base) as tmp:
        work = Path(tmp)
        (work / "nvme").mkdir()
        modes = args.modes.split(",")
        limits: dict[str, tuple[float, float]] = {}
        if "cpu" in modes:
            limits["cpu"] = pcie_limits(args.bucket_mb << 21, device)
        for name in args.models.split(","):
            rows = {}
            for mode in modes:
                n = sum(torch.Size(s).numel() for s in shapes(name))
                if mode == "nvme":
                    if 8 * n > args.nvme_max_gb * 1e9:
                        print(json.dumps({"bench": "offload", "model": name, "mode": mode,
                                          "skipped": f"moments {8 * n / 1e9:.1f} GB > --nvme-max-gb"}))
                        continue
                    if "nvme" not in limits:
                        probe = min(8 * n, 8 << 30)
                        limits["nvme"] = disk_limits(work, probe, args.bucket_mb << 20)
                        duplex = disk_duplex_limit(work, probe, args.bucket_mb << 20)
                rows[mode] = row = run_mode(name, mode, args, device, work)
                if mode in limits:
                    lr, lw = limits[mode]
                    row.update(limit_read_GBps=lr, limit_write_GBps=lw,
                               link_frac=min(row["read_GBps"] / lr, row["write_GBps"] / lw))
                    if mode == "nvme":   # one disk does both directions at once in a streamed step
                        row.update(limit_duplex_GBps=duplex,
                                   duplex_frac=min(row["read_GBps"], row["write_GBps"]) / duplex)
                if "none" in rows and mode != "none":
                    base_row = rows["none"]
                    row.update(overhead_s=row["step_s"] - base_row["step_s"],
                               overhead_x=row["step_s"] / base_row["step_s"],
                               device_saved_bytes=base_row["peak_device_bytes"] - row["peak_device_bytes"])
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
