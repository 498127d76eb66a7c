"""Where a disk delta waits between prepare and apply: the engine's GPU when free memory exceeds the
delta's bytes by DEVICE_HEADROOM_BYTES, else host memory; the transport keeps each engine's answer
(`staged_on`) and the engine logs it at INFO. On CPU: the decision with a stubbed free-memory probe,
and a real CPU engine end to end (a raw first publish stored uncompressed, then an XOR one decoded
on 3 threads)."""

from __future__ import annotations

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


async def test_a_cpu_engine_stages_on_the_host_and_says_so(tmp_path):
    from miles.engines.embedded import launch_embedded_engine
    from miles.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(num_hidden_layers=2)
    engine = await launch_embedded_engine(path, log_path=tmp_path / "engine.log", extra_args=[
        "--torch-threads", "1", "--log-level", "info", "--random-seed", "0"])
    try:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        cfg = WeightsConfig(transport="disk_delta", check_weights=True, disk_dir=str(tmp_path / "d"),
                            delta_threads=3, delta_chunk_bytes=4 << 10)
        transport = make_transport(cfg, rank=0)
        publisher = WeightPublisher(cfg, [engine.url], transport)
        await publisher.connect()

        def run_update(version):
            def run():
                transport.begin(version)
                transport.send_bucket([(n, p.detach()) for n, p in model.named_parameters()])
                transport.finish(version)
            return run

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
            await EngineClient(engine.url).update_weights_from_delta(
                "prepare", str(transport.delta_dir), threads=0)
        await publisher.close()
        transport.close()
    finally:
        await engine.stop_async()
