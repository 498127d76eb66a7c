"""TITO (token-in, token-out) session server: token-exact multi-turn and agent trajectories.

An agent talks OpenAI or Anthropic chat to `/sessions/{id}/v1/...`; the server keeps the exact ids
the engine consumed and produced, splices only newly appended messages onto them, and hands the
trainer one sample per trajectory leaf.

Files: `server.py` (HTTP, its own process), `httpio.py` (bodies, error envelopes, SSE),
`api_openai.py` / `api_responses.py` / `api_anthropic.py` (wire formats), `request.py` (one turn's
request), `messages.py` (normalized messages, boundary validation), `history.py` (tool calls and
results pair up), `tokenize_pool.py` (large renders tokenized in worker processes),
`session.py` (a turn: locate, tokenize, commit, complete), `tree.py` (branches, sample assembly),
`prefix.py` (hash-chained prefix lookup), `engine.py` (the turn's `/generate`), `client.py`
(create/collect from the rollout side), `families/` (templates, renderers, parsers),
`template.py` (Jinja full re-render), `verify.py` (round-trip verifier), `tokenizer.py` and
`qwen_vocab.py` (tokenizers, offline). Nothing here imports `miles.actors`.
"""
