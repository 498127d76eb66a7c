"""The session server's per-job token: every route but /health needs it, as an OpenAI client
sends its API key (`Authorization: Bearer`) or as an Anthropic client does (`x-api-key`); without
it, a 401 in the route's API error shape that never echoes a token. No token means open."""

from __future__ import annotations

import subprocess
import sys

import aiohttp
import pytest

from miles.tito.client import SessionServerClient, SessionServerError

TOKEN = "job-token-5f1c"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def guarded(scripted_engine, tito_server, tiny_tokenizer, tiny_tokenizer_dir, monkeypatch):
    monkeypatch.delenv("MILES_SESSION_TOKEN", raising=False)
    engine = await scripted_engine(tiny_tokenizer)
    server, url = await tito_server(engine.url, str(tiny_tokenizer_dir), max_context_tokens=2048, token=TOKEN)
    async with aiohttp.ClientSession() as http:
        yield engine, server, url, http


async def _call(http, method, url, body=None, headers=None):
    async with http.request(method, url, json=body, headers=headers or {}) as r:
        return r.status, await r.json(content_type=None), r.headers


async def test_the_agent_endpoints_need_the_token(guarded):
    engine, server, url, http = guarded
    async with SessionServerClient(url, token=TOKEN) as client:
        s = await client.create_session(rollout_id="r")
    chat, messages = s["openai_base_url"] + "/chat/completions", s["base_url"] + "/v1/messages"
    anthropic_body = {"max_tokens": 8, "messages": USER}
    for headers, what in [({}, "missing API key"), ({"Authorization": "Bearer wrong"}, "invalid API key"),
                          ({"Authorization": f"Basic {TOKEN}"}, "missing API key"),
                          ({"x-api-key": TOKEN[:-1]}, "invalid API key")]:
        status, err, resp_headers = await _call(http, "POST", chat, {"messages": USER}, headers)
        assert status == 401 and resp_headers["WWW-Authenticate"] == "Bearer"
        e = err["error"]
        assert e["type"] == "invalid_request_error" and e["code"] == "invalid_api_key", err
        assert what in e["message"] and "MILES_SESSION_TOKEN" in e["message"]
        status, err, _ = await _call(http, "POST", messages, anthropic_body, headers)
        assert status == 401 and err["type"] == "error" and err["error"]["type"] == "authentication_error"
        assert what in err["error"]["message"]
        assert TOKEN not in str(err) and "wrong" not in str(err)
    assert len(engine.requests) == 0 and server.stats["unauthorized"] == 8
    # an OpenAI client's header and an Anthropic client's header both get in
    status, r, _ = await _call(http, "POST", chat, {"messages": USER}, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and r["object"] == "chat.completion"
    status, r, _ = await _call(http, "POST", messages, anthropic_body, {"x-api-key": TOKEN})
    assert status == 200 and r["type"] == "message"
    status, r, _ = await _call(http, "GET", s["openai_base_url"] + "/models", headers={"x-api-key": TOKEN})
    assert status == 200


async def test_management_routes_need_it_too_and_health_does_not(guarded):
    _, _, url, http = guarded
    for method, path in [("POST", "/sessions"), ("GET", "/sessions"), ("GET", "/stats"),
                         ("POST", "/sessions/x/samples"), ("DELETE", "/sessions/x")]:
        status, err, _ = await _call(http, method, url + path, {} if method == "POST" else None)
        assert status == 401 and err["error"]["code"] == "invalid_api_key", (path, err)
    assert (await _call(http, "GET", url + "/health"))[0] == 200
    with pytest.raises(SessionServerError, match="HTTP 401: Authorization: missing API key"):
        async with SessionServerClient(url) as client:
            await client.create_session()
    async with SessionServerClient(url, token=TOKEN) as client:
        s = await client.create_session(rollout_id="r")
        assert await client.collect(s["session_id"]) == []


async def test_the_token_comes_from_the_environment(scripted_engine, tito_server, tiny_tokenizer,
                                                    tiny_tokenizer_dir, monkeypatch):
    monkeypatch.setenv("MILES_SESSION_TOKEN", TOKEN)
    engine = await scripted_engine(tiny_tokenizer)
    _, url = await tito_server(engine.url, str(tiny_tokenizer_dir))
    async with aiohttp.ClientSession() as http:
        assert (await _call(http, "POST", url + "/sessions", {}))[0] == 401
    async with SessionServerClient(url) as client:  # the client reads the same variable
        assert client.token == TOKEN
        s = await client.create_session()
    async with aiohttp.ClientSession() as http:
        status, _, _ = await _call(http, "POST", s["openai_base_url"] + "/chat/completions",
                                   {"messages": USER}, {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200


async def test_no_token_means_open(scripted_engine, tito_server, tiny_tokenizer, tiny_tokenizer_dir,
                                   monkeypatch):
    monkeypatch.delenv("MILES_SESSION_TOKEN", raising=False)
    engine = await scripted_engine(tiny_tokenizer)
    _, url = await tito_server(engine.url, str(tiny_tokenizer_dir))
    async with SessionServerClient(url) as client:
        assert client.token is None
        s = await client.create_session()
    async with aiohttp.ClientSession() as http:
        assert (await _call(http, "POST", s["openai_base_url"] + "/chat/completions", {"messages": USER}))[0] == 200


def test_the_token_is_never_a_command_line_value(tmp_path):
    """`--token-file` only (argv is world-readable); a missing or empty file is refused by name."""
    run = [sys.executable, "-m", "miles.tito.server", "--engine-url", "http://127.0.0.1:9", "--tokenizer", "qwen"]
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for extra, expected in [(["--token", TOKEN], "unrecognized arguments: --token"),
                            (["--token-file", str(tmp_path / "nope")], "--token-file"),
                            (["--token-file", str(empty)], "the file is empty")]:
        out = subprocess.run(run + extra, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and expected in out.stderr, out.stderr
        assert TOKEN not in out.stderr.replace("--token " + TOKEN, "")
