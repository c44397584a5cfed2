"""sim-calibrate's reading and fitting: known coefficients recovered from a synthetic step log made
with the twin's own step-time function, and hostile or wrong input refused with its line."""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from carbonforge_runtime.core.step_models import shipped_models
from carbonforge_runtime.core.twin_data import SimError, StepCostModel, step_time_s
from carbonforge_runtime.offline.sim.calibrate import (
    MIN_STEPS,
    ModelInfo,
    check_model_text,
    fit_steps,
    model_text,
    predict_ms,
    read_step_log,
)
from carbonforge_runtime.offline.trace_reader import TraceInputError

T0 = 1_780_000_000.0  # 2026-05-28


def synthetic_steps(model: StepCostModel, count: int, noise: float, seed: int = 1,
                    decode: bool = True, prefill: bool = True) -> list[dict[str, Any]]:
    """Steps of a plausible engine (decode-heavy batches, some prompt chunks), timed by the model."""
    rng = random.Random(seed)
    steps = []
    for number in range(1, count + 1):
        decoding = rng.randrange(1, 200) if decode else 0
        contexts = [rng.randrange(100, 8000) for _ in range(decoding)]
        chunks = []
        if prefill and (not decode or rng.random() < 0.5):
            for _ in range(rng.randrange(1, 4)):
                chunks.append((rng.randrange(16, 2048), rng.choice([0, 0, rng.randrange(0, 20000)])))
        batched = decoding + sum(n for n, _ in chunks)
        kv_read = sum(contexts)
        attention = sum(n * (c + n / 2) for n, c in chunks)
        wall = step_time_s(model, batched, kv_read, attention) * (1 + rng.gauss(0, noise))
        steps.append({"kind": "step", "engine": 0, "step": number, "t": T0 + number * 0.05, "wall_s": wall,
                      "batched_tokens": batched, "prefill_tokens": batched - decoding, "decode_tokens": decoding,
                      "seqs": decoding + len(chunks), "kv_read_tokens": kv_read, "attention_units": attention,
                      "context_tokens": kv_read + sum(c for _, c in chunks)})
    return steps


def header(**overrides: Any) -> dict[str, Any]:
    values = {"kind": "engine", "engine": 0, "t": T0, "vllm": "0.32.0", "model": "Qwen/Qwen3-32B",
              "tensor_parallel_size": 2, "async_scheduling": True, "kv_cache_tokens": 393216, "block_size": 16}
    values.update(overrides)
    return values


def write_log(path: Path, lines: Iterable[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _columns(steps: list[dict[str, Any]]) -> tuple[list[int], list[int], list[float], list[float]]:
    return ([s["batched_tokens"] for s in steps], [s["kv_read_tokens"] for s in steps],
            [s["attention_units"] for s in steps], [s["wall_s"] * 1000 for s in steps])


@pytest.mark.parametrize("name", ["h100-tp2", "a100-80-tp1", "l4-tp1"])
def test_the_fit_recovers_a_models_coefficients_exactly_without_noise(name: str) -> None:
    model = shipped_models()[name]
    fit = fit_steps(*_columns(synthetic_steps(model, 600, noise=0.0)))
    assert fit.r2 > 0.999999 and fit.p90_rel_error < 1e-4
    assert fit.per_batched_token_ms == pytest.approx(model.per_batched_token_ms, rel=1e-3)
    assert fit.per_kv_token_read_ms == pytest.approx(model.per_kv_token_read_ms, rel=1e-3)
    assert fit.attention_ms == pytest.approx(model.attention_ms, rel=1e-3)
    assert fit.floor_ms + fit.overhead_ms == pytest.approx(model.floor_ms + model.overhead_ms, rel=1e-3)
    assert fit.floor_ms == pytest.approx(model.floor_ms, rel=0.02)


def test_the_fit_recovers_coefficients_under_noise_and_reports_its_error() -> None:
    model = shipped_models()["h100-tp2"]
    steps = synthetic_steps(model, 4000, noise=0.05, seed=7)
    fit = fit_steps(*_columns(steps))
    assert fit.per_batched_token_ms == pytest.approx(model.per_batched_token_ms, rel=0.05)
    assert fit.per_kv_token_read_ms == pytest.approx(model.per_kv_token_read_ms, rel=0.05)
    assert fit.attention_ms == pytest.approx(model.attention_ms, rel=0.05)
    assert fit.floor_ms + fit.overhead_ms == pytest.approx(model.floor_ms + model.overhead_ms, rel=0.1)
    # 5% noise: about 4% mean relative error, about 8% at p90
    assert 0.03 < fit.mean_rel_error < 0.05 and 0.06 < fit.p90_rel_error < 0.1
    assert fit.r2 > 0.9 and fit.steps == 4000 and fit.unfitted == ()
    # the error printed is the one of the twin's own formula with the fitted coefficients
    b, k, a, _ = _columns(steps[:5])
    cost = StepCostModel("fit", 1, "h100", 2, fit.floor_ms, fit.per_batched_token_ms, fit.per_kv_token_read_ms,
                         fit.attention_ms, fit.overhead_ms, 1000, "test")
    import numpy as np

    assert list(predict_ms(fit.coefficients(), np.array(b), np.array(k), np.array(a))) == pytest.approx(
        [step_time_s(cost, *row) * 1000 for row in zip(b, k, a, strict=True)])


def test_coefficients_stay_non_negative_and_unused_terms_are_named() -> None:
    model = shipped_models()["h100-tp2"]
    steps = synthetic_steps(model, 300, noise=0.02, decode=False)  # prompt chunks only: no KV read term
    fit = fit_steps(*_columns(steps))
    assert fit.unfitted == ("per_kv_token_read",) and fit.per_kv_token_read_ms == 0.0
    assert min(fit.coefficients().values()) >= 0.0
    # time that falls as tokens grow: the per-token cost would be negative; it is held at 0
    fit = fit_steps([10, 20, 30, 40] * 10, [0] * 40, [0.0] * 40, [9.0, 8.0, 7.0, 6.0] * 10)
    assert fit.per_batched_token_ms == 0.0 and fit.overhead_ms == pytest.approx(7.5)


def test_reading_a_log_with_headers_gzip_and_skips(tmp_path: Path) -> None:
    model = shipped_models()["h100-tp2"]
    steps = synthetic_steps(model, 50, noise=0.0)
    steps[3] = {**steps[3], "batched_tokens": 0, "kv_read_tokens": 0, "attention_units": 0}
    path = tmp_path / "steps.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write(json.dumps(header()) + "\n\n")
        handle.writelines(json.dumps(s) + "\n" for s in steps)
    data = read_step_log(path, skip_first=2)
    assert data.logged == 50 and data.skipped == 2 and data.empty == 1 and len(data.wall_ms) == 47
    assert data.headers[0]["kv_cache_tokens"] == 393216
    assert data.first_t == steps[2]["t"] and data.last_t == steps[-1]["t"]


@pytest.mark.parametrize(("line", "problem"), [
    ("not json", "is not JSON"),
    ("[1, 2]", "is not a JSON object"),
    ({"request_id": "chatcmpl-1", "prompt_tokens": 3}, "is not a step-log line"),
    ({"kind": "step", "batched_tokens": -1}, "batched_tokens=-1"),
    ({"kind": "step", "batched_tokens": True}, "batched_tokens=True"),
    ({"kind": "step", "batched_tokens": 10**9}, "batched_tokens=1000000000"),
    ({"kind": "step", "batched_tokens": 5, "kv_read_tokens": 1.5}, "kv_read_tokens=1.5"),
    ({"kind": "step", "batched_tokens": 5, "kv_read_tokens": 0, "attention_units": "NaN"}, "attention_units"),
    ({"kind": "step", "batched_tokens": 5, "kv_read_tokens": 0, "attention_units": 0, "wall_s": 0}, "wall_s=0"),
    ({"kind": "step", "batched_tokens": 5, "kv_read_tokens": 0, "attention_units": 0, "wall_s": 1e9}, "wall_s"),
    ('{"kind": "step", "batched_tokens": 5, "kv_read_tokens": 0, "attention_units": 0, "wall_s": Infinity}',
     "wall_s"),
    ({"kind": "step", "batched_tokens": 5, "kv_read_tokens": 0, "attention_units": 0, "wall_s": 0.1}, "t=None"),
    ("[" * 100_000, "is not JSON"),
])
def test_bad_lines_are_refused_with_their_line(tmp_path: Path, line: Any, problem: str) -> None:
    good = synthetic_steps(shipped_models()["l4-tp1"], 3, noise=0.0)
    path = write_log(tmp_path / "s.jsonl", [header(), *good, line])
    with pytest.raises(SimError) as caught:
        read_step_log(path)
    assert "s.jsonl:5: " in caught.value.message and problem in caught.value.message


def test_unreadable_or_too_small_logs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceInputError, match="does not exist"):
        read_step_log(tmp_path / "missing.jsonl")
    with pytest.raises(TraceInputError, match="is a directory"):
        read_step_log(tmp_path)
    few = write_log(tmp_path / "few.jsonl", [header(), *synthetic_steps(shipped_models()["l4-tp1"], MIN_STEPS - 1, 0)])
    with pytest.raises(SimError, match=f"at least {MIN_STEPS}"):
        read_step_log(few)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(few.read_bytes() * 5)[:-30])
    with pytest.raises(TraceInputError, match="truncated"):
        read_step_log(cut)


def test_the_model_text_is_the_shipped_format(tmp_path: Path) -> None:
    model = shipped_models()["a100-80-tp1"]
    fit = fit_steps(*_columns(synthetic_steps(model, 200, noise=0.0)))
    text = model_text(fit, ModelInfo("mine: a test", 3, "a100 #1", 1, 40_000), "Fitted: 'quotes', colons: and\nlines")
    loaded = check_model_text(text, tmp_path / "m.yaml")
    assert (loaded.name, loaded.version, loaded.gpu) == ("mine: a test", 3, "a100 #1")
    assert loaded.kv_capacity_tokens == 40_000
    assert loaded.proxy is False and loaded.scaling_rule is None and "quotes" in loaded.provenance
    assert loaded.per_kv_token_read_ms == pytest.approx(model.per_kv_token_read_ms, rel=1e-3)
    assert text.splitlines()[1:6] == ["name: 'mine: a test'", "version: 3", "gpu: 'a100 #1'",
                                      "tensor_parallel_size: 1", "coefficients_ms:"]


# ---- the host's admission delay --------------------------------------------------------------------


def synthetic_requests(base_ms: float, per_prompt_token_ms: float, count: int, seed: int = 1,
                       waiting_share: float = 0.3, noise_ms: float = 0.0, step_s: float = 0.02) -> list[dict[str, Any]]:
    """Request lines of an engine whose host takes ``base + per token x prompt`` ms (plus noise) from
    the arrival stamp to the engine core's queue. A share of them find the engine waiting for work
    and enter at once; the others wait for the end of a step (steps of ``step_s``), and their intake
    window is the whole step."""
    import math

    rng = random.Random(seed)
    arrival = T0
    lines = []
    for _ in range(count):
        arrival += rng.expovariate(10.0)
        prompt = rng.randrange(16, 8000)
        reached = arrival + max(0.0, base_ms + per_prompt_token_ms * prompt + rng.gauss(0, noise_ms)) / 1000
        if rng.random() < waiting_share:
            added, window = reached, 0.0
        else:
            phase = rng.uniform(0, step_s)
            added = T0 + phase + math.ceil((reached - T0 - phase) / step_s) * step_s
            window = step_s
        lines.append({"kind": "request", "engine": 0, "t_arrival": round(arrival, 6), "t_added": round(added, 6),
                      "intake_window_s": window, "prompt_tokens": prompt})
    return lines


def _admission(tmp_path: Path, requests: list[dict[str, Any]]) -> Any:
    from carbonforge_runtime.offline.sim.calibrate import fit_log_admission

    steps = synthetic_steps(shipped_models()["l4-tp1"], MIN_STEPS, noise=0.0)
    return fit_log_admission(read_step_log(write_log(tmp_path / "s.jsonl", [header(), *steps, *requests])))


def test_the_admission_fit_recovers_known_terms_from_requests_taken_in_at_once(tmp_path: Path) -> None:
    fit = _admission(tmp_path, synthetic_requests(3.0, 0.0005, 400))
    assert fit.requests == 400 and 80 < fit.exact < 160 and fit.unfitted == ()
    assert fit.base_ms == pytest.approx(3.0, rel=1e-3)
    assert fit.per_prompt_token_ms == pytest.approx(0.0005, rel=1e-3)
    assert fit.mean_miss_ms < 1e-3
    # the wait for a step boundary is not the host's: the scheduler saw the requests far later on average
    assert fit.mean_to_scheduler_ms > fit.mean_ms + 5.0


def test_the_admission_fit_finds_the_delay_within_step_boundaries_alone(tmp_path: Path) -> None:
    # every request waited for the end of a 20 ms step: each delay is known only to lie in its window
    fit = _admission(tmp_path, synthetic_requests(3.0, 0.0005, 400, waiting_share=0.0))
    assert fit.exact == 0
    assert fit.mean_ms == pytest.approx(3.0 + 0.0005 * 4008, rel=0.05)
    assert fit.base_ms == pytest.approx(3.0, rel=0.1) and fit.per_prompt_token_ms == pytest.approx(0.0005, rel=0.15)
    noisy = _admission(tmp_path, synthetic_requests(3.0, 0.0005, 2000, seed=4, noise_ms=0.5))
    assert noisy.mean_ms == pytest.approx(3.0 + 0.0005 * 4008, rel=0.05)


def test_admission_fit_edge_cases() -> None:
    from carbonforge_runtime.offline.sim.calibrate import MIN_REQUESTS, fit_admission

    assert fit_admission([100] * (MIN_REQUESTS - 1), [1.0] * (MIN_REQUESTS - 1), [1.0] * (MIN_REQUESTS - 1)) is None
    same = fit_admission([100] * 20, [2.0] * 20, [2.0] * 20)  # one prompt length: no per-token term to fit
    assert same is not None and same.unfitted == ("per_prompt_token",)
    assert (same.base_ms, same.per_prompt_token_ms) == (pytest.approx(2.0), 0.0)
    # a delay that falls as prompts grow would need a negative term: it is held at 0
    falling = fit_admission([100, 200, 300, 400] * 5, [4.0, 3.0, 2.0, 1.0] * 5, [4.0, 3.0, 2.0, 1.0] * 5)
    assert falling is not None and falling.per_prompt_token_ms == 0.0 and falling.base_ms == pytest.approx(2.5)


def test_request_lines_are_read_skipped_with_the_steps_before_them_and_checked(tmp_path: Path) -> None:
    steps = synthetic_steps(shipped_models()["l4-tp1"], 30, noise=0.0)
    requests = synthetic_requests(3.0, 0.0, 12)
    lines = [header(), requests[0], *steps[:5], *requests[1:4], *steps[5:], *requests[4:]]
    data = read_step_log(write_log(tmp_path / "s.jsonl", lines), skip_first=5)
    # the first request came before the fifth step ended: skipped with the warm-up
    assert data.requests_skipped == 1 and len(data.added) == 11 and len(data.wall_ms) == 25
    assert list(data.prompt) == [r["prompt_tokens"] for r in requests[1:]]
    bad = {**requests[0], "intake_window_s": -1}
    with pytest.raises(SimError, match=r"s2.jsonl:22: intake_window_s=-1"):
        read_step_log(write_log(tmp_path / "s2.jsonl", [header(), *steps[:20], bad]))
    with pytest.raises(SimError, match="prompt_tokens=None"):
        read_step_log(write_log(tmp_path / "s3.jsonl", [header(), *steps[:20], {"kind": "request"}]))


def test_a_log_without_request_lines_fits_no_delay_and_the_model_has_none(tmp_path: Path) -> None:
    from carbonforge_runtime.offline.sim.calibrate import fit_log_admission, format_admission, provenance

    model = shipped_models()["a100-80-tp1"]
    data = read_step_log(write_log(tmp_path / "old.jsonl", [header(), *synthetic_steps(model, 200, noise=0.0)]))
    assert fit_log_admission(data) is None and "not fitted" in format_admission(None)
    fit = fit_steps(data.batched, data.kv_read, data.attention, data.wall_ms)
    text = model_text(fit, ModelInfo("m", 1, "a100", 1, 40_000), provenance(data, fit, {}, "old.jsonl"), None)
    assert "admission" not in text
    assert not check_model_text(text, tmp_path / "m.yaml").has_admission_delay


def test_a_fitted_admission_delay_is_written_into_the_model_file(tmp_path: Path) -> None:
    from carbonforge_runtime.offline.sim.calibrate import fit_log_admission, format_admission, provenance

    model = shipped_models()["a100-80-tp1"]
    lines = [header(), *synthetic_steps(model, 200, noise=0.0), *synthetic_requests(2.5, 0.001, 300)]
    data = read_step_log(write_log(tmp_path / "new.jsonl", lines))
    admission = fit_log_admission(data)
    assert admission is not None
    fit = fit_steps(data.batched, data.kv_read, data.attention, data.wall_ms)
    text = model_text(fit, ModelInfo("m", 1, "a100", 1, 40_000), provenance(data, fit, {}, "new.jsonl", admission),
                      admission)
    loaded = check_model_text(text, tmp_path / "m.yaml")
    assert loaded.admission_base_ms == pytest.approx(2.5, rel=1e-3)
    assert loaded.admission_per_prompt_token_ms == pytest.approx(0.001, rel=1e-3)
    assert "Admission delay" in loaded.provenance and "300 requests" in loaded.provenance
    assert "admission delay" in format_admission(admission)
    # the rest of the model is what it was without the section
    assert loaded.without_admission_delay() == check_model_text(
        model_text(fit, ModelInfo("m", 1, "a100", 1, 40_000), provenance(data, fit, {}, "new.jsonl", admission)),
        tmp_path / "m.yaml")
