"""Session turns and the trajectory tree, with engine outputs given directly (no HTTP)."""

from __future__ import annotations

import numpy as np
import pytest

from miles.tito.families import get_family
from miles.tito.messages import ChatMessage, RequestError, ToolCall, parse_openai_messages
from miles.tito.session import EngineTurn, Session
from miles.tito.template import render_template
from miles.tito.verify import compare

QWEN = get_family("qwen3")
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def out_of(tok, text: str, version: str = "1", end: bool = True, routed=None) -> EngineTurn:
    ids = tok.encode(text) + ([tok.token_id("<|im_end|>")] if end else [])
    finish = {"type": "stop", "matched": ids[-1]} if end else {"type": "length", "length": len(ids)}
    return EngineTurn(output_ids=ids, logprobs=[-0.25 - i / 1000 for i in range(len(ids))], finish_reason=finish,
                      weight_versions=[(version, 0, len(ids))], routed_experts=routed)


def as_dict(m: ChatMessage) -> dict:
    d = m.to_template_dict()
    for call in d.get("tool_calls", []):
        call["function"]["arguments"] = dict(call["function"]["arguments"])
    return d


def turn(session, messages, text, tools=None, **kw):
    plan = session.prepare(parse_openai_messages(messages), tools, **kw)
    node, reply = session.complete(plan, out_of(session.tokenizer, text))
    return plan, node, as_dict(reply.to_message())


@pytest.fixture
def session(tiny_tokenizer):
    return Session("s1", QWEN, tiny_tokenizer, rollout_id="task-7", max_context_tokens=4096)


def test_each_turn_splices_onto_the_engine_ids_and_equals_a_full_render(session, tiny_tokenizer):
    msgs = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 1 + 2?"}]
    engine_seen, outputs = [], []
    for t in range(6):
        text = (f'<think>\nturn {t}\n</think>\n\ncalling\n<tool_call>\n{{"name": "add", "arguments": {{"a": {t}, "b": 2}}}}'
                f'\n</tool_call>')
        plan, node, reply = turn(session, msgs, text, TOOLS)
        if engine_seen:
            prev = engine_seen[-1] + outputs[-1]
            assert plan.input_ids[:len(prev)] == prev                      # the history is reused verbatim
            assert plan.appended_tokens == len(plan.input_ids) - len(prev)
        engine_seen.append(plan.input_ids)
        outputs.append(list(node.ids))
        assert reply["tool_calls"][0]["function"]["arguments"] == {"a": t, "b": 2}
        msgs += [reply, {"role": "tool", "content": str(t + 2)}]
    [sample] = session.collect()
    tokens = sample["tokens"].tolist()
    assert tokens == engine_seen[-1] + outputs[-1]
    mask = np.zeros(len(tokens), np.uint8)
    for seen, out in zip(engine_seen, outputs):
        mask[len(seen):len(seen) + len(out)] = 1
    prompt_len = len(tokens) - sample["response_length"]
    assert prompt_len == len(engine_seen[0])
    assert sample["loss_mask"].tolist() == mask[prompt_len:].tolist()
    assert np.all(sample["rollout_logprobs"][sample["loss_mask"] == 0] == 0)
    assert sample["rollout_id"] == "task-7" and sample["turns"] == 6 and sample["status"] == "completed"
    # token-exact against the template over the whole conversation (+ the bridge "\n")
    full = render_template(QWEN.chat_template, msgs[:-1], TOOLS, False)
    assert compare(tiny_tokenizer, QWEN, tokens + tiny_tokenizer.encode("\n"), tiny_tokenizer.encode(full)) == []


def test_engine_ids_are_kept_verbatim_never_retokenized(session, tiny_tokenizer):
    msgs = [{"role": "user", "content": "Say the answer is 12."}]
    plan = session.prepare(parse_openai_messages(msgs), None)
    canonical = tiny_tokenizer.encode("the answer is 12")
    spelled = [i for ch in "the answer is 12" for i in tiny_tokenizer.encode(ch)]   # one token per char
    assert spelled != canonical
    eot = tiny_tokenizer.token_id("<|im_end|>")
    node, reply = session.complete(plan, EngineTurn(output_ids=spelled + [eot], logprobs=[-1.0] * (len(spelled) + 1),
                                                    finish_reason={"type": "stop", "matched": eot}))
    assert reply.content == "the answer is 12"
    msgs += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "Again"}]
    plan2 = session.prepare(parse_openai_messages(msgs), None)
    assert plan2.input_ids[len(plan.input_ids):len(plan.input_ids) + len(spelled) + 1] == spelled + [eot]


def test_retry_is_a_branch_and_drop_retries_keeps_the_last(session):
    msgs = [{"role": "user", "content": "Pick a number"}]
    p1, first, _ = turn(session, msgs, "7")
    p2, second, reply = turn(session, msgs, "8")
    assert p2.reused_prompt and p2.prompt is p1.prompt and p2.appended_tokens == p1.appended_tokens
    assert len(session.collect("all")) == 2
    [kept] = session.collect()
    assert kept["leaf"] == second.id
    # continuing from the *first* attempt makes it a fork, not a retry: both are kept
    turn(session, msgs + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "Why?"}], "because")
    assert len(session.collect()) == 2


def test_subagent_and_compaction_restart_are_branches_with_one_rollout_id(session):
    main = [{"role": "system", "content": "main agent"}, {"role": "user", "content": "fix the bug"}]
    _, _, r = turn(session, main, "let me look")
    main += [r, {"role": "user", "content": "go on"}]
    turn(session, main, "found it")
    turn(session, [{"role": "system", "content": "subagent: search"}, {"role": "user", "content": "find foo"}], "foo.py")
    turn(session, [{"role": "system", "content": "main agent"},
                   {"role": "user", "content": "Summary so far: found it. Continue."}], "done")
    samples = session.collect()
    assert len(samples) == 3
    assert {s["rollout_id"] for s in samples} == {"task-7"}
    assert sorted(s["turns"] for s in samples) == [1, 1, 2]
    assert session.info()["leaves"] == 3


def test_edited_history_forks_at_the_deepest_match(session, tiny_tokenizer):
    msgs = [{"role": "user", "content": "a"}]
    _, n1, r1 = turn(session, msgs, "one")
    msgs += [r1, {"role": "user", "content": "b"}]
    _, n2, r2 = turn(session, msgs, "two")
    edited = msgs + [{"role": "assistant", "content": "TWO (edited by the harness)"}, {"role": "user", "content": "c"}]
    loc = session.locate(parse_openai_messages(edited), None)
    assert loc.attach is n1 and loc.start == 2          # the edited turn is rendered, not trained on
    plan = session.commit_prompt(loc, session.tokenize(loc), None)
    assert "TWO (edited" in tiny_tokenizer.decode(plan.prompt.ids)


def test_reserialized_tool_arguments_and_dropped_reasoning_still_match(session):
    msgs = [{"role": "user", "content": "add"}]
    _, node, reply = turn(session, msgs, '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
                          TOOLS)
    echoed = {"role": "assistant", "content": None,
              "tool_calls": [{"id": "other-id", "type": "function", "function": {"name": "add", "arguments": '{"b":2,"a":1}'}}]}
    loc = session.locate(parse_openai_messages(msgs + [echoed, {"role": "tool", "content": "3"}]), TOOLS)
    assert loc.attach is node and loc.start == 2
    strict = Session("s2", QWEN, session.tokenizer, matcher="strict")
    _, n2, _ = turn(strict, msgs, '<think>\nhm\n</think>\n\nhi', TOOLS)
    assert strict.locate(parse_openai_messages(msgs + [{"role": "assistant", "content": "hi"}]), TOOLS).attach is not n2


def test_context_limit_refusal_leaves_the_session_untouched(tiny_tokenizer):
    s = Session("s3", QWEN, tiny_tokenizer, max_context_tokens=40)
    before = s.tree.n_nodes
    with pytest.raises(RequestError, match=r"context length: the prompt is \d+ tokens and the limit is 40") as e:
        s.prepare(parse_openai_messages([{"role": "user", "content": "x " * 60}]), None)
    assert e.value.status == 400 and e.value.field == "messages"
    assert s.tree.n_nodes == before and s.collect("all") == []
    plan = s.prepare(parse_openai_messages([{"role": "user", "content": "hi"}]), None, max_tokens=1000)
    assert plan.max_new_tokens == 40 - len(plan.input_ids)          # clipped to the room left


def test_truncated_turn_is_closed_by_a_masked_bridge(session, tiny_tokenizer):
    msgs = [{"role": "user", "content": "long story"}]
    plan = session.prepare(parse_openai_messages(msgs), None)
    node, reply = session.complete(plan, out_of(tiny_tokenizer, "once upon a", end=False))
    assert node.finish["type"] == "length"
    msgs += [as_dict(reply.to_message()), {"role": "user", "content": "go on"}]
    plan2 = session.prepare(parse_openai_messages(msgs), None)
    assert plan2.prompt.parent is node
    assert tiny_tokenizer.decode(plan2.prompt.ids).startswith("<|im_end|>\n<|im_start|>user")
    session.complete(plan2, out_of(tiny_tokenizer, "there was"))
    [sample] = session.collect()
    resp = sample["tokens"][-sample["response_length"]:]
    bridge_at = len(node.ids)
    assert resp[bridge_at] == tiny_tokenizer.token_id("<|im_end|>") and sample["loss_mask"][bridge_at] == 0


def test_routed_experts_are_stitched_from_each_turns_new_positions(session, tiny_tokenizer):
    def routing(start, end):
        return np.arange(start, end, dtype=np.int32).repeat(4).reshape(-1, 2, 2)

    msgs = [{"role": "user", "content": "a"}]
    plan = session.prepare(parse_openai_messages(msgs), None, want_routed_experts=True)
    assert plan.routed_experts_start == 0
    out = out_of(tiny_tokenizer, "one")
    out.routed_experts = routing(0, len(plan.input_ids) + len(out.output_ids) - 1)
    node, reply = session.complete(plan, out)
    msgs += [as_dict(reply.to_message()), {"role": "user", "content": "b"}]
    plan2 = session.prepare(parse_openai_messages(msgs), None, want_routed_experts=True)
    assert plan2.routed_experts_start == node.path_len - 1          # only new positions are asked for
    out2 = out_of(tiny_tokenizer, "two")
    out2.routed_experts = routing(plan2.routed_experts_start, len(plan2.input_ids) + len(out2.output_ids) - 1)
    session.complete(plan2, out2)
    [sample] = session.collect(with_routed_experts=True)
    n = len(sample["tokens"])
    assert sample["routed_experts"].shape == (n - 1, 2, 2)
    assert np.array_equal(sample["routed_experts"][:, 0, 0], np.arange(n - 1))
    # a later turn that asks after one that did not gets the whole path, not a hole
    s3 = Session("s6", QWEN, tiny_tokenizer)
    m3 = [{"role": "user", "content": "a"}]
    _, n3, r3 = turn(s3, m3, "x")
    plan3 = s3.prepare(parse_openai_messages(m3 + [r3, {"role": "user", "content": "b"}]), None, want_routed_experts=True)
    assert plan3.routed_experts_start == 0
    # a turn that did not ask leaves a hole: no routing, and the reason
    s2 = Session("s4", QWEN, tiny_tokenizer)
    turn(s2, [{"role": "user", "content": "a"}], "x")
    [plain] = s2.collect(with_routed_experts=True)
    assert plain["routed_experts"] is None and "no routed experts" in plain["routed_experts_missing"]


def test_weight_version_spans_map_to_response_positions(session, tiny_tokenizer):
    msgs = [{"role": "user", "content": "a"}]
    plan = session.prepare(parse_openai_messages(msgs), None)
    n1, r1 = session.complete(plan, out_of(tiny_tokenizer, "one two", version="4"))
    msgs += [as_dict(r1.to_message()), {"role": "user", "content": "b"}]
    plan2 = session.prepare(parse_openai_messages(msgs), None)
    out2 = out_of(tiny_tokenizer, "three four five", version="4")
    k = len(out2.output_ids)
    out2.weight_versions = [("4", 0, 2), ("5", 2, k)]                  # weights changed mid-turn
    session.complete(plan2, out2)
    [s] = session.collect()
    off = len(n1.ids) + len(plan2.prompt.ids)
    assert s["weight_versions"] == [["4", 0, off + 2], ["5", off + 2, off + k]]


def test_per_turn_tokenization_covers_only_the_appended_messages(tiny_tokenizer):
    encoded: list[int] = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tiny_tokenizer, name)

        def encode(self, text):
            encoded.append(len(text))
            return tiny_tokenizer.encode(text)

    s = Session("s5", QWEN, Counting())
    msgs = [{"role": "system", "content": "long " * 2000}, {"role": "user", "content": "start"}]
    for t in range(30):
        plan = s.prepare(parse_openai_messages(msgs), None)
        _, reply = s.complete(plan, out_of(tiny_tokenizer, f"reply {t} " + "words " * 50))
        msgs += [as_dict(reply.to_message()), {"role": "tool", "content": f"result {t}"}]
    assert encoded[0] > 10_000
    assert max(encoded[1:]) < 100          # bridge + one tool message + generation prompt


def test_stop_string_cuts_the_reply_and_the_bridge_closes_the_turn(session, tiny_tokenizer):
    msgs = [{"role": "user", "content": "count"}]
    plan = session.prepare(parse_openai_messages(msgs), None)
    ids = tiny_tokenizer.encode("one two STOP")
    node, reply = session.complete(plan, EngineTurn(output_ids=ids, logprobs=[-1.0] * len(ids),
                                                    finish_reason={"type": "stop", "matched": "STOP"}))
    assert reply.content == "one two " and list(node.ids) == ids      # the engine's ids, untouched
    assert node.bridge == "<|im_end|>\n"
    msgs += [as_dict(reply.to_message()), {"role": "user", "content": "again"}]
    plan2 = session.prepare(parse_openai_messages(msgs), None)
    assert plan2.prompt.parent is node
