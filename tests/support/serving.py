"""Checks that several end-to-end tests make on a serving runtime: a chat both ways, a clean stop; and
the bounded tool schema the structured-output tests ask for."""

from __future__ import annotations

import signal
import time
from typing import Any

import openai

from tests.support import RuntimeProcess

#: A bounded schema (string length, number range): the random built-in model's structured output
#: stays valid against it (docs/emulate.md).
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER_TOOL: Any = {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city.",
                                                      "strict": True, "parameters": WEATHER_SCHEMA}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]


def chat_both_ways(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    messages = [{"role": "user", "content": "What is the capital city of France?"}]
    # 24 tokens: room for the tiny recipe's thinking budget (8) and an answer after it.
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                              extra_body={"ignore_eos": True})
    assert response.model == model
    assert response.id.startswith("chatcmpl-")
    assert response.usage is not None and response.usage.completion_tokens == 24
    assert response.choices[0].message.content

    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert pieces, "no streamed content"
    assert usage is not None and usage.completion_tokens == 20 and usage.prompt_tokens > 0


def stop_cleanly(runtime: RuntimeProcess, drain_s: float) -> None:
    children = set(runtime.known_children)
    assert children, "the engine's processes were not seen"
    started = time.monotonic()
    code = runtime.stop(signal.SIGTERM, timeout_s=drain_s + 30)
    elapsed = time.monotonic() - started
    assert code == 0, runtime.output()
    assert elapsed < drain_s + 15, f"stopping took {elapsed:.1f} s"
    left = runtime.leftover_children()
    assert left == set(), "engine processes survived the runtime:\n" + runtime.describe(left)
    assert "vLLM stopped" in runtime.output()
