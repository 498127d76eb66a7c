"""Tiny models and tokenizers built offline, for tests, benchmarks and the CPU quickstart.

Design decisions:
- No model hub is reachable, so every model is built from a transformers config with random
  weights (seeded) and saved as an ordinary HF safetensors directory: the engines and the trainer
  load it exactly as they would load a real checkpoint.
- The tokenizer is a byte-level BPE trained with `tokenizers` on a small generated corpus (digits,
  arithmetic, a little English), with the ChatML special tokens Qwen uses. A small vocabulary keeps
  the LM head cheap, which is what makes CPU runs fast.
- Everything is cached under a directory keyed by its arguments; building twice is a no-op, and a
  build is written to a temporary directory and renamed so a crash never leaves a half-written one.
  A build is complete only with its required files (a model: config.json and its weights); a
  cached directory missing one is built again.
- transformers' `save_pretrained` writes nothing on a rank other than 0 once torch.distributed
  is up (seen: a Megatron test's rank 1 built a teacher first and cached a model directory with
  a tokenizer only). Such a rank builds in a fresh child process instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

ARCH_CONFIGS: dict[str, dict] = {
    "qwen3": dict(model_type="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  rope_theta=10000.0, tie_word_embeddings=True),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=256,
                      moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=4096, rope_theta=10000.0,
                      decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False),
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("MILES_CACHE", Path.home() / ".cache" / "miles"))


def _key(**kwargs) -> str:
    return hashlib.sha256(json.dumps(kwargs, sort_keys=True).encode()).hexdigest()[:12]


def _has(folder: Path, name: str) -> bool:
    """`name` exists in `folder`; "a|b": one of them does."""
    return any((folder / alt).exists() for alt in name.split("|"))


def _build_atomically(final: Path, build, required: tuple[str, ...] = ()) -> Path:
    """`build(tmp)` once into a temporary directory, renamed to `final` with a `.complete`
    marker; `required` files (or "a|b" alternatives) must be there for it to count."""
    if (final / ".complete").exists():
        if all(_has(final, name) for name in required):
            return final
        shutil.rmtree(final, ignore_errors=True)  # an incomplete build cached by older code
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        build(tmp)
        missing = [name for name in required if not _has(tmp, name)]
        if missing:
            raise RuntimeError(f"building {final.name}: {', '.join(missing)} not written")
        (tmp / ".complete").touch()
        try:
            tmp.rename(final)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists() and tmp != final:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ("the answer is what sum of and plus minus times equals number compute result "
             "please give final only a an to be you we it this that question think tool call "
             "user assistant system sort list reverse order numbers first second").split()
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        lines.append(f"What is {a} {op} {b}? The answer is {eval(f'{a}{op}{b}')}.")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
        lines.append(json.dumps({"name": rng.choice(words), "arguments": {"x": rng.randint(0, 99)}}))
    return lines


def build_tokenizer(out_dir: str | Path | None = None, vocab_size: int = 512, seed: int = 0) -> Path:
    """Train (once) a byte-level BPE tokenizer with ChatML specials; returns its directory."""
    out = Path(out_dir) if out_dir else default_cache_dir() / f"tokenizer-{_key(v=vocab_size, s=seed)}"

    def build(tmp: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                       pad_token="<|endoftext|>", bos_token=None)
        fast.save_pretrained(tmp)

    return _build_atomically(out, build)


def build_tiny_model(out_dir: str | Path | None = None, arch: str = "qwen3", seed: int = 0,
                     tokenizer_dir: str | Path | None = None, **overrides) -> Path:
    """Build (once) a random-weight model of `arch` plus the tiny tokenizer; returns the HF directory.

    `overrides` replace config fields (e.g. num_hidden_layers=4). The vocabulary size follows the
    tokenizer so every id the tokenizer makes is valid.
    """
    if arch not in ARCH_CONFIGS:
        raise ValueError(f"arch: unknown architecture {arch!r}; expected one of {sorted(ARCH_CONFIGS)}")
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else build_tokenizer()
    out = Path(out_dir) if out_dir else (
        default_cache_dir() / f"{arch}-{_key(a=arch, s=seed, o=overrides, t=str(tok_dir))}")

    if _distributed_rank() not in (None, 0) and not (out / ".complete").exists():
        return _build_in_child(out, arch, seed, tok_dir, overrides)

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir)
        fields = dict(ARCH_CONFIGS[arch])
        model_type = fields.pop("model_type")
        fields.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=None)
        fields.update(overrides)
        config = AutoConfig.for_model(model_type, **fields)
        config.dtype = "float32"
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return _build_atomically(out, build, required=("config.json", "model.safetensors|model.safetensors.index.json"))


def _distributed_rank() -> int | None:
    """This process's torch.distributed rank, or None when it is not initialized (or no torch)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank()


def _build_in_child(out: Path, arch: str, seed: int, tok_dir: Path, overrides: dict) -> Path:
    code = ("import json, sys; from miles.tiny import build_tiny_model; a = json.loads(sys.argv[1]); "
            "build_tiny_model(a['out'], a['arch'], a['seed'], a['tok'], **a['overrides'])")
    args = json.dumps({"out": str(out), "arch": arch, "seed": seed, "tok": str(tok_dir),
                       "overrides": overrides})
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    try:
        proc = subprocess.run([sys.executable, "-c", code, args], env=env, capture_output=True,
                              text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"building {out.name} in a child process: no result within 600 s") from None
    if proc.returncode != 0 or not (out / ".complete").exists():
        raise RuntimeError(f"building {out.name} in a child process failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout)[-2000:]}")
    return out
