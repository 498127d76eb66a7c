"""Disk-delta keeps generating: a real CPU embedded engine streams one long request while a delta is
prepared and applied through the publisher. The request never stops (no pause, no abort): it
streams tokens during `prepare`, its weight-version spans switch from the old version to the new
one at the apply, and it finishes by length. Afterwards the engine's weights equal the trainer's
(`/weights_checksum` against the checksums of what was sent), the publish report's pause and
resume are 0, and the engine swapped the whole weights in by pointer and copied the slices of
fused ones (its apply answer, and its log)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.engines.client import EngineClient
from miles.engines.embedded import launch_embedded_engine
from miles.tiny import build_tiny_model
from miles.weights import WeightPublisher, WeightsConfig
from miles.weights.checks import ChecksumTap
from miles.weights.disk_delta import DiskDeltaTransport

MAX_NEW_TOKENS = 2500
DEADLINE_S = 120.0


class Watched(DiskDeltaTransport):
    """The real transport; it notes how many tokens the request had streamed around each phase."""

    def __init__(self, cfg, progress: dict):
        super().__init__(cfg)
        self.progress, self.seen = progress, {}

    def prepare(self, version):
        self.seen[f"prepare_{version}_start"] = self.progress["tokens"]
        super().prepare(version)
        self.seen[f"prepare_{version}_end"] = self.progress["tokens"]

    def commit(self, version):
        self.seen[f"commit_{version}_start"] = self.progress["tokens"]
        super().commit(version)
        self.seen[f"commit_{version}_end"] = self.progress["tokens"]


async def test_a_delta_is_applied_while_a_request_keeps_generating(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(num_hidden_layers=4, hidden_size=256, intermediate_size=768)
    engine = await launch_embedded_engine(path, log_path=tmp_path / "engine.log", extra_args=[
        "--torch-threads", "1", "--log-level", "info", "--random-seed", "0",
        "--max-total-tokens", "4096"])
    client = EngineClient(engine.url)
    try:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        cfg = WeightsConfig(transport="disk_delta", check_weights=True, disk_dir=str(tmp_path / "d"))
        progress = {"tokens": 0}
        delta = Watched(cfg, progress)
        tap = ChecksumTap(delta)
        publisher = WeightPublisher(cfg, [engine.url], tap)
        await publisher.connect()

        def run_update(version):
            def run():
                tap.send(version, [[(n, p.detach()) for n, p in model.named_parameters()]])
            return run

        await publisher.publish(1, run_update(1))  # v1: the checkpoint's own weights, raw
        with torch.no_grad():  # v2: every weight a little different, as after a step
            gen = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)

        started = asyncio.Event()

        async def stream():
            last = None
            async for part in client.generate_stream(
                    [5, 17, 42, 7, 99, 3], {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0,
                                            "ignore_eos": True}, timeout_s=DEADLINE_S):
                last = part
                progress["tokens"] = len(part.output_ids)
                started.set()
            return last

        request = asyncio.ensure_future(stream())
        await asyncio.wait_for(started.wait(), DEADLINE_S)
        report = await asyncio.wait_for(publisher.publish(2, run_update(2)), DEADLINE_S)
        published_at = progress["tokens"]
        assert not request.done(), "the request finished before the delta was applied: make it longer"
        final = await asyncio.wait_for(request, DEADLINE_S)

        # It never stopped: finished by length, every token there, and it streamed while the
        # engines prepared the delta.
        assert final.finish_reason.type == "length" and len(final.output_ids) == MAX_NEW_TOKENS
        seen = delta.seen
        assert seen["prepare_2_end"] > seen["prepare_2_start"], seen
        # The tokens before the apply are v1's, the rest v2's: one switch, inside the commit.
        spans = [(s.version, s.start, s.end) for s in final.weight_versions]
        assert [v for v, _, _ in spans] == ["1", "2"], spans
        switch = spans[0][2]
        assert spans == [("1", 0, switch), ("2", switch, MAX_NEW_TOKENS)]
        assert seen["commit_2_start"] <= switch < MAX_NEW_TOKENS and published_at < MAX_NEW_TOKENS

        # Never paused; the stall is the commit; the engine holds what the trainer sent.
        assert report.checked and report.paused_s == 0.0
        assert report.pause_s == report.resume_s == report.stall_transfer_s == 0.0
        assert report.stall_s == pytest.approx(report.load_s + report.version_s) and report.load_s > 0
        assert 0.5 < report.changed_frac <= 1.0
        sums = await client.weights_checksum()
        assert sums == tap.sent_checksums
        info = await client.model_info()
        assert info["weight_version"] == "2"

        # Whole weights (norms, o_proj, down_proj, the tied embedding) swapped by pointer; the
        # slices of the fused q/k/v and gate/up copied.
        [applied] = delta.applied
        print(f"streamed tokens around the phases {seen}, switch at token {switch}; stall "
              f"{1e3 * report.stall_s:.1f} ms (engine held its step lock {1e3 * applied['swap_s']:.1f} "
              f"ms), prepare {1e3 * report.prepare_s:.1f} ms")
        per_layer_whole, per_layer_sliced = 6, 5
        assert applied["swapped"] == 4 * per_layer_whole + 2, applied
        assert applied["copied"] == 4 * per_layer_sliced, applied
        assert 0 < applied["swap_s"] <= report.load_s
        log = (tmp_path / "engine.log").read_text()
        assert f"{applied['swapped']} tensors swapped in, {applied['copied']} copied" in log
        await publisher.close()
        tap.close()
    finally:
        await client.close()
        await engine.stop_async()
