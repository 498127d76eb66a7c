"""Weight publication: trainer -> embedded engine over the nccl transport, against a raw broadcast.

Prints one JSON line per model:
  {"bench": "weights", "model", "bytes", "transport", "seconds", "GBps", "raw_broadcast_GBps",
   "frac_of_raw", "delta_frac", "machine", ...}

- Models: Qwen2-1.5B- and Qwen2-7B-shaped, bf16, random weights built in memory from their
  configs on the trainer device (no checkpoint). The engine starts from config.json alone
  (`--load-format dummy`), so a 7B run needs no 15 GB file.
- `seconds`: one `WeightPublisher.publish` (pause -> every bucket gathered, flattened, broadcast
  and copied into the engine's parameters -> version barrier -> continue), median of --rounds
  after one warm-up publish (which creates the NCCL communicator). Engine-side load included:
  the engine answers the version barrier only once the last bucket is in its weights.
- `raw_broadcast_GBps`: the same number of bytes broadcast from the trainer process to a bare
  receiver process on the engine's GPU, in chunks of the bucket size, nothing else; measured in
  the same run, before the publishes, and the receiver exits before they start: a receiver
  waiting in an NCCL call between rounds keeps a kernel spinning on the engine's GPU, which then
  time-slices the two processes and made publishes 1.5-3x slower in an earlier version of this
  bench. `frac_of_raw` = GBps / raw_broadcast_GBps.
- After the timed rounds, every engine parameter's digest (the device digest on GPUs, sha256 on
  hosts) is compared with the trainer's tensors
  (`checked`), so the figures are for bytes that really landed.
- `delta_frac`: one real optimizer step (a forward/backward on random tokens, AdamW lr 1e-6 on fp32
  master copies, weights rounded back to bf16), then the disk-delta payload (XOR with the previous
  bytes, zlib level 1, miles/weights/delta_format.py) as a fraction of the full size.
  `delta_changed_frac` is the fraction of bf16 elements that changed.
- Stall time (every transport): `stall_s` = `pause_s` + `transfer_s` + `load_s` + `version_s` +
  `resume_s`, medians over the rounds (PublishReport.metrics; `background_s`: disk_delta's
  transfer and prepare while the engine serves). `--transport colocated` (one GPU, CUDA IPC)
  reports `hbm_copy_s` (one device copy of the same bytes) and `stall_over_copy` = (stall - pause
  - resume) / hbm_copy_s (target <= 1.3): by default the trainer writes into the engine's own
  weights (weights.colocated_direct); `--colocated-buckets` times the flat-bucket path instead
  (the engine copies each bucket out: two copies per byte). `--transport disk_delta` runs one real
  AdamW step (`adamw_step`, untimed) before each publish, so each delta is what a step of RL
  ships; its line has the publish's own `delta_frac` (payload / full) and `changed_frac`, and no
  separate delta pass runs. A request streams from the engine through all its rounds (greedy,
  1,500 tokens, then the next): `decode_ms_per_token_idle` (2 s before each publish, after the
  step), `decode_ms_per_token_publishing` and `decode_max_gap_ms_publishing` (the longest wait
  between two streamed parts during a publish; `decode_max_gap_ms_by_phase`: encode, prepare,
  commit) say what generation saw. The engine decodes on `--delta-threads` threads, as the
  trainer encodes. `--batch-below-kb 1024,0` times the direct writes with tensors below that size
  in one _foreach_copy_ per bucket (weights.colocated_batch_below_bytes; 0: a copy_ each), one
  line each.
- Output as it is measured: per model and variant, a `"part": "publish"` line as soon as its
  rounds are timed, then the whole line once the check and the delta are done. `--budget-s`
  (default 80 on GPUs; 0: none; not with disk_delta) bounds the delta's encode (the slow part
  on a 7B: every byte to the host, XOR and zlib): past the budget it stops at a tensor boundary, and `delta_tensors` /
  `delta_of_tensors` say how much of the model the fraction covers. Progress with timings goes to
  stderr; `--log-dir` keeps the engine logs.
- Default: GPU 0 trainer -> GPU 1 engine, NCCL. `--tiny` (the default without 2 GPUs) is the CPU
  smoke test: tiny models, gloo, engine on CPU.

- `--no-rollback` (disk_delta): `weights.rollback = false`, the commit without the fleet
  transaction (no v-1 kept on the engines); the line's `rollback` says which ran. The stall
  bound of the transaction (issue 40: <= 1.1x) compares `stall_s` of the two.
- `--variants 1024:3,1024:3:0`: several (bucket MiB, inflight_buckets[, direct_min_bytes KiB])
  settings timed one after the other against the same engine, one JSON line each; the timeline
  fields say where the time went (`first_post_s`: gather of the first bucket;
  `bucket_gap_ms_median`: between completions). `direct_tensors`: how many went zero-copy.

Usage: .venv/bin/python bench/weights.py [--models qwen2-1.5b,qwen2-7b] [--bucket-mb 1024]
       [--inflight 3] [--direct-kb 8192] [--variants 1024:3,1024:3:0] [--rounds 3] [--tiny]
       [--no-check] [--no-delta] [--transport nccl|colocated|disk|disk_delta] [--colocated-buckets]
       [--no-rollback]
       [--batch-below-kb 1024,0]
       [--budget-s 80]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.weights.process_group import free_port, init_custom_process_group  # noqa: E402
from miles.hostinfo import machine

QWEN2 = dict(model_type="qwen2", max_position_embeddings=32768, rope_theta=1_000_000.0,
             rms_norm_eps=1e-6, use_sliding_window=False, bos_token_id=151643, eos_token_id=151645)
MODELS = {
    "qwen2-1.5b": dict(QWEN2, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                       tie_word_embeddings=True),
    "qwen2-7b": dict(QWEN2, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                     tie_word_embeddings=False),
    "tiny-qwen2": dict(QWEN2, bos_token_id=None, eos_token_id=0, hidden_size=256,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=512, vocab_size=4096, tie_word_embeddings=True),
    "tiny-qwen3": dict(model_type="qwen3", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=4096,
                       max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
                       eos_token_id=0),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


T0 = time.perf_counter()


def progress(msg: str) -> None:
    """Where the time goes, on stderr (stdout carries only the JSON lines)."""
    print(f"[weights {time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


# ---- the raw broadcast: a bare receiver process ----------------------------------------------------

def raw_receiver(args) -> None:
    """--raw-receiver: join the 2-rank group and receive `rounds` x nbytes in chunks."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pg = init_custom_process_group(args.backend, "127.0.0.1", args.port, 2, 1, "raw", 600.0)
    buf = torch.empty(args.chunk_bytes, dtype=torch.uint8, device=device)
    tiny = torch.zeros(1, device=device)
    for _ in range(args.rounds):
        torch.distributed.broadcast(tiny, src=0, group=pg)  # start together
        left = args.nbytes
        while left > 0:
            n = min(left, args.chunk_bytes)
            torch.distributed.broadcast(buf[:n], src=0, group=pg)
            left -= n
        torch.distributed.broadcast(tiny, src=1, group=pg)  # everything arrived
        sync(device)


class RawBroadcast:
    def __init__(self, backend: str, trainer_device: torch.device, engine_device: str, nbytes: int,
                 chunk_bytes: int, rounds: int, log_dir: Path):
        port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--raw-receiver", "--port", str(port), "--backend", backend,
             "--device", engine_device, "--nbytes", str(nbytes), "--chunk-bytes", str(chunk_bytes),
             "--rounds", str(rounds)],
            stdout=open(log_dir / "raw-receiver.log", "w"), stderr=subprocess.STDOUT)
        self.pg = init_custom_process_group(backend, "127.0.0.1", port, 2, 0, "raw", 600.0)
        self.device, self.nbytes, self.chunk_bytes = trainer_device, nbytes, chunk_bytes
        self.buf = torch.randint(0, 255, (chunk_bytes,), dtype=torch.uint8, device=trainer_device)
        self.tiny = torch.zeros(1, device=trainer_device)

    def round(self) -> float:
        dist = torch.distributed
        dist.broadcast(self.tiny, src=0, group=self.pg)
        sync(self.device)
        t = time.perf_counter()
        left = self.nbytes
        while left > 0:
            n = min(left, self.chunk_bytes)
            dist.broadcast(self.buf[:n], src=0, group=self.pg)
            left -= n
        dist.broadcast(self.tiny, src=1, group=self.pg)
        sync(self.device)
        return time.perf_counter() - t

    def close(self) -> None:
        self.proc.wait(timeout=60)
        torch.distributed.destroy_process_group(self.pg)


# ---- the trainer side --------------------------------------------------------------------------------

def build_model(name: str, device: torch.device, model_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM
    fields = dict(MODELS[name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.dtype = "bfloat16"
    model_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(model_dir)  # all the engine needs with --load-format dummy
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def hf_tensors(model, bucket_bytes: int):
    from miles.backends.hf_weights import iter_hf_weight_buckets
    for bucket in iter_hf_weight_buckets(model, bucket_bytes):
        yield from bucket


def run_update_for(model, transport, version: int, bucket_bytes: int):
    """What FSDPBackend.update_weights does on the sender rank, on a plain (unsharded) model."""
    from miles.backends.hf_weights import iter_hf_weight_buckets
    from miles.weights.base import send_weights

    def run() -> None:
        send_weights(transport, version, iter_hf_weight_buckets(model, bucket_bytes))
    return run


async def check_engine(model, url: str, bucket_bytes: int) -> tuple[int, str]:
    """Every engine parameter against the trainer's tensor: the device digest on GPUs (seconds
    for 7B), sha256 on hosts. Returns (tensors checked, algorithm)."""
    from miles.engines.client import EngineClient
    from miles.weights.checks import CHECKSUMS, compare_checksums
    named = list(hf_tensors(model, bucket_bytes))
    algorithm = "device" if named[0][1].is_cuda else "sha256"
    trainer = {n: CHECKSUMS[algorithm](t) for n, t in named}
    async with EngineClient(url, timeout_s=1800) as c:
        compare_checksums(trainer, await c.weights_checksum(algorithm=algorithm), url=url, version=-1)
    return len(trainer), algorithm


def adamw_step(model, device: torch.device) -> None:
    """One real AdamW step: a forward/backward on random tokens, lr 1e-6 on fp32 master copies,
    the weights rounded back to bf16 (what a disk delta ships after a step of RL)."""
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, vocab, (2, 256), generator=gen).to(device)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is None:
                continue
            master = p.detach().float().clone().requires_grad_(True)
            master.grad = p.grad.float()
            opt = torch.optim.AdamW([master], lr=1e-6, foreach=False)
            opt.step()
            p.copy_(master.detach().to(p.dtype))
            p.grad = None
            del master, opt
    model.eval()
    sync(device)


def delta_after_one_step(model, device: torch.device, threads: int, deadline: float | None = None) -> dict:
    """One real AdamW step (`adamw_step`), then the disk-delta payload.
    Past `deadline` (perf_counter) the encode stops after the tensor at hand (at least one): the
    fraction is then over the tensors done (`delta_tensors` of `delta_of_tensors`)."""
    from miles.weights.delta_format import encode_chunks
    old = {n: t.detach().clone() for n, t in hf_tensors(model, 1 << 30)}
    adamw_step(model, device)
    progress("delta: optimizer step done; encoding")
    t = time.perf_counter()
    full = payload = changed = elements = done = 0
    total = len(old)
    with ThreadPoolExecutor(threads) as pool:
        for name, new in hf_tensors(model, 1 << 30):
            if done and deadline is not None and time.perf_counter() > deadline:
                progress(f"delta: budget reached after {done} of {total} tensors")
                break
            done += 1
            a = old.pop(name)
            changed += int((a.view(torch.int16) != new.view(torch.int16)).sum())
            elements += new.numel()
            nb = new.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            ob = a.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            _, chunks = encode_chunks(nb, ob, codec="zlib", level=1, chunk_bytes=64 << 20, pool=pool)
            full += nb.nbytes
            payload += sum(memoryview(c).nbytes for c, _, _ in chunks)
    return {"delta_frac": payload / full, "delta_changed_frac": changed / elements,
            "delta_payload_bytes": payload, "delta_encode_s": time.perf_counter() - t,
            "delta_tensors": done, "delta_of_tensors": total, "delta_bytes_covered": full}


def device_copy_s(nbytes: int, device: torch.device) -> float:
    """One copy of `nbytes` within `device` (the HBM-speed floor of a colocated publish)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync(device)
    t = time.perf_counter()
    dst.copy_(src)
    sync(device)
    return time.perf_counter() - t


class DecodeWatch:
    """One request after another streaming from the engine (greedy, ignore_eos) for as long as
    the bench runs: when each streamed part arrived and how many tokens the request had then.
    disk_delta never pauses the engine; these say what a request saw while a delta was encoded,
    prepared and applied (as the client sees it: its event loop shares the host with the encode)."""

    def __init__(self, url: str, max_new_tokens: int):
        from miles.engines.client import EngineClient
        self.client, self.max_new_tokens = EngineClient(url), max_new_tokens
        # (arrival, seconds since the last part, seconds per token since the last part)
        self.parts: list[tuple[float, float, float]] = []
        self.task: asyncio.Task | None = None
        self.error: BaseException | None = None

    async def _run(self) -> None:
        try:
            while True:
                last_t, last_n = None, 0
                async for part in self.client.generate_stream(
                        [5, 17, 42, 7, 99, 3], {"max_new_tokens": self.max_new_tokens, "temperature": 0.0,
                                                "ignore_eos": True}, timeout_s=600):
                    t, n = time.perf_counter(), len(part.output_ids)
                    if last_t is not None and n > last_n:
                        self.parts.append((t, t - last_t, (t - last_t) / (n - last_n)))
                    last_t, last_n = t, n
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - reported with the figures
            self.error = e

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())
        for _ in range(600):  # the first tokens, within a minute
            if len(self.parts) >= 8 or self.error is not None:
                break
            await asyncio.sleep(0.1)
        if self.error is not None or len(self.parts) < 8:
            raise RuntimeError(f"decode watch: no tokens streamed from the engine within 60 s ({self.error!r})")

    def window(self, t0: float, t1: float, per_token: bool = True) -> list[float]:
        return [pt if per_token else gap for t, gap, pt in self.parts if t0 <= t < t1]

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.client.close()


def decode_figures(watch: DecodeWatch, idle: list[tuple[float, float]],
                   busy: list[tuple[float, float]], phases: list[dict[str, tuple[float, float]]]) -> dict:
    """ms per token while nothing was published (`idle` windows) and while a delta was (`busy`):
    medians, and the longest gap a request saw during a publish (the apply's stall included),
    also per phase of the publish (encode: the trainer writes the delta; prepare: the engine
    decodes it; commit: the swap's round trip)."""
    def gaps(windows, per_token=True):
        return [g for a, b in windows for g in watch.window(a, b, per_token)]
    # a wait is counted where its part arrived: up to 50 ms past the publish (`phases`)
    quiet, during = gaps(idle), gaps(busy)
    waits = gaps([(p["encode"][0], p["commit"][1]) for p in phases], per_token=False)
    ms = lambda x: round(1e3 * x, 2)  # noqa: E731
    by_phase = {}
    for name in ("encode", "prepare", "commit"):
        got = gaps([p[name] for p in phases], per_token=False)
        by_phase[name] = ms(max(got)) if got else None
    return {"decode_max_gap_ms_by_phase": by_phase,
            "decode_ms_per_token_idle": ms(statistics.median(quiet)) if quiet else None,
            "decode_ms_per_token_publishing": ms(statistics.median(during)) if during else None,
            "decode_max_gap_ms_publishing": ms(max(waits)) if waits else None,
            "decode_tokens_publishing": len(during),
            "decode_error": repr(watch.error) if watch.error else None}


def timeline_summary(transport) -> dict:
    """Where the last publish's transfer time went (seconds since the transport's begin)."""
    rows = sorted(transport.timeline)
    if not rows:
        return {}
    done = [r[4] for r in rows]
    gaps = [b - a for a, b in zip(done, done[1:])]
    ms = lambda xs: [round(1e3 * x, 2) for x in xs]  # noqa: E731
    return {"first_post_s": round(rows[0][2], 5), "last_complete_s": round(done[-1], 5),
            "bucket_gap_ms_median": round(1e3 * statistics.median(gaps), 3) if gaps else None,
            "answer_lag_ms_median": round(1e3 * statistics.median(r[3] - r[2] for r in rows), 3),
            "timeline_ms": {"posted": ms(r[2] for r in rows), "answered": ms(r[3] for r in rows),
                            "complete": ms(done), "mib": [r[1] >> 20 for r in rows]}}


async def bench_model(name: str, args, work: Path) -> list[dict]:
    from miles.engines.embedded import launch_embedded_engine
    from miles.weights import WeightPublisher, WeightsConfig, make_transport

    trainer_device = torch.device(args.trainer_device)
    if trainer_device.type == "cuda":
        torch.cuda.set_device(trainer_device)
    backend = "nccl" if trainer_device.type == "cuda" else "gloo"
    model_dir = work / name
    model = build_model(name, trainer_device, model_dir)
    sync(trainer_device)
    nbytes = sum(t.numel() * t.element_size() for _, t in hf_tensors(model, 1 << 30))
    progress(f"{name}: {nbytes / 1e9:.2f} GB of weights built on {trainer_device}; starting the engine")
    bucket_bytes = args.bucket_mb << 20
    engine = await launch_embedded_engine(
        model_dir, log_path=(args.log_dir or work) / f"engine-{name}.log", ready_timeout_s=900,
        extra_args=["--device", args.engine_device, "--dtype", "bfloat16", "--load-format", "dummy",
                    "--skip-tokenizer-init", "--disable-cuda-graph", "--max-total-tokens", "2048",
                    "--context-length", "2048", "--max-running-requests", "4", "--log-level", "info",
                    "--torch-threads", str(max(1, min(8, (os.cpu_count() or 2) // 2)))])
    variants = [parse_variant(v, args.direct_kb) for v in args.variants.split(",")] \
        if args.variants else [(bucket_bytes, args.inflight, args.direct_kb << 10)]
    raw = None
    outs = []
    version = 1
    kind = args.transport
    try:
        cfg = WeightsConfig(transport=kind, bucket_bytes=variants[0][0], group_backend=backend,
                            queue_depth=args.queue_depth, inflight_buckets=variants[0][1],
                            direct_min_bytes=variants[0][2], connect_timeout_s=300,
                            colocated_direct=not args.colocated_buckets, delta_threads=args.delta_threads,
                            rollback=not args.no_rollback,
                            disk_dir=str(work / "disk") if kind in ("disk", "disk_delta") else "")
        transport = make_transport(cfg, rank=0)
        publisher = WeightPublisher(cfg, [engine.url], transport)
        await publisher.connect()
        progress(f"{name}: engine up and connected ({kind})")
        raw_s = []
        if kind == "nccl":
            raw = await asyncio.to_thread(RawBroadcast, backend, trainer_device, args.engine_device,
                                          nbytes, bucket_bytes, args.rounds + 1, work)
            await asyncio.to_thread(raw.round)  # warm-up
            raw_s = [await asyncio.to_thread(raw.round) for _ in range(args.rounds)]
            await asyncio.to_thread(raw.close)
            raw = None
        elif kind == "colocated":  # the reference: the same bytes copied once at HBM speed
            raw_s = [device_copy_s(nbytes, trainer_device) for _ in range(args.rounds + 1)][1:]
        batch_below = [int(x) << 10 for x in args.batch_below_kb.split(",")] if kind == "colocated" \
            else [cfg.colocated_batch_below_bytes]
        for (vb, vi, vd), vs in itertools.product(variants, batch_below):
            # the transport reads these at every begin()
            cfg.bucket_bytes, cfg.inflight_buckets, cfg.direct_min_bytes = vb, vi, vd
            cfg.colocated_batch_below_bytes = vs
            await publisher.publish(version, run_update_for(model, transport, version, vb))  # warm-up
            version += 1
            progress(f"{name}: warm-up publish done; {args.rounds} timed rounds")
            pub_s, paused, parts = [], [], []
            watch, idle, busy, phases = None, [], [], []
            if kind == "disk_delta":  # it never pauses: a request streams through every round
                watch = DecodeWatch(engine.url, max_new_tokens=1500)
                await watch.start()
            for r in range(args.rounds):
                if kind == "disk_delta":  # a delta of unchanged weights would be empty
                    await asyncio.to_thread(adamw_step, model, trainer_device)
                    t = time.perf_counter()
                    await asyncio.sleep(2.0)  # the decode speed with nothing published
                    idle.append((t, time.perf_counter()))
                t = time.perf_counter()
                report = await publisher.publish(version, run_update_for(model, transport, version, vb))
                busy.append((t, time.perf_counter()))
                # the phases on the publish's clock (a gap is counted where its part arrived)
                e, p = t + report.transfer_s, t + report.transfer_s + report.prepare_s
                phases.append({"encode": (t, e), "prepare": (e, p), "commit": (p, busy[-1][1] + 0.05)})
                version += 1
                pub_s.append(report.seconds)
                paused.append(report.paused_s)
                parts.append(report.metrics())
                direct = report.direct_tensors
            decode = {}
            if watch is not None:
                await watch.stop()
                decode = decode_figures(watch, idle, busy, phases)
            seconds = statistics.median(pub_s)
            raw_seconds = statistics.median(raw_s) if raw_s else None
            stall = {k.split("/", 1)[1]: statistics.median(m[k] for m in parts) for k in parts[0]
                     if k.endswith("_s")}
            ref = {}
            if kind == "nccl":
                ref = {"raw_broadcast_GBps": nbytes / raw_seconds / 1e9,
                       "frac_of_raw": raw_seconds / seconds, "raw_seconds": raw_seconds}
            elif kind == "colocated":  # target: stall <= 1.3 x copy + pause + resume
                ref = {"hbm_copy_s": raw_seconds, "stall_over_copy": (
                    stall["stall_s"] - stall["pause_s"] - stall["resume_s"]) / raw_seconds}
            outs.append({
                "bench": "weights", "model": name, "bytes": nbytes,
                "transport": kind if backend == "nccl" or kind != "nccl" else "nccl(gloo)",
                "seconds": seconds, "GBps": nbytes / seconds / 1e9, **stall, **ref,
                "payload_bytes": report.payload_bytes, "machine": machine(),
                "delta_frac": report.payload_bytes / report.bytes if kind == "disk_delta" else None,
                "changed_frac": report.changed_frac, **decode,
                "rollback": cfg.rollback if kind == "disk_delta" else None,
                "paused_s": statistics.median(paused),
                "bucket_bytes": vb, "inflight_buckets": vi, "buckets": math.ceil(nbytes / vb),
                "direct_min_bytes": vd, "direct_tensors": direct, "publish_s_all": pub_s,
                "colocated_direct": cfg.colocated_direct if kind == "colocated" else None,
                "batch_below_bytes": vs if kind == "colocated" else None,
                "stall_s_all": [m["weights/stall_s"] for m in parts],
                "ordered_calls": getattr(transport, "_ordered", None), "rounds": args.rounds,
                "checked_tensors": 0, **(timeline_summary(transport) if kind == "nccl" else {}),
                # colocated direct writes, the last round: ms since begin() at the gate (engines
                # paused), the last copy issued, the copies done on the GPU, the engine's answer
                **({"direct_phases_ms": {k: round(1e3 * v, 3) for k, v in transport.phases.items()}}
                   if getattr(transport, "phases", None) else {})})
            # the publish figures now, before the check and the delta (minutes for a 7B on a
            # loaded host): a run cut short by its time limit still reports them
            print(json.dumps({**outs[-1], "part": "publish"}), flush=True)
        if not args.no_check:
            checked, algorithm = await check_engine(model, engine.url, bucket_bytes)
            for out in outs:  # (what the engine holds after the last variant's last publish)
                out["checked_tensors"], out["check"] = checked, algorithm
            progress(f"{name}: {checked} tensors checked ({algorithm})")
        await publisher.close()
        transport.close()
    finally:
        if raw is not None:
            await asyncio.to_thread(raw.close)
        await engine.stop_async()
    if not args.no_delta and kind != "disk_delta":  # disk_delta: its publishes measured it
        deadline = T0 + args.budget_s if args.budget_s > 0 else None
        delta = delta_after_one_step(model, trainer_device, args.delta_threads, deadline)
        progress(f"{name}: delta encoded in {delta['delta_encode_s']:.1f} s")
        for out in outs:
            out.update(delta)
    del model
    if trainer_device.type == "cuda":
        torch.cuda.empty_cache()
    return outs


def parse_variant(text: str, direct_kb: int) -> tuple[int, int, int]:
    """'bucket MiB:inflight[:direct KiB]' -> (bucket_bytes, inflight_buckets, direct_min_bytes)."""
    parts = [int(x) for x in text.split(":")]
    if len(parts) not in (2, 3):
        raise SystemExit(f"--variants: {text!r} is not MiB:inflight or MiB:inflight:directKiB")
    return parts[0] << 20, parts[1], (parts[2] if len(parts) == 3 else direct_kb) << 10


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None)
    p.add_argument("--tiny", action="store_true", help="CPU smoke test (gloo, tiny models)")
    p.add_argument("--bucket-mb", type=int, default=None)
    p.add_argument("--queue-depth", type=int, default=2)
    p.add_argument("--log-dir", type=Path, default=None, help="keep the engine logs here")
    p.add_argument("--inflight", type=int, default=3, help="weights.inflight_buckets")
    p.add_argument("--direct-kb", type=int, default=8192,
                   help="weights.direct_min_bytes in KiB (0: every bucket one flat broadcast)")
    p.add_argument("--variants", default="", help="e.g. 1024:3,1024:3:0,256:3 (bucket MiB:inflight"
                   "[:direct KiB]), each timed against the same engine")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--transport", default="nccl", choices=["nccl", "colocated", "disk", "disk_delta"],
                   help="colocated: trainer and engine on one GPU (CUDA IPC)")
    p.add_argument("--colocated-buckets", action="store_true",
                   help="colocated: flat buckets the engine copies out (weights.colocated_direct = "
                        "false) instead of writing into the engine's weights")
    p.add_argument("--batch-below-kb", default="1024",
                   help="colocated: weights.colocated_batch_below_bytes values in KiB, each timed "
                        "(e.g. 1024,0: small tensors in one _foreach_copy_, or every tensor a copy_)")
    p.add_argument("--trainer-device", default=None)
    p.add_argument("--engine-device", default=None)
    p.add_argument("--delta-threads", type=int, default=min(16, os.cpu_count() or 2))
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--no-rollback", action="store_true",
                   help="disk_delta: weights.rollback = false (engines keep no v-1: today's one-phase "
                        "commit, the baseline of the fleet transaction's stall)")
    p.add_argument("--no-delta", action="store_true")
    p.add_argument("--budget-s", type=float, default=None,
                   help="the delta's encode stops at a tensor boundary past this (0: no limit; "
                        "default 80 on GPUs, none with --tiny, whose encode takes milliseconds)")
    # the raw receiver (internal)
    p.add_argument("--raw-receiver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--device", help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--chunk-bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.raw_receiver:
        raw_receiver(args)
        return
    gpus_needed = 2 if args.transport == "nccl" else 1
    tiny = args.tiny or not (torch.cuda.is_available() and torch.cuda.device_count() >= gpus_needed)
    if tiny and args.transport == "colocated":
        raise SystemExit("--transport colocated shares GPU memory (CUDA IPC): it needs a GPU")
    args.models = args.models or ("tiny-qwen2,tiny-qwen3" if tiny else "qwen2-1.5b,qwen2-7b")
    args.trainer_device = args.trainer_device or ("cpu" if tiny else "cuda:0")
    args.engine_device = args.engine_device or (
        "cpu" if tiny else "cuda:1" if args.transport == "nccl" else args.trainer_device)
    args.bucket_mb = args.bucket_mb or (1 if tiny else 1024)
    args.budget_s = (0.0 if tiny else 80.0) if args.budget_s is None else args.budget_s
    if tiny:
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="miles-bench-weights-") as tmp:
        for name in args.models.split(","):
            for out in asyncio.run(bench_model(name, args, Path(tmp))):
                print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
