"""End to end (issue 16, acceptance 6): ``tune --write DIR`` on a small trace for the CPU recipe, then
the runtime serves the written recipe through CF_RECIPES_DIR, answers a chat completion and logs how
the recipe departs from the shipped benchmark.

The same engine runs with a trace level and no sink, the other check that only needs a tiny recipe
served from the --context-key flag: one warning, tracing off, serving works. The SIGTERM stop is last."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.support import REPO, TINY_KEY, TINY_SERVED_NAME, RuntimeProcess, synthetic_mooncake

#: Holds with a second engine beside it (scripts/test.sh runs these modules two at a time).
pytestmark = pytest.mark.parallel_safe


def decode_heavy_trace(path: Path) -> Path:
    """Short prompts and longer answers, more than 16 at a time: the CPU recipe's 16 sequences are few."""
    return synthetic_mooncake(path, 80, seed=11, per_second=20.0, prompt=(64, 600), output=(64, 256))


@dataclass
class TunedEngine:
    runtime: RuntimeProcess
    patch: dict[str, Any]
    tune_output: str


@pytest.fixture(scope="module")
def tuned_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TunedEngine]:
    tmp_path = tmp_path_factory.mktemp("tuned-engine")
    trace = decode_heavy_trace(tmp_path / "trace.jsonl")
    recipes = tmp_path / "recipes"
    result_path = tmp_path / "tune.json"
    # The CPU recipe has no shipped step-time model: a GPU one stands in (the figures are a proxy).
    tuned = subprocess.run(
        [sys.executable, "-m", "carbonforge_runtime", "tune", str(trace), "--context-key", TINY_KEY,
         "--goal", "mean_e2e", "--cost-model", "a100-80-tp1", "--kv-tokens", "16384", "--load", "1.5",
         "--budget", "8", "--jobs", "1", "-o", str(result_path), "--write", str(recipes), "-q"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert tuned.returncode == 0, tuned.stdout + tuned.stderr
    document = json.loads(result_path.read_text())
    written = recipes / "cf-tiny--bf16--chat--cpu.yaml"
    assert yaml.safe_load(written.read_text())["benchmark"]["predicted"]["measured"] is False

    # --request-trace without --trace-file or --trace-endpoint: a level with no sink.
    runtime = RuntimeProcess(["--context-key", TINY_KEY, "--request-trace", "standard"], tmp_path / "logs",
                             env={"CF_RECIPES_DIR": str(recipes)}).start()
    try:
        runtime.wait_ready()
        yield TunedEngine(runtime, document["patch"], tuned.stdout)
    finally:
        runtime.kill()


def test_a_tuned_recipe_serves_on_the_cpu_engine_and_logs_its_departure(tuned_engine: TunedEngine) -> None:
    runtime, patch = tuned_engine.runtime, tuned_engine.patch
    assert patch, tuned_engine.tune_output  # the shipped recipe's 16 sequences leave room to improve
    out = runtime.output()
    departure = [line for line in out.splitlines() if "departs from the shipped benchmark" in line]
    assert len(departure) == 1, out
    for knob in patch.get("vllm", {}):
        assert f"vllm.{knob} " in departure[0]
    if "scheduler" in patch:
        assert "scheduler." in departure[0]
    client = openai.OpenAI(base_url=runtime.base_url, api_key="unused", timeout=120, max_retries=0)
    response = client.chat.completions.create(
        model=TINY_SERVED_NAME, messages=[{"role": "user", "content": "What is the capital city of France?"}],
        max_tokens=24, extra_body={"ignore_eos": True})
    assert response.model == TINY_SERVED_NAME
    assert response.usage is not None and response.usage.completion_tokens == 24
    assert response.choices[0].message.content


def test_a_trace_level_without_a_sink_warns_once_and_serves(tuned_engine: TunedEngine) -> None:
    runtime = tuned_engine.runtime
    client = openai.OpenAI(base_url=runtime.base_url, api_key="unused", timeout=300, max_retries=0)
    reply = client.chat.completions.create(model=TINY_SERVED_NAME, max_tokens=4, extra_body={"ignore_eos": True},
                                           messages=[{"role": "user", "content": "request 1: invoice payment"}])
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    out = runtime.output()
    assert out.count("has no sink, so tracing stays off") == 1, out
    assert "request trace off" in runtime.engine_log()


def test_sigterm_stops_the_tuned_engine(tuned_engine: TunedEngine) -> None:
    """Last: the stop both checks above shared; tracing stayed off, so no trace file was written."""
    runtime = tuned_engine.runtime
    assert runtime.stop(signal.SIGTERM, timeout_s=60) == 0, runtime.output()
    assert not list(runtime.log_dir.rglob("*.jsonl"))
