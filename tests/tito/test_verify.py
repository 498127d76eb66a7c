"""Round-trip verifier: registered families pass; the stock Qwen3 template and a buggy family fail."""

from __future__ import annotations

from pathlib import Path

import json
import subprocess
import sys

import pytest

from miles.tito.families.llama3 import LLAMA3_SPECIAL_TOKENS
from miles.tito.families.qwen3 import Qwen3Family
from miles.tito.messages import parse_openai_messages
from miles.tito.tokenizer import load_tokenizer
from miles.tito.verify import compare, main, verify_conversation

DATA = Path(__file__).parent / "data"

QWEN_DATA = str(DATA / "conversations_qwen3.jsonl")
LLAMA_DATA = str(DATA / "conversations_llama3.jsonl")


@pytest.fixture(scope="module")
def qwen_vocab_with_llama_headers(tmp_path_factory):
    """The real Qwen BPE plus Llama 3's header tokens: the llama3 family over a large real vocabulary."""
    from tokenizers import AddedToken, Tokenizer
    from miles.tito.qwen_vocab import build_qwen_tokenizer
    tok = Tokenizer.from_file(str(build_qwen_tokenizer() / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in LLAMA3_SPECIAL_TOKENS])
    path = tmp_path_factory.mktemp("qwen-llama") / "tokenizer.json"
    tok.save(str(path))
    return path


def _lines(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_qwen3_passes_with_real_vocabulary_and_tiny_tokenizer(capsys, tiny_tokenizer_dir):
    assert main(["--family", "qwen3", "--tokenizer", "qwen", QWEN_DATA]) == 0
    rows = _lines(capsys)
    assert rows[-1] == {"family": "qwen3", "tokenizer": "qwen", "conversations": 4, "failed": 0}
    assert sum(r["boundaries"] for r in rows[:-1]) == 15
    # Text the engine emits right after "assistant\n" may tokenize differently from a whole-text
    # render ("\n\nNoted." after "\n"): same text, other ids, reported but not critical.
    soft = [m for r in rows[:-1] for m in r["mismatches"]]
    assert all(m["kind"] == "tokens" and not m["critical"] for m in soft)
    assert main(["--family", "qwen3", "--tokenizer", str(tiny_tokenizer_dir), QWEN_DATA]) == 0


def test_llama3_passes(capsys, llama_tokenizer_path, qwen_vocab_with_llama_headers):
    assert main(["--family", "llama3", "--tokenizer", str(llama_tokenizer_path), LLAMA_DATA]) == 0
    assert main(["--family", "llama3", "--tokenizer", str(qwen_vocab_with_llama_headers), LLAMA_DATA]) == 0
    assert _lines(capsys)[-1]["failed"] == 0


def test_stock_qwen3_template_fails_where_it_cuts_thinking(capsys):
    """The stock template drops <think> of earlier turns: not an extension of what the engine saw."""
    assert main(["--family", "qwen3", "--template", str(DATA / "qwen3_stock.jinja"), QWEN_DATA]) == 1
    rows = _lines(capsys)
    assert rows[-1]["failed"] == 4
    tool_conv = rows[1]
    first = tool_conv["mismatches"][0]
    assert first["kind"] == "special" and first["critical"]
    assert (first["actual"], first["expected"]) == ("<think>", "<tool_call>")
    tok = load_tokenizer("qwen")
    # the reported position is the <think> the engine produced in the first assistant turn
    conv = [json.loads(line) for line in open(QWEN_DATA)][1]
    msgs = parse_openai_messages(conv["messages"])
    from miles.tito.families import get_family
    prefix = get_family("qwen3").render(msgs[:2], conv["tools"], 0, True)
    assert first["position"] == len(tok.encode(prefix))


class ForgetsNewline(Qwen3Family):
    """A buggy splice: drops the "\\n" the template writes after <|im_end|>."""
    name = "qwen3-buggy-test"

    def bridge(self, last_token):
        return ""


def test_buggy_family_is_caught_with_its_position(qwen_tokenizer):
    conv = [json.loads(line) for line in open(QWEN_DATA)][0]
    msgs = parse_openai_messages(conv["messages"])
    good = verify_conversation(Qwen3Family(), qwen_tokenizer, msgs)
    bad = verify_conversation(ForgetsNewline(), qwen_tokenizer, msgs, template=Qwen3Family.chat_template)
    assert good["ok"] and not bad["ok"]
    m = bad["mismatches"][0]
    # "<|im_end|>" then "<|im_start|>" where the template has "<|im_end|>", "\n", "<|im_start|>"
    assert (m["kind"], m["expected"], m["actual"], m["boundary"]) == ("special", "\n", "<|im_start|>", 3)


def test_text_mismatch_reports_token_and_character_position(qwen_tokenizer):
    from miles.tito.families import get_family
    fam = get_family("qwen3")
    actual = qwen_tokenizer.encode("<|im_start|>user\nWhat is 2+3?<|im_end|>\n")
    expected = qwen_tokenizer.encode("<|im_start|>user\nWhat is 2+4?<|im_end|>\n")
    [m] = compare(qwen_tokenizer, fam, actual, expected)
    assert (m.kind, m.position, m.char, m.critical) == ("text", 1, 15, True)
    assert (m.actual, m.expected) == ("user\nWhat is 2+3?", "user\nWhat is 2+4?")
    # the same difference inside engine-generated tokens is not critical
    [soft] = compare(qwen_tokenizer, fam, actual, expected, generated=[1] * len(actual))
    assert not soft.critical


def test_llama3_trim_is_a_soft_text_mismatch(llama_tokenizer_path):
    """Llama's template trims assistant text on re-render; the engine's untrimmed text stays."""
    from miles.tito.families import get_family
    tok = load_tokenizer(str(llama_tokenizer_path))
    msgs = parse_openai_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " 42 "},
                                  {"role": "user", "content": "ok"}])
    report = verify_conversation(get_family("llama3"), tok, msgs)
    assert report["ok"]
    [m] = report["mismatches"]
    assert (m["kind"], m["actual"], m["expected"], m["critical"]) == ("text", "\n\n 42 ", "\n\n42", False)


def test_cli_runs_as_a_process(tiny_tokenizer_dir):
    out = subprocess.run([sys.executable, "-m", "miles.tito.verify", "--family", "qwen3", "--tokenizer",
                          str(tiny_tokenizer_dir), QWEN_DATA], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["failed"] == 0
