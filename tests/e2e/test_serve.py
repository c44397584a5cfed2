"""End to end: the runtime launches the real vLLM CPU engine; the real openai client talks to it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai

from tests.support import REPO, TEST_RECIPES, TINY_KEY, TINY_SERVED_NAME, RuntimeProcess


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


def test_serves_cf_context_key_and_stops_on_sigterm(tmp_path: Path) -> None:
    runtime = RuntimeProcess([], tmp_path, env={"CF_CONTEXT_KEY": TINY_KEY}).start()
    try:
        runtime.wait_ready()
        out = runtime.output()
        assert f"ready: OpenAI API on http://127.0.0.1:{runtime.port}/v1 serving model '{TINY_SERVED_NAME}'" in out
        assert "Traceback" not in out
        # The runtime's own log stays short; the engine's goes to vllm.log.
        assert len(out.splitlines()) < 30
        assert "vllm.entrypoints.openai.api_server" in runtime.engine_log()
        chat_both_ways(runtime.base_url, TINY_SERVED_NAME)
        assert container_healthcheck(runtime.port) == 0
        stop_cleanly(runtime, drain_s=15)
        assert container_healthcheck(runtime.port) == 1
    finally:
        runtime.kill()


def container_healthcheck(port: int) -> int:
    """The image's HEALTHCHECK command, run outside the image."""
    env = {**os.environ, "CF_PORT": str(port)}
    return subprocess.run([sys.executable, str(REPO / "docker" / "healthcheck.py")], env=env, timeout=30).returncode


def test_override_mode_serves_the_given_model(tmp_path: Path, tiny_model: str) -> None:
    args = ["--", tiny_model, "--served-model-name", "tiny-override", "--dtype", "bfloat16",
            "--max-model-len", "1024", "--shutdown-timeout", "5"]
    runtime = RuntimeProcess(args, tmp_path, env={"CF_CONTEXT_KEY": TINY_KEY}).start()
    try:
        runtime.wait_ready()
        assert "CF_CONTEXT_KEY is ignored" in runtime.output()
        chat_both_ways(runtime.base_url, "tiny-override")
        stop_cleanly(runtime, drain_s=5)
    finally:
        runtime.kill()


def test_context_key_flag_with_extra_vllm_flags_and_engine_death(tmp_path: Path) -> None:
    args = ["--context-key", TINY_KEY, "--", "--max-num-seqs", "3", "--served-model-name", "tiny-extra"]
    runtime = RuntimeProcess(args, tmp_path).start()
    try:
        runtime.wait_ready()
        out = runtime.output()
        assert "extra vLLM flags depart from the benchmark: adds --max-num-seqs 3" in out
        log = runtime.engine_log()
        assert "'max_num_seqs': 3" in log  # vLLM's own "non-default args" line
        chat_both_ways(runtime.base_url, "tiny-extra")
        # The engine dying while serving ends the runtime with the same summary and a non-zero code.
        os.kill(runtime.engine_pid(), signal.SIGKILL)
        code = runtime.wait(60)
        out = runtime.output()
        assert code != 0
        assert "vLLM exited (code 137, killed by SIGKILL) while serving" in out
        assert "last lines of" in out
        deadline = time.monotonic() + 20
        while runtime.leftover_children() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert runtime.leftover_children() == set()
    finally:
        runtime.kill()


def test_engine_that_cannot_start_is_reported_quickly(tmp_path: Path) -> None:
    runtime = RuntimeProcess(["--context-key", "cf-tiny-broken:bf16:chat:cpu"], tmp_path,
                             env={"CF_RECIPES_DIR": str(TEST_RECIPES)})
    started = time.monotonic()
    runtime.start()
    try:
        code = runtime.wait(120)
        elapsed = time.monotonic() - started
        out = runtime.output()
        assert code != 0
        assert "vLLM exited (code 2) before becoming ready" in out
        assert "| " in out and "no-such-engine-flag" in out  # the log tail
        assert "hint: vLLM rejected a command-line flag" in out
        assert "Traceback" not in out
        assert elapsed < 60, f"took {elapsed:.1f} s"
    finally:
        runtime.kill()
