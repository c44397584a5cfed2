"""Request tags at the API server: the ``metadata`` field and the ``X-CF-Task`` header checked against the
OpenAI API's limits, and carried to the engine in ``vllm_xargs`` under reserved keys that no client can
set; followed through vLLM 0.32's own request classes to ``SamplingParams.extra_args``."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from carbonforge_runtime.apiserver.request_contract import RequestContract
from carbonforge_runtime.core.api_contract import API_CONTRACT_VARIABLE, ROUTES, ApiContract, ApiError, check_request
from carbonforge_runtime.core.request_tags import (
    MAX_KEY_CHARS,
    MAX_TAGS,
    MAX_VALUE_CHARS,
    MODEL_ARG,
    RESERVED_ARGS,
    TAGS_ARG,
    TagError,
    model_from_arg,
    request_tags,
    tags_from_arg,
)

QWEN3 = ApiContract(reasoning=True, tools=True, thinking_budget={"low": 8, "medium": 32, "xhigh": None})
PLAIN = ApiContract()
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


def xargs(forwarded: bytes | ApiError) -> Any:
    assert isinstance(forwarded, bytes), forwarded
    return orjson.loads(forwarded).get("vllm_xargs")


def tags_of(forwarded: bytes | ApiError) -> dict[str, str]:
    return tags_from_arg((xargs(forwarded) or {}).get(TAGS_ARG))


def refusal(result: bytes | ApiError) -> ApiError:
    assert isinstance(result, ApiError), result
    return result


# ---- the limits -------------------------------------------------------------------------------------


def test_metadata_within_the_openai_limits_becomes_the_tags() -> None:
    full = {f"k{i:02d}".ljust(MAX_KEY_CHARS, "x"): "v" * MAX_VALUE_CHARS for i in range(MAX_TAGS)}
    assert request_tags(full, b"") == full
    assert request_tags(None, b"") == {} and request_tags({}, b"") == {}
    assert request_tags({"team": "billing", "": "x"}, b"") == TagError(
        "Invalid 'metadata': a key is empty. Name every key with 1 to 64 characters.", "metadata", "empty_string")


@pytest.mark.parametrize(("metadata", "code", "says"), [
    ({f"k{i}": "v" for i in range(MAX_TAGS + 1)}, "object_above_max_properties", "at most 16 properties"),
    ({"k" * (MAX_KEY_CHARS + 1): "v"}, "string_above_max_length", "at most 64 characters, but got 65"),
    ({"team": "v" * (MAX_VALUE_CHARS + 1)}, "string_above_max_length", "maximum length 512, but got a string "
                                                                         "with length 513"),
    ({"team": 7}, "invalid_type", "'metadata.team': expected a string, but got a number"),
    ({"team": None}, "invalid_type", "but got null"),
    ({"team": ["a"]}, "invalid_type", "but got an array"),
    (["team", "billing"], "invalid_type", "expected an object of string keys and string values, but got an array"),
    ("team=billing", "invalid_type", "but got a string"),
])
def test_metadata_past_the_limits_is_refused_in_the_openai_shape(metadata: Any, code: str, says: str) -> None:
    error = refusal(check_request(CHAT, orjson.dumps({"messages": MESSAGES, "metadata": metadata}), QWEN3))
    assert (error.status, error.type, error.param, error.code) == (400, "invalid_request_error", "metadata", code)
    assert says in error.message
    assert set(orjson.loads(error.body())["error"]) == {"message", "type", "param", "code"}


def test_the_task_header_wins_over_metadata_and_is_bounded() -> None:
    assert request_tags({"task": "from-client", "team": "b"}, b"triage") == {"task": "triage", "team": "b"}
    assert request_tags({"task": "from-client"}, b"") == {"task": "from-client"}
    assert request_tags(None, "résumé-triage".encode()) == {"task": "résumé-triage"}
    assert request_tags(None, b"  ") == {}  # an empty header names no task
    assert request_tags(None, b"t" * MAX_VALUE_CHARS) == {"task": "t" * MAX_VALUE_CHARS}
    for raw, says in ((b"t" * (MAX_VALUE_CHARS + 1), "at most 512 characters, but got 513"),
                      (b"a\x01b", "printable"), (b"a\tb", "printable"), (b"\xff\xfe", "UTF-8")):
        error = request_tags(None, raw)
        assert isinstance(error, TagError), raw
        assert (error.param, error.code) == ("X-CF-Task", "invalid_task_header") and says in error.message, raw
    error = refusal(check_request(CHAT, orjson.dumps({"messages": MESSAGES}), PLAIN, task_header=b"a\x00"))
    assert (error.status, error.param) == (400, "X-CF-Task")


# ---- the channel to the engine ----------------------------------------------------------------------


def test_tags_and_model_reach_vllms_sampling_params_on_chat_completions_and_responses() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    metadata = {"team": "billing", "task": "mine"}
    want = {"team": "billing", "task": "triage"}
    cases = [
        (CHAT, {"model": "m", "messages": MESSAGES, "metadata": metadata, "n": 2},
         lambda r: ChatCompletionRequest.model_validate(r).to_sampling_params(16, {})),
        ("/v1/completions", {"model": "m", "prompt": ["a", "b"], "metadata": metadata},
         lambda r: CompletionRequest.model_validate(r).to_sampling_params(16, {})),
        ("/v1/responses", {"model": "m", "input": "x", "metadata": metadata},
         lambda r: ResponsesRequest.model_validate(r).to_sampling_params(16, {})),
    ]
    for path, body, sampling_params in cases:
        for contract in (QWEN3, PLAIN):
            forwarded = check_request(path, orjson.dumps(body), contract, task_header=b"triage")
            assert isinstance(forwarded, bytes)
            extra = sampling_params(orjson.loads(forwarded)).extra_args
            assert extra is not None and tags_from_arg(extra[TAGS_ARG]) == want, path
            assert model_from_arg(extra[MODEL_ARG]) == "m", path
            assert orjson.loads(forwarded)["metadata"] == metadata  # the client's field is left as sent


def test_every_route_to_the_engine_is_tagged_and_no_other() -> None:
    tagged = {path for path, route in ROUTES.items() if route.tags}
    assert tagged == {CHAT, "/v1/chat/completions/batch", "/invocations", "/v1/responses", "/v1/completions",
                      "/v1/messages", "/inference/v1/generate"}
    meta = {"team": "b"}
    batch = check_request("/v1/chat/completions/batch", orjson.dumps(
        {"model": "m", "messages": [MESSAGES, MESSAGES], "metadata": meta}), QWEN3)
    assert tags_of(batch) == meta and xargs(batch)[MODEL_ARG] == "m"
    for body in ({"model": "m", "messages": MESSAGES, "metadata": meta},
                 {"model": "m", "prompt": "x", "metadata": meta}):
        assert tags_of(check_request("/invocations", orjson.dumps(body), QWEN3)) == meta
    # Anthropic's metadata is not the OpenAI field: only the header is read there
    messages = check_request("/v1/messages", orjson.dumps(
        {"model": "m", "messages": MESSAGES, "max_tokens": 4, "metadata": {"user_id": None}}), QWEN3,
        task_header=b"triage")
    assert tags_of(messages) == {"task": "triage"} and xargs(messages)[MODEL_ARG] == "m"
    # the token-in, token-out route carries them in sampling_params.extra_args
    generate = check_request("/inference/v1/generate", orjson.dumps(
        {"model": "m", "token_ids": [1, 2], "sampling_params": {"max_tokens": 3, "extra_args": {"mine": 1}}}),
        QWEN3, task_header=b"triage")
    assert isinstance(generate, bytes)
    extra = orjson.loads(generate)["sampling_params"]["extra_args"]
    assert extra["mine"] == 1 and tags_from_arg(extra[TAGS_ARG]) == {"task": "triage"} and extra[MODEL_ARG] == "m"
    # a render reaches no engine: nothing added
    render = orjson.dumps({"model": "m", "messages": MESSAGES, "metadata": meta})
    assert check_request("/v1/chat/completions/render", render, PLAIN, task_header=b"t") is render


def test_a_client_cannot_set_the_reserved_keys_and_keeps_its_own() -> None:
    spoof = {"cf_tags": '{"task": "someone-else"}', "cf_model": "other", "cf_true_output_tokens": 5}
    for contract in (QWEN3, PLAIN):
        sent = xargs(check_request(CHAT, orjson.dumps({"model": "m", "messages": MESSAGES, "vllm_xargs": spoof}),
                                   contract, task_header=b"triage"))
        assert sent == {"cf_true_output_tokens": 5, "cf_model": "m", "cf_tags": '{"task":"triage"}'}
        # no tags and no model: the spoofed values are dropped, nothing takes their place
        sent = xargs(check_request(CHAT, orjson.dumps({"messages": MESSAGES, "vllm_xargs": spoof}), contract))
        assert sent == {"cf_true_output_tokens": 5}
    for path in ("/v1/chat/completions/render", "/v1/completions/render", "/v1/responses/render"):
        body = orjson.dumps({"messages": MESSAGES, "prompt": "x", "input": "x", "vllm_xargs": spoof})
        assert xargs(check_request(path, body, QWEN3)) == {"cf_true_output_tokens": 5}, path
    generate = check_request("/inference/v1/generate", orjson.dumps(
        {"token_ids": [1], "sampling_params": {"extra_args": spoof}}), QWEN3)
    assert isinstance(generate, bytes)
    assert orjson.loads(generate)["sampling_params"]["extra_args"] == {"cf_true_output_tokens": 5}
    # a channel that is not an object is vLLM's to refuse: passed on as it is
    odd = orjson.dumps({"model": "m", "messages": MESSAGES, "vllm_xargs": "x"})
    assert check_request(CHAT, odd, PLAIN) is odd


def test_nothing_in_vllm_reads_the_reserved_keys() -> None:
    """vLLM reads ``extra_args`` only by name (kv_transfer_params, custom logits processors' own keys,
    ...): keys no vLLM code names cannot change what it generates."""
    from pathlib import Path

    import vllm

    root = Path(vllm.__file__).parent
    sources = list(root.rglob("*.py"))
    assert len(sources) > 500  # the installed package, not a stub
    assert {TAGS_ARG, MODEL_ARG} <= set(RESERVED_ARGS)
    named = [str(path.relative_to(root)) for path in sources
             for text in [path.read_text(errors="replace")] if any(key in text for key in RESERVED_ARGS)]
    assert named == []
    readers = [path for path in sources if "extra_args.get(" in path.read_text(errors="replace")]
    assert readers  # the scan sees the places that do read extra_args


def test_the_recorded_side_reads_only_what_the_middleware_writes() -> None:
    assert tags_from_arg('{"team":"b","task":"t"}') == {"team": "b", "task": "t"}
    for bad in (None, "", "{nope", "[1]", '{"team": 1}', '{"": "x"}', orjson.dumps({"k" * 65: "v"}).decode(),
                orjson.dumps({f"k{i}": "v" for i in range(MAX_TAGS + 2)}).decode(), 7):
        assert tags_from_arg(bad) == {}, bad
    assert model_from_arg("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert model_from_arg(None) is None and model_from_arg("") is None and model_from_arg(3) is None


# ---- through the middleware -------------------------------------------------------------------------


async def echo(request: Request) -> Response:
    return JSONResponse({"received": orjson.loads(await request.body())})


def client(monkeypatch: pytest.MonkeyPatch) -> httpx.AsyncClient:
    monkeypatch.setenv(API_CONTRACT_VARIABLE, PLAIN.to_json())
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    inner = Starlette(routes=[Route(path, echo, methods=["POST"]) for path in (CHAT, "/v1/completions")])
    inner.add_middleware(RequestContract)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=inner), base_url="http://test")


def test_the_middleware_reads_the_header_and_refuses_before_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        async with client(monkeypatch) as http:
            ok = await http.post(CHAT, json={"model": "m", "messages": MESSAGES, "metadata": {"team": "b"}},
                                 headers={"X-CF-Task": "triage"})
            sent = ok.json()["received"]["vllm_xargs"]
            assert tags_from_arg(sent[TAGS_ARG]) == {"team": "b", "task": "triage"} and sent[MODEL_ARG] == "m"
            too_many = {f"k{i}": "v" for i in range(MAX_TAGS + 1)}
            refused = await http.post("/v1/completions", json={"model": "m", "prompt": "x", "metadata": too_many})
            assert refused.status_code == 400
            assert refused.json()["error"]["param"] == "metadata" and "received" not in refused.json()
            header = await http.post(CHAT, json={"messages": MESSAGES}, headers={"X-CF-Task": "t" * 600})
            assert header.status_code == 400 and header.json()["error"]["code"] == "invalid_task_header"
    asyncio.run(go())
