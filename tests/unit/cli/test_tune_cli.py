"""``carbonforge-runtime tune``: refusals, a better configuration on a trace the shipped recipe serves
badly (issue 16, acceptance 6), and a written recipe that loads and launches with its departure
logged. That the result does not depend on --jobs (worker processes) is checked in
tests/integration/test_tune_jobs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from tests.support import offline_argv, synthetic_mooncake

KEY = "qwen3-32b:fp8:chat:a100-80x1"
runner = CliRunner()


def long_prompts(path: Path, count: int, seed: int = 7) -> Path:
    """Prompts of 6,000-12,000 tokens with short answers, arriving about twice a second: a chat recipe
    sized for short prompts, and more than it can serve."""
    return synthetic_mooncake(path, count, seed=seed, per_second=2.0, prompt=(6000, 12001), output=(4, 64))


@pytest.mark.parametrize(("args", "message"), [
    (["--goal", "fastest"], "unknown goal"),
    (["--goal", "throughput", "--slo", "ttft_p99"], "not NAME=LIMIT"),
    (["--goal", "throughput", "--slo", "ttft_p99=soon"], "not a duration"),
    (["--goal", "throughput", "--slo", "tpot=1s"], "unknown figure"),
    (["--goal", "mean_e2e", "--budget", "0"], "budget"),
    (["--goal", "mean_e2e", "--jobs", "0"], "jobs"),
    (["--goal", "mean_e2e", "--output", "DIR"], "is a directory"),
    (["--goal", "mean_e2e", "--write", "FILE"], "is not a directory"),
    (["--goal", "mean_e2e", "--load", "0"], "--load"),
    (["--goal", "mean_e2e", "--context-key", "cf-tiny:bf16:chat:cpu"], "--cost-model"),
])
def test_bad_input_is_refused_in_one_line_without_output(tmp_path: Path, args: list[str], message: str) -> None:
    trace = long_prompts(tmp_path / "t.jsonl", 5)
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("")
    out = tmp_path / "r.json"
    argv = offline_argv(args, {"DIR": str(tmp_path / "d"), "FILE": str(tmp_path / "f")}, KEY, out)
    result = runner.invoke(cli.app, ["tune", str(trace), *argv])
    assert result.exit_code == 2, result.output
    assert message in result.output and "fix:" in result.output
    assert "Traceback" not in result.output
    assert not out.exists()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object], str]:
    """One tune run, its candidates evaluated in this process: spawning workers (each importing vLLM
    anew) is what test_tune_jobs in tests/integration checks; here the search and what it writes are."""
    pytest.importorskip("vllm")
    from concurrent.futures import ThreadPoolExecutor

    from carbonforge_runtime.cli import tune as tune_cli

    base = tmp_path_factory.mktemp("tune")
    trace = long_prompts(base / "long.jsonl", 20)
    out = base / "r.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tune_cli, "_pool", lambda jobs: ThreadPoolExecutor(max_workers=1))
        result = runner.invoke(cli.app, ["tune", str(trace), "--context-key", KEY, "--goal", "mean_e2e",
                                         "--load", "1.2", "--budget", "20", "--jobs", "2", "-o", str(out),
                                         "--write", str(base / "recipes"), "-q"])
    assert result.exit_code == 0, result.output
    return base, json.loads(out.read_text()), result.output


def test_tune_finds_a_clearly_better_configuration_than_the_shipped_chat_recipe_for_long_prompts(
        tuned: tuple[Path, dict[str, object], str]) -> None:
    _, doc, output = tuned
    candidates = doc["candidates"]
    assert isinstance(candidates, list) and 1 < len(candidates) <= 20
    assert [c["index"] for c in candidates] == list(range(len(candidates)))
    assert candidates[0]["changes"] == {}  # candidate 0: the recipe as shipped
    tune = doc["tune"]
    assert isinstance(tune, dict) and tune["best"] != 0 and tune["proxy_cost_model"] is True
    best, shipped = candidates[tune["best"]], candidates[0]
    assert best["rank"] == 1 and best["feasible"]
    assert best["figures"]["e2e_mean_s"] < 0.85 * shipped["figures"]["e2e_mean_s"]
    assert any(not c["feasible"] and "chunked prefill" in c["figures"]["error"] for c in candidates)
    assert doc["patch"] and set(doc["patch"]) <= {"vllm", "scheduler"}
    assert "best: candidate" in output and "patch for " + KEY in output and "<- goal" in output
    label = "predicted by the twin with step-time model a100-80-tp1 v1, a proxy"
    assert tune["label"]["kind"] == "predicted" and tune["label"]["text"] == label
    assert f"figures {label}: rankings, not promises" in output
    window = tune["window"]
    assert isinstance(window, dict) and window["capacity_measured_with"] == "fcfs"
    assert window["measured_capacity_rps"] > 0


def test_the_written_recipe_loads_and_its_launch_logs_the_departure(
        tuned: tuple[Path, dict[str, object], str], tmp_path: Path) -> None:
    from carbonforge_runtime.recipes import load_recipes, recipe_dirs, resolve

    base, doc, _ = tuned
    path = base / "recipes" / "qwen3-32b--fp8--chat--a100-80x1.yaml"
    written = yaml.safe_load(path.read_text())
    predicted = written["benchmark"]["predicted"]
    assert predicted["measured"] is False and predicted["goal"] == "mean_e2e"
    assert predicted["trace"]["file"] == "long.jsonl" and len(predicted["trace"]["sha256"]) == 64
    assert predicted["cost_model"]["name"] == "a100-80-tp1" and predicted["cost_model"]["proxy"] is True
    assert predicted["chosen"]["e2e_mean_s"] < predicted["shipped"]["e2e_mean_s"]
    assert predicted["window"]["load"] == 1.2
    recipe = resolve(KEY, load_recipes(recipe_dirs(str(base / "recipes"))))
    assert recipe.source == path and recipe.replaces is not None
    patch = doc["patch"]
    assert isinstance(patch, dict)
    for knob, value in patch.get("vllm", {}).items():
        assert recipe.vllm[knob] == value
    if "scheduler" in patch:
        assert recipe.scheduler.family == patch["scheduler"].get("family", recipe.replaces.scheduler.family)
    env = {"CF_RECIPES_DIR": str(base / "recipes"), "CF_LOG_DIR": str(tmp_path / "logs")}
    result = runner.invoke(cli.app, ["serve", "--context-key", KEY, "--dry-run"], env=env)
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("departure:")]
    assert len(lines) == 1 and "departs from the shipped benchmark" in lines[0], result.output
    for knob, value in patch.get("vllm", {}).items():
        flag = "--" + knob.replace("_", "-")
        shown = (flag if value else "--no-" + knob.replace("_", "-")) if isinstance(value, bool) else f"{flag} {value}"
        assert f"vllm.{knob} " in lines[0]
        assert shown in result.output
