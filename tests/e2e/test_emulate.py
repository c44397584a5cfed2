"""``serve --emulate``: a GPU recipe served on the CPU engine with the built-in model standing in, every
step paced to the recipe's step-time model, against the real OpenAI SDK and LangChain.

One engine serves every check here. Structured output is asked for with no ``logit_bias``: the stand-in's
structured output (guidance, no free whitespace) must make the random weights produce valid JSON for a
bounded schema on their own. Thinking is turned off per request (``enable_thinking: false``), as an agent
that wants its answer at once would: with thinking on, the stand-in thinks the recipe's budget (1,024
tokens at the default effort) of random text first. The last test reads the engine's own step log: a
paced step's wall time is its modelled time.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from carbonforge_runtime.core.step_models import shipped_models
from carbonforge_runtime.core.twin_data import step_time_s
from tests.support import RuntimeProcess, free_port
from tests.support.serving import ASK, WEATHER_SCHEMA, WEATHER_TOOL

KEY = "qwen3-32b:fp8:chat:a100-80x1"
SERVED = "Qwen/Qwen3-32B-FP8"
API_KEY = "cf-emulate-key-5b7e91"
#: Every step four times its modelled time: on this two-core machine the engine's own work and the API
#: server then stay well inside each step.
SLOWDOWN = 4.0
NO_THINKING: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}}


class Session:
    def __init__(self, runtime: RuntimeProcess, steps: Path, metrics_port: int) -> None:
        self.runtime = runtime
        self.steps = steps
        self.metrics_port = metrics_port
        self.client = openai.OpenAI(base_url=runtime.base_url, api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    log_dir = tmp_path_factory.mktemp("emulate")
    steps = log_dir / "steps.jsonl"
    metrics_port = free_port()
    runtime = RuntimeProcess(["--context-key", KEY, "--emulate", "--emulate-slowdown", str(SLOWDOWN),
                              "--step-log", str(steps), "--metrics"], log_dir,
                             env={"CF_API_KEY": API_KEY, "CF_METRICS_PORT": str(metrics_port)}).start()
    try:
        runtime.wait_ready()
        yield Session(runtime, steps, metrics_port)
    finally:
        runtime.kill()


def test_chat_and_streaming_under_the_recipes_served_name(session: Session) -> None:
    reply = session.client.chat.completions.create(model=SERVED, messages=ASK, max_tokens=12,
                                                   extra_body={**NO_THINKING, "ignore_eos": True})
    assert reply.model == SERVED
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.choices[0].message.content
    pieces = [part.delta.content for chunk in session.client.chat.completions.create(
        model=SERVED, messages=ASK, max_tokens=8, stream=True, extra_body={**NO_THINKING, "ignore_eos": True})
        for part in chunk.choices if part.delta.content]
    assert len(pieces) >= 2


def test_a_key_is_required(session: Session) -> None:
    answer = httpx.post(f"{session.runtime.base_url}/chat/completions", json={"model": SERVED, "messages": ASK},
                        timeout=30)
    assert answer.status_code == 401


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_match_their_schema_without_logit_bias(session: Session, choice: Any) -> None:
    reply = session.client.chat.completions.create(model=SERVED, messages=ASK, tools=[WEATHER_TOOL], tool_choice=choice,
                                                   max_tokens=200, seed=11, parallel_tool_calls=False,
                                                   extra_body=NO_THINKING)
    calls = reply.choices[0].message.tool_calls
    assert calls and len(calls) == 1, reply
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER_SCHEMA)


def test_a_json_schema_response_validates_without_logit_bias(session: Session) -> None:
    for seed in (1, 2, 3):
        reply = session.client.chat.completions.create(
            model=SERVED, messages=ASK, max_tokens=200, seed=seed, extra_body=NO_THINKING,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "forecast", "schema": WEATHER_SCHEMA, "strict": True}})
        assert reply.choices[0].finish_reason == "stop", reply
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), WEATHER_SCHEMA)


class get_weather(BaseModel):  # the tool's name, as the model sees it
    """Forecast for a city."""

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


def test_langchain_bind_tools_without_logit_bias(session: Session) -> None:
    llm = ChatOpenAI(base_url=session.runtime.base_url, api_key=API_KEY,  # type: ignore[arg-type]
                     model=SERVED, timeout=120, max_retries=0, max_tokens=200, seed=5, extra_body=NO_THINKING)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True, parallel_tool_calls=False)
    message = bound.invoke("Weather in Oslo?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    get_weather.model_validate(message.tool_calls[0]["args"])


def _load(session: Session, clients: int, each: int) -> None:
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            for n in range(each):
                session.client.chat.completions.create(
                    model=SERVED, messages=[{"role": "user", "content": f"client {index} question {n} " * (1 + n)}],
                    max_tokens=24 + 8 * (index % 3), extra_body={**NO_THINKING, "ignore_eos": True})
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads), errors


def _metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + "{")]
    assert lines, f"{name} missing"
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_steps_last_their_modelled_time_in_the_step_log(session: Session) -> None:
    """Last: stops the engine, so that the step log and the shutdown line are complete."""
    _load(session, clients=6, each=4)
    page = httpx.get(f"http://127.0.0.1:{session.metrics_port}/metrics", timeout=10).text
    assert _metric(page, "carbonforge_engine_emulated_steps_total") >= 100
    late_metric = _metric(page, "carbonforge_engine_emulated_late_steps_total")
    assert session.runtime.stop(timeout_s=90) == 0, session.runtime.output()

    model = shipped_models()["a100-80-tp1"]
    lines = [json.loads(line) for line in session.steps.read_text().splitlines()]
    header, steps = lines[0], [line for line in lines if line["kind"] == "step"]
    assert header["kv_cache_tokens"] == 137024 and header["block_size"] == 32  # the modelled A100's KV cache
    assert len(steps) >= 150
    errors = []
    for step in steps:
        modelled = SLOWDOWN * step_time_s(model, step["batched_tokens"], step["kv_read_tokens"],
                                          step["attention_units"])
        errors.append(step["wall_s"] / modelled - 1)
    within = sum(1 for e in errors if abs(e) <= 0.02) / len(errors)
    worst = max(errors, key=abs)
    print(f"emulate: {len(steps)} steps at slowdown {SLOWDOWN:g}: {within:.2%} within 2% of their modelled time, "
          f"worst {worst:+.1%}; late steps (metric, before the last requests ended): {late_metric:g}")
    assert within >= 0.99, (within, sorted(errors, key=abs)[-10:])
    summary = session.runtime.engine_log_search(
        r"emulated: the real engine paced to step-time model a100-80-tp1 v1, a proxy; [0-9.]+% of [0-9,]+ steps late"
        r"; slowdown 4; (\d+) of (\d+) steps ran late")
    assert summary is not None, session.runtime.engine_log()[-3000:]
    assert int(summary.group(2)) >= len(steps) and int(summary.group(1)) / int(summary.group(2)) <= 0.01
    assert "NOT FAITHFUL" not in session.runtime.engine_log()
    assert summary.group(0) in session.runtime.output()  # the runtime repeats it in its own log
    print(f"emulate: shutdown line: {summary.group(0)}")
