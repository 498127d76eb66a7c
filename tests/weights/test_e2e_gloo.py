"""End to end on CPU: the FSDP trainer -> embedded engines, over the nccl transport's code path on
gloo, plus disk and disk-delta, with check_weights on (every engine parameter's sha256 equals what
the trainer sent). The trainer ranks run weights_worker.py; the figures it reports are checked here
so a failure names what broke.
"""

from __future__ import annotations

import pytest

from miles.tiny import build_tiny_model
from weights_helpers import run_ranks, with_engines


async def test_fsdp_two_ranks_to_two_engines(tmp_path):
    path = build_tiny_model(arch="qwen3")
    zero = (await with_engines(path, 2, tmp_path, lambda urls: run_ranks(
        "nccl2", tmp_path, world_size=2, timeout_s=240,
        env={"ENGINE_URLS": ",".join(urls), "MODEL_PATH": str(path)})))[0]
    assert zero["connect_s"] < 10
    v1 = zero["v1"]
    assert v1["report"]["checked"] and v1["report"]["buckets"] > 2, v1["report"]
    # Zero-copy: most tensors (the matrices) went straight into engine parameters, not all.
    assert 0 < v1["report"]["direct_tensors"] < v1["report"]["tensors"], v1["report"]
    assert v1["versions"] == ["1", "1"]
    # The in-flight request crossed the in-place update: both versions, no gap, nothing lost.
    assert v1["finish"] == "length" and v1["tokens"] == 400
    (va, sa, ea), (vb, sb, eb) = v1["spans"]
    assert (va, vb) == ("default", "1") and sa == 0 and ea == sb and eb == 400 and ea >= 1
    v2 = zero["v2"]
    assert v2["report"]["checked"] and v2["finish"] == "length"
    assert [s[0] for s in v2["spans"]] == ["1", "2"] and v2["retractions"] >= 1
    refused = zero["refused"]
    assert refused is not None and refused["step"] == "transfer"
    assert "model.layers.0.bogus.weight" in refused["message"] and "resumed" in refused["message"]
    assert zero["after_refusal"] == {"version": "2", "generated": 4}
    assert zero["v3"]["report"]["checked"] and zero["v3"]["versions"] == ["3", "3"]


async def test_moe_bit_exact_then_disk_and_disk_delta(tmp_path):
    path = build_tiny_model(arch="qwen3_moe")
    out = (await with_engines(path, 1, tmp_path, lambda urls: run_ranks(
        "moe", tmp_path, world_size=1, timeout_s=240,
        env={"ENGINE_URLS": urls[0], "MODEL_PATH": str(path), "WORK_DIR": str(tmp_path)})))[0]
    # nccl (gloo): bit-exact, per-expert names, and the same greedy tokens as the HF export.
    assert out["nccl"]["checked"] and out["nccl"]["tensors"] > 50
    assert out["nccl"]["direct_tensors"] == 0  # direct_min_bytes=0: flat buckets only
    assert out["checksums_equal_export"]
    assert out["greedy_published"] == out["greedy_export"] and len(out["greedy_export"]) == 16
    # disk: checked, and only the newest versions are kept.
    assert out["disk"]["checked"] and out["disk_dirs"] == ["v000002"]
    # disk_delta: raw first, then XOR against v3, both checked.
    assert out["delta_v3"]["checked"] and out["delta_v3_base"] is None
    assert out["delta_v4"]["checked"] and out["delta_v4_base"] == 3
    assert "xor" in out["delta_v4_kinds"]
    assert out["delta_v4"]["payload_bytes"] < out["delta_v4"]["bytes"]
    # the changed fraction: all of a raw version, a part of an lr=1e-6 step's
    assert out["delta_v3"]["changed_frac"] == 1.0 and 0 < out["delta_v4"]["changed_frac"] < 1.0
    # stall: the swap only (disk_delta prepares while serving)
    v4 = out["delta_v4"]
    assert v4["stall_s"] == pytest.approx(v4["pause_s"] + v4["stall_transfer_s"] + v4["load_s"]
                                          + v4["version_s"] + v4["resume_s"])
    assert v4["stall_transfer_s"] == 0.0 and v4["background_s"] > 0
    # Damaged deltas are refused while the engine serves: it keeps v4, unchanged, and generates.
    for name, needle in (("corrupted", "corrupted"), ("truncated", "truncated")):
        err = out[name]
        assert err is not None and err["step"] == "prepare", (name, err)
        assert needle in err["message"] and "nothing was changed" in err["message"], err
        assert out[name + "_after"] == {"version": "4", "unchanged": True, "generated": 16}
    assert out["delta_v5"]["checked"] and out["delta_v5_base"] == 4 and out["final_version"] == "5"
