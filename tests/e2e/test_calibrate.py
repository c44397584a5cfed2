"""End to end (issue 31, acceptance 3): ``calibrate`` on the CPU engine, in its one engine start.

The built-in tiny model's steps are too short to fit (the HTTP front end, not the engine, sets the
pace), so a deeper random-weight stand-in serves: the prediction benchmark's own 8-layer model
(``benchmarks/predict_cpu.py --layers 8``), built once into the test cache. Its recipe runs eagerly
(no compile at start), so the engine is ready in well under a minute.

Checked: the fitted model file loads as a step-time model; the predicted-against-served table is
printed with its four rows after the twin's prediction; the local recipe loads through
CF_RECIPES_DIR (``recipes show`` and a dry run of ``serve``) with its benchmark block labelled
measured on the CPU engine, and ``serve`` then serves it (a second engine start, eager, about half a
minute) to the OpenAI SDK; ``tune --cost-model`` runs on the fitted file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import yaml

from carbonforge_runtime.core.step_models import load_model_file
from tests.support import REPO, STARTS, RuntimeProcess, tiny_model_dir

KEY = "cf-deep:bf16:chat:cpu"
LAYERS = 8
BUDGET = "240s"


def deep_model() -> Path:
    """The prediction benchmark's deeper stand-in, built once beside the test run's tiny model."""
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("CF_TINY_MODEL_DIR", str(tiny_model_dir()))
    from benchmarks.predict_cpu import build_model

    return build_model(tiny_model_dir().parent, LAYERS)


def write_recipe(directory: Path, model: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "cf-deep--bf16--chat--cpu.yaml").write_text(f"""key: {KEY}
plan: free
description: an {LAYERS}-layer random-weight stand-in on the CPU engine, for calibrate's end-to-end test
model: {{repo: {model}, served_name: carbonforge/tiny-chat}}
vllm:
  dtype: bfloat16
  max_model_len: 2048
  max_num_seqs: 8
  max_num_batched_tokens: 512
  enable_prefix_caching: true
  block_size: 32
  enforce_eager: true
  extra_args: ["--num-gpu-blocks-override", "512"]
drain_timeout_s: 5
env: {{VLLM_CPU_KVCACHE_SPACE: "1", HF_HUB_OFFLINE: "1", VLLM_USE_AOT_COMPILE: "0"}}
scheduler: {{family: fcfs, params: {{}}}}
""")


def cli(args: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "carbonforge_runtime", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def test_calibrate_the_cpu_engine_end_to_end(tmp_path: Path) -> None:
    started = time.monotonic()
    write_recipe(tmp_path / "recipes", deep_model())
    out = tmp_path / "calibration"
    env = {**os.environ, "CF_RECIPES_DIR": str(tmp_path / "recipes"), "HF_HUB_OFFLINE": "1"}
    env.pop("CF_CONTEXT_KEY", None)
    STARTS.append(out / "logs")  # calibrate's own runtime, counted with the suite's engine starts
    run = cli(["calibrate", "--context-key", KEY, "--budget", BUDGET, "-o", str(out)], env, 300)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    print(run.stdout)
    print(f"calibrate took {time.monotonic() - started:.0f} s")

    # The fitted model, as sim --cost-model and tune --cost-model read it.
    model_path = out / "step-model.yaml"
    model = load_model_file(model_path)
    assert model.gpu == "cpu" and not model.proxy and model.kv_capacity_tokens == 512 * 32
    assert "R2" in run.stdout

    # The twin's prediction first, then the table of predicted against served with its four rows.
    assert "predicted (before it is served):" in run.stdout
    table = run.stdout.split("predicted against served (the check load):\n", 1)[1].splitlines()
    assert table[0].split() == ["figure", "predicted", "served", "error"]
    assert [line.split("  ")[0].strip() for line in table[1:5]] == ["mean e2e", "p99 e2e", "mean TTFT", "throughput"]
    assert all(line.rstrip().endswith("%") for line in table[1:5]), table[:5]
    assert run.stdout.index("predicted (before it is served):") < run.stdout.index("predicted against served")

    # The local recipe, through CF_RECIPES_DIR: its figures measured on the CPU engine, with the table.
    recipes = out / "recipes"
    written = recipes / "cf-deep--bf16--chat--cpu.yaml"
    benchmark = yaml.safe_load(written.read_text())["benchmark"]
    host = benchmark["measured_on"]
    assert (host["gpu"], host["gpu_count"], host["vllm"]) == ("cpu", 0, "0.32.0") and host["driver"]
    assert benchmark["date"] and set(benchmark["figures"]["predicted_against_served"]) == {
        "mean_e2e_s", "p99_e2e_s", "mean_ttft_s", "throughput_rps"}
    local = {**env, "CF_RECIPES_DIR": str(recipes)}
    shown = cli(["recipes", "show", KEY], local, 60)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert f"# {written}" in shown.stdout and "benchmark.figures: measured on cpu" in shown.stdout
    dry = cli(["serve", "--context-key", KEY, "--dry-run"], local, 60)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert str(written) in dry.stdout

    # Served for real from that directory: the engine takes the written recipe and answers the SDK.
    runtime = RuntimeProcess(["--context-key", KEY], tmp_path / "serve-logs", env={"CF_RECIPES_DIR": str(recipes)})
    try:
        runtime.start().wait_ready()
        client = openai.OpenAI(base_url=runtime.base_url, api_key="unused", timeout=120, max_retries=0)
        answer = client.chat.completions.create(model="carbonforge/tiny-chat", max_tokens=8,
                                                messages=[{"role": "user", "content": "hello"}],
                                                extra_body={"ignore_eos": True})
        assert answer.usage is not None and answer.usage.completion_tokens == 8
        assert runtime.stop() == 0, runtime.output()
    finally:
        runtime.kill()
    assert str(written) in runtime.output(), runtime.output()[-3000:]

    # tune on the calibrated recipe with the fitted model (the check load as its trace).
    result = tmp_path / "tune.json"
    tuned = cli(["tune", str(out / "check-load.jsonl"), "--context-key", KEY, "--goal", "mean_e2e",
                 "--cost-model", str(model_path), "--limit", "40", "--budget", "3", "--jobs", "1", "-o", str(result),
                 "-q"], local, 180)
    assert tuned.returncode == 0, tuned.stdout + tuned.stderr
    assert json.loads(result.read_text())["tune"]["cost_model"]["name"] == model.name
    print(f"the whole test took {time.monotonic() - started:.0f} s")
