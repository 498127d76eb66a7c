"""On-policy distillation with the teacher on the rollout side (`[teacher]`): a teacher engine's
prompt log-probs of the response tokens (`Sample.teacher_logprobs`) are the trainer-side
teacher's, and a real `miles run` of recipes/algos/opd_engine_quickstart.toml distils from them."""

from __future__ import annotations

import asyncio
import copy
import json

import numpy as np
import pytest
import torch

from miles.algo import LossConfig
from miles.backends import RankInfo, make_backend
from miles.backends.config import TrainConfig
from miles.config import RecipeError, load_recipe
from miles.recipe_checks import check_recipe
from miles.rl.teacher_scores import aligned_teacher_logprobs, check_vocab, score_sample
from miles.tiny import build_tiny_model, build_tokenizer
from miles.wire.messages import Sample
from test_algo_quickstarts import ROOT, run_recipe

STUDENT = build_tiny_model(arch="qwen3")
LOSS = LossConfig(opd_kl_coef=1.0, opd_only=True, loss_reduction="token")


def _peaked_teacher(tmp_path):
    """The student's 4-layer sibling with its final norm scaled by 8 (far from the random student)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = build_tiny_model(arch="qwen3", seed=7, num_hidden_layers=4)
    lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        lm.model.norm.weight.mul_(8.0)
    out = tmp_path / "teacher"
    lm.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(path)).save_pretrained(out)
    return out


def _samples(n: int = 8, vocab: int = 400) -> list[Sample]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        p, r = int(rng.integers(3, 12)), int(rng.integers(1, 16))
        out.append(Sample(tokens=rng.integers(0, vocab, p + r).astype(np.int32), response_length=r,
                          loss_mask=np.ones(r, np.uint8), rollout_logprobs=(-rng.random(r) * 5).astype(np.float32),
                          reward=float(i % 2), group_id=f"g{i // 4}", index=i % 4, status="completed"))
    return out


def _hf_teacher_logprobs(teacher, sample: Sample) -> np.ndarray:
    """log pi_teacher(token t | tokens < t) of each response token by a plain HF forward."""
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32)
    n, r = len(sample.tokens), sample.response_length
    ids = torch.as_tensor(sample.tokens, dtype=torch.int64)[None]
    with torch.no_grad():
        logits = lm(input_ids=ids).logits[0, n - r - 1:n - 1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, n - r:, None])[:, 0].numpy()


async def _engine_scores(teacher, samples: list[Sample]) -> list[np.ndarray]:
    from miles.engines.client import EngineClient
    from miles.engines.embedded import launch_embedded_engine
    engine = await launch_embedded_engine(teacher, extra_args=["--device", "cpu", "--dtype", "float32"])
    try:
        async with EngineClient(engine.url) as client:
            return list(await asyncio.gather(*(score_sample(client, s) for s in samples)))
    finally:
        await engine.stop_async(grace_s=3.0)


def test_engine_teacher_logprobs_equal_the_trainer_side_teacher_pass(tmp_path):
    """Per token, the engine's prompt log-probs from logprob_start_len = the prompt length are the
    teacher's log-prob of each response token given everything before it (an HF forward, 1e-4);
    trained on, they give the same step as the trainer-side teacher pass over the same tokens
    (the reverse KL is a mean of per-token differences and grad_norm weighs each token's
    advantage, so an off-by-one or a wrong token would move both far beyond 1e-4)."""
    teacher = _peaked_teacher(tmp_path)
    samples = _samples()
    scores = asyncio.run(_engine_scores(teacher, samples))
    for s, lp in zip(samples, scores):
        assert lp.dtype == np.float32 and len(lp) == s.response_length
        np.testing.assert_allclose(lp, _hf_teacher_logprobs(teacher, s), atol=1e-4, rtol=0)
    carried = copy.deepcopy(samples)
    for s, lp in zip(carried, scores):
        s.teacher_logprobs = lp

    made = []

    def backend(cfg):
        b = make_backend("fsdp")
        b.init(cfg, RankInfo(), LOSS)
        made.append(b)
        return b

    common = dict(model_path=str(STUDENT), param_dtype="float32", lr=1e-3, max_tokens_per_microbatch=256)
    try:
        by_pass = backend(TrainConfig(teacher_model_path=str(teacher), **common)).train(samples)
        rollout_side = backend(TrainConfig(teacher_from_samples=True, **common))
        assert rollout_side.teacher is None   # [teacher] on the rollout side: none on the trainer
        by_engine = rollout_side.train(carried)
        assert by_pass["teacher_reverse_kl"] > 1.0
        for key in ("teacher_reverse_kl", "loss", "pg_loss", "grad_norm"):
            assert by_engine[key] == pytest.approx(by_pass[key], rel=1e-4), key
        with pytest.raises(ValueError, match="carry no teacher_logprobs"):
            rollout_side.train(samples)   # no trainer-side teacher to fall back on
    finally:
        if made:
            made[-1].close()


def test_alignment_and_vocabulary_are_refused_loudly(tmp_path):
    s = Sample(tokens=np.arange(7, dtype=np.int32), response_length=3)
    assert aligned_teacher_logprobs([-1.0, -2.0, -3.0], s).tolist() == [-1.0, -2.0, -3.0]
    with pytest.raises(ValueError, match="returned 4 prompt log-probs for a response of 3 tokens"):
        aligned_teacher_logprobs([None, -1.0, -2.0, -3.0], s)
    with pytest.raises(ValueError, match="returned none prompt log-probs"):
        aligned_teacher_logprobs(None, s)
    other = build_tiny_model(arch="qwen3", tokenizer_dir=build_tokenizer(vocab_size=640))
    with pytest.raises(ValueError, match="vocab_size 640 differs from the student's"):
        check_vocab(str(other), str(STUDENT))


def test_recipe_checks_name_the_teacher_fields(tmp_path):
    recipe = ROOT / "recipes/algos/opd_engine_quickstart.toml"
    tiny = ['teacher.path=""', 'teacher.tiny="qwen3"']

    def refused(*overrides):
        with pytest.raises(RecipeError) as e:
            check_recipe(load_recipe(recipe, list(overrides)), "r")
        return str(e.value)

    assert check_recipe(load_recipe(recipe, tiny), "r") == []
    assert "train.teacher_model_path = 'x': expected ''" in refused(*tiny, 'train.teacher_model_path="x"')
    assert "teacher.tiny = 'qwen3': expected algo.opd_kl_coef > 0" in refused(*tiny, "algo.opd_kl_coef=0.0",
                                                                             "algo.opd_only=false")
    assert "rollout.temperature = 0.7: expected 1.0" in refused(*tiny, "rollout.temperature=0.7",
                                                                "train.temperature=0.7")
    assert "teacher.tiny = 'llama9': expected one of" in refused('teacher.path=""', 'teacher.tiny="llama9"')
    assert "teacher.path = '/nonexistent': expected an HF model directory" in refused('teacher.path="/nonexistent"')
    assert "algo.opd_kl_coef = 1.0: distils from a teacher" in refused('teacher.path=""')
    other = build_tiny_model(arch="qwen3", tokenizer_dir=build_tokenizer(vocab_size=640))
    assert "vocab_size 640 differs from the student's" in refused(f"teacher.path={json.dumps(str(other))}",
                                                                  f"model.path={json.dumps(str(STUDENT))}")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_opd_engine_quickstart_scores_every_sample_and_reverse_kl_falls(tmp_path):
    """A real `miles run`: the teacher (a random tiny 4-layer qwen3: near-uniform, far from the
    warm-started student) is served by its own engine; every sample is scored there and none
    fails; the trainer builds no teacher and refuses any batch with a sample lacking
    teacher_logprobs, so a finished run means every trained sample carried them; the reverse KL
    to the teacher falls."""
    steps, groups, n = 12, 8, 8
    code, log, rows = run_recipe(tmp_path, "recipes/algos/opd_engine_quickstart.toml", "opd_engine", [
        'teacher.path=""', 'teacher.tiny="qwen3"', "teacher.tiny_overrides={num_hidden_layers=4}",
        f"loop.num_steps={steps}", "loop.save_every=0", 'eval.mode="off"', "sft.steps=10"], timeout_s=380)
    assert code == 0, log
    train = [r for r in rows if r.get("kind") == "train"]
    assert len(train) == steps
    # measured (20 steps, sft 20): 1.83, 1.49, 1.44, 0.98, 0.20, then 0.03-0.10
    kl = [r["train/teacher_reverse_kl"] for r in train]
    assert sum(kl[-4:]) / 4 < 0.5 * sum(kl[:4]) / 4, kl
    last = [r for r in rows if r.get("kind") == "actors"][-1]
    assert last["rollout/teacher_failed"] == 0 and last["rollout/samples_failed"] == 0, last
    assert last["rollout/teacher_scored"] >= steps * groups * n, last
    assert (tmp_path / "opd_engine" / "teacher" / "logs" / "engine0.log").exists()


def test_scoring_retries_transient_errors_and_a_failure_fails_only_its_sample():
    from miles.actors.rollout import RolloutWorker
    from miles.engines.client import EngineUnavailable, FinishReason, GenerateResult
    from miles.rl.teacher_scores import TeacherScorer
    from miles.wire.messages import EngineSet

    class Fleet:   # the teacher fleet's GetEngines, asked again after a transient error
        asks = 0

        async def call(self, msg, timeout_s=None):
            Fleet.asks += 1
            return EngineSet(gateway_url="http://127.0.0.1:9", engine_urls=[], model_path=str(STUDENT))

    class Client:
        base_url, calls, bodies = "http://127.0.0.1:9", 0, []

        async def generate(self, ids, params, **kw):
            Client.calls += 1
            Client.bodies.append((params.max_new_tokens, kw))
            if Client.calls == 1:
                raise EngineUnavailable("/generate: HTTP 503: restarting")
            return GenerateResult(rid="r", output_ids=[], finish_reason=FinishReason(type="length"),
                                  input_logprobs=[-0.5, -1.5])

        async def close(self):
            pass

    scorer = TeacherScorer(Fleet(), load_recipe(ROOT / "recipes/algos/opd_engine_quickstart.toml"), str(STUDENT))
    scorer.client = Client()
    sample = Sample(tokens=np.arange(5, dtype=np.int32), response_length=2, status="completed")
    asyncio.run(scorer.score(sample))
    assert sample.teacher_logprobs.tolist() == [-0.5, -1.5]
    assert Client.bodies[-1] == (0, {"return_logprob": True, "logprob_start_len": 3})
    assert scorer.counts == {"teacher_scored": 1, "teacher_failed": 0, "teacher_retried": 1} and Fleet.asks == 1

    class Broken:
        async def score(self, s):
            raise ValueError("teacher engine returned 0 prompt log-probs for a response of 2 tokens")

    worker = RolloutWorker()
    worker.teacher = Broken()
    failed = Sample(tokens=np.arange(5, dtype=np.int32), response_length=2, status="completed")
    asyncio.run(worker._teacher_score(failed))
    assert failed.status == "failed"
    assert failed.metadata["error"] == ("teacher: ValueError: teacher engine returned 0 prompt log-probs "
                                        "for a response of 2 tokens")
