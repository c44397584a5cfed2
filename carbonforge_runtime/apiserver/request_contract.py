"""The request contract as an ASGI middleware, loaded by vLLM's API server with ``--middleware``.

It runs in the API server process, outermost in vLLM's middleware stack, and sees every request
before vLLM does. In order:

1. **The key.** When keys are required (``VLLM_API_KEY``), every path but the public ones
   (:data:`~carbonforge_runtime.core.api_contract.PUBLIC_PATHS`) needs ``Authorization: Bearer KEY``,
   judged from the headers alone: a refused request is answered 401 before a byte of its body is
   read, whatever route vLLM has for it (a websocket is closed instead).
2. **Stopped.** Once the runtime says the server stops taking requests (the licence expired, or a
   multi-host group lost a host), the probes answer 503 and so does every other request but the
   metrics scrape; requests already in flight finish.
3. **The size.** A body is read only up to ``max_request_bytes``: a larger one is answered 413 as soon
   as its declared length or the bytes read so far pass the limit.
4. **The contract.** A JSON POST to a route of
   :data:`~carbonforge_runtime.core.api_contract.ROUTES` is judged by
   :func:`~carbonforge_runtime.core.api_contract.check_request`: an accepted body goes on (rewritten
   where the effort needs mapping, and with the request's tags, from its ``metadata`` and its
   ``X-CF-Task`` header, and its model name in ``vllm_xargs`` for the engine's trace record), a
   refused one is answered in the OpenAI error shape. Chat answers get ``reasoning_content`` beside
   vLLM's ``reasoning``.

Routes are matched the way Starlette matches them: the path without ``--root-path``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from carbonforge_runtime.core.api_contract import (
    API_CONTRACT_VARIABLE,
    GROUP_DOWN_VARIABLE,
    LICENCE_EXPIRED_ERROR,
    LICENCE_EXPIRED_VARIABLE,
    ROUTES,
    ApiContract,
    ApiError,
    alias_reasoning_events,
    alias_reasoning_json,
    auth_error,
    check_request,
    is_public,
    route_path,
    too_large_error,
)
from carbonforge_runtime.core.request_tags import TASK_HEADER

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

def contract_from_environ(environ: MutableMapping[str, str] | None = None) -> ApiContract:
    text = (environ if environ is not None else os.environ).get(API_CONTRACT_VARIABLE)
    return ApiContract.from_json(text) if text else ApiContract()


async def _respond(send: Send, error: ApiError) -> None:
    body = error.body()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _header(message: Message, name: bytes) -> bytes:
    for key, value in message.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return b""


class _ReasoningAlias:
    """A ``send`` that adds ``reasoning_content`` beside vLLM's ``reasoning`` in chat answers: a JSON
    answer is held until whole (its length changes), a stream is rewritten event by event."""

    __slots__ = ("held", "pending", "send", "start", "streaming")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.start: Message | None = None
        self.streaming = False
        self.pending = b""
        self.held: list[bytes] = []

    async def __call__(self, message: Message) -> None:
        if self.streaming and message["type"] == "http.response.body":  # the hot path: once per event
            data = message.get("body", b"")
            if self.pending:
                data = self.pending + data
                self.pending = b""
            if message.get("more_body", False):
                cut = data.rfind(b"\n\n") + 2
                if cut < 2:
                    self.pending = data
                    return
                data, self.pending = data[:cut], data[cut:]
            message["body"] = alias_reasoning_events(data)
            await self.send(message)
            return
        kind = message["type"]
        if kind == "http.response.start":
            content_type = _header(message, b"content-type")
            if content_type.startswith(b"text/event-stream"):
                self.streaming = True
            elif content_type.startswith(b"application/json") and message.get("status") == 200:
                self.start = message
                return
            await self.send(message)
            return
        if kind != "http.response.body" or self.start is None:
            await self.send(message)
            return
        self.held.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = alias_reasoning_json(b"".join(self.held))
        start = self.start
        headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.send({**start, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None when the client went away first; :class:`_TooLarge` as soon
    as more than ``limit`` bytes have come."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` once, then the client's own messages (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}


def _declared_length(scope: Scope) -> int | None:
    """The body's length from ``content-length``; None when absent (chunked, or no body) or unreadable
    (the server refuses those itself)."""
    raw = _header(scope, b"content-length")
    return int(raw) if raw.isdigit() else None


def key_digests(keys: str | None) -> tuple[bytes, ...]:
    """The digests of the keys clients may send (``VLLM_API_KEY``); empty: no key is required."""
    return (hashlib.sha256(keys.encode("utf-8")).digest(),) if keys else ()


def key_verdict(scope: Scope, digests: tuple[bytes, ...]) -> ApiError | None:
    """None when ``Authorization: Bearer KEY`` holds one of the keys, else the 401 to answer with
    (compared as digests in constant time, as vLLM does)."""
    value = _header(scope, b"authorization")
    if not value:
        return auth_error(key_sent=False)
    scheme, _, token = value.partition(b" ")
    sent = hashlib.sha256(token).digest()
    matched = False
    for digest in digests:
        matched |= hmac.compare_digest(sent, digest)
    return None if matched and scheme.lower() == b"bearer" else auth_error(key_sent=True)


_TASK_HEADER = TASK_HEADER.lower().encode()
#: The probes: what load balancers ask before they send a request.
PROBES = frozenset({"/health", "/ping"})
METRICS_PATH = "/metrics"
_GROUP_DOWN = ApiError(503, "the serving group lost a host; this server is stopping", type="service_unavailable")


class RequestContract:
    """``--middleware carbonforge_runtime.apiserver.request_contract.RequestContract``."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.contract = contract_from_environ()
        self.keys = key_digests(os.environ.get("VLLM_API_KEY"))
        self.group_down_file = os.environ.get(GROUP_DOWN_VARIABLE) or None
        self.licence_expired_file = os.environ.get(LICENCE_EXPIRED_VARIABLE) or None

    def stopped(self, route: str) -> ApiError | None:
        """The 503 for ``route`` once the server stops taking requests, else None."""
        if route == METRICS_PATH:
            return None
        if self.licence_expired_file and os.path.exists(self.licence_expired_file):
            return LICENCE_EXPIRED_ERROR
        if route in PROBES and self.group_down_file and os.path.exists(self.group_down_file):
            return _GROUP_DOWN
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        route = route_path(scope["path"], scope.get("root_path", ""))
        refusal = None
        if self.keys and not is_public(route) and scope.get("method") != "OPTIONS":
            refusal = key_verdict(scope, self.keys)
        refusal = refusal or self.stopped(route)
        if kind == "websocket":
            if refusal is not None:  # closing before accepting refuses the handshake (403)
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        if refusal is None and (_declared_length(scope) or 0) > self.contract.max_request_bytes:
            refusal = too_large_error(self.contract.max_request_bytes)
        if refusal is not None:
            await _respond(send, refusal)
            return
        try:  # every request, whatever its headers say: a body is never passed on unread
            body = await _read_body(receive, self.contract.max_request_bytes)
        except _TooLarge:
            await _respond(send, too_large_error(self.contract.max_request_bytes))
            return
        if body is None:
            return
        target = ROUTES.get(route) if scope.get("method") == "POST" else None
        if target is not None:
            verdict = check_request(route, body, contract=self.contract, task_header=_header(scope, _TASK_HEADER))
            if isinstance(verdict, ApiError):
                await _respond(send, verdict)
                return
            if verdict is not body:
                scope = _with_length(scope, len(verdict))
            body = verdict
            if self.contract.reasoning and target.answers:
                send = _ReasoningAlias(send)
        await self.app(scope, _replay(body, receive), send)
