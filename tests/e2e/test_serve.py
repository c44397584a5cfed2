"""End to end: the runtime launches the real vLLM CPU engine; the real openai client talks to it."""

from __future__ import annotations

import os
import re
import shutil
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


#: The start-up phases of the CPU engine, in the order the runtime must report them.
CPU_PHASES = ["launching processes", "loading weights", "compiling", "measuring memory for the KV cache",
              "starting the API server"]
_PHASE_NAMES = "|".join([*CPU_PHASES, "downloading weights", "capturing CUDA graphs"])


def assert_startup_phases(out: str) -> None:
    """The runtime's output names the phases while the engine starts, then gives each one's time and the
    KV capacity just before the ready line."""
    lines = out.splitlines()
    ready_at = next(i for i, line in enumerate(lines) if "ready: OpenAI API" in line)
    summary, kv = lines[ready_at - 2], lines[ready_at - 1]
    assert " engine ready after " in summary, out
    times = re.findall(r"(?:: |, )([a-zA-Z ]+?) ([0-9.]+) s", summary.split(" engine ready after ", 1)[1])
    assert [name for name, _ in times] == CPU_PHASES, summary
    total = float(re.search(r"engine ready after ([0-9.]+) s", summary)[1])  # type: ignore[index]
    assert abs(sum(float(took) for _, took in times) - total) <= 2.0, summary
    assert re.search(r"KV cache: [0-9,]+ tokens \(CPU\); maximum concurrency at 2,048 tokens per request: "
                     r"[0-9.]+x$", kv), kv
    progress = [line for line in lines[:ready_at] if "engine starting" in line]
    assert progress, out  # the tiny engine takes well over the 10 s between progress lines here
    for line in progress:
        assert re.search(rf"engine starting, [0-9]+ s so far: ({CPU_PHASES[0]}|({_PHASE_NAMES}) for [0-9]+ s) "
                         r"\(details in ", line), line


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
        assert_startup_phases(out)
        # The runtime's own log stays short; the engine's goes to vllm.log (progress lines aside, whose
        # number grows with the start-up time).
        assert len([line for line in out.splitlines() if "engine starting, " not in line]) < 30
        assert "vllm.entrypoints.openai.api_server" in runtime.engine_log()
        chat_both_ways(runtime.base_url, TINY_SERVED_NAME)
        assert container_healthcheck(runtime) == 0
        stop_cleanly(runtime, drain_s=15)
        assert container_healthcheck(runtime) == 1
    finally:
        runtime.kill()


def container_healthcheck(runtime: RuntimeProcess) -> int:
    """The image's HEALTHCHECK command, run outside the image, with the runtime's log directory
    (where the runtime records the address it serves)."""
    env = {**os.environ, "CF_PORT": str(runtime.port), "CF_LOG_DIR": str(runtime.log_dir)}
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


def test_engine_failing_while_loading_weights_is_reported_in_that_phase(tmp_path: Path, tiny_model: str) -> None:
    # A copy of the tiny model whose weights file lost its second half (as an interrupted copy leaves it):
    # the header still reads, so only loading the tensors fails.
    model = tmp_path / "tiny-truncated"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    weights.write_bytes(data[:header_end + (len(data) - header_end) // 2])
    args = ["--", str(model), "--served-model-name", "tiny-truncated", "--dtype", "bfloat16",
            "--max-model-len", "1024"]
    runtime = RuntimeProcess(args, tmp_path / "logs").start()
    try:
        code = runtime.wait(300)
        out = runtime.output()
        assert code != 0
        assert "vLLM exited (code 1) before becoming ready, while loading weights" in out
        phases = [line for line in out.splitlines() if "start-up phases until then: " in line]
        assert len(phases) == 1, out
        assert re.search(r"launching processes [0-9.]+ s, loading weights [0-9.]+ s$", phases[0]), phases[0]
        assert "ready: OpenAI API" not in out
    finally:
        runtime.kill()
