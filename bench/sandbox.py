"""Sandbox lifecycle benchmark: one JSON line per backend.

    python bench/sandbox.py [--backends subprocess,bwrap,docker] [--n 50] [--episodes 200]

Per backend: `n` sequential episodes of create -> exec("echo hi") -> destroy give the p50 of each
step (ms); then `episodes` through a SandboxPool with `--concurrency` give episodes_per_s.
Backends that cannot run here are reported on stderr and skipped. Target: create+exec+destroy p50
under 50 ms for subprocess and bwrap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from miles.sandboxes import BackendUnavailableError, SandboxPool, SandboxSpec, get_backend
from miles.hostinfo import machine


async def make(name: str, base_dir: str):
    if name in ("subprocess", "bwrap"):
        return get_backend(name, base_dir=base_dir), SandboxSpec(ttl_s=600)
    if name == "docker":
        backend = get_backend("docker")
        if not await backend.available():
            raise BackendUnavailableError("no Docker daemon answers")
        from miles.sandboxes.baseimage import ensure_base_image
        return backend, SandboxSpec(image=await ensure_base_image(backend.api), ttl_s=600)
    raise BackendUnavailableError(f"{name}: cloud backends need their provider (no network)")


async def bench(name: str, n: int, episodes: int, concurrency: int, base_dir: str) -> dict:
    backend, spec = await make(name, base_dir)
    creates, execs, destroys = [], [], []
    try:
        for i in range(n + 2):
            t0 = time.perf_counter()
            sb = await backend.create(spec)
            t1 = time.perf_counter()
            r = await sb.exec("echo hi")
            t2 = time.perf_counter()
            await sb.destroy()
            t3 = time.perf_counter()
            assert r.ok and r.stdout == "hi\n", r
            if i >= 2:  # the first two warm caches (spawner start, image inspect)
                creates.append(t1 - t0)
                execs.append(t2 - t1)
                destroys.append(t3 - t2)
        pool = SandboxPool(backend, max_concurrent=concurrency)

        async def episode(sb):
            await sb.exec("echo hi")

        t0 = time.perf_counter()
        await asyncio.gather(*(pool.run(spec, episode) for _ in range(episodes)))
        rate = episodes / (time.perf_counter() - t0)
    finally:
        await backend.close()
    ms = lambda xs: round(statistics.median(xs) * 1000, 2)  # noqa: E731
    return {"bench": "sandbox", "backend": name, "create_ms_p50": ms(creates),
            "exec_ms_p50": ms(execs), "destroy_ms_p50": ms(destroys),
            "episode_ms_p50": ms([a + b + c for a, b, c in zip(creates, execs, destroys)]),
            "episodes_per_s": round(rate, 1), "concurrency": concurrency, "n": n,
            "loadavg_1m": round(os.getloadavg()[0], 2), "machine": machine()}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="subprocess,bwrap,docker")
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    from miles.sandboxes.hostfs import default_base_dir
    base_dir = tempfile.mkdtemp(prefix="miles-sbx-bench-",
                                dir=os.path.dirname(default_base_dir()))
    os.chmod(base_dir, 0o711)
    try:
        for name in args.backends.split(","):
            scale = 4 if name == "docker" else 1  # containers cost ~0.3 s each
            try:
                line = await bench(name, max(5, args.n // scale), max(10, args.episodes // scale),
                                   args.concurrency, base_dir)
            except BackendUnavailableError as exc:
                print(f"skip {name}: {exc}", file=sys.stderr)
                continue
            print(json.dumps(line), flush=True)
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
