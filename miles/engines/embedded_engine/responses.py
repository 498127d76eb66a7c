"""The embedded engine's JSON responses: bodies and SGLang's (OpenAI's) error envelope."""

from __future__ import annotations

import msgspec
from aiohttp import web


def json_response(data, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def error_response(message: str, status: int = 400, param: str | None = None, typ: str | None = None):
    """SGLang's (OpenAI's) error envelope."""
    typ = typ or ("BadRequestError" if status < 500 else "InternalServerError")
    return json_response({"error": {"message": message, "type": typ, "param": param, "code": status}},
                         status)
