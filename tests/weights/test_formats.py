"""The pieces under the transports, without engines: the delta format (XOR, compression, checksums,
damage detection), the CUDA IPC codec (no pickle; the CPU fall-back errors), flat buckets and the
send pipeline."""

from __future__ import annotations

import threading
import time
import types
import zlib

import msgspec
import numpy as np
import pytest
import torch

from miles.weights import WeightsConfig
from miles.weights.buckets import BufferPool, Coalescer, SendPipeline, flatten
from miles.weights.delta_format import (DeltaError, DeltaWriter, decode_entry, decompress,
                                        encode_chunks, read_manifest, sha256)

# ---- delta format ---------------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().copy()


def one_step(seed: int = 0, n: int = 50_000) -> tuple[np.ndarray, np.ndarray]:
    """bf16 weights before and after a small update (only a few elements cross a rounding step)."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g) * 0.02
    old = master.to(torch.bfloat16)
    new = (master + 1e-6 * torch.randn(n, generator=g).sign()).to(torch.bfloat16)
    return tensor_bytes(old), tensor_bytes(new)


def write_delta(tmp_path, entries, *, base_version=3, codec="zlib", chunk_bytes=16 << 10):
    w = DeltaWriter(tmp_path / "delta-v000004", version=4, base_version=base_version, codec=codec)
    items = []
    for name, new, base in entries:
        kind, chunks = encode_chunks(new, base, codec=codec, level=1, chunk_bytes=chunk_bytes, pool=None)
        items.append((name, "bfloat16", [new.nbytes // 2], kind, chunks, sha256(new),
                      sha256(base) if kind == "xor" else None))
    w.write_bucket(items)
    return w.close(), w.final


@pytest.mark.parametrize("codec", ["zlib", "lzma"])
def test_xor_delta_round_trip_is_exact_and_small(tmp_path, codec):
    old, new = one_step()
    changed = float((old.view(np.uint16) != new.view(np.uint16)).mean())
    assert 0 < changed < 0.2
    manifest, d = write_delta(tmp_path, [("w", new, old), ("norm", old, old)], codec=codec)
    assert manifest.payload_bytes < 0.5 * manifest.full_bytes
    norm = manifest.entries[1]
    assert all(c.length == 0 for c in norm.chunks)  # unchanged: all-zero chunks cost nothing
    back = read_manifest(d)
    assert back == manifest
    assert np.array_equal(decode_entry(d, back, back.entries[0], old), new)
    assert np.array_equal(decode_entry(d, back, back.entries[1], old), old)


def test_raw_entries_need_no_base(tmp_path):
    _, new = one_step(1)
    manifest, d = write_delta(tmp_path, [("w", new, None)], base_version=None)
    assert manifest.entries[0].kind == "raw" and manifest.base_version is None
    assert np.array_equal(decode_entry(d, manifest, manifest.entries[0], None), new)


def test_damage_is_detected_with_a_clear_error(tmp_path):
    old, new = one_step(2)
    manifest, d = write_delta(tmp_path, [("w", new, old)])
    entry = manifest.entries[0]
    data = d / entry.file
    good = data.read_bytes()
    # A flipped byte inside a compressed chunk: undecodable, or decodes to the wrong tensor.
    chunk = next(c for c in entry.chunks if c.length)
    bad = bytearray(good)
    bad[chunk.offset + chunk.length // 2] ^= 0xFF
    data.write_bytes(bytes(bad))
    with pytest.raises(DeltaError, match=r"tensor 'w': (chunk \d+ is corrupted|checksum mismatch)"):
        decode_entry(d, manifest, entry, old)
    # A file cut short.
    data.write_bytes(good[: len(good) // 2])
    with pytest.raises(DeltaError, match=r"data file 'data-00000.bin' is truncated \(chunk \d+ needs bytes"):
        decode_entry(d, manifest, entry, old)
    # Intact delta, wrong base: named as such, not as corruption.
    data.write_bytes(good)
    with pytest.raises(DeltaError, match="this engine's weights are not the delta's base"):
        decode_entry(d, manifest, entry, new)
    # A damaged manifest.
    (d / "manifest.json").write_bytes(b'{"format": "miles-delta/1", "version": ')
    with pytest.raises(DeltaError, match="manifest.json is damaged"):
        read_manifest(d)
    with pytest.raises(DeltaError, match="no manifest.json"):
        read_manifest(tmp_path)


def test_raw_chunks_are_stored_and_xor_chunks_only_when_they_do_not_shrink(tmp_path):
    old, new = one_step(4)
    noise = np.random.default_rng(0).integers(0, 256, new.nbytes, dtype=np.uint8)  # XOR won't shrink
    zeros = np.zeros(4096, dtype=np.uint8)
    manifest, d = write_delta(tmp_path, [("raw", new, None), ("xor", new, old),
                                         ("noise", new ^ noise, new), ("zeros", zeros, None)])
    raw, xor, noisy, empty = manifest.entries
    assert raw.kind == "raw" and all(c.stored and c.length == c.raw_length for c in raw.chunks)
    assert xor.kind == "xor" and not any(c.stored for c in xor.chunks)
    assert sum(c.length for c in xor.chunks) < 0.5 * new.nbytes
    assert noisy.kind == "xor" and all(c.stored for c in noisy.chunks)
    assert all(c.length == 0 for c in empty.chunks)  # an all-zero raw tensor costs nothing either
    for entry, want, base in ((raw, new, None), (xor, new, old), (noisy, new ^ noise, new),
                              (empty, zeros, None)):
        assert np.array_equal(decode_entry(d, manifest, entry, base), want), entry.name
    # A stored chunk whose length is not its raw length is named as corrupted.
    bad = msgspec.structs.replace(raw, chunks=[msgspec.structs.replace(raw.chunks[0], length=10),
                                               *raw.chunks[1:]])
    with pytest.raises(DeltaError, match=r"tensor 'raw': chunk 0 is corrupted: stored with 10 bytes"):
        decode_entry(d, manifest, bad, None)


def test_a_bucket_is_encoded_chunk_by_chunk_on_the_pool_as_one_tensor_is(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from miles.weights.delta_format import encode_tensors
    pairs = [one_step(5 + k, n=20_000 * (k + 1)) for k in range(3)]
    pairs = [(new, old) for old, new in pairs] + [(pairs[0][1], None)]
    with ThreadPoolExecutor(3) as pool:
        got = encode_tensors(pairs, codec="zlib", level=1, chunk_bytes=8 << 10, pool=pool)
    for (new, base), (kind, chunks, digest) in zip(pairs, got):
        want_kind, want = encode_chunks(new, base, codec="zlib", level=1, chunk_bytes=8 << 10, pool=None)
        assert kind == want_kind and digest == sha256(new)
        assert [(bytes(c), n, st) for c, n, st in chunks] == [(bytes(c), n, st) for c, n, st in want]
    assert [k for k, _, _ in got] == ["xor", "xor", "xor", "raw"]


def test_a_manifest_written_before_stored_chunks_still_decodes(tmp_path):
    old, new = one_step(8)
    manifest, d = write_delta(tmp_path, [("w", new, old)])
    raw = msgspec.json.decode((d / "manifest.json").read_bytes())
    raw["entries"][0]["chunks"] = [c[:3] for c in raw["entries"][0]["chunks"]]  # [offset, length, raw]
    (d / "manifest.json").write_bytes(msgspec.json.encode(raw))
    back = read_manifest(d)
    assert not any(c.stored for c in back.entries[0].chunks)
    assert np.array_equal(decode_entry(d, back, back.entries[0], old), new)


def test_pruning_keeps_the_version_just_written_when_a_resumed_run_repeats_numbers(tmp_path):
    from miles.weights.disk import prune
    for v in (3, 4, 5, 9, 10):  # 9 and 10: an earlier run that got further than this one
        (tmp_path / f"delta-v{v:06d}").mkdir()
    (tmp_path / "delta-v000011.tmp").mkdir()  # not a version directory: left alone
    prune(tmp_path, "delta-v", 2, current=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["delta-v000004", "delta-v000005",
                                                         "delta-v000011.tmp"]
    prune(tmp_path, "delta-v", 1, current=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["delta-v000005", "delta-v000011.tmp"]


def test_decompression_is_bounded_by_the_declared_length():
    bomb = zlib.compress(bytes(10 << 20))
    with pytest.raises(DeltaError, match=r"decodes to 1025\+ bytes, expected 1024"):
        decompress(bomb, "zlib", 1024)
    with pytest.raises(DeltaError, match="undecodable zlib data"):
        decompress(b"not zlib", "zlib", 10)


def test_zstd_needs_its_package_or_says_so():
    try:
        import zstandard  # noqa: F401
    except ImportError:
        from miles.weights.delta_format import compress
        with pytest.raises(DeltaError, match="needs the `zstandard` package"):
            compress(b"x", "zstd", 3)
    else:
        pytest.skip("zstandard is installed")


def test_manifest_names_no_file_outside_its_directory(tmp_path):
    old, new = one_step(3)
    manifest, d = write_delta(tmp_path, [("w", new, old)])
    raw = msgspec.json.decode((d / "manifest.json").read_bytes())
    raw["entries"][0]["file"] = "../../etc/passwd"
    (d / "manifest.json").write_bytes(msgspec.json.encode(raw))
    with pytest.raises(DeltaError, match="outside the delta directory"):
        read_manifest(d)


# ---- CUDA IPC codec -------------------------------------------------------------------------------

def fake_reduction():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    args = (torch.Tensor, torch.Size([6]), (1,), 2, torch.storage.TypedStorage, torch.bfloat16, 0,
            b"\x01handle\xff", 4096, 512, False, b"/torch_123_refcount", 64, b"\x00event", True)
    return rebuild_cuda_tensor, args


def test_ipc_fields_round_trip_as_json_without_pickle():
    from miles.weights import cuda_ipc
    fields = cuda_ipc.fields_from_reduction(fake_reduction(), "GPU-1234")
    bucket = cuda_ipc.IpcBucket(fields, ["a", "b"], [[2], [1, 2]])
    wire = msgspec.json.encode(bucket)
    assert b"pickle" not in wire and b"\x80" not in wire  # plain JSON text, handles in base64
    back = cuda_ipc.decode_bucket(wire.decode())
    assert back == bucket
    args = cuda_ipc.rebuild_args(back.flat, local_index=3)
    _, orig = fake_reduction()
    assert args[1:4] == orig[1:4] and args[5] == torch.bfloat16 and args[6] == 3
    assert args[4] is torch.UntypedStorage and args[0] is torch.Tensor
    assert args[7:] == orig[7:]


def test_ipc_refuses_what_it_cannot_share():
    from miles.weights import cuda_ipc
    from torch.multiprocessing.reductions import reduce_tensor
    with pytest.raises(ValueError, match="the tensor is on cpu, not on a GPU"):
        cuda_ipc.share(torch.zeros(3))
    with pytest.raises(ValueError, match="not a CUDA tensor"):
        cuda_ipc.fields_from_reduction(reduce_tensor(torch.zeros(3)), "GPU-0")
    fields = cuda_ipc.fields_from_reduction(fake_reduction(), "GPU-1234")
    with pytest.raises(ValueError, match="dtype 'complex64' is not one of"):
        cuda_ipc.rebuild_args(msgspec.structs.replace(fields, dtype="complex64"), 0)
    with pytest.raises(ValueError, match="not a miles_cuda_ipc bucket"):
        cuda_ipc.decode_bucket('{"flat": {}, "names": []}')


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fall-back")
def test_without_cuda_the_colocated_path_says_what_to_use():
    from miles.engines.embedded_engine.weights import apply_cuda_ipc_bucket
    from miles.weights import cuda_ipc, make_transport
    with pytest.raises(RuntimeError, match="this process has no CUDA"):
        cuda_ipc.local_device_index("GPU-1234")
    with pytest.raises(RuntimeError, match="transport='colocated' shares GPU memory .* use "
                                           "transport='nccl'"):
        make_transport(WeightsConfig(transport="colocated")).connect(["http://127.0.0.1:9"])
    cpu_engine = types.SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(ValueError, match="'miles_cuda_ipc' needs an engine on CUDA"):
        apply_cuda_ipc_bucket(cpu_engine, "{}")


# ---- flat buckets and the send pipeline ------------------------------------------------------------

def test_coalescer_buckets_by_bytes_and_dtype():
    out = []
    c = Coalescer(100, out.append)
    c.add([("a", torch.ones(10)), ("b", torch.ones(10)), ("c", torch.ones(20))])  # 40+40 | 80
    c.add([("d", torch.ones(4, dtype=torch.bfloat16))])                         # dtype change
    c.add([("e", torch.ones(50))])                                              # alone: > bucket
    c.flush()
    assert [b.names for b in out] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [b.index for b in out] == [0, 1, 2, 3] and out[2].dtype_name == "bfloat16"
    x, y = torch.randn(2, 3), torch.randn(4)
    b = flatten([("x", x), ("y", y)])
    assert b.flat.shape == (10,) and b.nbytes == 40
    views = dict(b.views())
    assert torch.equal(views["x"], x) and torch.equal(views["y"], y)
    with pytest.raises(ValueError, match="one dtype"):
        flatten([("x", x), ("y", y.double())])


def test_direct_tensors_skip_the_flatten_and_follow_the_packed_ones():
    big, small, big2, odd = torch.randn(16, 4), torch.randn(3), torch.randn(32), torch.randn(4, 16).t()
    pool = BufferPool()
    b = flatten([("big", big), ("small", small), ("big2", big2), ("odd", odd)], pool=pool,
                direct_min_bytes=64)
    # Packed first (the small one, and a non-contiguous one however large), then the direct ones.
    assert b.names == ["small", "odd", "big", "big2"] and b.flat_count == 2
    assert b.shapes == [[3], [16, 4], [16, 4], [32]]
    assert b.direct[0].data_ptr() == big.data_ptr() and b.direct[1].data_ptr() == big2.data_ptr()
    assert b.nbytes == 4 * (3 + 64 + 64 + 32) and len(b.wire) == 3
    views = dict(b.views())
    assert all(torch.equal(views[n], t) for n, t in
               (("big", big), ("small", small), ("big2", big2), ("odd", odd)))
    everything = flatten([("big", big), ("big2", big2)], direct_min_bytes=64)
    assert everything.flat is None and everything.flat_count == 0 and len(everything.wire) == 2
    b.release()
    assert b.flat is None and b.direct == []
    assert flatten([("big", big), ("small", small)]).flat_count == 2  # 0: all packed (SGLang's)


def _engine_weights_and_group(name: str):
    """A tiny model's engine weights (fp32, CPU) and an UpdateGroups holding a one-rank gloo group
    `name` (rank 0 is the broadcasts' source, so a receive completes at once)."""
    import socket
    from miles.engines.embedded_engine.params import Weights
    from miles.engines.embedded_engine.shapes import load_hf_config, shape_from_config
    from miles.engines.embedded_engine.weights import UpdateGroups, init_custom_process_group
    from miles.tiny import build_tiny_model
    weights = Weights(shape_from_config(load_hf_config(build_tiny_model(arch="qwen3"))),
                      torch.device("cpu"), torch.float32)
    groups = UpdateGroups(torch.device("cpu"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    groups.groups[name] = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 1, 0, name, 30)
    return weights, groups


def test_a_direct_tensor_of_another_dtype_lands_in_scratch_and_is_copied_in():
    """The engine is fp32, the wire bf16: the direct tensor cannot go straight into the parameter,
    so it is received into scratch and copied in (cast) when the bucket completes."""
    weights, groups = _engine_weights_and_group("s")
    shape = list(weights.final_norm.shape)
    groups.receive(weights, "s", ["model.norm.weight"], ["bfloat16"], [shape], "miles_direct", 0)
    (pending,) = groups.pending.values()
    assert pending.flat is None and [n for n, _ in pending.scratch] == ["model.norm.weight"]
    received = pending.scratch[0][1]
    received.copy_(torch.linspace(-1, 1, received.numel()).view(shape))  # what arrived
    groups.complete_pending(weights)
    assert torch.equal(weights.final_norm, received.float())
    assert isinstance(groups.take_timing()["copy_enqueue_s"], float)


def test_a_direct_bucket_with_a_bad_flat_count_is_refused_before_anything_is_received():
    weights, groups = _engine_weights_and_group("g")
    before = weights.embed.clone()
    names = ["model.norm.weight", "model.embed_tokens.weight"]
    shapes = [list(weights.final_norm.shape), list(weights.embed.shape)]
    for bad in (3, -1, None):
        with pytest.raises(ValueError, match=f"flat_count: {bad!r} must be in \\[0, 2\\]"):
            groups.receive(weights, "g", names, ["float32"] * 2, shapes, "miles_direct", bad)
    assert not groups.pending and torch.equal(weights.embed, before)


def test_send_pipeline_keeps_order_and_overlaps_one_bucket():
    events = []

    def send(bucket):
        events.append(("send", bucket.index))
        return lambda: events.append(("complete", bucket.index))

    p = SendPipeline(send, depth=2, timeout_s=5)
    p.start()
    for i in range(3):
        p.put(flatten([("t", torch.ones(2))], index=i))
    p.drain()
    # Bucket k completes only after bucket k+1 went out: the two overlap.
    assert events == [("send", 0), ("send", 1), ("complete", 0), ("send", 2), ("complete", 1),
                      ("complete", 2)]


def test_send_pipeline_with_inflight_completes_k_buckets_later():
    events = []

    def send(bucket):
        events.append(("send", bucket.index))
        return lambda: events.append(("complete", bucket.index))

    p = SendPipeline(send, depth=4, timeout_s=5, inflight=3)
    p.start()
    for i in range(5):
        p.put(flatten([("t", torch.ones(2))], index=i))
    p.drain()
    assert events == [("send", 0), ("send", 1), ("send", 2), ("send", 3), ("complete", 0),
                      ("send", 4), ("complete", 1), ("complete", 2), ("complete", 3), ("complete", 4)]


def test_buffer_pool_reuses_released_buffers_and_keeps_bytes_exact():
    pool = BufferPool(min_bytes=64)
    out = []
    c = Coalescer(64, out.append, pool=pool)
    tensors = [(f"t{i}", torch.randn(8)) for i in range(8)]  # 32 bytes each: two per bucket
    c.add(tensors[:4])
    c.flush()
    assert pool.allocated == 2 and [b.names for b in out] == [["t0", "t1"], ["t2", "t3"]]
    assert torch.equal(out[1].flat, torch.cat([tensors[2][1], tensors[3][1]]))
    for b in out:
        b.release()
    assert out[0].flat is None
    c.add(tensors[4:])
    c.flush()
    assert pool.allocated == 2  # the next version's buckets went into the same two buffers
    assert torch.equal(out[3].flat, torch.cat([tensors[6][1], tensors[7][1]]))
    assert dict(out[2].views())["t4"].equal(tensors[4][1])


def test_send_pipeline_failure_reaches_the_caller():
    release = threading.Event()

    def send(bucket):
        if bucket.index == 1:
            raise ConnectionError("engine went away")
        release.wait(5)
        return None

    p = SendPipeline(send, depth=1, timeout_s=2)
    p.start()
    p.put(flatten([("t", torch.ones(1))], index=0))
    release.set()
    p.put(flatten([("t", torch.ones(1))], index=1))
    deadline = time.monotonic() + 5
    while p._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ConnectionError, match="engine went away"):
        p.put(flatten([("t", torch.ones(1))], index=2))
    with pytest.raises(ConnectionError):
        p.drain()


# ---- the device checksum ------------------------------------------------------------------------

def test_device_digest_sees_every_word_and_its_position(monkeypatch):
    from miles.weights import checks
    from miles.weights.checks import device_digest
    g = torch.Generator().manual_seed(0)
    t = torch.randn(1000, 37, generator=g)
    d = device_digest(t)
    assert d == device_digest(t.clone()) and d.startswith("float32:148000:")
    changed = t.clone()
    changed[500, 3] = torch.nextafter(changed[500, 3], torch.tensor(1e9))  # one bit of one word
    swapped = t.clone().reshape(-1)
    swapped[[10, 11]] = swapped[[11, 10]]
    assert len({d, device_digest(changed), device_digest(swapped.reshape(t.shape))}) == 3
    assert device_digest(t[:999]) != d                                       # truncated
    assert device_digest(t, torch.bfloat16) == device_digest(t.to(torch.bfloat16)) != d
    odd = torch.arange(7, dtype=torch.uint8)                                 # padded to 8 bytes
    assert device_digest(odd) != device_digest(torch.cat([odd, odd.new_zeros(1)]))
    monkeypatch.setattr(checks, "_CHUNK_WORDS", 1000)                        # many chunks, same sum
    assert device_digest(t) == d
    assert device_digest(t.T) == device_digest(t.T.contiguous())             # bytes in logical order


def test_checksum_tap_auto_picks_sha256_for_host_tensors_and_refuses_unknown_names():
    from miles.weights.checks import ChecksumTap, tensor_sha256

    class Sink:
        def send(self, version, buckets):
            list(buckets)

    tap = ChecksumTap(Sink())
    tap.send(1, [[("w", torch.ones(3))]])
    assert tap.algorithm == "sha256" and tap.sent_checksums == {"w": tensor_sha256(torch.ones(3))}
    with pytest.raises(ValueError, match="weights.checksum='md5' is not one of auto, device, sha256"):
        ChecksumTap(Sink(), "md5")
