"""The tokenizer the session server renders with: a thin wrapper over `tokenizers.Tokenizer`.

Design decisions:
- We use the Rust `tokenizers` object directly (not transformers' wrapper): it is what a model
  directory's `tokenizer.json` describes, it is several times faster per call, and the session
  server tokenizes on every turn.
- `encode` never adds BOS/EOS: the chat template owns every special token it wants.
- `decode` keeps special tokens: `<think>` and `<tool_call>` are special in some vocabularies
  and the reply parser needs to see them.
- Sources: a model directory (its `tokenizer.json`), a `tokenizer.json` file, or `qwen` for the
  real Qwen vocabulary built offline (see `qwen_vocab.py`).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


class ChatTokenizer:
    def __init__(self, tokenizer, source: str = ""):
        self._tok = tokenizer
        self.source = source
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.added_ids = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        """Id of a single added token; raises naming the token when the vocabulary lacks it."""
        tid = self.added_ids.get(token)
        if tid is None:
            tid = self._tok.token_to_id(token)
        if tid is None:
            raise KeyError(f"token {token!r} is not in the vocabulary of {self.source or 'the tokenizer'}")
        return tid

    def id_to_token(self, tid: int) -> str | None:
        return self._tok.id_to_token(int(tid))


@lru_cache(maxsize=8)
def load_tokenizer(source: str | Path) -> ChatTokenizer:
    """`source`: a model directory, a tokenizer.json path, or `qwen` (real Qwen vocabulary)."""
    from tokenizers import Tokenizer

    src = str(source)
    if src == "qwen":
        from miles.tito.qwen_vocab import build_qwen_tokenizer
        path = build_qwen_tokenizer() / "tokenizer.json"
    else:
        path = Path(src)
        if path.is_dir():
            path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer: no tokenizer.json at {str(path)!r} (from source {src!r})")
    return ChatTokenizer(Tokenizer.from_file(str(path)), source=src)
