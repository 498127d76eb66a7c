"""pass@k in the evaluator: the unbiased estimator against counting subsets, and `eval.samples_per_prompt`
samples per prompt, each with its own seed, scored into eval/pass@1 and eval/pass@k."""

from __future__ import annotations

import itertools
import math

import pytest
from aiohttp import web

from miles.actors.evaluator import Evaluator, pass_at_k
from miles.backends import TrainConfig
from miles.config import Recipe, RunConfig, load_recipe
from miles.rl.config import DataConfig, EvalConfig
from miles.rl.data import Prompt
from miles.seeds import eval_seed, sample_seed


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                outcomes = [1] * c + [0] * (n - c)
                subsets = list(itertools.combinations(outcomes, k))
                assert math.isclose(pass_at_k(n, c, k), sum(any(s) for s in subsets) / len(subsets)), (n, c, k)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3) and pass_at_k(4, 1, 2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="n=2 c=3 k=1"):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError, match="k=3"):
        pass_at_k(2, 1, 3)


def test_samples_per_prompt_is_a_checked_recipe_field():
    assert load_recipe(text="").eval.samples_per_prompt == 1
    assert load_recipe(text="[eval]\nsamples_per_prompt = 4\ntemperature = 1.0").eval.samples_per_prompt == 4
    with pytest.raises(Exception, match="eval.samples_per_prompt"):
        load_recipe(text="[eval]\nsamples_per_prompt = 0")


class SeedEngine:
    """Answers "ok" only for seeds the test picks per prompt: the pass counts are known exactly."""

    def __init__(self, passing: dict[int, set[int]]):
        self.passing, self.seeds = passing, []

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt, seed = body["input_ids"][-1] - ord("0"), body["sampling_params"]["sampling_seed"]
        self.seeds.append((prompt, seed))
        text = "ok" if seed in self.passing.get(prompt, set()) else "no"
        return web.json_response({"output_ids": [ord(c) for c in text], "meta_info": {
            "finish_reason": {"type": "stop"}, "weight_version": "7"}})


class ByteTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


async def test_each_prompt_is_sampled_n_times_with_its_own_seeds_and_scored_pass_at_k(tmp_path):
    seed = 100
    # prompt 0: 0 of 4 pass; prompt 1: 1 of 4; prompt 2: 4 of 4
    fake = SeedEngine({1: {eval_seed(seed, 1, 2)}, 2: {eval_seed(seed, 2, j) for j in range(4)}})
    app = web.Application()
    app.router.add_post("/generate", fake.generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        ev = Evaluator()
        ev.recipe = Recipe(run=RunConfig(output_dir=str(tmp_path), seed=seed), data=DataConfig(),
                           train=TrainConfig(reward_key="pass"),
                           eval=EvalConfig(samples_per_prompt=4, temperature=1.0, pass_threshold=1.0))
        ev.cfg = ev.recipe.eval
        ev.tokenizer = ByteTokenizer()
        ev.reward_fn = lambda s: {"pass": float(s.response == "ok"), "other": 5.0}
        ev.prompts = [Prompt(index=i, prompt=f"q{i}", label="ok") for i in range(3)]
        metrics, served = await ev._score(url)
    finally:
        await runner.cleanup()
    # sample j of prompt p: eval_seed(run seed, p, j), twelve distinct seeds, none a training one
    assert sorted(fake.seeds) == sorted((p, eval_seed(seed, p, j)) for p in range(3) for j in range(4))
    assert len({s for _, s in fake.seeds}) == 12
    assert not {s for _, s in fake.seeds} & {sample_seed(seed, p, j, 0) for p in range(3) for j in range(4)}
    assert metrics["eval/n"] == 3 and metrics["eval/k"] == 4
    assert metrics["eval/reward"] == pytest.approx(5 / 12)
    assert metrics["eval/pass@1"] == pytest.approx((0 + 0.25 + 1) / 3)
    assert metrics["eval/pass@k"] == pytest.approx((0 + 1 + 1) / 3)
    assert served == (7, 7)
