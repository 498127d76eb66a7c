"""A user's `rollout.function` plug-ins (the contract test `tests/rl/test_plugin_function.py`).

`rollout` builds every group itself: one `/generate` call per sample straight to the engine with
the context's sampling params and seeds, rewards through `ctx.reward`, and a marker in each
sample's metadata so the test can tell its groups from the default path's. `fails_twice` fails
its first two calls, each in its own way, then behaves.
"""

import asyncio

import numpy as np

from miles.wire.messages import Group, Sample

MARKER = "function_plugin"
calls = {"fails_twice": 0}


async def _sample(ctx, prompt, prompt_ids, group_id, i):
    seed = ctx.sample_seed(prompt, i)
    res = await ctx.engine.generate(prompt_ids, ctx.sampling_params(seed), return_logprob=True,
                                    routing_key=group_id, rid=f"{group_id}-{i}-{seed}")
    out = np.asarray(res.output_ids, np.int32)
    return Sample(
        tokens=np.concatenate([np.asarray(prompt_ids, np.int32), out]), response_length=len(out),
        loss_mask=np.ones(len(out), np.uint8),
        rollout_logprobs=np.asarray(res.output_logprobs, np.float32),
        weight_versions=res.version_spans(), group_id=group_id, index=i,
        prompt=prompt.prompt, label=prompt.label,
        response=ctx.tokenizer.decode(res.output_ids, skip_special_tokens=True),
        status="completed" if res.finish_reason.type == "stop" else "truncated",
        metadata={**prompt.metadata, "made_by": MARKER, "seed": seed})


async def rollout(ctx, n_groups):
    assert n_groups == len(ctx.prompts) > 0
    groups = []
    for prompt in ctx.prompts:
        group_id = f"fn-p{prompt.index}"
        ids = ctx.tokenize(prompt)
        samples = await asyncio.gather(*(_sample(ctx, prompt, ids, group_id, i)
                                         for i in range(ctx.recipe.rollout.n_samples_per_prompt)))
        await ctx.reward(list(samples))
        groups.append(Group(group_id=group_id, samples=list(samples), prompt_index=prompt.index))
    return groups


async def fails_twice(ctx, n_groups):
    """Call 1 raises; call 2 returns a group for a prompt it was not given; then as `rollout`."""
    calls["fails_twice"] += 1
    if calls["fails_twice"] == 1:
        raise RuntimeError("the user's rollout function fails on its first call")
    groups = await rollout(ctx, n_groups)
    if calls["fails_twice"] == 2:
        groups[0].prompt_index = 10**6
    return groups


def not_async(ctx, n_groups):
    return []
