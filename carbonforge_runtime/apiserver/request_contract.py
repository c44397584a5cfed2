"""The request contract as an ASGI middleware, loaded by vLLM's API server with ``--middleware``.

It runs in the API server process, outermost in vLLM's middleware stack, and sees every request:

* a JSON POST to a chat or completion endpoint is read whole and judged by
  :func:`~carbonforge_runtime.core.api_contract.check_request`; an accepted body goes on (rewritten
  only where the effort needs mapping), a refused one is answered with the OpenAI error shape;
* when vLLM checks API keys (``VLLM_API_KEY``), its bare 401 is reshaped into the documented
  message. The key check itself stays vLLM's: a refused body is still shown to it (as an empty,
  invalid body), so a caller without the right key gets 401, never a 400 about the body;
* everything else, responses and streaming included, passes through untouched.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from carbonforge_runtime.core.api_contract import (
    API_CONTRACT_VARIABLE,
    CHAT_PATH,
    GROUP_DOWN_VARIABLE,
    ApiContract,
    ApiError,
    alias_reasoning_events,
    alias_reasoning_json,
    auth_error,
    check_request,
    is_guarded,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

#: What vLLM's handlers get in place of a refused body while its key check decides.
_POISON = b"\x00"


def contract_from_environ(environ: MutableMapping[str, str] | None = None) -> ApiContract:
    text = (environ if environ is not None else os.environ).get(API_CONTRACT_VARIABLE)
    return ApiContract.from_json(text) if text else ApiContract()


async def _respond(send: Send, error: ApiError) -> None:
    body = error.body()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _has_authorization(scope: Scope) -> bool:
    return any(name.lower() == b"authorization" for name, _ in scope.get("headers", ()))


class _Reshaped:
    """A ``send`` that replaces the inner app's response: a 401 by the documented 401, any other
    status by ``otherwise`` (or passes it through when ``otherwise`` is None)."""

    __slots__ = ("key_sent", "otherwise", "replaced", "send")

    def __init__(self, send: Send, key_sent: bool, otherwise: ApiError | None) -> None:
        self.send = send
        self.key_sent = key_sent
        self.otherwise = otherwise
        self.replaced = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if message["status"] == 401:
                self.replaced = True
                await _respond(self.send, auth_error(self.key_sent))
                return
            if self.otherwise is not None:
                self.replaced = True
                await _respond(self.send, self.otherwise)
                return
        elif self.replaced:
            return  # the inner app's body of a replaced response
        await self.send(message)


def _header(message: Message, name: bytes) -> bytes:
    for key, value in message.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return b""


class _ReasoningAlias:
    """A ``send`` that adds ``reasoning_content`` beside vLLM's ``reasoning`` in chat answers: a JSON
    answer is held until whole (its length changes), a stream is rewritten event by event. With
    ``key_sent`` given (keys are checked), it also reshapes a 401 as :class:`_Reshaped` does: one
    wrapper instead of two, since a stream passes every event through it."""

    __slots__ = ("held", "key_sent", "pending", "replaced", "send", "start", "streaming")

    def __init__(self, send: Send, key_sent: bool | None = None) -> None:
        self.send = send
        self.key_sent = key_sent
        self.replaced = False
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
        if self.replaced:
            return
        kind = message["type"]
        if kind == "http.response.start":
            if self.key_sent is not None and message["status"] == 401:
                self.replaced = True
                await _respond(self.send, auth_error(self.key_sent))
                return
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


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client went away first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
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


HEALTH_PATH = "/health"
_GROUP_DOWN = ApiError(503, "the serving group lost a host; this server is stopping", type="service_unavailable")


class RequestContract:
    """``--middleware carbonforge_runtime.apiserver.request_contract.RequestContract``."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.contract = contract_from_environ()
        self.keys_checked = bool(os.environ.get("VLLM_API_KEY"))
        self.group_down_file = os.environ.get(GROUP_DOWN_VARIABLE) or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path == HEALTH_PATH and self.group_down_file and os.path.exists(self.group_down_file):
            await _respond(send, _GROUP_DOWN)
            return
        guarded = self.keys_checked and is_guarded(path) and scope.get("method") != "OPTIONS"
        if scope.get("method") != "POST":
            await self.app(scope, receive, _Reshaped(send, _has_authorization(scope), None) if guarded else send)
            return
        body = await _read_body(receive)
        if body is None:
            return
        verdict = check_request(path, body, contract=self.contract)
        if isinstance(verdict, ApiError):
            if not guarded:
                await _respond(send, verdict)
                return
            # vLLM's key check answers first; its handlers get a body they refuse at once.
            await self.app(_with_length(scope, len(_POISON)), _replay(_POISON, receive),
                           _Reshaped(send, _has_authorization(scope), verdict))
            return
        if verdict is not body:
            scope = _with_length(scope, len(verdict))
        key_sent = _has_authorization(scope) if guarded else None
        if self.contract.reasoning and path == CHAT_PATH:
            send = _ReasoningAlias(send, key_sent)
        elif key_sent is not None:
            send = _Reshaped(send, key_sent, None)
        await self.app(scope, _replay(verdict, receive), send)
