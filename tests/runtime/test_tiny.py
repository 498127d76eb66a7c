"""miles.tiny: a cached build is complete or built again, and a torch.distributed rank other than
0 (where transformers' save_pretrained writes nothing) still gets a complete model."""

from __future__ import annotations

import json

import pytest

from miles import tiny


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _complete(path) -> bool:
    return all((path / name).exists() for name in (".complete", "config.json", "model.safetensors"))


def test_a_rank_other_than_0_builds_the_model_in_a_child_process(cache, monkeypatch):
    monkeypatch.setattr(tiny, "_distributed_rank", lambda: 1)
    calls = []
    real = tiny._build_in_child
    monkeypatch.setattr(tiny, "_build_in_child", lambda *a: calls.append(a) or real(*a))
    path = tiny.build_tiny_model(arch="qwen3", seed=3, num_hidden_layers=1)
    assert len(calls) == 1 and _complete(path)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 1
    assert tiny.build_tiny_model(arch="qwen3", seed=3, num_hidden_layers=1) == path
    assert len(calls) == 1  # cached: no second child


def test_a_cached_directory_without_its_weights_is_built_again(cache):
    path = tiny.build_tiny_model(arch="qwen3", seed=4, num_hidden_layers=1)
    (path / "config.json").unlink()   # what the rank-1 race used to cache: a tokenizer only
    (path / "model.safetensors").unlink()
    assert (path / ".complete").exists()
    assert tiny.build_tiny_model(arch="qwen3", seed=4, num_hidden_layers=1) == path
    assert _complete(path)


def test_a_build_that_writes_no_weights_is_never_marked_complete(cache, tmp_path):
    with pytest.raises(RuntimeError, match="model.safetensors\\|model.safetensors.index.json not written"):
        tiny._build_atomically(tmp_path / "m", lambda d: (d / "config.json").write_text("{}"),
                               required=("config.json", "model.safetensors|model.safetensors.index.json"))
    assert not (tmp_path / "m").exists()
