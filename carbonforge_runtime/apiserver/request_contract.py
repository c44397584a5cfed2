"""The request contract as an ASGI middleware, loaded by vLLM's API server with ``--middleware``.

It runs in the API server process, outermost in vLLM's middleware stack, and sees every request
before vLLM does. In order:

1. **The key.** When keys are required (``CF_API_KEY``'s digest, the keys file
   ``CF_API_KEYS_FILE``: :mod:`~carbonforge_runtime.apiserver.keys`), every path but the public ones
   (:data:`~carbonforge_runtime.core.api_contract.PUBLIC_PATHS`) needs ``Authorization: Bearer KEY``
   with the scope the route needs (:func:`~carbonforge_runtime.core.api_keys.required_scope`), judged
   from the headers alone: a refused request is answered 401 or 403 before a byte of its body is
   read, whatever route vLLM has for it (a websocket is closed instead). ``GET /v1/auth/whoami``
   is answered here: the key's name, scopes and limits.
2. **Stopped.** Once the runtime says the server stops taking requests (the licence expired, or a
   multi-host group lost a host), the probes answer 503 and so does every other request but the
   metrics scrape; requests already in flight finish.
3. **The size.** A body is read only up to ``max_request_bytes``: a larger one is answered 413 as soon
   as its declared length or the bytes read so far pass the limit.
4. **The limits.** A named key's requests in flight and requests per minute
   (:mod:`~carbonforge_runtime.core.rate_limits`), held in this process: past either, 429 with
   ``Retry-After``; a request counted against a per-minute limit is answered with OpenAI's
   ``x-ratelimit-*-requests`` headers.
5. **The contract.** A JSON POST to a route of
   :data:`~carbonforge_runtime.core.api_contract.ROUTES` is judged by
   :func:`~carbonforge_runtime.core.api_contract.check_request`: an accepted body goes on (rewritten
   where the effort needs mapping, and with the request's tags, from its ``metadata`` and its
   ``X-CF-Task`` header, its model name and its named key's tenant, priority class and share in
   ``vllm_xargs`` for the engine's scheduler and trace record), a
   refused one is answered in the OpenAI error shape. Chat answers get ``reasoning_content`` beside
   vLLM's ``reasoning``.

Routes are matched the way Starlette matches them: the path without ``--root-path``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from carbonforge_runtime.apiserver.keys import POLL_S, REFRESH_DEADLINE_S, KeyStore, in_daemon_thread, log
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
    check_request,
    concurrency_error,
    is_public,
    rate_limit_error,
    route_path,
    scope_error,
    too_large_error,
)
from carbonforge_runtime.core.api_keys import WHOAMI_PATH, ApiKey, required_scope, shortcut_key
from carbonforge_runtime.core.rate_limits import CONCURRENCY_RETRY_AFTER_S, RETRY_AFTER_HEADER
from carbonforge_runtime.core.request_tags import TASK_HEADER, tenant_args

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

def contract_from_environ(environ: MutableMapping[str, str] | None = None) -> ApiContract:
    text = (environ if environ is not None else os.environ).get(API_CONTRACT_VARIABLE)
    return ApiContract.from_json(text) if text else ApiContract()


async def _respond(send: Send, error: ApiError) -> None:
    await _respond_json(send, error.status, error.body(), error.headers)


async def _respond_json(send: Send, status: int, body: bytes, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class _WithHeaders:
    """A ``send`` that adds ``headers`` to the answer's start (the rate-limit headers of a counted request)."""

    __slots__ = ("headers", "send")

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        self.send = send
        self.headers = headers

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *self.headers]}
        await self.send(message)


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


#: Who an open API (no key required) says the caller is: no name, every scope, no limit.
_OPEN_IDENTITY = orjson.dumps(shortcut_key(b"").identity())


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
        self.keys = KeyStore.from_environ()
        self.in_flight: dict[str, int] = {}
        self.watcher: asyncio.Task[None] | None = None
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

    async def watch_keys(self) -> None:
        """Look at the keys file about once a second for as long as the server runs (in a thread of
        its own, each look given up after :data:`REFRESH_DEADLINE_S`)."""
        pending: asyncio.Future[bool] | None = None
        while True:
            await asyncio.sleep(POLL_S)
            if pending is None or pending.done():
                pending = in_daemon_thread(self.keys.refresh)
            try:
                await asyncio.wait_for(asyncio.shield(pending), timeout=REFRESH_DEADLINE_S)
            except TimeoutError:
                log.error("%s: still being read after %.0f s; the keys in force stay", self.keys.path,
                          REFRESH_DEADLINE_S)
            except Exception:  # never let the watcher die: the next look tries again
                log.exception("looking at %s failed; the keys in force stay", self.keys.path)

    def start_watching(self) -> None:
        """Start :meth:`watch_keys` on the running loop unless it runs there already (the server's
        lifespan start, or its first request)."""
        loop = asyncio.get_running_loop()
        if self.watcher is None or self.watcher.get_loop() is not loop or self.watcher.done():
            self.watcher = loop.create_task(self.watch_keys())

    def admit(self, key: ApiKey) -> ApiError | list[tuple[bytes, bytes]]:
        """Count a request of the named ``key`` against its limits: the 429 to answer with, or the
        headers of its answer (none without a per-minute limit)."""
        if key.max_in_flight is not None and self.in_flight.get(key.name or "", 0) >= key.max_in_flight:
            return concurrency_error(key.max_in_flight,
                                     ((RETRY_AFTER_HEADER, str(CONCURRENCY_RETRY_AFTER_S).encode()),))
        taken = self.keys.take(key)
        if taken is None:
            return []
        if not taken.allowed:
            return rate_limit_error(taken.limit, tuple(taken.headers()))
        return taken.headers()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if self.keys.path is not None:
            self.start_watching()
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        route = route_path(scope["path"], scope.get("root_path", ""))
        method = scope.get("method")
        refusal = None
        key: ApiKey | None = None
        if self.keys.required and not is_public(route) and method != "OPTIONS":
            found = self.keys.identify(_header(scope, b"authorization"))
            if isinstance(found, ApiError):
                refusal = found
            else:
                key = found
                needed = required_scope(method or "GET", route)
                if needed is not None and needed not in key.scopes:
                    refusal = scope_error(needed)
        refusal = refusal or self.stopped(route)
        if kind == "websocket":
            if refusal is not None:  # closing before accepting refuses the handshake (403)
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        if refusal is None and route == WHOAMI_PATH and method == "GET":
            await _respond_json(send, 200, orjson.dumps(key.identity()) if key is not None else _OPEN_IDENTITY)
            return
        if refusal is None and (_declared_length(scope) or 0) > self.contract.max_request_bytes:
            refusal = too_large_error(self.contract.max_request_bytes)
        if refusal is None and key is not None and key.name is not None:
            admitted = self.admit(key)
            if isinstance(admitted, ApiError):
                refusal = admitted
            elif admitted:
                send = _WithHeaders(send, admitted)
        if refusal is not None:
            await _respond(send, refusal)
            return
        if key is None or key.name is None or key.max_in_flight is None:
            await self.serve(scope, receive, send, route, key)
            return
        name = key.name
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        try:
            await self.serve(scope, receive, send, route, key)
        finally:
            left = self.in_flight[name] - 1
            if left:
                self.in_flight[name] = left
            else:
                del self.in_flight[name]

    async def serve(self, scope: Scope, receive: Receive, send: Send, route: str, key: ApiKey | None) -> None:
        """An admitted request: its body read (up to the limit) and judged, then handed to vLLM."""
        try:  # every request, whatever its headers say: a body is never passed on unread
            body = await _read_body(receive, self.contract.max_request_bytes)
        except _TooLarge:
            await _respond(send, too_large_error(self.contract.max_request_bytes))
            return
        if body is None:
            return
        target = ROUTES.get(route) if scope.get("method") == "POST" else None
        if target is not None:
            tenant = tenant_args(key.name, key.priority, key.share) if key is not None and key.name else None
            verdict = check_request(route, body, contract=self.contract, task_header=_header(scope, _TASK_HEADER),
                                    tenant=tenant)
            if isinstance(verdict, ApiError):
                await _respond(send, verdict)
                return
            if verdict is not body:
                scope = _with_length(scope, len(verdict))
            body = verdict
            if self.contract.reasoning and target.answers:
                send = _ReasoningAlias(send)
        await self.app(scope, _replay(body, receive), send)
