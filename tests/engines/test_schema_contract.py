"""Every request body our client sends is valid for SGLang, checked against SGLang's own schema.

The real `EngineClient` talks to a tiny local capture server; each captured body is then checked
against the released sglang wheel (downloaded once by the `sglang_wheel` fixture, read at test
time, never committed):

- `/generate`: `sglang/api/v1/api_types.py`, the msgspec schema behind SGLang's JSON contract gate
  (it loads standalone), decodes the body exactly as the server does (a violation is a 400
  there; `sampling_params` rejects unknown keys). That schema ignores unknown top-level keys,
  so the top-level keys are also checked against the fields of `GenerateReqInput`
  (`sglang/srt/managers/io_struct.py`): a misspelt `return_routed_experts` would otherwise be
  dropped in silence.
- Control routes: the route -> request class map is read from `http_server.py`, the class's
  fields from `io_struct.py` (both with `ast`; neither module imports without a GPU stack), and
  the body is converted into a msgspec Struct of those fields with unknown fields forbidden.
- Every path the client calls must be one of SGLang's routes (our documented extensions aside).
"""

from __future__ import annotations

import ast
import importlib.util
import typing
from typing import Any

import msgspec
import numpy as np
import pytest
from aiohttp import web

from miles.engines.client import EngineClient, SamplingParams
from miles.engines.procs import free_port

# Routes the embedded engine adds on top of SGLang's API (documented in client.py).
MILES_EXTENSIONS = {"/weights_checksum"}


# ---- the capture server ----------------------------------------------------------------------

def _generate_response(body: dict) -> dict:
    prompt = len(body.get("input_ids") or [0])
    n = (body.get("sampling_params") or {}).get("max_new_tokens") or 2
    meta = {"id": body.get("rid", "r"), "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": prompt, "completion_tokens": n, "cached_tokens": 0,
            "weight_version": "3"}
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = [[-0.5, 7, None]] * n
        meta["input_token_logprobs"] = [[None, 1, None]] + [[-1.0, 1, None]] * (prompt - 1)
    if body.get("return_routed_experts"):
        rows = prompt + n - 1 - body.get("routed_experts_start_len", 0)
        import base64
        meta["routed_experts"] = base64.b64encode(np.zeros(rows * 2 * 2, "<i4").tobytes()).decode()
    return {"text": "xy", "output_ids": [7] * n, "meta_info": meta}


@pytest.fixture
async def capture():
    """(base_url, captured) where captured is a list of (method, path, body, headers)."""
    captured: list[tuple[str, str, Any, dict]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        captured.append((request.method, request.path, body, dict(request.headers)))
        if request.path == "/generate":
            answer = _generate_response(body)
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b"data: " + msgspec.json.encode(answer) + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
                return resp
            return web.json_response(answer)
        if request.path in ("/model_info", "/server_info"):
            return web.json_response({"model_path": "m", "weight_version": "3",
                                      "num_hidden_layers": 2, "num_experts_per_tok": 2})
        if request.path == "/get_weights_by_name":
            return web.json_response([0.1, 0.2])
        if request.path in ("/abort_request", "/flush_cache"):
            return web.Response(text="")
        return web.json_response({"success": True, "message": "ok", "status": "ok",
                                  "new_version": "x", "num_paused_requests": 0})

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", captured
    await runner.cleanup()


# ---- what the client sends ---------------------------------------------------------------------

EVERY_SAMPLING_PARAM = {
    "max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
    "min_new_tokens": 1, "stop": ["\n\n", "</answer>"], "stop_token_ids": [2, 3],
    "ignore_eos": False, "skip_special_tokens": False, "no_stop_trim": True, "sampling_seed": 7,
    "frequency_penalty": 0.1, "presence_penalty": 0.2, "repetition_penalty": 1.1,
    "logit_bias": {"5": -1.5}, "spaces_between_special_tokens": False, "n": 1,
}


async def _drive_client(url: str) -> None:
    """Call every request-making method of the client, with each option."""
    async with EngineClient(url, routed_experts_layout=(2, 2), max_retries=0) as c:
        await c.generate([1, 2, 3], {"max_new_tokens": 4})
        await c.generate(np.array([1, 2, 3], dtype=np.int64), EVERY_SAMPLING_PARAM)
        await c.generate([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0,
                                                   top_k=-1, stop="x", sampling_seed=3,
                                                   ignore_eos=True))
        await c.generate([1, 2, 3], {"max_new_tokens": 2}, return_logprob=True,
                         logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)
        await c.generate([1, 2, 3, 4], {"max_new_tokens": 2}, return_routed_experts=True,
                         routed_experts_start_len=3)
        await c.generate([1, 2], {"max_new_tokens": 2}, rid="rid-1", session_id="s-1",
                         routing_key="s-1")
        await c.generate(text="hello", sampling_params={"max_new_tokens": 2})
        async for _ in c.generate_stream([1, 2, 3], {"max_new_tokens": 2}, return_logprob=True,
                                         rid="rid-2"):
            pass
        for mode in ("in_place", "retract", "abort"):
            await c.pause_generation(mode)
        await c.continue_generation()
        await c.abort_request("rid-1")
        await c.abort_request(abort_all=True)
        await c.flush_cache()
        await c.update_weights_from_disk("/ckpt/step-3", weight_version=3)
        await c.update_weights_from_disk("/ckpt/step-4", weight_version="4", load_format="auto",
                                         abort_all_requests=True, flush_cache=False)
        await c.init_weights_update_group("127.0.0.1", 29500, 1, 2, group_name="g", backend="gloo")
        await c.update_weights_from_distributed(["w"], ["torch.bfloat16"], [[4, 8]], group_name="g",
                                                weight_version=5, flush_cache=False)
        await c.destroy_weights_update_group("g")
        await c.update_weights_from_tensor(["cGF5bG9hZA=="], load_format="flattened_bucket",
                                           weight_version=6)
        await c.update_weights_from_tensor(["cGF5bG9hZA=="])
        await c.update_weight_version(7)
        await c.get_weights_by_name("model.embed_tokens.weight", truncate_size=4)
        await c.model_info()
        await c.server_info()
        await c.health()


# ---- SGLang's schema, from the wheel -----------------------------------------------------------

def _load_api_types(wheel, tmp_path):
    path = tmp_path / "sglang_api_v1_api_types.py"
    path.write_text(wheel.read("sglang/api/v1/api_types.py"))
    spec = importlib.util.spec_from_file_location("sglang_api_v1_api_types", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _routes(http_server_src: str) -> dict[str, tuple[set[str], str | None]]:
    """{path: (methods, request class name or None)} from the FastAPI decorators."""
    routes: dict[str, tuple[set[str], str | None]] = {}
    for fn in ast.walk(ast.parse(http_server_src)):
        if not isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        request_class = None
        for arg in fn.args.args:
            names = [n.id for n in ast.walk(arg.annotation or ast.Constant(None))
                     if isinstance(n, ast.Name)]
            request_class = next((n for n in names if n.endswith(("ReqInput", "Req"))),
                                 request_class)
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and getattr(dec.func.value, "id", None) == "app" and dec.args
                    and isinstance(dec.args[0], ast.Constant)):
                continue
            kind = dec.func.attr
            methods = {kind.upper()} if kind in ("get", "post", "put", "delete") else set()
            for kw in dec.keywords:
                if kw.arg == "methods":
                    methods |= set(ast.literal_eval(kw.value))
            routes[dec.args[0].value] = (methods, request_class)
    return routes


class _Unwrap(ast.NodeTransformer):
    """`Annotated[T, meta(...)]` -> `T` (the metadata calls need SGLang's classes)."""

    def visit_Subscript(self, node):
        self.generic_visit(node)
        if getattr(node.value, "id", None) == "Annotated" and isinstance(node.slice, ast.Tuple):
            return node.slice.elts[0]
        return node


class _Types(dict):
    """Names for evaluating io_struct annotations; SGLang's own types become Any."""

    def __missing__(self, name):
        return Any


def _request_structs(io_struct_src: str) -> dict[str, type]:
    """msgspec Structs (unknown fields forbidden) with the fields of each io_struct class."""
    classes = {n.name: n for n in ast.parse(io_struct_src).body if isinstance(n, ast.ClassDef)}
    # JSON carries bytes as base64 strings (SGLang's Base64Bytes).
    names = _Types({**vars(typing), "bytes": str, "int": int, "float": float, "str": str,
                    "bool": bool, "list": list, "dict": dict, "tuple": tuple})

    def fields(name: str) -> list[tuple[str, Any, Any]]:
        node = classes.get(name)
        if node is None:
            return []
        out = [f for base in node.bases for f in fields(getattr(base, "id", ""))]
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                expr = ast.Expression(_Unwrap().visit(stmt.annotation))
                ann = eval(compile(ast.fix_missing_locations(expr), name, "eval"), {}, names)
                out = [f for f in out if f[0] != stmt.target.id]
                if stmt.value is None:
                    out.append((stmt.target.id, ann, msgspec.NODEFAULT))
                else:
                    out.append((stmt.target.id, ann, None))
        return out

    structs = {}
    for name in classes:
        if name.endswith(("ReqInput", "Req")):
            spec = [(f, t) if d is msgspec.NODEFAULT else (f, t, d) for f, t, d in fields(name)]
            spec.sort(key=len)  # required fields first
            structs[name] = msgspec.defstruct(name, spec, kw_only=True,
                                              forbid_unknown_fields=True)
    return structs


def _dataclass_fields(src: str, class_name: str) -> set[str]:
    node = next(n for n in ast.parse(src).body
                if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {s.target.id for s in node.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


# ---- the test --------------------------------------------------------------------------------

async def test_every_request_body_matches_sglang_schema(sglang_wheel, capture, tmp_path):
    url, captured = capture
    await _drive_client(url)

    api = _load_api_types(sglang_wheel, tmp_path)
    io_struct = sglang_wheel.read("sglang/srt/managers/io_struct.py")
    routes = _routes(sglang_wheel.read("sglang/srt/entrypoints/http_server.py"))
    structs = _request_structs(io_struct)
    generate_fields = _dataclass_fields(io_struct, "GenerateReqInput")
    assert "/generate" in routes and "/pause_generation" in routes, "route parser found nothing"

    checked: set[str] = set()
    for method, path, body, headers in captured:
        where = f"{method} {path} {body!r}"
        if path in MILES_EXTENSIONS:
            continue
        assert path in routes, f"{where}: not an SGLang {sglang_wheel.version} route"
        methods, request_class = routes[path]
        assert method in methods, f"{where}: SGLang serves {path} with {sorted(methods)}"
        if path == "/generate":
            try:
                api.GenerateRequest.from_json_value(body)
            except api.JsonContractError as e:
                pytest.fail(f"{where}: SGLang's contract gate would answer 400: {e}")
            unknown = set(body) - generate_fields
            assert not unknown, f"{where}: not GenerateReqInput fields: {sorted(unknown)}"
        elif request_class is not None:
            assert request_class in structs, f"{where}: request class {request_class} not found"
            try:
                msgspec.convert(body, structs[request_class])
            except msgspec.ValidationError as e:
                pytest.fail(f"{where}: does not fit SGLang's {request_class}: {e}")
        else:
            assert body in (None, {}), f"{where}: SGLang's handler takes no body"
        checked.add(path)

    expected = {"/generate", "/pause_generation", "/continue_generation", "/abort_request",
                "/flush_cache", "/update_weights_from_disk", "/init_weights_update_group",
                "/update_weights_from_distributed", "/destroy_weights_update_group",
                "/update_weights_from_tensor", "/update_weight_version", "/get_weights_by_name",
                "/model_info", "/server_info", "/health"}
    assert expected <= checked, f"not exercised: {sorted(expected - checked)}"
    routing = [h for m, p, b, h in captured if b and b.get("session_id") == "s-1"]
    assert routing[0]["X-SMG-Routing-Key"] == "s-1"


def test_the_schema_check_catches_mistakes(sglang_wheel, tmp_path):
    """The checks above are not vacuous: typical mistakes fail them."""
    api = _load_api_types(sglang_wheel, tmp_path)
    with pytest.raises(api.JsonContractError, match="max_tokens"):
        api.GenerateRequest.from_json_value({"input_ids": [1], "sampling_params": {"max_tokens": 4}})
    with pytest.raises(api.JsonContractError):
        api.GenerateRequest.from_json_value({"input_ids": [1], "sampling_params": {
            "temperature": "hot"}})
    io_struct = sglang_wheel.read("sglang/srt/managers/io_struct.py")
    structs = _request_structs(io_struct)
    with pytest.raises(msgspec.ValidationError, match="mode"):
        msgspec.convert({"mode": "sideways"}, structs["PauseGenerationReqInput"])
    with pytest.raises(msgspec.ValidationError, match="new_versoin"):
        msgspec.convert({"new_versoin": "3"}, structs["UpdateWeightVersionReqInput"])
    with pytest.raises(msgspec.ValidationError, match="model_path"):
        msgspec.convert({"weight_version": "3"}, structs["UpdateWeightFromDiskReqInput"])
    assert "return_routed_experts" in _dataclass_fields(io_struct, "GenerateReqInput")
    assert "return_routed_expert" not in _dataclass_fields(io_struct, "GenerateReqInput")
