"""The middleware in a Starlette app stacked the way vLLM 0.32 stacks it: vLLM's own key check inside,
ours outermost. The inner route echoes what reached it, so every test sees what vLLM would get."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from carbonforge_runtime.apiserver.request_contract import RequestContract
from carbonforge_runtime.core.api_contract import (
    API_CONTRACT_VARIABLE,
    MSG_BAD_EFFORT,
    MSG_INVALID_JSON,
    MSG_NO_KEY,
    MSG_WRONG_KEY,
    ApiContract,
)

QWEN3 = ApiContract(reasoning=True, tools=True, thinking_budget={"low": 8, "medium": 32, "xhigh": None})
KEY = "k-123"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def chat(request: Request) -> Response:
    raw = await request.body()
    try:
        received = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return JSONResponse({"error": {"message": "vLLM's own parse error"}}, status_code=400)
    if received.get("stream"):
        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"delta": {"reasoning": "th"}}]}\n\ndata: {"choices": [{"delta": '
            yield b'{"reasoning": "ink"}}]}\n\n'
            yield b'data: {"choices": [{"delta": {"content": "answer"}}]}\n\ndata: [DONE]\n\n'
        return StreamingResponse(events(), media_type="text/event-stream")
    return JSONResponse({"received": received, "length": request.headers.get("content-length"),
                         "choices": [{"message": {"content": "answer", "reasoning": "thought"}}]})


async def health(request: Request) -> Response:
    return Response(status_code=200)


def app(monkeypatch: pytest.MonkeyPatch, contract: ApiContract, key: str | None) -> httpx.AsyncClient:
    monkeypatch.setenv(API_CONTRACT_VARIABLE, contract.to_json())
    if key:
        monkeypatch.setenv("VLLM_API_KEY", key)
    else:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    inner = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health),
                              Route("/v1/models", health)])
    if key:
        inner.add_middleware(AuthenticationMiddleware, tokens=[key])
    inner.add_middleware(RequestContract)  # added last: outermost, as vLLM adds --middleware
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=inner), base_url="http://test")


def run(coroutine):  # type: ignore[no-untyped-def]
    return asyncio.run(coroutine)


def test_effort_is_mapped_and_the_length_header_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        async with app(monkeypatch, QWEN3, None) as client:
            answer = await client.post("/v1/chat/completions",
                                       json={**CHAT, "chat_template_kwargs": {"reasoning_effort": "medium"}})
            data = answer.json()
            assert data["received"]["chat_template_kwargs"] == {"enable_thinking": True}
            assert data["received"]["thinking_token_budget"] == 32
            assert int(data["length"]) == len(orjson.dumps(data["received"]))
            assert data["choices"][0]["message"]["reasoning_content"] == "thought"
            assert int(answer.headers["content-length"]) == len(answer.content)
    run(go())


def test_refusals_answer_without_reaching_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        async with app(monkeypatch, QWEN3, None) as client:
            bad = await client.post("/v1/chat/completions", content=b"{nope",
                                    headers={"content-type": "application/json"})
            assert bad.status_code == 400 and bad.json()["error"]["message"] == MSG_INVALID_JSON
            high = await client.post("/v1/chat/completions",
                                     json={**CHAT, "chat_template_kwargs": {"reasoning_effort": "high"}})
            assert high.status_code == 400
            assert set(high.json()["error"]) == {"message", "type", "param", "code"}
            assert high.json()["error"]["message"] == MSG_BAD_EFFORT
    run(go())


def test_streams_carry_reasoning_content_even_when_events_are_split(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        async with app(monkeypatch, QWEN3, None) as client:
            answer = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            events = [e for e in answer.text.split("\n\n") if e]
            deltas = [orjson.loads(e[6:])["choices"][0]["delta"] for e in events[:-1]]
            assert deltas == [{"reasoning": "th", "reasoning_content": "th"},
                              {"reasoning": "ink", "reasoning_content": "ink"}, {"content": "answer"}]
            assert events[-1] == "data: [DONE]"
    run(go())


def test_vllm_checks_the_key_and_its_401_is_reshaped(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        async with app(monkeypatch, QWEN3, KEY) as client:
            none = await client.post("/v1/chat/completions", json=CHAT)
            assert none.status_code == 401 and none.json()["error"]["message"] == MSG_NO_KEY
            wrong = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and wrong.json()["error"]["message"] == MSG_WRONG_KEY
            models = await client.get("/v1/models")
            assert models.status_code == 401 and models.json()["error"]["message"] == MSG_NO_KEY
            # a bad body without the key is still a 401: the key is judged first
            bad = await client.post("/v1/chat/completions", content=b"{nope")
            assert bad.status_code == 401
            right = {"Authorization": f"Bearer {KEY}"}
            bad = await client.post("/v1/chat/completions", content=b"{nope", headers=right)
            assert bad.status_code == 400 and bad.json()["error"]["message"] == MSG_INVALID_JSON
            ok = await client.post("/v1/chat/completions", json=CHAT, headers=right)
            assert ok.status_code == 200 and ok.json()["received"]["messages"] == CHAT["messages"]
            assert (await client.get("/health")).status_code == 200
    run(go())


def test_a_model_without_reasoning_passes_bodies_and_answers_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        async with app(monkeypatch, ApiContract(tools=True), None) as client:
            raw = orjson.dumps({**CHAT, "max_tokens": 3})
            answer = await client.post("/v1/chat/completions", content=raw)
            data = answer.json()
            # as sent, but for the model name the engine's trace record gets in vllm_xargs
            assert data["received"] == {**orjson.loads(raw), "vllm_xargs": {"cf_model": "m"}}
            assert int(data["length"]) == len(raw) + len(b',"vllm_xargs":{"cf_model":"m"}')
            assert "reasoning_content" not in data["choices"][0]["message"]
    run(go())


def test_health_answers_503_once_the_group_has_lost_a_host(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from carbonforge_runtime.core.api_contract import GROUP_DOWN_VARIABLE

    down = tmp_path / "group-down"
    monkeypatch.setenv(GROUP_DOWN_VARIABLE, str(down))

    async def go() -> None:
        async with app(monkeypatch, QWEN3, KEY) as client:
            assert (await client.get("/health")).status_code == 200
            down.touch()  # the leader's runtime found a host gone
            lost = await client.get("/health")
            assert lost.status_code == 503 and "lost a host" in lost.json()["error"]["message"]
            served = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"})
            assert served.status_code == 200  # only the health answer changes; the runtime stops the engine
    run(go())
