"""The embedded engine's routing for a model with a dense layer (SGLang's layout: every layer, -1 on
the dense one), and the trainer replaying it: the MoE layer's recorded rows are exactly what the
fp32 trainer routes, the dense layer's sentinel rows are skipped."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from miles.algo.routing import micro_batch_indices, pack_routing
from miles.backends.router_replay import RouterReplay
from miles.tiny import build_tiny_model


async def _generate(path, prompt):
    from miles.engines.client import EngineClient, SamplingParams
    from miles.engines.routed_experts import routed_experts_layout_from_config
    from miles.engines.embedded import launch_embedded_engine

    engine = await launch_embedded_engine(str(path), extra_args=["--enable-return-routed-experts"],
                                          ready_timeout_s=120)
    try:
        async with EngineClient(engine.url, routed_experts_layout=routed_experts_layout_from_config(path)) as c:
            return await c.generate(prompt, SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=1),
                                    return_logprob=True, return_routed_experts=True)
    finally:
        await engine.stop_async()


@pytest.mark.slow
def test_dense_layer_reads_minus_one_and_the_moe_layer_replays_exactly():
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(arch="qwen3_moe", mlp_only_layers=[0])
    prompt = list(range(20, 40))
    result = asyncio.run(_generate(path, prompt))
    routed = result.routed_experts
    tokens = prompt + list(result.output_ids)
    assert routed.shape == (len(tokens) - 1, 2, 2)
    assert (routed[:, 0] == -1).all()                       # layer 0 is dense
    assert ((routed[:, 1] >= 0) & (routed[:, 1] < 8)).all()  # layer 1 recorded for every token
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    replay = RouterReplay.install(lm)
    assert sorted(replay.routers) == [1]
    indices = micro_batch_indices([pack_routing(routed)], [len(tokens)], 2, 2)
    with torch.no_grad(), replay.micro_batch(indices, replay=False):
        lm.model(input_ids=torch.tensor([tokens]))
    m = replay.take_metrics()
    assert m["routing_native_agreement"] == 1.0             # fp32 engine == fp32 trainer, token for token
    assert np.isclose(m["routing_agreement"], 1.0)
