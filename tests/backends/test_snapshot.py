"""In-memory trainer snapshots (miles/backends/snapshot.py): the double-buffered file and a
real FSDP backend on gloo restored from it, on 1 and 2 ranks."""

from __future__ import annotations

import numpy as np
import pytest
from backend_helpers import REPO, run_ranks

from miles.wire import snapshot

WORKER = REPO / "tests" / "backends" / "snapshot_worker.py"


def test_double_buffer_keeps_the_newest_whole_snapshot_and_finds_a_torn_one(tmp_path):
    f = snapshot.SnapshotFile(tmp_path / "trainer-0.snap")
    assert f.images() == [] and f.newest() is None
    for call in (1, 2, 3):
        f.write({"train_call": call}, [np.full(10, call, np.float32), np.arange(3, dtype=np.int64)])
    images = f.images()
    assert [i.meta["train_call"] for i in images] == [3, 2]  # two slots: the newest and one older
    first = np.frombuffer(images[0].data, np.float32, 10, images[0].meta["offsets"][0])
    assert first.tolist() == [3.0] * 10
    # torn: the newest slot's `end` never written (its writer was killed mid-copy)
    with open(f.path, "r+b") as fh:
        fh.seek(snapshot.HEADER_BYTES + (3 % 2) * f._slot_bytes() + 8)
        fh.write(bytes(8))
    reopened = snapshot.SnapshotFile(f.path)
    assert [i.meta["train_call"] for i in reopened.images()] == [2]
    reopened.write({"train_call": 3}, [np.zeros(4000, np.float32)])  # bigger: the file is rewritten
    assert [i.meta["train_call"] for i in reopened.images()] == [3]
    assert snapshot.common_step([[3, 2], [2, 1]]) == 2 and snapshot.common_step([[3], [2]]) is None


def test_a_snapshot_too_big_for_its_directory_is_one_clear_error(tmp_path, monkeypatch):
    f = snapshot.SnapshotFile(tmp_path / "trainer-0.snap")

    class Full:
        f_bavail, f_frsize = 1, 4096
    monkeypatch.setattr(snapshot.os, "statvfs", lambda _: Full())
    with pytest.raises(snapshot.SnapshotTooBig, match="loop.snapshot = false"):
        f.write({"train_call": 1}, [np.zeros(1 << 20, np.uint8)])


@pytest.mark.parametrize("world", [2])  # N ranks; one rank is the chaos cases' (tests/chaos)
def test_fsdp_ranks_restored_from_their_snapshots_train_the_same_losses(tmp_path, world):
    ranks = run_ranks(f"heal:{tmp_path}", tmp_path, world_size=world, timeout_s=300, worker=WORKER)
    assert all(r["restored"] == 2 for r in ranks)
    assert ranks[0]["phases"] == ["rl", "sft"]
    if world == 2:  # data parallel: both ranks report the same all-reduced losses
        assert ranks[0]["losses"] == ranks[1]["losses"]
