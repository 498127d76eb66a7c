"""TITO (token-in, token-out) session server: token-exact multi-turn and agent trajectories.

An agent talks OpenAI or Anthropic chat to `/sessions/{id}/v1/...`; the server keeps the exact ids
the engine consumed and produced, splices only newly appended messages onto them, and hands the
trainer one sample per trajectory leaf. Files: `server.py` (HTTP), `session.py` (a turn),
`tree.py` (branches and sample assembly), `prefix.py` (prefix lookup), `families/` (templates and
parsers), `verify.py` (round-trip check). Nothing here imports `miles.actors`.
"""
