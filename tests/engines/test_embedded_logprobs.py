"""Embedded engine numerics: logprobs and routed experts equal a fresh transformers forward."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.engines.client import EngineClient
from miles.engines.embedded import launch_embedded_engine
from miles.tiny import build_tiny_model

ARGS = ["--torch-threads", "1", "--random-seed", "0", "--log-level", "warning",
        "--max-total-tokens", "4096", "--max-running-requests", "16"]
TOL = 1e-4


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    paths = {a: build_tiny_model(arch=a) for a in ("qwen3", "qwen3_moe")}
    logs = tmp_path_factory.mktemp("logs")

    async def start():
        return await asyncio.gather(*(launch_embedded_engine(
            p, extra_args=ARGS + ["--enable-return-routed-experts"], log_path=logs / f"{a}.log")
            for a, p in paths.items()))
    started = asyncio.run(start())
    yield {a: (p, e.url) for (a, p), e in zip(paths.items(), started)}
    for e in started:
        e.stop()


def hf_reference(path, tokens: list[int], temperature: float = 1.0):
    """Full-sequence HF forward: (log_softmax(logits / temperature) [T, V], router top-k ids per
    layer or None)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=model.config.model_type == "qwen3_moe")
    logp = (out.logits[0].float() / temperature).log_softmax(-1)
    routing = None
    if getattr(out, "router_logits", None):
        k = model.config.num_experts_per_tok
        routing = np.stack([torch.topk(torch.softmax(r.float(), -1), k, dim=-1).indices.numpy()
                            for r in out.router_logits], axis=1)  # [T, layers, k]
    return logp, routing


def check_against_hf(path, prompt, res, temperature: float = 1.0):
    """Output logprobs follow the convention (sampling.py): the temperature-scaled distribution,
    before truncation; temperature 0 (greedy) reports temperature 1."""
    tokens = prompt + res.output_ids
    logp, routing = hf_reference(path, tokens, temperature or 1.0)
    P = len(prompt)
    ref = logp[P - 1:-1].gather(1, torch.tensor(res.output_ids)[:, None])[:, 0].numpy()
    got = np.asarray(res.output_logprobs)
    assert np.abs(ref - got).max() <= TOL, np.abs(ref - got).max()
    return logp, routing


PROMPTS = [[5, 17, 99, 3], list(range(40, 71)), [200, 201, 7, 7, 7, 9, 11, 300, 301, 2, 64]]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
async def test_logprobs_match_hf_forward(engines, arch):
    path, url = engines[arch]
    params = [{"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True},
              {"max_new_tokens": 20, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True},
              {"max_new_tokens": 9, "temperature": 0.8, "top_p": 0.9, "top_k": 50, "sampling_seed": 3,
               "ignore_eos": True}]
    async with EngineClient(url) as c:
        results = await asyncio.gather(*(c.generate(p, sp, return_logprob=True, return_routed_experts=True)
                                         for p, sp in zip(PROMPTS, params)))
    for prompt, sp, res in zip(PROMPTS, params, results):
        assert len(res.output_ids) == sp["max_new_tokens"] and res.finish_reason.type == "length"
        _, routing = check_against_hf(path, prompt, res, sp["temperature"])
        if arch == "qwen3_moe":
            n = len(prompt) + len(res.output_ids) - 1
            assert res.routed_experts.shape == (n, 2, 2)  # (tokens-1, layers, top_k)
            assert (res.routed_experts == routing[:n]).all()
        else:
            assert res.routed_experts is None


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
async def test_logprobs_when_one_batch_spans_kv_buckets(engines, arch):
    """Decode groups rows by their own kv bucket (64, 128, 256 keys here): each row still matches HF."""
    path, url = engines[arch]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 300, n).tolist() for n in (90, 200, 3, 8, 70)]
    async with EngineClient(url) as c:
        results = await asyncio.gather(*(c.generate(p, {"max_new_tokens": 10, "temperature": 1.0,
                                                        "sampling_seed": i, "ignore_eos": True},
                                                    return_logprob=True, return_routed_experts=True)
                                         for i, p in enumerate(prompts)))
    for prompt, res in zip(prompts, results):
        _, routing = check_against_hf(path, prompt, res)
        if arch == "qwen3_moe":
            assert (res.routed_experts == routing[:len(prompt) + 9]).all()


async def test_logprobs_are_of_the_temperature_scaled_distribution(engines):
    """At temperature 0.7 the engine reports log_softmax(hf_logits / 0.7), truncated or not, with
    top logprobs of the same distribution; the raw (temperature-1) values would be off by far more
    than the tolerance."""
    path, url = engines["qwen3"]
    prompt = PROMPTS[2]
    params = [{"max_new_tokens": 10, "temperature": 0.7, "sampling_seed": 11, "ignore_eos": True},
              {"max_new_tokens": 10, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.05,
               "sampling_seed": 12, "ignore_eos": True},
              {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}]
    async with EngineClient(url) as c:  # one batch: rows of different temperatures side by side
        results = await asyncio.gather(*(c.generate(prompt, sp, return_logprob=True, top_logprobs_num=5)
                                         for sp in params))
    for sp, res in zip(params, results):
        logp, _ = check_against_hf(path, prompt, res, sp["temperature"])
        P = len(prompt)
        for i, top in enumerate(res.output_top_logprobs):
            ref = torch.topk(logp[P - 1 + i], 5)
            assert [t for _, t in top] == ref.indices.tolist()
            assert np.abs(np.asarray([lp for lp, _ in top]) - ref.values.numpy()).max() <= TOL
    raw, _ = hf_reference(path, prompt + results[0].output_ids, 1.0)
    raw_lp = raw[len(prompt) - 1:-1].gather(1, torch.tensor(results[0].output_ids)[:, None])[:, 0].numpy()
    assert np.abs(raw_lp - np.asarray(results[0].output_logprobs)).max() > 100 * TOL


async def test_prompt_logprobs_and_routed_start(engines):
    path, url = engines["qwen3_moe"]
    prompt = PROMPTS[1]
    async with EngineClient(url) as c:
        res = await c.generate(prompt, {"max_new_tokens": 4, "temperature": 0.0}, return_logprob=True,
                               logprob_start_len=0, return_routed_experts=True,
                               routed_experts_start_len=5)
    logp, routing = check_against_hf(path, prompt, res)
    ref = logp[:len(prompt) - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].numpy()
    assert res.input_logprobs[0] is None and len(res.input_logprobs) == len(prompt)
    assert np.abs(np.asarray(res.input_logprobs[1:]) - ref).max() <= TOL
    n = len(prompt) + len(res.output_ids) - 1
    assert (res.routed_experts == routing[5:n]).all()


async def test_max_new_tokens_zero_and_top_logprobs(engines):
    path, url = engines["qwen3"]
    async with EngineClient(url) as c:
        res0 = await c.generate([1, 2, 3], {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
        res = await c.generate([1, 2, 3], {"max_new_tokens": 3, "temperature": 0.0}, return_logprob=True,
                               top_logprobs_num=4)
    assert res0.output_ids == [] and res0.finish_reason.type == "length" and len(res0.input_logprobs) == 3
    logp, _ = check_against_hf(path, [1, 2, 3], res)
    for i, top in enumerate(res.output_top_logprobs):
        assert len(top) == 4 and top[0][1] == res.output_ids[i]  # greedy picks the top-1
        ref = torch.topk(logp[2 + i], 4)
        assert [t for _, t in top] == ref.indices.tolist()


async def test_moe_update_by_per_expert_and_fused_names(engines):
    """Checkpoint (per-expert) names and transformers-5 fused names both land in the experts."""
    from safetensors.torch import load_file

    from miles.engines.client import encode_tensor_payload
    from miles.weights.checks import tensor_sha256
    path_a, url = engines["qwen3_moe"]
    path_b = build_tiny_model(arch="qwen3_moe", seed=1)
    sd_a, sd_b = (load_file(str(p / "model.safetensors")) for p in (path_a, path_b))
    async with EngineClient(url) as c:
        assert await c.weights_checksum() == {n: tensor_sha256(t) for n, t in sd_a.items()}
        await c.update_weights_from_tensor([encode_tensor_payload(sd_b)], weight_version="1")
        assert await c.weights_checksum() == {n: tensor_sha256(t) for n, t in sd_b.items()}
        res = await c.generate(PROMPTS[0], {"max_new_tokens": 8, "temperature": 0.0}, return_logprob=True,
                               return_routed_experts=True)
        _, routing = check_against_hf(path_b, PROMPTS[0], res)
        assert (res.routed_experts == routing[:len(res.routed_experts)]).all()
        # transformers 5 keeps experts fused in memory: [E, 2I, H] (gate rows then up rows), [E, H, I]
        p = "model.layers.0.mlp.experts."
        E = 8
        gate_up = torch.stack([torch.cat([sd_a[f"{p}{e}.gate_proj.weight"], sd_a[f"{p}{e}.up_proj.weight"]])
                               for e in range(E)])
        down = torch.stack([sd_a[f"{p}{e}.down_proj.weight"] for e in range(E)])
        await c.update_weights_from_tensor([encode_tensor_payload({p + "gate_up_proj": gate_up,
                                                                   p + "down_proj": down})])
        names = [f"{p}{e}.{w}_proj.weight" for e in range(E) for w in ("gate", "up", "down")]
        assert await c.weights_checksum(names) == {n: tensor_sha256(sd_a[n]) for n in names}
        await c.update_weights_from_disk(str(path_a), weight_version="default")  # leave it as found
