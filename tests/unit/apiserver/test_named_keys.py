"""Named keys in the middleware: every status, code and header of the platform's contract, whoami, the
limits on an injected clock, the tenant written into ``vllm_xargs`` over whatever a client sent, the keys
file re-read while serving (a broken one keeps the last good keys), and no secret in any log line."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import REGISTRY
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from carbonforge_runtime.apiserver.keys import KeyStore
from carbonforge_runtime.apiserver.request_contract import RequestContract
from carbonforge_runtime.core.api_contract import (
    API_CONTRACT_VARIABLE,
    MSG_NO_KEY,
    MSG_WRONG_KEY,
    ApiContract,
    ApiError,
)
from carbonforge_runtime.core.api_keys import KEYS_FILE_VARIABLE, SHORTCUT_DIGEST_VARIABLE, WHOAMI_PATH, ApiKey
from carbonforge_runtime.core.request_tags import MODEL_ARG, PRIORITY_ARG, SHARE_ARG, TENANT_ARG

CHAT = "/v1/chat/completions"
GENERATE = "/inference/v1/generate"
MESSAGES = [{"role": "user", "content": "hi"}]
SECRETS = {name: f"cf-test-{name}-5b0e7d1c9a2f4e6b8d0c" for name in ("team-a", "reader", "slow", "old", "shortcut")}


def digest(name: str) -> str:
    return hashlib.sha256(SECRETS[name].encode()).hexdigest()


def keys_text(*, drop: str | None = None, rpm: int = 2) -> str:
    entries = {
        "team-a": f"scopes: [models:read, inference:invoke]\n    requests_per_minute: {rpm}\n    priority: 2\n"
                  "    share: 3",
        "reader": "scopes: [models:read]",
        "slow": "scopes: [inference:invoke]\n    max_in_flight: 1",
        "old": "scopes: [models:read, inference:invoke]\n    expires: 2020-01-01",
    }
    return "keys:\n" + "".join(f"  - name: {name}\n    sha256: {digest(name)}\n    {rest}\n"
                               for name, rest in entries.items() if name != drop)


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {SECRETS[name]}"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Inner:
    """vLLM's side: echoes the body it got; ``/slow`` waits until released."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = asyncio.Event()

        async def echo(request: Request) -> Response:
            self.calls.append(request.url.path)
            raw = await request.body()
            return JSONResponse({"received": orjson.loads(raw) if raw else None})

        async def slow(request: Request) -> Response:
            self.calls.append(request.url.path)
            await asyncio.wait_for(self.release.wait(), timeout=10)
            return JSONResponse({"slow": True})

        self.app = Starlette(routes=[
            Route(CHAT, echo, methods=["POST"]), Route(GENERATE, echo, methods=["POST"]),
            Route("/v1/chat/completions/render", echo, methods=["POST"]), Route("/v1/models", echo),
            Route("/scale_elastic_ep", echo, methods=["POST"]), Route("/slow", slow, methods=["POST"]),
            Route("/health", echo)])


def serving(monkeypatch: pytest.MonkeyPatch, keys_file: Path | None, shortcut: str | None = None,
            max_bytes: int = 4096) -> tuple[RequestContract, Inner, Clock]:
    monkeypatch.setenv(API_CONTRACT_VARIABLE, ApiContract(max_request_bytes=max_bytes).to_json())
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for variable, value in ((KEYS_FILE_VARIABLE, str(keys_file) if keys_file else None),
                            (SHORTCUT_DIGEST_VARIABLE, hashlib.sha256(shortcut.encode()).hexdigest()
                             if shortcut else None)):
        if value:
            monkeypatch.setenv(variable, value)
        else:
            monkeypatch.delenv(variable, raising=False)
    inner = Inner()
    contract = RequestContract(inner.app)
    clock = Clock()
    contract.keys.clock = clock
    return contract, inner, clock


def http(contract: RequestContract) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=contract), base_url="http://test")


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(keys_text())
    return path


def error_of(answer: httpx.Response) -> dict[str, Any]:
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


def test_every_refusal_has_its_status_code_and_header(monkeypatch: pytest.MonkeyPatch, keys_file: Path) -> None:
    contract, inner, _ = serving(monkeypatch, keys_file, shortcut=SECRETS["shortcut"])

    async def go() -> None:
        async with http(contract) as client:
            none = await client.post(CHAT, json={"messages": MESSAGES})
            assert none.status_code == 401 and error_of(none)["code"] == "missing_api_key"
            assert error_of(none)["message"] == MSG_NO_KEY and none.headers["www-authenticate"] == "Bearer"
            for headers in ({"authorization": "Bearer cf-unknown"}, {"authorization": f"Basic {SECRETS['team-a']}"},
                            {"authorization": SECRETS["team-a"]}):
                wrong = await client.post(CHAT, json={"messages": MESSAGES}, headers=headers)
                assert wrong.status_code == 401 and error_of(wrong)["code"] == "invalid_api_key", headers
                assert error_of(wrong)["message"] == MSG_WRONG_KEY
                assert wrong.headers["www-authenticate"] == 'Bearer error="invalid_token"'
            expired = await client.get("/v1/models", headers=auth("old"))
            assert expired.status_code == 401 and error_of(expired)["code"] == "invalid_api_key"
            assert "expired" in error_of(expired)["message"] and "invalid_token" in expired.headers["www-authenticate"]
            reader = await client.post(CHAT, json={"messages": MESSAGES}, headers=auth("reader"))
            assert reader.status_code == 403 and error_of(reader)["code"] == "insufficient_scope"
            assert error_of(reader)["type"] == "permission_error" and "inference:invoke" in error_of(reader)["message"]
            assert reader.headers["www-authenticate"] == 'Bearer error="insufficient_scope", scope="inference:invoke"'
            invoker = await client.get("/v1/models", headers=auth("slow"))
            assert invoker.status_code == 403 and 'scope="models:read"' in invoker.headers["www-authenticate"]
            operator = await client.post("/scale_elastic_ep", json={}, headers=auth("team-a"))
            assert operator.status_code == 403 and 'scope="operator"' in operator.headers["www-authenticate"]
            assert (await client.get("/v1/models", headers=auth("reader"))).status_code == 200
            too_large = await client.post(CHAT, content=b"x" * 5000, headers=auth("team-a"))
            assert too_large.status_code == 413 and error_of(too_large)["code"] == "request_too_large"
            assert (await client.get("/health")).status_code == 200  # public, no key
            # the CF_API_KEY shortcut: every scope, no limit, no headers
            for _ in range(5):
                ok = await client.post(CHAT, json={"messages": MESSAGES}, headers=auth("shortcut"))
                assert ok.status_code == 200 and "x-ratelimit-limit-requests" not in ok.headers
            assert (await client.post("/scale_elastic_ep", json={}, headers=auth("shortcut"))).status_code == 200
    asyncio.run(go())
    assert "/scale_elastic_ep" in inner.calls and inner.calls.count(CHAT) == 5


def test_requests_per_minute_headers_and_429(monkeypatch: pytest.MonkeyPatch, keys_file: Path) -> None:
    contract, inner, clock = serving(monkeypatch, keys_file)

    async def go() -> None:
        async with http(contract) as client:
            first = await client.post(CHAT, json={"messages": MESSAGES}, headers=auth("team-a"))
            assert first.status_code == 200
            assert (first.headers["x-ratelimit-limit-requests"], first.headers["x-ratelimit-remaining-requests"],
                    first.headers["x-ratelimit-reset-requests"]) == ("2", "1", "30s")
            models = await client.get("/v1/models", headers=auth("team-a"))  # every route counts
            assert models.headers["x-ratelimit-remaining-requests"] == "0"
            assert models.headers["x-ratelimit-reset-requests"] == "1m0s"
            calls = len(inner.calls)
            refused = await client.post(CHAT, json={"messages": MESSAGES}, headers=auth("team-a"))
            assert refused.status_code == 429 and error_of(refused)["code"] == "rate_limit_exceeded"
            assert error_of(refused)["type"] == "rate_limit_error"
            assert "2 requests per minute" in error_of(refused)["message"]
            assert refused.headers["retry-after"] == "30" and refused.headers["x-ratelimit-remaining-requests"] == "0"
            assert len(inner.calls) == calls  # vLLM never saw it
            whoami = await client.get(WHOAMI_PATH, headers=auth("team-a"))  # not counted
            assert whoami.status_code == 200 and "x-ratelimit-limit-requests" not in whoami.headers
            clock.now += 12.0
            still = await client.post(CHAT, json={"messages": MESSAGES}, headers=auth("team-a"))
            assert still.status_code == 429 and still.headers["retry-after"] == "18"
            clock.now += 18.0
            again = await client.post(CHAT, json={"messages": MESSAGES}, headers=auth("team-a"))
            assert again.status_code == 200 and again.headers["x-ratelimit-remaining-requests"] == "0"
    asyncio.run(go())


def test_in_flight_limit_and_its_429(monkeypatch: pytest.MonkeyPatch, keys_file: Path) -> None:
    contract, inner, _ = serving(monkeypatch, keys_file)

    async def go() -> None:
        async with http(contract) as client:
            held = asyncio.create_task(client.post("/slow", json={}, headers=auth("slow")))
            for _ in range(200):
                if inner.calls:
                    break
                await asyncio.sleep(0.01)
            assert contract.in_flight == {"slow": 1}
            refused = await client.post(CHAT, json={"messages": MESSAGES}, headers=auth("slow"))
            assert refused.status_code == 429 and error_of(refused)["code"] == "concurrency_limit_exceeded"
            assert refused.headers["retry-after"] == "1" and "x-ratelimit-limit-requests" not in refused.headers
            other = await client.post(CHAT, json={"messages": MESSAGES}, headers=auth("team-a"))
            assert other.status_code == 200  # limits are per key
            inner.release.set()
            assert (await asyncio.wait_for(held, 10)).status_code == 200
            assert contract.in_flight == {}
            assert (await client.post(CHAT, json={"messages": MESSAGES}, headers=auth("slow"))).status_code == 200
            assert contract.in_flight == {}
    asyncio.run(go())


def test_whoami_answers_name_scopes_and_limits(monkeypatch: pytest.MonkeyPatch, keys_file: Path) -> None:
    contract, inner, _ = serving(monkeypatch, keys_file, shortcut=SECRETS["shortcut"])

    async def go() -> None:
        async with http(contract) as client:
            me = await client.get(WHOAMI_PATH, headers=auth("team-a"))
            assert me.status_code == 200 and me.json() == {
                "object": "api_key", "name": "team-a", "scopes": ["inference:invoke", "models:read"],
                "limits": {"requests_per_minute": 2, "max_in_flight": None}, "priority": 2, "share": 3.0,
                "expires_at": None}
            assert SECRETS["team-a"] not in me.text and digest("team-a") not in me.text
            reader = await client.get(WHOAMI_PATH, headers=auth("reader"))  # any scope will do
            assert reader.json()["scopes"] == ["models:read"]
            shortcut = await client.get(WHOAMI_PATH, headers=auth("shortcut"))
            assert shortcut.json()["name"] is None and "operator" in shortcut.json()["scopes"]
            assert (await client.get(WHOAMI_PATH)).status_code == 401
            assert (await client.get(WHOAMI_PATH, headers=auth("old"))).status_code == 401
    asyncio.run(go())
    assert inner.calls == []
    open_api, _, _ = serving(monkeypatch, None)

    async def open_go() -> None:
        async with http(open_api) as client:
            me = await client.get(WHOAMI_PATH)
            assert me.status_code == 200 and me.json()["name"] is None
    asyncio.run(open_go())


def test_the_tenant_overwrites_what_a_client_sent(monkeypatch: pytest.MonkeyPatch, keys_file: Path) -> None:
    contract, _, _ = serving(monkeypatch, keys_file, shortcut=SECRETS["shortcut"])
    posing = {TENANT_ARG: "someone-else", PRIORITY_ARG: 99, SHARE_ARG: 1000.0, "mine": "kept"}

    async def go() -> None:
        async with http(contract) as client:
            chat = await client.post(CHAT, json={"model": "m", "messages": MESSAGES, "vllm_xargs": posing},
                                     headers=auth("team-a"))
            sent = chat.json()["received"]["vllm_xargs"]
            assert sent == {"mine": "kept", MODEL_ARG: "m", TENANT_ARG: "team-a", PRIORITY_ARG: 2, SHARE_ARG: 3.0}
            plain = await client.post(CHAT, json={"messages": MESSAGES}, headers=auth("slow"))  # defaults
            assert plain.json()["received"]["vllm_xargs"] == {TENANT_ARG: "slow", PRIORITY_ARG: 0, SHARE_ARG: 1.0}
            generate = await client.post(GENERATE, json={"token_ids": [1], "sampling_params": {
                "extra_args": posing}}, headers=auth("slow"))
            extra = generate.json()["received"]["sampling_params"]["extra_args"]
            assert extra == {"mine": "kept", TENANT_ARG: "slow", PRIORITY_ARG: 0, SHARE_ARG: 1.0}
            render = await client.post("/v1/chat/completions/render", json={"messages": MESSAGES,
                                                                             "vllm_xargs": posing},
                                       headers=auth("team-a"))
            assert render.json()["received"]["vllm_xargs"] == {"mine": "kept"}  # never reaches the engine
            shortcut = await client.post(CHAT, json={"messages": MESSAGES, "vllm_xargs": posing},
                                         headers=auth("shortcut"))
            assert shortcut.json()["received"]["vllm_xargs"] == {"mine": "kept"}  # no named key: no tenant
    asyncio.run(go())


def errors_total() -> float:
    return REGISTRY.get_sample_value("carbonforge_api_keys_file_errors_total") or 0.0


def test_the_file_is_re_read_and_a_broken_one_keeps_the_last_good(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "keys.yaml"
    path.write_text(keys_text())
    store = KeyStore(str(path), None)
    assert set(store.keys.names) == {"team-a", "reader", "slow", "old"}
    assert REGISTRY.get_sample_value("carbonforge_api_keys_loaded") == 4
    assert not store.refresh()  # unchanged: not read again
    replace(path, keys_text(drop="reader"))
    assert store.refresh() and "reader" not in store.keys.names
    refused = store.identify(auth("reader")["authorization"].encode())
    assert isinstance(refused, ApiError) and refused.code == "invalid_api_key"
    before = errors_total()
    replace(path, keys_text() + "  - name: broken\n    sha256: nope\n    scopes: [models:read]\n")
    assert not store.refresh() and not store.refresh()
    assert set(store.keys.names) == {"team-a", "slow", "old"}  # the last good set
    assert errors_total() == before + 1  # said once per change, not on every look
    assert REGISTRY.get_sample_value("carbonforge_api_keys_file_valid") == 0
    assert "entry 5 ('broken', line 19): sha256: is not 64 hexadecimal digits" in caplog.text
    assert "the last good keys stay in force (3 named keys)" in caplog.text
    path.unlink()
    assert not store.refresh() and len(store.keys) == 3 and "cannot be read" in caplog.text
    replace(path, keys_text(rpm=5))
    assert store.refresh() and len(store.keys) == 4
    assert REGISTRY.get_sample_value("carbonforge_api_keys_file_valid") == 1
    key = store.identify(auth("team-a")["authorization"].encode())
    assert isinstance(key, ApiKey) and key.requests_per_minute == 5 and key.identity()["name"] == "team-a"
    for secret in SECRETS.values():
        assert secret not in caplog.text
    for name in SECRETS:
        assert digest(name) not in caplog.text


def replace(path: Path, text: str) -> None:
    """Write ``text`` over ``path`` as an operator's tool does: a new file renamed over the old one."""
    fresh = path.with_suffix(".new")
    fresh.write_text(text)
    os.replace(fresh, path)


def test_a_revoked_key_stops_within_seconds_while_serving(monkeypatch: pytest.MonkeyPatch, keys_file: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    contract, _, _ = serving(monkeypatch, keys_file)

    async def go() -> float:
        async with http(contract) as client:
            assert (await client.get("/v1/models", headers=auth("reader"))).status_code == 200  # starts the watcher
            replace(keys_file, keys_text(drop="reader"))
            revoked = time.monotonic()
            while time.monotonic() - revoked < 5:
                if (await client.get("/v1/models", headers=auth("reader"))).status_code == 401:
                    return time.monotonic() - revoked
                await asyncio.sleep(0.1)
            raise AssertionError("the revoked key still works after 5 s")
    took = asyncio.run(go())
    assert took < 3.0
    assert all(secret not in caplog.text for secret in SECRETS.values())


def test_a_broken_file_at_start_refuses_every_named_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("keys: [")
    contract, _, _ = serving(monkeypatch, path)
    assert contract.keys.required and len(contract.keys.keys) == 0
    assert "not valid YAML" in caplog.text

    async def go() -> None:
        async with http(contract) as client:
            assert (await client.get("/v1/models", headers=auth("reader"))).status_code == 401
    asyncio.run(go())


def test_scope_and_limit_refusals_read_no_body(monkeypatch: pytest.MonkeyPatch, keys_file: Path) -> None:
    from tests.unit.apiserver.test_closed_by_default import Client, endless

    contract, inner, _ = serving(monkeypatch, keys_file)
    client = Client(contract)
    status, error = client.request(CHAT, endless(), {**auth("reader"), "transfer-encoding": "chunked"})
    assert status == 403 and error["error"]["code"] == "insufficient_scope"
    for _ in range(2):
        assert client.request("/v1/models", [], auth("team-a"), method="GET")[0] == 200
    status, error = client.request(CHAT, endless(), {**auth("team-a"), "transfer-encoding": "chunked"})
    assert status == 429 and error["error"]["code"] == "rate_limit_exceeded"
    assert client.read == 0 and inner.calls == ["/v1/models", "/v1/models"]


def test_a_look_at_the_keys_file_runs_beside_the_loop_and_never_holds_up_its_shutdown() -> None:
    from carbonforge_runtime.apiserver.keys import in_daemon_thread

    release = threading.Event()
    started = threading.Event()
    finished = threading.Event()

    def stuck() -> bool:  # a read of a stalled volume
        started.set()
        release.wait(60)
        finished.set()
        return True

    async def go() -> bool:
        assert await in_daemon_thread(lambda: True) is True
        with pytest.raises(KeyError):
            await in_daemon_thread(lambda: {}["missing"])
        pending = in_daemon_thread(stuck)
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        return pending.done()

    done = asyncio.run(go())
    # asyncio.run has closed its loop while the look was still stuck: it did not wait for it.
    assert started.is_set() and not done and not finished.is_set()
    release.set()
    assert finished.wait(10)
