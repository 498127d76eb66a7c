"""Prompt tokenization shared by rollout and evaluation, so both see the same token ids.

Design decisions:
- One function, not a method on the rollout worker: the evaluator must tokenize exactly as
  rollout does (a chat template applied in one and skipped in the other scores a different task).
- A prompt that is already a list of chat messages always goes through the chat template; a plain
  string goes through it only with `data.apply_chat_template`, else it is encoded as it is
  (no special tokens: the template, when used, adds what the model expects).
"""

from __future__ import annotations

from typing import Any


def prompt_token_ids(tokenizer: Any, prompt: str | list[dict[str, Any]],
                     apply_chat_template: bool) -> list[int]:
    """The token ids a prompt is generated from (`apply_chat_template`: `data.apply_chat_template`)."""
    if isinstance(prompt, list):
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
    if apply_chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, tokenize=True))
    return list(tokenizer.encode(prompt, add_special_tokens=False))
