"""The request contract's decisions over request bodies, and the reasoning alias on answers."""

from __future__ import annotations

import orjson
import pytest

from carbonforge_runtime.core.api_contract import (
    MSG_BAD_EFFORT,
    MSG_INVALID_JSON,
    MSG_MISSING_MESSAGES,
    MSG_NO_KEY,
    MSG_NO_TOOLS,
    MSG_WRONG_KEY,
    NO_THINKING,
    ApiContract,
    ApiError,
    alias_reasoning_events,
    alias_reasoning_json,
    auth_error,
    check_request,
    effort_of,
)
from carbonforge_runtime.core.contract import ContractError

CHAT = "/v1/chat/completions"
QWEN3 = ApiContract(reasoning=True, tools=True, thinking_budget={"low": 1024, "medium": 4096, "xhigh": None})
PLAIN = ApiContract(reasoning=False, tools=False)
MESSAGES = [{"role": "user", "content": "hi"}]


def body(**fields: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": MESSAGES, **fields})


def forwarded(result: bytes | ApiError) -> dict:
    assert isinstance(result, bytes), result
    return orjson.loads(result)


@pytest.mark.parametrize("value", ["high", "max", "minimal", "none", "HIGH", "", None, 3])
def test_only_the_documented_efforts_are_accepted(value: object) -> None:
    result = check_request(CHAT, body(chat_template_kwargs={"reasoning_effort": value}), QWEN3)
    assert isinstance(result, ApiError)
    assert (result.status, result.message, result.param) == (400, MSG_BAD_EFFORT, "chat_template_kwargs")
    assert orjson.loads(result.body()) == {"error": {"message": MSG_BAD_EFFORT, "type": "invalid_request_error",
                                                     "param": "chat_template_kwargs",
                                                     "code": "invalid_reasoning_effort"}}


@pytest.mark.parametrize("kwargs", [{"enable_thinking": True}, {"enable_thinking": False, "x": 1},
                                    {"reasoning_effort": "low", "enable_thinking": False}, ["low"], "low"])
def test_other_template_arguments_are_refused(kwargs: object) -> None:
    assert effort_of(kwargs, None) == ApiError(400, MSG_BAD_EFFORT, "chat_template_kwargs",
                                               "invalid_reasoning_effort")


@pytest.mark.parametrize(("kwargs", "top", "effort"), [
    (None, None, "low"), ({}, None, "low"), ({"reasoning_effort": "low"}, None, "low"),
    ({"reasoning_effort": "medium"}, None, "medium"), ({"reasoning_effort": "xhigh"}, None, "xhigh"),
    ({"enable_thinking": False}, None, NO_THINKING), (None, "medium", "medium"),
    ({"reasoning_effort": "xhigh"}, "xhigh", "xhigh"),
])
def test_accepted_efforts(kwargs: object, top: object, effort: str) -> None:
    assert effort_of(kwargs, top) == effort


def test_the_sdk_reasoning_effort_field_follows_the_same_rule() -> None:
    bad = effort_of(None, "high")
    assert isinstance(bad, ApiError) and bad.param == "reasoning_effort"
    assert isinstance(effort_of({"reasoning_effort": "low"}, "medium"), ApiError)  # two different answers


@pytest.mark.parametrize(("kwargs", "expected_kwargs", "budget"), [
    (None, {"enable_thinking": True}, 1024),
    ({"reasoning_effort": "medium"}, {"enable_thinking": True}, 4096),
    ({"reasoning_effort": "xhigh"}, {"enable_thinking": True}, None),
    ({"enable_thinking": False}, {"enable_thinking": False}, None),
])
def test_efforts_become_what_a_qwen3_template_understands(kwargs: object, expected_kwargs: dict,
                                                         budget: int | None) -> None:
    fields = {} if kwargs is None else {"chat_template_kwargs": kwargs}
    sent = forwarded(check_request(CHAT, body(**fields, reasoning_effort=None), QWEN3))
    assert sent["chat_template_kwargs"] == expected_kwargs
    assert sent.get("thinking_token_budget") == budget
    assert "reasoning_effort" not in sent
    assert sent["messages"] == MESSAGES


def test_a_budget_the_client_sets_is_kept() -> None:
    sent = forwarded(check_request(CHAT, body(thinking_token_budget=7), QWEN3))
    assert sent["thinking_token_budget"] == 7


def test_a_model_without_reasoning_gets_no_template_arguments() -> None:
    sent = forwarded(check_request(CHAT, body(chat_template_kwargs={"reasoning_effort": "medium"}), PLAIN))
    assert "chat_template_kwargs" not in sent and "thinking_token_budget" not in sent
    untouched = body(max_tokens=3)  # only the model name for the trace is added, to the text as sent
    assert check_request(CHAT, untouched, PLAIN) == untouched[:-1] + b',"vllm_xargs":{"cf_model":"m"}}'
    no_model = orjson.dumps({"messages": MESSAGES, "max_tokens": 3})
    assert check_request(CHAT, no_model, PLAIN) is no_model


def test_malformed_json_and_missing_messages() -> None:
    for raw in (b"{bad", b"", b"[1, 2]", b'"text"', b"\xff\xfe"):
        error = check_request(CHAT, raw, QWEN3)
        assert isinstance(error, ApiError) and (error.status, error.message) == (400, MSG_INVALID_JSON), raw
    error = check_request(CHAT, b'{"model": "m"}', QWEN3)
    assert isinstance(error, ApiError)
    assert (error.status, error.message, error.param) == (400, MSG_MISSING_MESSAGES, "messages")
    # completions need valid JSON, not messages; other paths are not looked at
    assert isinstance(check_request("/v1/completions", b"{bad", QWEN3), ApiError)
    ok = b'{"prompt": "x"}'
    assert check_request("/v1/completions", ok, QWEN3) is ok
    assert check_request("/v1/audio/transcriptions", b"--multipart--", QWEN3) == b"--multipart--"


def test_tools_on_a_model_without_tool_calls_are_refused() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    error = check_request(CHAT, body(tools=tools), PLAIN)
    assert isinstance(error, ApiError) and (error.status, error.message, error.param) == (400, MSG_NO_TOOLS, "tools")
    assert isinstance(check_request(CHAT, body(tools=tools), QWEN3), bytes)
    assert isinstance(check_request(CHAT, body(tools=tools, tool_choice="none"), PLAIN), bytes)


def test_auth_errors_in_the_openai_shape() -> None:
    assert orjson.loads(auth_error(False).body())["error"]["message"] == MSG_NO_KEY
    wrong = auth_error(True)
    assert wrong.status == 401 and orjson.loads(wrong.body())["error"]["message"] == MSG_WRONG_KEY


def test_reasoning_alias_on_answers_and_streams() -> None:
    answer = orjson.dumps({"choices": [{"message": {"content": "a", "reasoning": "think"}}]})
    aliased = orjson.loads(alias_reasoning_json(answer))["choices"][0]["message"]
    assert aliased == {"content": "a", "reasoning": "think", "reasoning_content": "think"}
    plain = b'{"choices": [{"message": {"content": "a"}}]}'
    assert alias_reasoning_json(plain) is plain
    events = (b'data: {"choices": [{"delta": {"reasoning": "t"}}]}\n\n'
              b'data: {"choices": [{"delta": {"content": "c"}}]}\n\ndata: [DONE]\n\n')
    out = alias_reasoning_events(events).split(b"\n\n")
    assert orjson.loads(out[0][6:])["choices"][0]["delta"] == {"reasoning": "t", "reasoning_content": "t"}
    assert out[1:] == [b'data: {"choices": [{"delta": {"content": "c"}}]}', b"data: [DONE]", b""]


def test_the_contract_round_trips_and_refuses_what_it_does_not_know() -> None:
    assert ApiContract.from_json(QWEN3.to_json()) == QWEN3
    for text in ("nope", '{"version": 2}', '{"version": 1, "extra": 1}', '{"version": 1, "tools": "yes"}',
                 '{"version": 1, "thinking_budget": {"high": 5}}', '{"version": 1, "thinking_budget": {"low": 0}}'):
        with pytest.raises(ContractError):
            ApiContract.from_json(text)


@pytest.mark.parametrize("raw", [b'{"model": "m", "messages": []}', b'{"messages":[]}  \n',
                                 b'{"messages": [], "x": {"y": 1}}'])
def test_default_effort_fields_are_added_to_the_text_as_sent(raw: bytes) -> None:
    sent = check_request(CHAT, raw, QWEN3)
    assert isinstance(sent, bytes) and sent.startswith(raw.rstrip()[:-1].rstrip())
    model = orjson.loads(raw).get("model")
    assert orjson.loads(sent) == {**orjson.loads(raw), "chat_template_kwargs": {"enable_thinking": True},
                                  "thinking_token_budget": 1024,
                                  **({"vllm_xargs": {"cf_model": model}} if model else {})}


@pytest.mark.parametrize("value", ['"plain"', '"with \\"quotes\\" and \\\\ slashes"', "null", '""'])
def test_the_reasoning_splice_keeps_any_string(value: str) -> None:
    raw = f'{{"choices":[{{"delta":{{"reasoning":{value}}}}}]}}'.encode()
    out = orjson.loads(alias_reasoning_json(raw))["choices"][0]["delta"]
    assert out["reasoning_content"] == out["reasoning"] == orjson.loads(value)
    event = b"data: " + raw + b"\n\n"
    spliced = alias_reasoning_events(event)
    assert spliced.endswith(b"\n\n") and orjson.loads(spliced[6:])["choices"][0]["delta"] == out


def test_answers_the_splice_does_not_fit_are_parsed() -> None:
    two = orjson.dumps({"choices": [{"message": {"reasoning": "a"}}, {"message": {"reasoning": "b"}}]})
    spaced = b'{"choices": [{"message": {"reasoning": "a"}}]}'
    assert [c["message"]["reasoning_content"] for c in orjson.loads(alias_reasoning_json(two))["choices"]] == ["a", "b"]
    assert orjson.loads(alias_reasoning_json(spaced))["choices"][0]["message"]["reasoning_content"] == "a"
