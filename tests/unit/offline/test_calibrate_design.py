"""calibrate's decisions as plain functions: the budget and its split, the loads, the comparison, the
host block and the local recipe."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from carbonforge_runtime.core.figure_labels import MEASURED, benchmark_labels
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.offline.calibrate import design
from carbonforge_runtime.offline.calibrate.design import (
    CALIBRATION,
    CHECK,
    PHASES,
    START,
    WRITE,
    EngineLimits,
)
from carbonforge_runtime.recipes.loader import shipped_recipes_dir
from carbonforge_runtime.recipes.model import recipe_from_mapping

LIMITS = EngineLimits(max_model_len=2048, max_num_batched_tokens=512, max_num_seqs=8, kv_tokens=16384)


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90.0), ("15m", 900.0), ("1h", 3600.0), ("1h30m", 5400.0), ("2m30s", 150.0), ("600", 600.0),
    (" 15M ", 900.0), ("1.5m", 90.0),
])
def test_budgets_in_the_forms_an_operator_types(text: str, seconds: float) -> None:
    assert design.parse_budget(text) == seconds


@pytest.mark.parametrize(("text", "problem"), [
    ("", "is not a duration"), ("fifteen", "is not a duration"), ("15 m", "is not a duration"),
    ("15x", "is not a duration"), ("1m1m", "names a unit twice"), ("-5m", "is not a duration"),
    ("30s", "is too small"), ("0", "is too small"), ("48h", "is over 24 h"),
])
def test_bad_budgets_are_refused_with_the_fix(text: str, problem: str) -> None:
    with pytest.raises(UsageError, match=problem) as caught:
        design.parse_budget(text)
    assert caught.value.exit_code == 2 and "--budget" in caught.value.remedy


def test_the_phases_share_the_time_left_and_what_one_leaves_goes_on() -> None:
    left = 900.0
    shares = [design.allowance(phase, left) for phase in PHASES]
    # Spending every phase's allowance in turn spends the whole usable budget, and no more.
    spent, rest = 0.0, left
    for phase in PHASES:
        part = design.allowance(phase, rest)
        spent += part
        rest -= part
    assert spent == pytest.approx(left - design.STOP_RESERVE_S)
    assert shares[0] == pytest.approx((left - design.STOP_RESERVE_S) * design.PHASE_WEIGHTS[START])
    assert design.allowance(WRITE, 100.0) == pytest.approx(100.0 - design.STOP_RESERVE_S)  # the last takes all
    # A fast start leaves more for the loads.
    assert design.allowance(CALIBRATION, 800.0) > design.allowance(CALIBRATION, 700.0)
    assert design.allowance(CHECK, 10.0) == 0.0  # nothing left beyond the stop reserve


def test_durations_are_printed_in_minutes_and_seconds() -> None:
    assert design.format_duration(65.4) == "1m05s"
    assert design.format_duration(42) == "42s"
    assert design.format_duration(-3) == "0s"


def test_limits_come_from_the_engine_then_the_recipe_then_vllm() -> None:
    facts = {"max_num_seqs": 8, "kv_cache_tokens": 16384, "max_num_batched_tokens": 512}
    assert design.limits_of({"max_model_len": 2048, "max_num_seqs": 16}, facts) == LIMITS
    fallback = design.limits_of({}, {})
    assert fallback == EngineLimits(design.DEFAULT_MAX_MODEL_LEN, design.DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                    design.DEFAULT_MAX_NUM_SEQS, design.DEFAULT_MAX_MODEL_LEN * 256)
    with pytest.raises(ValueError):
        EngineLimits(0, 1, 1, 1)


def test_the_calibration_load_spans_the_step_models_terms() -> None:
    waves = design.calibration_waves(LIMITS)
    output = design.wave_output_tokens(LIMITS)
    sizes = {len(w) for w in waves}
    assert sizes == {1, 2, 4, 8}  # decode batches of every size up to max_num_seqs
    prompts = {r.prompt_tokens for w in waves for r in w}
    assert min(prompts) <= 16  # short prompts: one small chunk
    assert LIMITS.max_num_batched_tokens in prompts  # one full chunk
    assert max(prompts) == LIMITS.max_model_len - output - 1  # up to the context limit: chunked, long contexts
    assert all(r.prompt_tokens + r.output_tokens < LIMITS.max_model_len for w in waves for r in w)
    # The first round already has every batch size, so a run cut short by its budget still spans them.
    first_round = waves[:len(design.concurrency_grid(LIMITS))]
    assert sorted(len(w) for w in first_round) == [1, 2, 4, 8]
    # Every wave fits the KV cache.
    assert all(sum(r.prompt_tokens + r.output_tokens for r in w) <= LIMITS.kv_tokens for w in waves)


def test_a_small_kv_cache_cuts_the_prompts_not_the_batch() -> None:
    small = EngineLimits(max_model_len=4096, max_num_batched_tokens=1024, max_num_seqs=16, kv_tokens=4096)
    waves = design.calibration_waves(small)
    assert max(len(w) for w in waves) == 16
    assert all(sum(r.prompt_tokens + r.output_tokens for r in w) <= small.kv_tokens for w in waves)


def test_grids() -> None:
    assert design.concurrency_grid(LIMITS) == [1, 2, 4, 8]
    assert design.concurrency_grid(EngineLimits(2048, 512, 6, 16384)) == [1, 2, 4, 6]
    assert design.concurrency_grid(EngineLimits(2048, 512, 1, 16384)) == [1]
    assert design.prompt_grid(LIMITS, 64) == [16, 64, 256, 512, 1024, 1983]
    tiny = EngineLimits(max_model_len=64, max_num_batched_tokens=512, max_num_seqs=2, kv_tokens=1024)
    assert max(design.prompt_grid(tiny, design.wave_output_tokens(tiny))) < 64
    warm = design.warmup_wave(LIMITS)
    assert [r.prompt_tokens for r in warm] == [16, 512, 1983]


def test_the_check_load_is_another_traffic_within_the_limits() -> None:
    records = design.check_records(300, LIMITS)
    assert len(records) == 300
    times = [r["t_arrival"] for r in records]
    assert times == sorted(times)
    rate = (len(records) - 1) / (times[-1] - times[0])
    assert 0.8 < rate < 1.25  # about one request a second, scaled later
    prompts = [r["prompt_tokens"] for r in records]
    outputs = [r["output_tokens"] for r in records]
    assert all(p + o < LIMITS.max_model_len for p, o in zip(prompts, outputs, strict=True))
    long_share = sum(p >= LIMITS.max_num_batched_tokens for p in prompts) / len(prompts)
    assert 0.2 < long_share < 0.4
    assert len(set(outputs)) > 20  # spread output lengths, unlike the waves' fixed one
    assert design.check_records(300, LIMITS) == records  # deterministic
    with pytest.raises(ValueError):
        design.check_records(1, LIMITS)


def test_the_check_load_is_sized_to_its_share_of_the_budget() -> None:
    assert design.check_size(60.0, 10.0) == 210  # half of 60 s at 70% of 10 req/s
    assert design.check_size(10.0, 1.0) == 20  # never fewer than say something
    assert design.check_size(10_000.0, 100.0) == 250
    assert design.check_size(100.0, float("nan")) == 20


def record(arrival: float, e2e: float, ttft: float, finish: str = "length") -> dict[str, object]:
    return {"t_arrival": arrival, "t_completion": arrival + e2e, "e2e_latency_s": e2e, "ttft_s": ttft,
            "finish_reason": finish}


def test_figures_from_per_request_records() -> None:
    records = [record(0.0, 1.0, 0.1), record(1.0, 2.0, 0.3), record(2.0, 3.0, 0.2, finish="abort")]
    figures = design.figures_of(records)
    assert figures["requests"] == 2
    assert figures["mean_e2e_s"] == pytest.approx(1.5)
    assert figures["p99_e2e_s"] == pytest.approx(2.0)
    assert figures["mean_ttft_s"] == pytest.approx(0.2)
    assert figures["throughput_rps"] == pytest.approx(2 / 3.0)
    empty = design.figures_of([])
    assert empty["requests"] == 0 and math.isnan(empty["mean_e2e_s"])


def test_the_comparison_table_has_four_rows_with_relative_errors() -> None:
    predicted = {"mean_e2e_s": 1.1, "p99_e2e_s": 1.8, "mean_ttft_s": float("nan"), "throughput_rps": 9.0}
    served = {"mean_e2e_s": 1.0, "p99_e2e_s": 2.0, "mean_ttft_s": 0.2, "throughput_rps": 10.0}
    rows = design.compare(predicted, served)
    assert [r.name for r in rows] == ["mean e2e", "p99 e2e", "mean TTFT", "throughput"]
    assert rows[0].relative_error == pytest.approx(0.1)
    assert rows[1].relative_error == pytest.approx(-0.1)
    assert math.isnan(rows[2].relative_error)
    text = design.format_comparison(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["figure", "predicted", "served", "error"]
    assert "+10.0%" in lines[1] and "-10.0%" in lines[2] and "-" in lines[3] and "req/s" in lines[4]
    assert design.table_json(rows)["mean_ttft_s"] == {"predicted": None, "served": 0.2, "relative_error": None}
    assert design.Row("x", "y", 1.0, 0.0).relative_error != design.Row("x", "y", 1.0, 0.0).relative_error  # NaN


def test_the_host_block_names_the_gpus_or_the_cpu_engine_honestly() -> None:
    gpus = design.host_block(["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"], "550.54.15", "0.32.0", False)
    assert gpus == {"gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 2, "driver": "550.54.15", "vllm": "0.32.0"}
    cpu = design.host_block(["NVIDIA H100 80GB HBM3"], "550.54.15", "0.32.0", True)  # the engine ran on the CPU
    assert cpu == {"gpu": "cpu", "gpu_count": 0, "driver": design.CPU_DRIVER, "vllm": "0.32.0"}
    assert design.host_block([], None, "0.32.0", False)["gpu"] == "cpu"


def test_the_local_recipe_is_the_served_one_measured_here(tmp_path: Path) -> None:
    source = yaml.safe_load((shipped_recipes_dir() / "cf-tiny--bf16--chat--cpu.yaml").read_text(encoding="utf-8"))
    rows = design.compare({"mean_e2e_s": 1.0, "p99_e2e_s": 2.0, "mean_ttft_s": 0.1, "throughput_rps": 5.0},
                          {"mean_e2e_s": 1.1, "p99_e2e_s": 2.1, "mean_ttft_s": 0.1, "throughput_rps": 5.0})
    host = design.host_block([], None, "0.32.0", True)
    block = design.benchmark_block(host, "2026-12-06", rows, "/x/step-model.yaml", {"r2": 0.97, "steps": 900},
                                   {"requests": 40})
    text = design.recipe_text(source, block)
    assert text.startswith("# Calibrated by carbonforge-runtime calibrate")
    data = yaml.safe_load(text)
    assert {k: v for k, v in data.items() if k != "benchmark"} == {k: v for k, v in source.items() if k != "benchmark"}
    recipe = recipe_from_mapping(data, tmp_path / "r.yaml")  # the loader's own checks pass
    labels = benchmark_labels(recipe.benchmark)
    assert [(part, label.kind) for part, label in labels] == [("figures", MEASURED)]
    assert labels[0][1].text() == f"measured on cpu, driver {design.CPU_DRIVER}, vLLM 0.32.0, 2026-12-06"
    figures = recipe.benchmark["figures"]
    assert set(figures["predicted_against_served"]) == {"mean_e2e_s", "p99_e2e_s", "mean_ttft_s", "throughput_rps"}
    assert figures["step_model"] == {"file": "/x/step-model.yaml", "r2": 0.97, "steps": 900}


def test_a_stop_names_the_phase_what_was_done_and_written() -> None:
    stop = design.CalibrationStopped("fit", "no fit is possible", ["engine start: ready after 30 s"],
                                     ["/o/step-model.yaml"], "pass a larger --budget")
    text = stop.render()
    assert stop.exit_code == 1 and stop.phase == "fit"
    assert "stopped in the fit phase: no fit is possible" in text
    assert "done: engine start: ready after 30 s" in text and "written: /o/step-model.yaml" in text
    assert "fix: pass a larger --budget" in text
    nothing = design.CalibrationStopped("engine start", "x", [], [], "y").render()
    assert "done: nothing" in nothing and "written: nothing" in nothing
