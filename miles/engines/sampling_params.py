"""SGLang's sampling parameters of one `/generate` request, and the ones a rollout sample gets
from `recipe.rollout`. A contract of the RL layer (docs/architecture.md#layers): msgspec only, so
the rollout worker's module and `miles check` do not import the HTTP client for it."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """SGLang sampling parameters; unset fields are not sent (the engine's defaults apply)."""
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    sampling_seed: int | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None


def sampling_params(cfg, seed: int) -> SamplingParams:
    """The `/generate` sampling params of one sample (`cfg` is `recipe.rollout`)."""
    return SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          top_p=cfg.top_p, top_k=cfg.top_k, sampling_seed=seed,
                          stop_token_ids=cfg.stop_token_ids or None,
                          ignore_eos=cfg.ignore_eos or None)
