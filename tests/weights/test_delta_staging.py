"""Where a disk delta waits between prepare and apply: the engine's GPU when free memory exceeds the
delta's bytes by DEVICE_HEADROOM_BYTES, else host memory; the transport keeps each engine's answer
(`staged_on`) and the engine logs it at INFO. On CPU: the decision with a stubbed free-memory probe,
and a real CPU engine end to end (a raw first publish stored uncompressed, then an XOR one decoded
on 3 threads)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from miles.engines.client import EngineClient
from miles.engines.embedded_engine import delta
from miles.weights import WeightPublisher, WeightsConfig, make_transport


def test_staging_device_needs_the_delta_plus_headroom_free(monkeypatch):
    gpu = torch.device("cuda", 0)
    manifest = SimpleNamespace(full_bytes=1 << 30)
    need = manifest.full_bytes + delta.DEVICE_HEADROOM_BYTES
    for free, where in ((need + 1, gpu), (need, torch.device("cpu")), (0, torch.device("cpu"))):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, f=free: (f, 1 << 40))
        assert delta._staging_device(gpu, manifest) == where, free
    assert delta._staging_device(torch.device("cpu"), manifest) == torch.device("cpu")


def test_the_changed_elements_are_staged_on_the_gpu_when_whole_tensors_do_not_fit(monkeypatch):
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    xor = SimpleNamespace(kind="xor", changed=1000, shape=[100, 100], dtype="bfloat16")
    manifest = SimpleNamespace(full_bytes=1 << 30, entries=[xor, xor])
    sparse = 2 * 1000 * (4 + 2)  # an int32 index and a bf16 value per changed element
    assert delta._sparse_bytes(manifest) == sparse
    head = delta.DEVICE_HEADROOM_BYTES
    for free, mode, want in ((manifest.full_bytes + head + 1, "auto", (gpu, False)),
                             (manifest.full_bytes + head + 1, "sparse", (gpu, True)),
                             (sparse + head + 1, "auto", (gpu, True)),
                             (sparse + head + 1, "dense", (cpu, False)),
                             (sparse + head, "auto", (cpu, False))):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, f=free: (f, 1 << 40))
        assert delta._staging_plan(gpu, manifest, mode) == want, (free, mode)
    assert delta._staging_plan(cpu, manifest, "auto") == (cpu, False)
    assert delta._staging_plan(cpu, manifest, "sparse") == (cpu, True)
    # A raw entry, or one from a trainer that did not count its changes, is staged whole.
    for other in (SimpleNamespace(kind="raw", changed=None, shape=[4], dtype="bfloat16"),
                  SimpleNamespace(kind="xor", changed=None, shape=[4], dtype="bfloat16")):
        mixed = SimpleNamespace(full_bytes=1 << 30, entries=[xor, other])
        assert delta._sparse_bytes(mixed) is None
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (sparse + head + 1, 1 << 40))
        assert delta._staging_plan(gpu, mixed, "auto") == (cpu, False)


@contextlib.asynccontextmanager
async def cpu_engine_and_publisher(tmp_path, extra_args: list[str], **weights):
    """A real CPU embedded engine (tiny model) and a disk_delta publisher into it, checked by
    checksum; yields (model, transport, publisher, run_update, client)."""
    from miles.engines.embedded import launch_embedded_engine
    from miles.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(num_hidden_layers=2)
    engine = await launch_embedded_engine(path, log_path=tmp_path / "engine.log", extra_args=[
        "--torch-threads", "1", "--log-level", "info", "--random-seed", "0", *extra_args])
    client = EngineClient(engine.url)
    try:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        cfg = WeightsConfig(transport="disk_delta", check_weights=True, disk_dir=str(tmp_path / "d"),
                            **weights)
        transport = make_transport(cfg, rank=0)
        publisher = WeightPublisher(cfg, [engine.url], transport)
        await publisher.connect()

        def run_update(version):
            def run():
                transport.send(version, [[(n, p.detach()) for n, p in model.named_parameters()]])
            return run

        yield model, transport, publisher, run_update, client
        await publisher.close()
        transport.close()
    finally:
        await client.close()
        await engine.stop_async()


async def test_a_sparse_delta_is_scattered_into_the_live_weights(tmp_path):
    """--delta-staging sparse on a CPU engine: the changed elements are staged and written in
    place, the fused q/k/v and gate/up slices too; the engine then holds what the trainer sent."""
    async with cpu_engine_and_publisher(tmp_path, ["--delta-staging", "sparse"], delta_threads=2) as (
            model, transport, publisher, run_update, client):
        assert (await publisher.publish(1, run_update(1))).checked  # raw: staged whole
        before = await client.model_info()
        with torch.no_grad():  # a few elements of every weight, as a small step moves them
            gen = torch.Generator().manual_seed(3)
            for p in model.parameters():
                flat = p.view(-1)
                idx = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 50)]
                flat[idx] += 0.5
        report = await publisher.publish(2, run_update(2))
        assert report.checked and 0 < report.changed_frac < 0.05, report.changed_frac
        n = len(transport.last_manifest.entries)
        assert all(e.changed for e in transport.last_manifest.entries)
        [applied] = transport.applied
        assert applied["scattered"] == n and applied["swapped"] == applied["copied"] == 0, applied
        log = (tmp_path / "engine.log").read_text()
        assert f"staged on cpu (sparse: {n} as changed elements" in log
        assert f"0 tensors swapped in, 0 copied, {n} scattered" in log
        assert before["weight_version"] == "1"
        assert (await client.model_info())["weight_version"] == "2"


async def test_a_cpu_engine_stages_on_the_host_and_says_so(tmp_path):
    async with cpu_engine_and_publisher(tmp_path, [], delta_threads=3, delta_chunk_bytes=4 << 10) as (
            model, transport, publisher, run_update, client):
        report = await publisher.publish(1, run_update(1))
        assert report.checked
        assert transport.staged_on == ["cpu"]
        assert "staged on cpu" in (tmp_path / "engine.log").read_text()
        # The first publish is raw: its chunks are stored as they are, never compressed.
        first = transport.last_manifest
        assert first.base_version is None and report.payload_bytes == first.full_bytes
        assert all(c.stored for e in first.entries for c in e.chunks if c.length)
        # The next is an XOR against it, encoded and decoded on 3 threads, and checked again.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        report = await publisher.publish(2, run_update(2))
        assert report.checked and transport.last_manifest.base_version == 1
        assert {e.kind for e in transport.last_manifest.entries} == {"xor"}
        assert 0 < report.payload_bytes < report.bytes
        # Bad input is refused by name.
        with pytest.raises(Exception, match=r"threads: 0 is not in \[1, 64\]"):
            await client.update_weights_from_delta("prepare", str(transport.delta_dir), threads=0)
