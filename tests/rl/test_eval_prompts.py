"""`prompt_token_ids`: rollout and evaluation tokenize a prompt the same way."""

from __future__ import annotations

from miles.rl.prompts import prompt_token_ids


class FakeTokenizer:
    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.calls.append(("chat", messages, add_generation_prompt, tokenize))
        return (7, 8, *[len(m["content"]) for m in messages])

    def encode(self, text, add_special_tokens):
        self.calls.append(("encode", text, add_special_tokens))
        return [ord(c) for c in text]


def test_plain_prompt_is_encoded_without_special_tokens():
    tok = FakeTokenizer()
    assert prompt_token_ids(tok, "ab", False) == [97, 98]
    assert tok.calls == [("encode", "ab", False)]


def test_plain_prompt_goes_through_the_chat_template_when_asked():
    tok = FakeTokenizer()
    assert prompt_token_ids(tok, "abc", True) == [7, 8, 3]
    assert tok.calls == [("chat", [{"role": "user", "content": "abc"}], True, True)]


def test_message_list_always_goes_through_the_chat_template():
    tok = FakeTokenizer()
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": "yz"}]
    assert prompt_token_ids(tok, messages, False) == [7, 8, 1, 2]
    assert tok.calls[0][0] == "chat"
