"""WeightsConfig validation (errors name the key and the value) and make_transport's choices."""

from __future__ import annotations

import msgspec
import pytest

from miles.backends.base import RankInfo
from miles.weights import WeightsConfig, make_transport
from miles.weights.checks import ChecksumTap
from miles.weights.colocated import ColocatedTransport
from miles.weights.disk import DiskTransport
from miles.weights.disk_delta import DiskDeltaTransport
from miles.weights.nccl import NcclTransport


def test_defaults_and_toml_decode():
    cfg = WeightsConfig()
    assert (cfg.transport, cfg.pause_mode, cfg.check_weights) == ("nccl", "in_place", False)
    cfg = msgspec.toml.decode(b'transport = "disk_delta"\ndisk_dir = "d"\ndelta_codec = "lzma"\n'
                              b'delta_level = 6\n', type=WeightsConfig)
    assert cfg.transport == "disk_delta" and cfg.delta_level == 6


@pytest.mark.parametrize("toml, needle", [
    (b'transprt = "nccl"', "transprt"),
    (b'transport = "rdma"', "transport"),
    (b'pause_mode = "abort"', "pause_mode"),
])
def test_decode_errors_name_the_key(toml, needle):
    with pytest.raises((msgspec.ValidationError, ValueError), match=needle):
        msgspec.toml.decode(toml, type=WeightsConfig)


@pytest.mark.parametrize("kwargs, needle", [
    ({"bucket_bytes": 0}, "weights.bucket_bytes=0 must be an integer >= 1"),
    ({"queue_depth": 0}, "weights.queue_depth=0"),
    ({"direct_min_bytes": -1}, "weights.direct_min_bytes=-1 must be an integer >= 0"),
    ({"pause_timeout_s": 0}, "weights.pause_timeout_s=0 must be a finite number > 0"),
    ({"transfer_timeout_s": float("inf")}, "weights.transfer_timeout_s=inf"),
    ({"master_port": 70000}, "weights.master_port=70000 must be <= 65535"),
    ({"transport": "disk"}, "weights.disk_dir is empty; transport='disk'"),
    ({"transport": "disk_delta", "disk_dir": "d", "delta_level": 12}, "weights.delta_level=12 must be"),
    ({"pause_mode": "abort"}, "weights.pause_mode='abort' is not one of in_place, retract"),
    ({"master_address": ""}, "weights.master_address is empty"),
])
def test_python_construction_is_checked_too(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        WeightsConfig(**kwargs)


def test_make_transport_picks_senders(tmp_path):
    nccl = WeightsConfig()
    assert isinstance(make_transport(nccl, rank=0), NcclTransport)
    assert make_transport(nccl, rank=0).traits.sender
    assert not make_transport(nccl, rank=1).traits.sender
    # A RankInfo works as well as an int; colocated: every rank feeds its own engine.
    info = RankInfo(rank=1, world_size=2, master_port=1234)
    colo = make_transport(WeightsConfig(transport="colocated"), rank=info)
    assert isinstance(colo, ColocatedTransport) and colo.traits.sender and colo.world_size == 2
    disk = make_transport(WeightsConfig(transport="disk", disk_dir=str(tmp_path)), rank=0,
                          model_path="m")
    assert isinstance(disk, DiskTransport) and str(disk.source_dir) == "m"
    delta = make_transport(WeightsConfig(transport="disk_delta", disk_dir=str(tmp_path)), rank=2)
    assert isinstance(delta, DiskDeltaTransport) and not delta.traits.sender
    assert not delta.traits.pauses_engines and delta.traits.sets_version


def test_check_weights_wraps_the_sender_only(tmp_path):
    cfg = WeightsConfig(check_weights=True)
    tap = make_transport(cfg, rank=0)
    assert isinstance(tap, ChecksumTap) and isinstance(tap.inner, NcclTransport) and tap.traits.sender
    assert not isinstance(make_transport(cfg, rank=1), ChecksumTap)

    class Recipe:
        class train:
            model_path = "from-recipe"
    disk = make_transport(WeightsConfig(transport="disk", disk_dir=str(tmp_path), check_weights=True),
                          recipe=Recipe())
    assert str(disk.inner.source_dir) == "from-recipe" and disk.traits.pauses_engines
