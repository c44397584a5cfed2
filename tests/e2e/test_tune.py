"""End to end (issue 16, acceptance 6): ``tune --write DIR`` on a small trace for the CPU recipe, then
the runtime serves the written recipe through CF_RECIPES_DIR, answers a chat completion and logs how
the recipe departs from the shipped benchmark."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import openai
import yaml

from tests.support import REPO, TINY_KEY, TINY_SERVED_NAME, RuntimeProcess, synthetic_mooncake


def decode_heavy_trace(path: Path) -> Path:
    """Short prompts and longer answers, more than 16 at a time: the CPU recipe's 16 sequences are few."""
    return synthetic_mooncake(path, 80, seed=11, per_second=20.0, prompt=(64, 600), output=(64, 256))


def test_a_tuned_recipe_serves_on_the_cpu_engine_and_logs_its_departure(tmp_path: Path) -> None:
    trace = decode_heavy_trace(tmp_path / "trace.jsonl")
    recipes = tmp_path / "recipes"
    result_path = tmp_path / "tune.json"
    # The CPU recipe has no shipped step-time model: a GPU one stands in (the figures are a proxy).
    tuned = subprocess.run(
        [sys.executable, "-m", "carbonforge_runtime", "tune", str(trace), "--context-key", TINY_KEY,
         "--goal", "mean_e2e", "--cost-model", "a100-80-tp1", "--kv-tokens", "16384", "--load", "1.5",
         "--budget", "8", "--jobs", "2", "-o", str(result_path), "--write", str(recipes), "-q"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert tuned.returncode == 0, tuned.stdout + tuned.stderr
    document = json.loads(result_path.read_text())
    patch = document["patch"]
    assert patch, tuned.stdout  # the shipped recipe's 16 sequences leave room to improve
    written = recipes / "cf-tiny--bf16--chat--cpu.yaml"
    assert yaml.safe_load(written.read_text())["benchmark"]["predicted"]["measured"] is False

    runtime = RuntimeProcess(["--context-key", TINY_KEY], tmp_path / "logs",
                             env={"CF_RECIPES_DIR": str(recipes)}).start()
    try:
        runtime.wait_ready()
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
        assert runtime.stop(signal.SIGTERM, timeout_s=60) == 0, runtime.output()
    finally:
        runtime.kill()
