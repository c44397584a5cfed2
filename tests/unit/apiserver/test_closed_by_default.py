"""The API server closed by default: vLLM 0.32's real app (every router it registers, our middleware
loaded with ``--middleware`` as the runtime loads it), and the middleware driven through raw ASGI
messages where a test must see what was read."""

from __future__ import annotations

import asyncio
import logging
import typing
from collections.abc import Iterator, MutableMapping
from typing import Any

import httpx
import orjson
import pytest

from carbonforge_runtime.apiserver.request_contract import RequestContract
from carbonforge_runtime.core.api_contract import (
    API_CONTRACT_VARIABLE,
    GROUP_DOWN_VARIABLE,
    LICENCE_EXPIRED_VARIABLE,
    MSG_BAD_EFFORT,
    MSG_NO_KEY,
    PUBLIC_PATHS,
    ROUTES,
    ApiContract,
)
from carbonforge_runtime.runtime.planning.command import MIDDLEWARE

KEY = "k-closed-1"
QWEN3 = ApiContract(reasoning=True, tools=True, thinking_budget={"low": 8, "medium": 32, "xhigh": None},
                    max_request_bytes=4096)


def build_vllm_app(*extra: str) -> Any:
    """vLLM's API server app with every task's routes and our middleware outermost, as vLLM builds it
    for ``vllm serve m --middleware ... EXTRA``; the middleware reads its environment at the first request."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.tasks import SupportedTask
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", "--middleware", MIDDLEWARE, *extra])
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        return build_app(args, supported_tasks=typing.get_args(SupportedTask))
    finally:  # SageMaker's bootstrap raises the root logger's level: later tests' log captures need it back
        root.setLevel(level)
        root.handlers[:] = handlers


@pytest.fixture(scope="module")
def vllm_app() -> Iterator[Any]:
    """:func:`build_vllm_app` with keys required."""
    patch = pytest.MonkeyPatch()
    patch.setenv("VLLM_API_KEY", KEY)
    patch.setenv(API_CONTRACT_VARIABLE, QWEN3.to_json())
    try:
        yield build_vllm_app()
    finally:
        patch.undo()


def _routes(app: Any) -> list[tuple[str, str]]:
    """(method or "WEBSOCKET", concrete path) for every route of ``app``; path parameters filled in."""
    from starlette.routing import Mount, Route, WebSocketRoute

    found: list[tuple[str, str]] = []
    for route in app.routes:
        path = route.path.replace("{", "").replace("}", "")  # /v1/responses/{response_id} -> .../response_id
        if isinstance(route, WebSocketRoute):
            found.append(("WEBSOCKET", path))
        elif isinstance(route, Route):
            found += [(method, path) for method in sorted(route.methods or ()) if method != "HEAD"]
        elif isinstance(route, Mount):
            found.append(("GET", path + "/"))
    return found


async def _websocket_answer(app: Any, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if sent:
            await asyncio.sleep(3600)
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": path, "raw_path": path.encode(), "root_path": "", "headers": headers,
             "query_string": b"", "scheme": "ws", "server": ("test", 80), "client": ("127.0.0.1", 1),
             "subprotocols": [], "asgi": {"version": "3.0"}}
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent[0]


def test_every_route_of_vllm_needs_the_key_but_the_public_ones(vllm_app: Any) -> None:
    routes = _routes(vllm_app)
    paths = {path for _, path in routes}
    assert {"/invocations", "/tokenize", "/scale_elastic_ep", "/v1/chat/completions", "/version"} <= paths
    assert set(PUBLIC_PATHS) <= paths  # the list names only what exists

    async def go() -> None:
        transport = httpx.ASGITransport(app=vllm_app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for method, path in routes:
                if method == "WEBSOCKET":
                    refused = await _websocket_answer(vllm_app, path, [])
                    assert refused == {"type": "websocket.close", "code": 1008}, path
                    continue
                answer = await client.request(method, path, content=b"{}" if method == "POST" else None)
                if path in PUBLIC_PATHS:
                    assert answer.status_code != 401, (method, path)
                else:
                    assert answer.status_code == 401, (method, path, answer.status_code)
                    assert answer.json()["error"]["message"] == MSG_NO_KEY, (method, path)
            # a path no router has is refused too: what a later vLLM adds starts closed
            assert (await client.post("/v9/anything", content=b"{}")).status_code == 401
            assert (await client.get("/health")).status_code != 401
    asyncio.run(go())


def test_the_right_key_passes_on_every_route(vllm_app: Any) -> None:
    async def go() -> None:
        transport = httpx.ASGITransport(app=vllm_app, raise_app_exceptions=False)
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers) as client:
            for method, path in _routes(vllm_app):
                if method == "WEBSOCKET" or path in PUBLIC_PATHS:
                    continue
                body = orjson.dumps({"messages": [{"role": "user", "content": "x"}]}) if method == "POST" else None
                answer = await asyncio.wait_for(client.request(method, path, content=body), timeout=30)
                assert answer.status_code != 401, (method, path)
    asyncio.run(go())


def test_every_path_that_reaches_a_chat_completion_or_responses_handler_has_its_contract(vllm_app: Any) -> None:
    from fastapi.routing import APIRoute
    from vllm.entrypoints.openai.chat_completion.protocol import BatchChatCompletionRequest, ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    kinds = {ChatCompletionRequest: "chat", BatchChatCompletionRequest: "chat_batch",
             ResponsesRequest: "responses", CompletionRequest: "json"}
    seen = set()
    for route in vllm_app.routes:
        if not isinstance(route, APIRoute):
            continue
        for annotation in typing.get_type_hints(route.endpoint).values():
            if annotation in kinds:
                assert route.path in ROUTES, route.path
                assert ROUTES[route.path].kind == kinds[annotation], route.path
                seen.add(route.path)
    # SageMaker's /invocations takes a bare Request and picks the chat or completion handler by the body
    assert ROUTES["/invocations"].kind == "invocation"
    app_paths = {getattr(route, "path", None) for route in vllm_app.routes}
    # every path of the table exists (the pooling routes appear only with a pooling model's config)
    assert set(ROUTES) - app_paths == {"/v1/embeddings"}
    assert {"/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses"} <= seen


def test_under_a_root_path_vllms_app_still_gets_the_contract(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    down = tmp_path / "group-down"
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    monkeypatch.setenv(API_CONTRACT_VARIABLE, QWEN3.to_json())
    monkeypatch.setenv(GROUP_DOWN_VARIABLE, str(down))
    app = build_vllm_app("--root-path", "/api")
    high = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"reasoning_effort": "high"}}

    async def go() -> None:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for path in ("/api/v1/chat/completions", "/v1/chat/completions", "/api/invocations"):
                refused = await client.post(path, json=high, headers={"Authorization": f"Bearer {KEY}"})
                assert refused.status_code == 400, (path, refused.text)
                assert refused.json()["error"]["message"] == MSG_BAD_EFFORT, path
                assert (await client.post(path, json=high)).status_code == 401, path
            down.touch()
            assert (await client.get("/api/health")).status_code == 503
    asyncio.run(go())


# ---- the middleware through raw ASGI messages ----------------------------------------------------


class Inner:
    """The app behind the middleware: records what reached it and answers 200."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.calls.append((scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


class Client:
    """Sends one request as ``chunks`` and counts how many the middleware read."""

    def __init__(self, middleware: RequestContract) -> None:
        self.middleware = middleware
        self.read = 0

    def request(self, path: str, chunks: Iterator[bytes] | list[bytes], headers: dict[str, str],
                root_path: str = "", method: str = "POST") -> tuple[int, dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        source = iter(chunks)

        async def receive() -> dict[str, Any]:
            chunk = next(source, None)
            if chunk is None:
                return {"type": "http.request", "body": b"", "more_body": False}
            self.read += len(chunk)
            return {"type": "http.request", "body": chunk, "more_body": True}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(dict(message))

        scope = {"type": "http", "method": method, "path": root_path + path, "root_path": root_path,
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()], "query_string": b""}
        asyncio.run(self.middleware(scope, receive, send))
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return sent[0]["status"], (orjson.loads(body) if body.startswith(b"{") else {"text": body.decode()})


def middleware(monkeypatch: pytest.MonkeyPatch, key: str | None = KEY, **files: str) -> tuple[RequestContract, Inner]:
    monkeypatch.setenv(API_CONTRACT_VARIABLE, QWEN3.to_json())
    if key:
        monkeypatch.setenv("VLLM_API_KEY", key)
    else:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for variable in (GROUP_DOWN_VARIABLE, LICENCE_EXPIRED_VARIABLE):
        if variable in files:
            monkeypatch.setenv(variable, files[variable])
        else:
            monkeypatch.delenv(variable, raising=False)
    inner = Inner()
    return RequestContract(inner), inner


def endless(size: int = 64 * 1024) -> Iterator[bytes]:
    while True:
        yield b"x" * size


def test_a_request_without_the_key_is_refused_before_its_body_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    contract, inner = middleware(monkeypatch)
    client = Client(contract)
    status, error = client.request("/invocations", endless(), {"transfer-encoding": "chunked"})
    assert status == 401 and error["error"]["code"] == "missing_api_key"
    status, _ = client.request("/v1/chat/completions", endless(), {"content-length": str(256 << 20),
                                                                     "authorization": "Bearer wrong"})
    assert status == 401
    status, _ = client.request("/v1/chat/completions", endless(), {"authorization": f"Basic {KEY}",
                                                                     "transfer-encoding": "chunked"})
    assert status == 401  # the scheme must be Bearer
    assert client.read == 0 and inner.calls == []


def test_a_body_over_the_limit_gets_413_as_soon_as_it_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    contract, inner = middleware(monkeypatch)
    client = Client(contract)
    auth = {"authorization": f"Bearer {KEY}"}
    status, error = client.request("/v1/chat/completions", endless(), {**auth, "content-length": str(1 << 30)})
    assert status == 413 and error["error"]["code"] == "request_too_large" and client.read == 0
    assert "CF_MAX_REQUEST_BYTES" in error["error"]["message"]
    status, _ = client.request("/tokenize", endless(1000), {**auth, "transfer-encoding": "chunked"})
    assert status == 413
    assert 4096 < client.read <= 4096 + 1000  # read up to the first chunk past the limit, no further
    assert inner.calls == []
    # at the limit it passes, on any path
    status, _ = client.request("/tokenize", [b"y" * 4096], {**auth, "transfer-encoding": "chunked"})
    assert status == 200 and inner.calls == [("/tokenize", b"y" * 4096)]


def test_without_keys_the_limit_still_holds_and_public_paths_stay_open(monkeypatch: pytest.MonkeyPatch) -> None:
    contract, _ = middleware(monkeypatch, key=None)
    client = Client(contract)
    assert client.request("/v1/models", [], {}, method="GET")[0] == 200
    assert client.request("/ping", endless(), {"transfer-encoding": "chunked"})[0] == 413
    contract, _ = middleware(monkeypatch)
    client = Client(contract)
    for path in PUBLIC_PATHS:
        assert client.request(path, [], {}, method="GET")[0] == 200, path


def test_the_contract_holds_on_every_route_and_under_a_root_path(monkeypatch: pytest.MonkeyPatch) -> None:
    contract, inner = middleware(monkeypatch)
    client = Client(contract)
    auth = {"authorization": f"Bearer {KEY}"}
    high_chat = orjson.dumps({"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"reasoning_effort": "high"}})
    high_batch = orjson.dumps({"messages": [[{"role": "user", "content": "x"}]], "reasoning_effort": "high"})
    high_responses = orjson.dumps({"input": "x", "reasoning": {"effort": "high"}})
    for root in ("", "/api"):
        for path, body in (("/v1/chat/completions", high_chat), ("/invocations", high_chat),
                           ("/v1/chat/completions/batch", high_batch), ("/v1/responses", high_responses),
                           ("/v1/chat/completions/render", high_chat)):
            status, error = client.request(path, [body], auth, root_path=root)
            assert status == 400 and error["error"]["message"] == MSG_BAD_EFFORT, (root, path)
        assert client.request("/v1/models", [], {}, root_path=root, method="GET")[0] == 401
        assert client.request("/health", [], {}, root_path=root, method="GET")[0] == 200
    assert inner.calls == [("/health", b""), ("/api/health", b"")]
    # accepted: the effort is mapped the same way on each
    ok = orjson.dumps({"input": "x", "reasoning": {"effort": "medium", "summary": "auto"}})
    assert client.request("/v1/responses", [ok], auth, root_path="/api")[0] == 200
    sent = orjson.loads(inner.calls[-1][1])
    assert sent["chat_template_kwargs"] == {"enable_thinking": True} and sent["reasoning"] == {"summary": "auto"}
    batch = orjson.dumps({"messages": [[{"role": "user", "content": "x"}]]})
    assert client.request("/v1/chat/completions/batch", [batch], auth)[0] == 200
    sent = orjson.loads(inner.calls[-1][1])
    assert sent["chat_template_kwargs"] == {"enable_thinking": True} and "thinking_token_budget" not in sent
    completion = orjson.dumps({"prompt": "x", "reasoning_effort": "high"})  # a completion: no effort rule
    assert client.request("/invocations", [completion], auth)[0] == 200


def test_stopped_servers_answer_503_on_probes_and_requests(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    expired, down = tmp_path / "expired", tmp_path / "down"
    contract, _ = middleware(monkeypatch, **{LICENCE_EXPIRED_VARIABLE: str(expired),
                                                 GROUP_DOWN_VARIABLE: str(down)})
    client = Client(contract)
    auth = {"authorization": f"Bearer {KEY}"}
    chat = orjson.dumps({"messages": [{"role": "user", "content": "x"}]})
    assert client.request("/v1/chat/completions", [chat], auth)[0] == 200
    down.touch()
    status, error = client.request("/health", [], {}, root_path="/api", method="GET")
    assert status == 503 and "lost a host" in error["error"]["message"]
    assert client.request("/v1/chat/completions", [chat], auth)[0] == 200  # the runtime stops the engine
    down.unlink()
    expired.touch()
    for path, method in (("/v1/chat/completions", "POST"), ("/health", "GET"), ("/ping", "GET")):
        status, error = client.request(path, [chat] if method == "POST" else [], auth, method=method)
        assert status == 503 and error["error"]["code"] == "licence_expired", path
    assert client.request("/metrics", [], {}, method="GET")[0] == 200
    # without the key, still 401: the key is judged first
    assert client.request("/v1/chat/completions", [chat], {})[0] == 401
