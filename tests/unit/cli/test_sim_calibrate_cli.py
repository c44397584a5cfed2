"""``carbonforge-runtime sim-calibrate``: the fit printed, the model file in the shipped format
(loaded by the shipped loader, taken by ``sim --cost-model``), deterministic, clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.core.step_models import load_model_file, resolve_model, shipped_models
from tests.unit.cli.test_sim_cli import KEY, mooncake
from tests.unit.offline.test_calibrate import header, synthetic_requests, synthetic_steps, write_log

runner = CliRunner()


def test_calibrate_writes_a_model_sim_takes(tmp_path: Path) -> None:
    truth = shipped_models()["h100-tp2"]
    log = write_log(tmp_path / "steps.jsonl", [header(), *synthetic_steps(truth, 2000, noise=0.03)])
    model_path = tmp_path / "models" / "h100-tp2-fitted.yaml"
    result = runner.invoke(cli.app, ["sim-calibrate", str(log), "-o", str(model_path), "--gpu", "h100"])
    assert result.exit_code == 0, result.output
    for label in ("per_batched_token", "per_kv_token_read", "attention", "overhead", "R2", "mean absolute error",
                  "mean relative error", "p90 relative error"):
        assert label in result.output
    model = load_model_file(model_path)
    assert (model.name, model.gpu, model.tensor_parallel_size, model.version) == ("h100-tp2-fitted", "h100", 2, 1)
    assert model.proxy is False and model.kv_capacity_tokens == 393216  # from the log's engine line
    assert model.per_batched_token_ms == pytest.approx(truth.per_batched_token_ms, rel=0.05)
    assert "2000 steps" in model.provenance and "2026-05-28" in model.provenance and str(log) in model.provenance
    assert "vLLM 0.32.0" in model.provenance and "p90 relative error" in model.provenance
    assert model.provenance.startswith("Fitted by carbonforge-runtime sim-calibrate to the step log")
    assert resolve_model(str(model_path), None, 1) == model
    first = model_path.read_bytes()
    again = runner.invoke(cli.app, ["sim-calibrate", str(log), "-o", str(model_path), "--gpu", "h100"])
    assert again.exit_code == 0 and model_path.read_bytes() == first  # the same log, the same file
    assert [p.name for p in model_path.parent.iterdir()] == [model_path.name]  # no temporary left

    pytest.importorskip("vllm")
    trace = mooncake(tmp_path / "m.jsonl", count=20)
    out = tmp_path / "r.json"
    sim = runner.invoke(cli.app, ["sim", str(trace), "--context-key", KEY, "-o", str(out), "-q",
                                  "--cost-model", str(model_path), "--kv-tokens", "20000"])
    assert sim.exit_code == 0, sim.output
    assert "PROXY" not in sim.output
    doc = json.loads(out.read_text())
    assert doc["sim"]["cost_model"]["name"] == "h100-tp2-fitted" and doc["sim"]["proxy_cost_model"] is False
    assert doc["summary"]["ok"] == 20


def test_request_lines_give_the_model_an_admission_delay_the_twin_adds(tmp_path: Path) -> None:
    truth = shipped_models()["l4-tp1"]
    old = write_log(tmp_path / "old.jsonl", [header(), *synthetic_steps(truth, 100, noise=0.0)])
    new = write_log(tmp_path / "new.jsonl", [header(), *synthetic_steps(truth, 100, noise=0.0),
                                             *synthetic_requests(3.0, 0.0005, 200)])
    without = runner.invoke(cli.app, ["sim-calibrate", str(old), "-o", str(tmp_path / "old.yaml")])
    assert without.exit_code == 0 and "admission delay  not fitted" in without.output
    assert not load_model_file(tmp_path / "old.yaml").has_admission_delay
    done = runner.invoke(cli.app, ["sim-calibrate", str(new), "-o", str(tmp_path / "new.yaml")])
    assert done.exit_code == 0, done.output
    assert "admission delay" in done.output and "200 (" in done.output
    model = load_model_file(tmp_path / "new.yaml")
    assert model.admission_base_ms == pytest.approx(3.0, rel=1e-3)
    assert model.admission_per_prompt_token_ms == pytest.approx(0.0005, rel=1e-3)

    pytest.importorskip("vllm")
    trace = mooncake(tmp_path / "m.jsonl", count=10)
    results = {}
    for name in ("old", "new"):
        out = tmp_path / f"{name}.json"
        sim = runner.invoke(cli.app, ["sim", str(trace), "--context-key", KEY, "-o", str(out), "-q",
                                      "--cost-model", str(tmp_path / f"{name}.yaml"), "--kv-tokens", "20000"])
        assert sim.exit_code == 0, sim.output
        results[name] = json.loads(out.read_text())
    assert "admission_delay_ms" not in results["old"]["sim"]["cost_model"]
    assert results["new"]["sim"]["cost_model"]["admission_delay_ms"]["base"] == pytest.approx(3.0, rel=1e-3)
    assert results["new"]["sim"]["queue_wait_s"]["mean"] > results["old"]["sim"]["queue_wait_s"]["mean"] + 0.003


def test_kv_size_and_parallel_size_from_options(tmp_path: Path) -> None:
    steps = synthetic_steps(shipped_models()["l4-tp1"], 100, noise=0.0)
    log = write_log(tmp_path / "s.jsonl", steps)  # no engine line
    out = tmp_path / "m.yaml"
    refused = runner.invoke(cli.app, ["sim-calibrate", str(log), "-o", str(out)])
    assert refused.exit_code == 2 and "--kv-tokens" in refused.output and not out.exists()
    assert "Traceback" not in refused.output
    done = runner.invoke(cli.app, ["sim-calibrate", str(log), "-o", str(out), "--kv-tokens", "5000", "--name", "x",
                                   "--tensor-parallel-size", "4", "--skip-first", "10"])
    assert done.exit_code == 0, done.output
    model = load_model_file(out)
    assert (model.name, model.kv_capacity_tokens, model.tensor_parallel_size) == ("x", 5000, 4)
    assert "90 steps" in model.provenance and "the first 10 skipped" in model.provenance


@pytest.mark.parametrize(("make", "args", "code", "message"), [
    (None, ["missing.jsonl"], 1, "does not exist"),
    ("bad", ["LOG"], 2, "s.jsonl:2: is not JSON"),
    ("trace", ["LOG"], 2, "is not a step-log line"),
    ("good", ["LOG", "-o", "OUT.json"], 2, "does not end in .yaml"),
    ("good", ["LOG", "-o", "DIR"], 2, "is a directory"),
    ("good", ["LOG", "--name", " "], 2, "must not be empty"),
    ("good", ["LOG", "--kv-tokens", "3"], 2, "kv-tokens"),
])
def test_refusals(tmp_path: Path, make: str | None, args: list[str], code: int, message: str) -> None:
    log = tmp_path / "s.jsonl"
    if make == "bad":
        write_log(log, [header(), "{oops"])
    elif make == "trace":
        write_log(log, [{"request_id": "chatcmpl-1", "prompt_tokens": 5, "output_tokens": 2}])
    elif make == "good":
        write_log(log, [header(), *synthetic_steps(shipped_models()["l4-tp1"], 30, noise=0.0)])
    (tmp_path / "d.yaml").mkdir()
    words = [str(log) if a == "LOG" else str(tmp_path / "o.json") if a == "OUT.json"
             else str(tmp_path / "d.yaml") if a == "DIR" else a for a in args]
    if "-o" not in words:
        words += ["-o", str(tmp_path / "m.yaml")]
    result = runner.invoke(cli.app, ["sim-calibrate", *words])
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "m.yaml").exists()


def test_the_container_command_line_reaches_both_commands() -> None:
    assert cli._dispatch(["sim-calibrate", "steps.jsonl"], {}) == ["sim-calibrate", "steps.jsonl"]
    assert cli._dispatch(["--step-log", "/tmp/s.jsonl", "--context-key", KEY], {})[:2] == ["serve", "--step-log"]


def test_a_poor_fit_is_written_with_a_warning(tmp_path: Path) -> None:
    import random

    rng = random.Random(5)
    steps = synthetic_steps(shipped_models()["l4-tp1"], 100, noise=0.0)
    for s in steps:
        s["wall_s"] = rng.uniform(0.001, 0.1)  # unrelated to the tokens
    log = write_log(tmp_path / "s.jsonl", [header(), *steps])
    result = runner.invoke(cli.app, ["sim-calibrate", str(log), "-o", str(tmp_path / "m.yaml")])
    assert result.exit_code == 0 and "a poor fit" in result.output
    assert load_model_file(tmp_path / "m.yaml").proxy is False


def test_a_paced_engines_log_is_fitted_with_its_provenance_saying_so(tmp_path: Path) -> None:
    truth = shipped_models()["h100-tp2"]
    log = write_log(tmp_path / "steps.jsonl", [header(emulated_cost_model="h100-tp2", emulated_slowdown=2.0),
                                              *synthetic_steps(truth, 500, noise=0.01)])
    result = runner.invoke(cli.app, ["sim-calibrate", str(log), "-o", str(tmp_path / "m.yaml")])
    assert result.exit_code == 0, result.output
    provenance = load_model_file(tmp_path / "m.yaml").provenance
    assert ("a paced engine (serve --emulate) whose steps follow the step-time model h100-tp2 at slowdown 2.0"
            in provenance)
    assert "not the hardware's" in provenance
