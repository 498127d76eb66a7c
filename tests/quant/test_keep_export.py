"""The keep-in-BF16 list (never substring) and the exporter's refusal rules."""

from __future__ import annotations

import pytest
import torch

from miles.quant.export import QuantizingTransport
from miles.quant.keep import DEFAULT_KEEP, KeepList, matches
from miles.weights.base import BucketStream, send_weights


def test_patterns_match_exactly_by_prefix_or_glob_never_by_substring():
    assert matches("model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp")
    assert not matches("model.layers.11.mlp.up_proj.weight", "model.layers.1.mlp")
    assert not matches("model.layers.11.mlp.up_proj.weight", "layers.1.mlp")
    assert not matches("model.layers.1.mlp.up_proj.weight", "layers.1.mlp")  # not a substring either
    assert matches("model.layers.1.mlp.up_proj.weight", "*.layers.1.mlp.*")
    assert not matches("model.layers.11.mlp.up_proj.weight", "*.layers.1.mlp.*")
    # verl's bug: the router exclusion must not catch the fused/unfused gate projections
    keep = KeepList()
    w = torch.zeros(4, 4)
    assert not keep.quantizes("model.layers.0.mlp.gate.weight", w)          # the router
    assert keep.quantizes("model.layers.0.mlp.gate_proj.weight", w)
    assert keep.quantizes("model.layers.0.mlp.gate_up_proj.weight", w)
    assert keep.quantizes("model.layers.0.mlp.experts.3.gate_proj.weight", w)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.2.input_layernorm.weight", "model.layers.2.self_attn.q_norm.weight"):
        assert not keep.quantizes(name, w), name
    assert not keep.quantizes("model.layers.0.self_attn.q_proj.bias", torch.zeros(4))
    assert not keep.quantizes("model.layers.0.mlp.up_proj.weight", torch.zeros(4, 4, dtype=torch.int8))
    assert "*.mlp.gate.weight" in DEFAULT_KEEP


def test_user_patterns_count_hits():
    keep = KeepList(["model.layers.3", "model.layers.30.*"])
    keep.quantizes("model.layers.3.mlp.up_proj.weight", torch.zeros(2, 2))
    keep.quantizes("model.layers.31.mlp.up_proj.weight", torch.zeros(2, 2))
    assert keep.unused() == ["model.layers.30.*"]


class Recorder(BucketStream):
    """The transport contract, recording what it is given (the e2e tests use real ones)."""

    def __init__(self):
        self.sent, self.finished = [], []

    def connect(self, engine_urls): pass

    def begin(self, version): self.sent = []

    def send_bucket(self, named_tensors): self.sent.append(list(named_tensors))

    def finish(self, version): self.finished.append(version)


def test_parts_travel_together_under_sglang_names_and_the_view_is_not_quantized_twice(monkeypatch):
    inner = Recorder()
    tr = QuantizingTransport(inner, "fp8", KeepList())
    w = torch.randn(8, 8, dtype=torch.bfloat16)
    norm = torch.ones(8, dtype=torch.bfloat16)
    calls = []
    import miles.quant.export as export
    real = export.quantize
    monkeypatch.setattr(export, "quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    views = []

    def tapped():  # what the checksum tap does: it asks for the view as the bucket passes
        views.append(tr.engine_view("m.layers.0.mlp.up_proj.weight", w))
        assert tr.engine_view("m.layers.0.input_layernorm.weight", norm) is norm
        yield [("m.layers.0.mlp.up_proj.weight", w), ("m.layers.0.input_layernorm.weight", norm)]

    tr.send(1, tapped())
    (view,) = views
    assert len(calls) == 1  # the tap's quantization was reused for the bucket
    (bucket,) = inner.sent
    assert [n for n, _ in bucket] == ["m.layers.0.mlp.up_proj.weight",
                                      "m.layers.0.mlp.up_proj.weight_scale_inv",
                                      "m.layers.0.input_layernorm.weight"]
    assert bucket[0][1].dtype == torch.float8_e4m3fn and view.dtype == torch.float32
    assert inner.finished == [1] and tr.quantize_s > 0


def test_a_nan_weight_is_refused_before_the_inner_finishes_and_every_bucket_is_walked():
    inner = Recorder()
    tr = QuantizingTransport(inner, "mxfp4", KeepList(), raw_fp8=True)
    bad = torch.zeros(4, 32)
    bad[1, 2] = float("nan")
    walked = []

    def buckets():  # the gather is collective: send_weights walks it to the end anyway
        for name, t in (("a.weight", bad), ("b.weight", torch.zeros(4, 32))):
            walked.append(name)
            yield [(name, t)]

    with pytest.raises(ValueError, match=r"'a\.weight' has 1 non-finite values"):
        send_weights(tr, 3, buckets())
    assert inner.sent == [] and inner.finished == [] and walked == ["a.weight", "b.weight"]


def test_raw_fp8_sends_bytes():
    inner = Recorder()
    tr = QuantizingTransport(inner, "nvfp4", KeepList(), raw_fp8=True)
    tr.send(1, [[("x.weight", torch.randn(4, 32))]])
    dtypes = {n: t.dtype for n, t in inner.sent[0]}
    assert dtypes == {"x.weight": torch.uint8, "x.weight_scale": torch.uint8,
                      "x.weight_scale_2": torch.float32}
