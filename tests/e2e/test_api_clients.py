"""The API as real clients use it: the OpenAI SDK and LangChain against the embedded default on the real
vLLM CPU engine, with an API key required and request tracing on.

One engine serves every check here. The tiny model's weights are random, so output is forced where a
test needs a shape: tool calls by ``tool_choice`` ``required`` or a named function with a strict
schema, and JSON by a ``json_schema`` response format (the built-in model's structured output, with no
free whitespace and no unnamed properties, makes them valid for a bounded schema with no ``logit_bias``
from the client), thinking by the recipe's thinking budget (the engine closes the thinking block after
a few tokens, so an answer follows).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import psutil
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.support import TINY_KEY, TINY_SERVED_NAME, RuntimeProcess, descendants
from tests.support.serving import ASK, WEATHER_SCHEMA, WEATHER_TOOL

API_KEY = "cf-test-key-8d1f0c5e2b"
# Thinking on (the default effort) costs the tiny recipe's budget of 8 tokens first.
ROOM = 600


class Session:
    def __init__(self, runtime: RuntimeProcess, trace: Path) -> None:
        self.runtime = runtime
        self.trace = trace
        self.client = openai.OpenAI(base_url=runtime.base_url, api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    log_dir = tmp_path_factory.mktemp("api-clients")
    trace = log_dir / "trace.jsonl"
    runtime = RuntimeProcess(["--context-key", TINY_KEY, "--request-trace", "standard", "--trace-file", str(trace)],
                             log_dir, env={"CF_API_KEY": API_KEY}).start()
    try:
        runtime.wait_ready()
        yield Session(runtime, trace)
        assert runtime.stop(timeout_s=60) == 0, runtime.output()
    finally:
        runtime.kill()


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of every call; ``required`` allows several."""
    assert message.tool_calls, message
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_match_the_schema_streamed_or_not(session: Session, choice: Any) -> None:
    common: Any = {"model": TINY_SERVED_NAME, "messages": ASK, "tools": [WEATHER_TOOL], "tool_choice": choice,
                   "max_tokens": ROOM, "seed": 11, "parallel_tool_calls": False}
    reply = session.client.chat.completions.create(**common)
    assert reply.choices[0].finish_reason in ("tool_calls", "stop")
    expected = calls_of(reply.choices[0].message)
    assert len(expected) == 1
    for name, arguments in expected:
        assert name == "get_weather"
        jsonschema.validate(arguments, WEATHER_SCHEMA)

    calls: dict[int, dict[str, str]] = {}
    for chunk in session.client.chat.completions.create(**common, stream=True):
        for part in chunk.choices:
            for delta in part.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function and delta.function.name:
                    call["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    assert list(calls) == list(range(len(expected)))
    # same seed: the same calls, whitespace aside
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == expected


def test_a_json_schema_response_matches_the_schema(session: Session) -> None:
    for seed in (1, 2):
        reply = session.client.chat.completions.create(
            model=TINY_SERVED_NAME, messages=ASK, max_tokens=ROOM, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "forecast", "schema": WEATHER_SCHEMA, "strict": True}})
        assert reply.choices[0].finish_reason == "stop", reply
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), WEATHER_SCHEMA)


def test_auto_tool_choice_is_accepted(session: Session) -> None:
    reply = session.client.chat.completions.create(model=TINY_SERVED_NAME, messages=ASK, tools=[WEATHER_TOOL],
                                                   tool_choice="auto", max_tokens=16)
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")


class get_weather(BaseModel):  # the tool's name, as the model sees it
    """Forecast for a city."""

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


def test_langchain_bind_tools(session: Session) -> None:
    llm = ChatOpenAI(base_url=session.runtime.base_url, api_key=API_KEY,  # type: ignore[arg-type]
                     model=TINY_SERVED_NAME, timeout=120, max_retries=0, max_tokens=ROOM, seed=5)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True, parallel_tool_calls=False)
    message = bound.invoke("Weather in Oslo?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    get_weather.model_validate(message.tool_calls[0]["args"])
    auto = llm.bind_tools([get_weather], tool_choice="auto").invoke("Hello", max_tokens=16)
    assert auto.response_metadata["finish_reason"] in ("length", "stop", "tool_calls")


def extra(message: Any, name: str) -> Any:
    return (message.model_extra or {}).get(name)


def test_thinking_arrives_in_reasoning_content_not_in_content(session: Session) -> None:
    reply = session.client.chat.completions.create(model=TINY_SERVED_NAME, messages=ASK, max_tokens=40, seed=3,
                                                   extra_body={"ignore_eos": True})
    message = reply.choices[0].message
    thinking = extra(message, "reasoning_content")
    assert thinking, message
    assert message.content and thinking not in message.content
    assert "<think>" not in message.content and "</think>" not in message.content

    reasoning, content = [], []
    for chunk in session.client.chat.completions.create(model=TINY_SERVED_NAME, messages=ASK, max_tokens=40,
                                                        seed=3, stream=True, extra_body={"ignore_eos": True}):
        for part in chunk.choices:
            if extra(part.delta, "reasoning_content"):
                reasoning.append(extra(part.delta, "reasoning_content"))
            if part.delta.content:
                content.append(part.delta.content)
    assert reasoning and content
    assert "".join(reasoning).strip() == thinking.strip()

    off = session.client.chat.completions.create(model=TINY_SERVED_NAME, messages=ASK, max_tokens=16,
                                                 extra_body={"ignore_eos": True,
                                                             "chat_template_kwargs": {"enable_thinking": False}})
    assert not extra(off.choices[0].message, "reasoning_content")
    assert off.choices[0].message.content


@pytest.mark.parametrize("kwargs", [{"reasoning_effort": "low"}, {"reasoning_effort": "medium"},
                                    {"reasoning_effort": "xhigh"}, {"enable_thinking": False}])
def test_documented_efforts_succeed(session: Session, kwargs: dict[str, Any]) -> None:
    reply = session.client.chat.completions.create(model=TINY_SERVED_NAME, messages=ASK, max_tokens=8,
                                                   extra_body={"chat_template_kwargs": kwargs})
    assert reply.usage is not None and reply.usage.completion_tokens >= 1


def error_of(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("effort", ["high", "max", "minimal", "none"])
def test_undocumented_efforts_are_refused(session: Session, effort: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        session.client.chat.completions.create(model=TINY_SERVED_NAME, messages=ASK, max_tokens=4,
                                               extra_body={"chat_template_kwargs": {"reasoning_effort": effort}})
    assert caught.value.status_code == 400
    assert error_of(caught.value)["message"] == "Unexpected reasoning effort"


def test_malformed_json_and_a_missing_messages_parameter(session: Session) -> None:
    url = f"{session.runtime.base_url}/chat/completions"
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    bad = httpx.post(url, content=b'{"model": "x", "messages": [', headers=headers, timeout=30)
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == "Invalid JSON payload"
    with pytest.raises(openai.BadRequestError) as caught:
        session.client.post("/chat/completions", body={"model": TINY_SERVED_NAME}, cast_to=httpx.Response)
    assert error_of(caught.value) == {"message": "Missing required parameter: 'messages'",
                                      "type": "invalid_request_error", "param": "messages",
                                      "code": "missing_required_parameter"}


def test_api_keys(session: Session) -> None:
    base = session.runtime.base_url
    for key, message in ((None, "Authentication Error, No api key passed in."),
                         ("wrong-key", "Authentication Error, Invalid API key passed in.")):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        answer = httpx.post(f"{base}/chat/completions", json={"model": TINY_SERVED_NAME, "messages": ASK},
                            headers=headers, timeout=30)
        assert answer.status_code == 401
        assert answer.json()["error"]["message"] == message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong-key", max_retries=0).models.list()
    assert [m.id for m in session.client.models.list()] == [TINY_SERVED_NAME]
    health = httpx.get(base.removesuffix("/v1") + "/health", timeout=30)
    assert health.status_code == 200


def test_the_key_is_in_no_log_trace_or_argument_list(session: Session) -> None:
    runtime = session.runtime
    assert runtime.proc is not None
    session.client.chat.completions.create(model=TINY_SERVED_NAME, messages=ASK, max_tokens=4)
    pids = {runtime.proc.pid, *descendants(runtime.proc.pid)}
    assert len(pids) >= 3  # the runtime, vLLM's API server and its engine core
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert API_KEY.encode() not in argv, pid
    files = [p for p in runtime.log_dir.iterdir() if p.is_file()]
    assert {"vllm.log", "runtime.log", "trace.jsonl"} <= {p.name for p in files}
    for path in files:
        assert API_KEY not in path.read_text(errors="replace"), path
    assert session.trace.stat().st_size > 0
    assert "API keys" not in runtime.output() or API_KEY not in runtime.output()
    assert os.environ.get("CF_API_KEY") != API_KEY  # the key reached the runtime through its own environment


def test_vllms_own_metrics_stay_open_on_the_api_port(session: Session) -> None:
    """An endpoint picker (the Gateway API Inference Extension's) scrapes vLLM's /metrics on the API port
    without a key: /metrics is one of the request contract's public paths. vLLM creates both gauges,
    one series per engine, when its stat logger starts, so they are there before any request."""
    page = httpx.get(session.runtime.base_url.removesuffix("/v1") + "/metrics", timeout=30)
    assert page.status_code == 200, page.text[:500]
    assert page.headers["content-type"].startswith("text/plain")
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"# TYPE {name} gauge" in page.text, name
        assert any(line.startswith(name + "{") for line in page.text.splitlines()), name
    # the key is still required where vLLM guards
    assert httpx.get(session.runtime.base_url + "/models", timeout=30).status_code == 401


# ---- closed by default: the key on every route, bodies never read before it ----------------------


def test_every_route_but_the_public_ones_refuses_a_request_without_the_key(session: Session) -> None:
    root = session.runtime.base_url.removesuffix("/v1")
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    spec = httpx.get(f"{root}/openapi.json", headers=keyed, timeout=30)
    assert spec.status_code == 200
    routes = [(method.upper(), path.replace("{", "").replace("}", ""))
              for path, methods in spec.json()["paths"].items() for method in methods]
    assert ("POST", "/invocations") in routes and ("POST", "/tokenize") in routes
    assert httpx.get(f"{root}/openapi.json", timeout=30).status_code == 401
    with httpx.Client(base_url=root, timeout=30) as raw:
        for method, path in routes:
            answer = raw.request(method, path, content=b"{}" if method == "POST" else None)
            if path in ("/health", "/ping", "/metrics"):
                assert answer.status_code == 200, (method, path, answer.status_code)
            else:
                assert answer.status_code == 401, (method, path, answer.status_code)
                assert answer.json()["error"]["code"] == "missing_api_key", (method, path)
        # SageMaker's route hands its body to the chat handler: with the key it serves
        served = raw.post("/invocations", headers=keyed, json={"model": TINY_SERVED_NAME, "messages": ASK,
                                                               "max_tokens": 2})
        assert served.status_code == 200 and served.json()["choices"], served.text
    def no_authorization(request: httpx.Request) -> None:  # the SDK insists on a key: drop the header it makes
        del request.headers["Authorization"]

    anonymous = openai.OpenAI(base_url=session.runtime.base_url, api_key="unused", max_retries=0, timeout=30,
                              http_client=httpx.Client(event_hooks={"request": [no_authorization]}))
    calls = (lambda: anonymous.chat.completions.create(model=TINY_SERVED_NAME, messages=ASK, max_tokens=2),
             lambda: anonymous.completions.create(model=TINY_SERVED_NAME, prompt="hi", max_tokens=2),
             lambda: anonymous.responses.create(model=TINY_SERVED_NAME, input="hi", max_output_tokens=2),
             lambda: anonymous.models.list())
    for call in calls:
        with pytest.raises(openai.AuthenticationError):
            call()


def test_the_effort_contract_holds_on_invocations_batch_and_responses(session: Session) -> None:
    root = session.runtime.base_url.removesuffix("/v1")
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    high = {"chat_template_kwargs": {"reasoning_effort": "high"}}
    cases = (("/invocations", {"model": TINY_SERVED_NAME, "messages": ASK, **high}),
             ("/v1/chat/completions/batch", {"model": TINY_SERVED_NAME, "messages": [ASK], **high}),
             ("/v1/responses", {"model": TINY_SERVED_NAME, "input": "hi", "reasoning": {"effort": "high"}}))
    for path, body in cases:
        answer = httpx.post(root + path, json=body, headers=keyed, timeout=60)
        assert answer.status_code == 400, (path, answer.text)
        assert answer.json()["error"]["message"] == "Unexpected reasoning effort", path
    answer = httpx.post(root + "/invocations", headers=keyed, timeout=120,
                        json={"model": TINY_SERVED_NAME, "messages": ASK, "max_tokens": 40})
    message = answer.json()["choices"][0]["message"]
    assert message.get("reasoning_content") == message.get("reasoning"), message


def _api_server(session: Session) -> psutil.Process:
    return psutil.Process(session.runtime.engine_pid())


class HealthWatch:
    """Polls /health every 50 ms on its own thread; ``worst_s`` is the slowest answer seen."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.worst_s = 0.0
        self.failures: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.done.is_set():
                start = time.monotonic()
                try:
                    status = client.get(self.root + "/health").status_code
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    status = 200
                self.worst_s = max(self.worst_s, time.monotonic() - start)
                if status != 200:
                    self.failures.append(str(status))
                time.sleep(0.05)

    def __enter__(self) -> HealthWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(timeout=10)


def _send_huge(port: int, path: str, headers: str, chunked: bool, total: int) -> tuple[str, float, int]:
    """POST ``total`` bytes to ``path`` as fast as the server takes them; (status line, seconds to it,
    bytes the socket accepted before the answer was seen).

    One thread sends and looks for the answer between sends, so the count stops where the answer
    arrived however late the machine schedules this process (a reader thread woken late let the
    count run on for hundreds of MiB while the server read and discarded the rest)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    block = b"{" * (1 << 20)
    piece = memoryview((b"%x\r\n" % len(block)) + block + b"\r\n" if chunked else block)
    sent, offset, answer = 0, 0, b""
    start = time.monotonic()
    deadline = start + 30
    try:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                     f"{framing}\r\n\r\n".encode())
        sock.setblocking(False)
        while not answer and time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock] if sent < total else [], [], 1.0)
            if not readable and writable:
                try:
                    n = sock.send(piece[offset:])
                except BlockingIOError:
                    continue
                except OSError:  # the server closed its side: what it said before is still to be read
                    readable = [sock]
                else:
                    sent += n
                    offset = (offset + n) % len(piece)
                    continue
            if readable:
                sock.settimeout(2)
                with contextlib.suppress(OSError):
                    answer = sock.recv(65536)
                break
        elapsed = time.monotonic() - start
    finally:
        sock.close()
    status = answer.split(b"\r\n", 1)[0].decode() if answer else "(no answer)"
    return status, elapsed, sent


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_256_mib_body_without_the_key_is_refused_unread(session: Session, chunked: bool) -> None:
    root = session.runtime.base_url.removesuffix("/v1")
    server = _api_server(session)
    before = server.memory_info().rss
    with HealthWatch(root) as health:
        status, elapsed, sent = _send_huge(session.runtime.port, "/invocations", "", chunked, 256 << 20)
        time.sleep(0.3)
    grown = server.memory_info().rss - before
    print(f"no key, {'chunked' if chunked else 'content-length'}: {status} in {elapsed:.3f} s, {sent >> 20} MiB "
          f"accepted by the socket, API server RSS {grown / (1 << 20):+.1f} MiB, /health worst {health.worst_s:.3f} s")
    assert status.startswith("HTTP/1.1 401"), status
    assert elapsed < 1.0 and grown < 16 << 20
    assert health.worst_s < 0.2 and not health.failures, (health.worst_s, health.failures)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_with_the_key_gets_413_at_the_limit(session: Session, chunked: bool) -> None:
    root = session.runtime.base_url.removesuffix("/v1")
    with HealthWatch(root) as health:
        status, elapsed, sent = _send_huge(session.runtime.port, "/v1/chat/completions",
                                           f"Authorization: Bearer {API_KEY}\r\n", chunked, 256 << 20)
    print(f"key, {'chunked' if chunked else 'content-length'}: {status} in {elapsed:.3f} s after {sent >> 20} MiB, "
          f"/health worst {health.worst_s:.3f} s")
    assert status.startswith("HTTP/1.1 413"), status
    # the default limit is 16 MiB: the answer comes once it is passed (plus what socket buffers hold)
    assert sent < 48 << 20, sent
    assert health.worst_s < 0.2 and not health.failures, (health.worst_s, health.failures)
    # the connection was the only casualty: the server serves on
    assert session.client.chat.completions.create(model=TINY_SERVED_NAME, messages=ASK, max_tokens=2).choices
