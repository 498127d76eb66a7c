"""The token-exactness (TITO) check of an agent episode's trained sample: everything between the
model's turns is the chat template's rendering of the conversation, and the model's turns are the
loss-masked runs, which the caller compares to the replies it expects."""

from __future__ import annotations

import numpy as np


def model_spans(sample) -> list[tuple[int, int]]:
    """The (start, end) in `sample.tokens` of each model turn: the runs of its loss mask."""
    prompt_len = len(sample.tokens) - sample.response_length
    mask = np.concatenate([np.zeros(prompt_len, np.int8), sample.loss_mask.astype(bool).astype(np.int8)])
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def model_turns(sample, tokenizer, messages: list, tools: list | None = None) -> list[list[int]]:
    """Each model turn's token ids in `sample`, in order (a run of the loss mask, its stop token left
    off), after asserting that the other tokens are the qwen3 template's rendering of `messages`
    (`ChatMessage`s; the assistant turns are not rendered, so their content may be anything) and
    `tools`, that the response opens with a model turn and that the rollout log-probs sit on the
    model's tokens only. A sample ends at its last model turn, so it may hold fewer turns than
    `messages` has assistant turns: what comes after is not in its tokens."""
    from miles.tito.families import get_family
    from miles.tito.messages import ChatMessage
    from miles.tito.template import render_template
    qwen3 = get_family("qwen3")
    spans = model_spans(sample)
    assistant = [i for i, m in enumerate(messages) if m.role == "assistant"]
    assert spans and len(spans) <= len(assistant), (len(spans), len(assistant))
    msgs = list(messages[:assistant[len(spans) - 1] + 1])
    marks = [f"\x00turn{k}\x00" for k in range(len(spans))]
    for mark, i in zip(marks, assistant):
        msgs[i] = ChatMessage(role="assistant", content=mark)
    text = render_template(qwen3.chat_template, [m.to_template_dict() for m in msgs], tools, False)
    tokens, pos, turns = sample.tokens.tolist(), 0, []
    for k, (mark, (a, b)) in enumerate(zip(marks, spans)):
        piece, text = text.split(mark)
        if k and tokenizer.id_to_token(tokens[pos - 1]) == qwen3.end_of_turn:
            piece = piece[len(qwen3.end_of_turn):]   # the model wrote the turn's end itself
        assert tokens[pos:a] == tokenizer.encode(piece), (k, tokenizer.decode(tokens[pos:a]), piece)
        ids = tokens[a:b]
        turns.append(ids[:-1] if tokenizer.id_to_token(ids[-1]) in qwen3.stop_tokens else ids)
        pos = b
    assert pos == len(tokens), (pos, len(tokens))
    model, logprobs = sample.loss_mask.astype(bool), sample.rollout_logprobs
    assert spans[0][0] == len(tokens) - sample.response_length, (spans[0], sample.response_length)
    assert (logprobs[~model] == 0).all() and (logprobs[model] <= 0).all() and (logprobs[model] < 0).any()
    return turns
