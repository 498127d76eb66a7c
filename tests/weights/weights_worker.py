"""One trainer rank of the end-to-end weight tests (launched by weights_helpers.run_ranks).

    python weights_worker.py <scenario> <out.json>      (ENGINE_URLS, MODEL_PATH, WORK_DIR in env)

Scenarios, each in one process (group) because start-up dominates the cost on CPU:
- nccl2: FSDP on 2 gloo ranks -> 2 embedded engines over the nccl transport (gloo group):
  in-flight requests cross in_place and retract publishes, check_weights, a refused bucket
  (engines resumed, clear error, next publish works).
- moe: FSDP on 1 rank, tiny Qwen3-MoE -> 1 engine: nccl bit-exact + greedy generation equal to an
  engine loaded from the trainer's HF export; then disk, disk_delta, and corrupted / truncated
  deltas refused while the engine keeps serving.
Rank 0 writes what it saw to <out.json>; the pytest side asserts on it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from backend_helpers import make_samples  # noqa: E402

from miles.algo import LossConfig  # noqa: E402
from miles.backends import RankInfo, TrainConfig, make_backend  # noqa: E402
from miles.engines.client import EngineClient  # noqa: E402
from miles.weights import WeightPublisher, WeightPublishError, WeightsConfig, make_transport  # noqa: E402
from miles.weights.base import DelegatingTransport  # noqa: E402

SFT = LossConfig(loss_type="sft", loss_reduction="token")


class Renaming(DelegatingTransport):
    """Forwards to `inner` but sends one tensor under a name no engine has (a refused bucket)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.done = False

    def send(self, version, buckets):
        self.inner.send(version, (self._rename(named) for named in buckets))

    def _rename(self, named):
        if not self.done:
            named = [("model.layers.0.bogus.weight", named[0][1])] + list(named[1:])
            self.done = True
        return named


async def wait_healthy(urls: list[str], timeout_s: float = 120.0) -> None:
    """The engines start alongside this process (the test overlaps the two start-ups)."""
    deadline = time.monotonic() + timeout_s
    for url in urls:
        async with EngineClient(url, timeout_s=2.0, max_retries=0) as c:
            while not await c.health():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine {url} not healthy within {timeout_s} s")
                await asyncio.sleep(0.1)


def backend_for(path: str, rank: RankInfo, lr: float = 1e-3):
    cfg = TrainConfig(model_path=path, param_dtype="float32", lr=lr, max_tokens_per_microbatch=4096,
                      grad_clip=0.0)
    backend = make_backend("fsdp")
    backend.init(cfg, rank, SFT)
    return backend


async def stream_until_first_token(client: EngineClient, prompt: list[int], n: int):
    """Start a greedy streaming request; return (async iterator, first chunk) once it generates."""
    it = client.generate_stream(prompt, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
    first = await it.__anext__()
    return it, first


async def drain(it):
    last = None
    async for chunk in it:
        last = chunk
    return last


def spans(result) -> list[list]:
    return [[s.version, s.start, s.end] for s in result.weight_versions]


# ---- nccl2 ---------------------------------------------------------------------------------------

def nccl2(rank: RankInfo, out: dict) -> None:
    urls = os.environ["ENGINE_URLS"].split(",")
    backend = backend_for(os.environ["MODEL_PATH"], rank)
    # direct_min_bytes: matrices go zero-copy ("miles_direct"), norms packed in the flat part.
    cfg = WeightsConfig(transport="nccl", check_weights=True, bucket_bytes=96 << 10, queue_depth=2,
                        direct_min_bytes=16 << 10,
                        connect_timeout_s=30, bucket_timeout_s=30, control_timeout_s=30)
    transport = make_transport(cfg, rank=rank)
    samples = make_samples(groups=2, per_group=2, seed=3)
    if rank.rank != 0:
        for _ in range(2):  # v1, v2, refused v3, v3: mirror rank 0's collectives
            backend.update_weights(transport, 0)
            backend.train(samples)
        backend.update_weights(transport, 0)
        backend.update_weights(transport, 0)
        return
    asyncio.run(nccl2_rank0(backend, cfg, transport, urls, samples, out))


async def nccl2_rank0(backend, cfg, transport, urls, samples, out) -> None:
    import msgspec
    await wait_healthy(urls)
    client = EngineClient(urls[0])
    publisher = WeightPublisher(cfg, urls, transport)
    t = time.perf_counter()
    await publisher.connect()
    out["connect_s"] = time.perf_counter() - t

    def update(version, tr=transport):
        return lambda: backend.update_weights(tr, version)

    # v1, in place: a request in flight crosses the update.
    it, first = await stream_until_first_token(client, [5, 6, 7, 8], 400)
    report = await publisher.publish(1, update(1))
    crossed = await drain(it)
    out["v1"] = {"report": msgspec.to_builtins(report), "spans": spans(crossed),
                 "finish": crossed.finish_reason.type, "tokens": len(crossed.output_ids),
                 "versions": [(await c.model_info())["weight_version"] for c in
                              [EngineClient(u) for u in urls]]}
    await asyncio.to_thread(backend.train, samples)

    # v2, retract: the request's KV is dropped and recomputed under the new weights.
    retract = WeightPublisher(msgspec.structs.replace(cfg, pause_mode="retract"), urls, transport)
    it, first = await stream_until_first_token(client, [9, 10, 11], 400)
    report = await retract.publish(2, update(2))
    crossed = await drain(it)
    out["v2"] = {"report": msgspec.to_builtins(report), "spans": spans(crossed),
                 "retractions": crossed.num_retractions, "finish": crossed.finish_reason.type}
    await asyncio.to_thread(backend.train, samples)

    # v3 refused: one tensor under a bogus name. Engines resume, keep version 2, still generate.
    try:
        await publisher.publish(3, update(3, Renaming(transport)))
        out["refused"] = None
    except WeightPublishError as e:
        out["refused"] = {"message": str(e), "step": e.step}
    info = await client.model_info()
    gen = await client.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0.0})
    out["after_refusal"] = {"version": info["weight_version"], "generated": len(gen.output_ids)}

    # v3 again: the group is rebuilt and the publish goes through, checked.
    report = await publisher.publish(3, update(3))
    out["v3"] = {"report": msgspec.to_builtins(report),
                 "versions": [(await EngineClient(u).model_info())["weight_version"] for u in urls]}
    await publisher.close()
    await client.close()


# ---- moe -------------------------------------------------------------------------------------

def moe(rank: RankInfo, out: dict) -> None:
    asyncio.run(moe_async(rank, out))


async def moe_async(rank: RankInfo, out: dict) -> None:
    import msgspec

    from miles.engines.embedded import launch_embedded_engine

    url = os.environ["ENGINE_URLS"]
    path = os.environ["MODEL_PATH"]
    work = Path(os.environ["WORK_DIR"])
    backend = backend_for(path, rank, lr=1e-3)
    samples = make_samples(groups=2, per_group=2, seed=4)
    await wait_healthy([url])
    client = EngineClient(url)
    prompt = [3, 14, 15, 92, 65]
    greedy = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}

    async def publish(publisher, transport, version, after=None):
        def run():
            backend.update_weights(transport, version)
            if after is not None:
                after(transport)
        return await publisher.publish(version, run)

    # 1. nccl (gloo): bit-exact, and greedy generation equals an engine loaded from the HF export.
    await asyncio.to_thread(backend.train, samples)
    # direct_min_bytes=0: every bucket one flat broadcast (SGLang's "flattened_bucket").
    cfg = WeightsConfig(transport="nccl", check_weights=True, bucket_bytes=256 << 10,
                        direct_min_bytes=0, connect_timeout_s=30, bucket_timeout_s=30)
    tr = make_transport(cfg, rank=rank)
    pub = WeightPublisher(cfg, [url], tr)
    await pub.connect()
    report = await publish(pub, tr, 1)
    out["nccl"] = msgspec.to_builtins(report)
    export = work / "export-v1"
    await asyncio.to_thread(backend.save_model, export, True)
    twin = await launch_embedded_engine(export, extra_args=["--torch-threads", "1", "--log-level",
                                                            "warning", "--random-seed", "0"])
    try:
        async with EngineClient(twin.url) as tc:
            out["greedy_published"] = (await client.generate(prompt, greedy)).output_ids
            out["greedy_export"] = (await tc.generate(prompt, greedy)).output_ids
            out["checksums_equal_export"] = (await client.weights_checksum()) == (await tc.weights_checksum())
    finally:
        await twin.stop_async()
    await pub.close()
    tr.close()

    # 2. disk: a full safetensors export per version, loaded by /update_weights_from_disk.
    await asyncio.to_thread(backend.train, samples)
    cfg = WeightsConfig(transport="disk", check_weights=True, bucket_bytes=256 << 10,
                        disk_dir=str(work / "disk"))
    tr = make_transport(cfg, rank=rank, model_path=path)
    pub = WeightPublisher(cfg, [url], tr)
    await pub.connect()
    out["disk"] = msgspec.to_builtins(await publish(pub, tr, 2))
    out["disk_dirs"] = sorted(p.name for p in (work / "disk").iterdir())
    await pub.close()
    tr.close()

    # 3. disk_delta: v3 is raw (no base yet), v4 is an XOR delta against v3.
    cfg = WeightsConfig(transport="disk_delta", check_weights=True, disk_dir=str(work / "delta"),
                        delta_chunk_bytes=64 << 10, delta_threads=2)
    tr = make_transport(cfg, rank=rank)
    pub = WeightPublisher(cfg, [url], tr)
    await pub.connect()
    await asyncio.to_thread(backend.train, samples)
    out["delta_v3"] = msgspec.to_builtins(await publish(pub, tr, 3))
    out["delta_v3_base"] = tr.last_manifest.base_version
    backend.cfg.lr = 1e-6  # a realistic RL step: few bytes change
    await asyncio.to_thread(backend.train, samples)
    out["delta_v4"] = msgspec.to_builtins(await publish(pub, tr, 4))
    out["delta_v4_base"] = tr.last_manifest.base_version
    out["delta_v4_kinds"] = sorted({e.kind for e in tr.last_manifest.entries})

    # 4. A corrupted and a truncated delta are refused; the engine keeps serving v4, unchanged.
    before = await client.weights_checksum()
    await asyncio.to_thread(backend.train, samples)

    def corrupt(t):
        data = sorted(t.delta_dir.glob("data-*.bin"), key=lambda p: p.stat().st_size)[-1]
        raw = bytearray(data.read_bytes())
        for i in range(len(raw) // 3, len(raw) // 3 + 64):
            raw[i] ^= 0x5A
        data.write_bytes(bytes(raw))

    def truncate(t):
        data = sorted(t.delta_dir.glob("data-*.bin"), key=lambda p: p.stat().st_size)[-1]
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])

    for name, damage in (("corrupted", corrupt), ("truncated", truncate)):
        try:
            await publish(pub, tr, 5, after=damage)
            out[name] = None
        except WeightPublishError as e:
            out[name] = {"message": str(e), "step": e.step}
        gen = await client.generate(prompt, greedy)
        out[name + "_after"] = {
            "version": (await client.model_info())["weight_version"],
            "unchanged": (await client.weights_checksum()) == before,
            "generated": len(gen.output_ids)}
    # 5. The base is still v4 on both sides, so a good v5 delta goes through, checked.
    out["delta_v5"] = msgspec.to_builtins(await publish(pub, tr, 5))
    out["delta_v5_base"] = tr.last_manifest.base_version
    out["final_version"] = (await client.model_info())["weight_version"]
    await pub.close()
    tr.close()
    await client.close()


def main() -> None:
    scenario, out_path = sys.argv[1], Path(sys.argv[2])
    rank = RankInfo.from_env()
    out: dict = {"rank": rank.rank}
    {"nccl2": nccl2, "moe": moe}[scenario](rank, out)
    out_path.write_text(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
