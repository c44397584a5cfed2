"""calibrate's phases against a stand-in engine (no vLLM started): the whole run, and every way a phase
stops it, naming the phase, what was done and written, with the engine stopped on every path."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from carbonforge_runtime.core.figure_labels import MEASURED, benchmark_labels
from carbonforge_runtime.core.step_models import load_model_file, shipped_models
from carbonforge_runtime.core.twin_data import SimError, StepCostModel, step_time_s
from carbonforge_runtime.offline.calibrate import design, run
from carbonforge_runtime.offline.calibrate.design import CalibrationStopped
from carbonforge_runtime.offline.calibrate.run import Host, Options, Prediction, calibrate
from carbonforge_runtime.offline.calibrate.served import EngineTrouble, ServedEngine
from carbonforge_runtime.offline.replay.aggregate import RequestOutcome
from carbonforge_runtime.offline.replay.plan import PlannedRequest
from carbonforge_runtime.offline.trace_reader import numbered_records
from carbonforge_runtime.recipes import load_recipes, recipe_dirs, resolve
from carbonforge_runtime.recipes.model import Recipe
from carbonforge_runtime.runtime.process.supervisor import EngineProcess

KEY = "cf-tiny:bf16:chat:cpu"
TRUTH = shipped_models()["l4-tp1"]


def tiny_recipe() -> Recipe:
    return resolve(KEY, load_recipes(recipe_dirs(None)))


class Clock:
    """A clock the stand-in engine moves forward as its work would take."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


#: The stand-in host's admission delay: base ms, ms per prompt token.
DELAY_MS = (4.0, 0.001)


class FakeEngine:
    """Logs steps timed by a step-time model for what it is sent, and trace records for every request."""

    def __init__(self, directory: Path, clock: Clock, model: StepCostModel = TRUTH, ready: bool = True,
                 start_error: bool = False, jitter: float = 0.0, log_steps: bool = True,
                 failing: Callable[[PlannedRequest], str | None] | None = None, start_s: float = 20.0) -> None:
        self.step_log = directory / "steps.jsonl"
        self.trace = directory / "requests.jsonl"
        self.log_dir = directory / "logs"
        self.clock = clock
        self.model = model
        self.ready = ready
        self.start_error = start_error
        self.jitter = jitter
        self.log_steps = log_steps
        self.failing = failing
        self.start_s = start_s
        self.stops = 0
        self.started = False
        self.sent: dict[str, PlannedRequest] = {}
        self.steps = 0
        self.wave = 0

    def start(self) -> None:
        if self.start_error:
            raise EngineTrouble("the runtime could not be started (no such file)")
        self.started = True
        header = {"kind": "engine", "engine": 0, "t": 1.0, "vllm": "0.32.0", "model": "tiny", "tensor_parallel_size": 1,
                  "async_scheduling": False, "max_num_seqs": 4, "max_num_batched_tokens": 256,
                  "kv_cache_tokens": 8192}
        self.step_log.write_text(json.dumps(header) + "\n")

    def wait_ready(self, deadline: float, progress: Callable[[str], None] | None = None) -> float:
        if not self.ready:
            self.clock.now = deadline
            raise EngineTrouble("the engine was not ready after 22 s (the phase's share of the budget)")
        self.clock.now += self.start_s
        return self.start_s

    def stop(self, grace_s: float) -> str:
        self.stops += 1
        return "stopped" if self.started else "never started"

    def send(self, plan: Sequence[PlannedRequest], deadline_s: float) -> list[RequestOutcome]:
        self.wave += 1
        outcomes = []
        lines = []
        for item in plan:
            outcome = RequestOutcome(item.index, item.send_at_s, sent_s=item.send_at_s)
            problem = self.failing(item) if self.failing else None
            if problem:
                outcome.error = problem
            else:
                outcome.done_s = item.send_at_s + 1.0
                outcome.request_id = f"cmpl-{self.wave}-{item.index}"
                self.sent[outcome.request_id] = item
            outcomes.append(outcome)
            # The request taken in by a waiting engine, the host's admission delay after its arrival.
            arrival = 2.0 + self.steps
            lines.append({"kind": "request", "engine": 0, "t_arrival": arrival, "intake_window_s": 0.0,
                          "t_added": arrival + (DELAY_MS[0] + DELAY_MS[1] * item.prompt_tokens) / 1000,
                          "prompt_tokens": item.prompt_tokens})
            # One prompt step and a few decode steps per request, timed by the model (with jitter).
            for batched, kv_read, attention in ((item.prompt_tokens, 0, item.prompt_tokens ** 2 / 2),
                                                *((len(plan), len(plan) * (item.prompt_tokens + k), 0.0)
                                                  for k in range(3))):
                self.steps += 1
                wall = step_time_s(self.model, batched, kv_read, attention)
                if self.jitter:  # step times unrelated to the batch: nothing to fit
                    wall = 0.001 + self.jitter * ((self.steps * 7919) % 100) / 100.0
                lines.append({"kind": "step", "engine": 0, "step": self.steps, "t": 2.0 + self.steps, "wall_s": wall,
                              "batched_tokens": batched, "prefill_tokens": batched, "decode_tokens": 0,
                              "seqs": 1, "kv_read_tokens": kv_read, "attention_units": attention,
                              "context_tokens": kv_read})
        if self.log_steps:
            with self.step_log.open("a") as handle:
                handle.write("".join(json.dumps(line) + "\n" for line in lines))
        self.clock.now += min(deadline_s, 0.5)
        return outcomes

    def step_count(self) -> int:
        return sum(1 for line in self.step_log.read_text().splitlines() if '"kind": "step"' in line)

    def records(self, request_ids: set[str], deadline: float) -> list[dict[str, Any]]:
        out = []
        for rid in sorted(request_ids):
            item = self.sent[rid]
            out.append({"request_id": rid, "t_arrival": item.send_at_s, "t_completion": item.send_at_s + 0.5,
                        "e2e_latency_s": 0.5, "ttft_s": 0.05, "finish_reason": "length"})
        return out


def fake_predictor(calls: list[dict[str, Any]]) -> run.Predictor:
    def predict(*, trace: Path, limit: int, load: float, cost_model: Path, kv_tokens: int,
                async_scheduling: bool | None, output: Path) -> Prediction:
        calls.append({"trace": trace, "limit": limit, "load": load, "cost_model": cost_model, "kv_tokens": kv_tokens,
                      "async_scheduling": async_scheduling})
        load_model_file(cost_model)  # the fitted file, as sim --cost-model reads it
        output.write_text("{}")
        rows = [r for _, r in numbered_records(trace)][:limit]
        first = rows[0]["t_arrival"]
        records = [{"t_arrival": (r["t_arrival"] - first) / 2.0, "t_completion": (r["t_arrival"] - first) / 2.0 + 0.55,
                    "e2e_latency_s": 0.55, "ttft_s": 0.05, "finish_reason": "length"} for r in rows]
        return Prediction(records, 2.0, 2.9, "(the twin's table)")

    return predict


def calibrate_with(tmp_path: Path, engine: FakeEngine, clock: Clock, budget_s: float = 900.0,
                   predict: run.Predictor | None = None) -> tuple[run.Outcome, list[str]]:
    lines: list[str] = []
    options = Options(KEY, tmp_path, budget_s)
    outcome = calibrate(options, tiny_recipe(), engine, predict or fake_predictor([]), Host(), "0.32.0",
                        lines.append, clock=clock, today=lambda: "2026-12-06")
    return outcome, lines


def test_a_whole_run_writes_the_model_and_a_measured_recipe(tmp_path: Path) -> None:
    clock = Clock()
    engine = FakeEngine(tmp_path, clock)
    calls: list[dict[str, Any]] = []
    outcome, lines = calibrate_with(tmp_path, engine, clock, predict=fake_predictor(calls))
    text = "\n".join(lines)
    # Progress lines name the phase and the time left.
    assert "calibrate [engine start, 15m00s left]" in text and "[calibration load," in text
    assert "R2" in text and "predicted (before it is served):\n(the twin's table)" in text
    assert text.index("(the twin's table)") < text.index("predicted against served")
    for name in ("mean e2e", "p99 e2e", "mean TTFT", "throughput"):
        assert name in text.split("predicted against served")[1]
    # The fitted model recovers the engine's own step times, and the twin was handed it.
    model = load_model_file(outcome.model)
    for batched, kv_read, attention in ((256, 0, 256 ** 2 / 2), (4, 4000, 0.0), (1024, 0, 1024 ** 2 / 2)):
        assert step_time_s(model, batched, kv_read, attention) == pytest.approx(
            step_time_s(TRUTH, batched, kv_read, attention), rel=0.03)
    assert model.kv_capacity_tokens == 8192 and model.gpu == "cpu" and not model.proxy
    assert outcome.r2 > 0.99
    # The file says which command fitted it, in its header and its provenance.
    model_file = outcome.model.read_text()
    assert model_file.startswith("# Step-time model fitted by carbonforge-runtime calibrate ")
    assert "Fitted by carbonforge-runtime calibrate to the step log" in model_file
    assert "sim-calibrate" not in model_file
    # The host's admission delay, fitted to the log's request lines, is in the model the twin was handed.
    assert model.admission_base_ms == pytest.approx(DELAY_MS[0], rel=1e-3)
    assert model.admission_per_prompt_token_ms == pytest.approx(DELAY_MS[1], rel=1e-3)
    assert "admission delay" in text and "known exactly" in text
    assert calls and calls[0]["cost_model"] == outcome.model and calls[0]["kv_tokens"] == 8192
    assert calls[0]["async_scheduling"] is False and calls[0]["load"] == design.CHECK_LOAD
    # The local recipe loads from its directory, labelled measured on the CPU engine.
    recipe = resolve(KEY, load_recipes(recipe_dirs(str(outcome.recipe.parent))))
    assert recipe.source == outcome.recipe
    labels = benchmark_labels(recipe.benchmark)
    assert [label.kind for _, label in labels] == [MEASURED]
    assert recipe.benchmark["measured_on"] == {"gpu": "cpu", "gpu_count": 0, "driver": design.CPU_DRIVER,
                                               "vllm": "0.32.0"}
    assert recipe.benchmark["date"] == "2026-12-06"
    table = recipe.benchmark["figures"]["predicted_against_served"]
    assert table["mean_e2e_s"] == {"predicted": 0.55, "served": 0.5, "relative_error": pytest.approx(0.1)}
    summary = json.loads(outcome.summary.read_text())
    assert summary["context_key"] == KEY and summary["benchmark"]["figures"]["check_load"]["requests"] > 0
    assert engine.stops >= 1


def stopped(tmp_path: Path, engine: FakeEngine, clock: Clock, **kwargs: Any) -> CalibrationStopped:
    with pytest.raises(CalibrationStopped) as caught:
        calibrate_with(tmp_path, engine, clock, **kwargs)
    assert engine.stops >= 1  # the engine is stopped on every path out
    return caught.value


def test_an_engine_that_never_becomes_ready_stops_the_start_phase(tmp_path: Path) -> None:
    clock = Clock()
    engine = FakeEngine(tmp_path, clock, ready=False)
    stop = stopped(tmp_path, engine, clock, budget_s=60.0)
    text = stop.render()
    assert stop.phase == design.START and stop.exit_code == 1
    assert "not ready" in text and "done: nothing" in text and "written: nothing" in text
    assert "doctor --context-key" in text and "--budget" in text
    assert not (tmp_path / "step-model.yaml").exists()


def test_an_engine_that_cannot_be_started_stops_the_start_phase(tmp_path: Path) -> None:
    clock = Clock()
    stop = stopped(tmp_path, FakeEngine(tmp_path, clock, start_error=True), clock)
    assert stop.phase == design.START and "could not be started" in stop.message


def test_failing_requests_stop_the_calibration_load(tmp_path: Path) -> None:
    clock = Clock()
    engine = FakeEngine(tmp_path, clock, failing=lambda item: "http 500: boom" if item.index > 5 else None)
    stop = stopped(tmp_path, engine, clock)
    assert stop.phase == design.CALIBRATION and "http 500: boom" in stop.message
    assert "engine start: ready after 20 s" in stop.message


def test_a_log_without_steps_makes_the_fit_impossible(tmp_path: Path) -> None:
    clock = Clock()
    stop = stopped(tmp_path, FakeEngine(tmp_path, clock, log_steps=False), clock)
    assert stop.phase == design.FIT and "no fit is possible" in stop.message and "--budget" in stop.remedy


def test_a_poor_fit_stops_after_writing_the_model_for_a_look(tmp_path: Path) -> None:
    clock = Clock()
    stop = stopped(tmp_path, FakeEngine(tmp_path, clock, jitter=0.05), clock)
    assert stop.phase == design.FIT and "the fit is poor" in stop.message
    assert f"written: {tmp_path / 'step-model.yaml'}" in stop.message
    assert not (tmp_path / "recipes").exists()


def test_an_engine_start_that_takes_the_whole_budget_leaves_none_for_the_loads(tmp_path: Path) -> None:
    clock = Clock()
    stop = stopped(tmp_path, FakeEngine(tmp_path, clock, start_s=80.0), clock, budget_s=90.0)
    assert stop.phase == design.CALIBRATION and "the budget is exhausted" in stop.message
    assert "engine start: ready after 80 s" in stop.message


def test_a_prediction_the_twin_refuses_stops_that_phase(tmp_path: Path) -> None:
    clock = Clock()

    def refuse(**_: Any) -> Prediction:
        raise SimError("every request is longer than max-model-len", "raise --max-model-len")

    stop = stopped(tmp_path, FakeEngine(tmp_path, clock), clock, predict=refuse)
    assert stop.phase == design.PREDICTION and "max-model-len" in stop.message
    assert str(tmp_path / "step-model.yaml") in stop.message  # the model was written before


def test_check_requests_cut_by_the_budget_stop_the_check_load(tmp_path: Path) -> None:
    clock = Clock()
    engine = FakeEngine(tmp_path, clock)
    engine.failing = lambda item: ("deadline: cancelled in flight at the overall deadline"
                                   if item.send_at_s > 0 and item.index == 3 else None)  # a check request
    stop = stopped(tmp_path, engine, clock)
    assert stop.phase == design.CHECK and "did not complete" in stop.message and "--budget" in stop.remedy


# --- the served engine's own process (a sleeper stands in for the runtime) -------------------------------


def sleeper(tmp_path: Path, code: str) -> ServedEngine:
    return ServedEngine(KEY, tmp_path, dict(os.environ), EngineProcess, argv_prefix=[sys.executable, "-c", code])


def test_a_runtime_that_never_says_ready_is_given_up_at_the_deadline_and_killed(tmp_path: Path) -> None:
    engine = sleeper(tmp_path, "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")
    engine.start()
    started = time.monotonic()
    with pytest.raises(EngineTrouble, match="not ready after"):
        engine.wait_ready(time.monotonic() + 1.0)
    assert time.monotonic() - started < 3.0
    assert engine.running()
    assert engine.stop(1.0).startswith("killed")  # it ignores SIGTERM: its process group is killed
    assert not engine.running()
    assert engine.stop(1.0).startswith("had exited")


def test_a_runtime_that_exits_during_the_start_is_reported_with_its_last_lines(tmp_path: Path) -> None:
    engine = sleeper(tmp_path, "print('error: no such recipe'); raise SystemExit(2)")
    engine.start()
    with pytest.raises(EngineTrouble, match="status 2") as caught:
        engine.wait_ready(time.monotonic() + 10.0)
    assert "no such recipe" in str(caught.value)
    assert engine.stop(1.0) == "had exited (status 2)"


def test_a_runtime_that_says_ready_is_ready_and_stops_on_sigterm(tmp_path: Path) -> None:
    engine = sleeper(tmp_path, "import time; print('ready: OpenAI API on x', flush=True); time.sleep(60)")
    assert engine.stop(1.0) == "never started"
    engine.start()
    assert engine.wait_ready(time.monotonic() + 10.0) < 10.0
    assert engine.argv[-8:] == ["serve", "--context-key", KEY, "--step-log", str(engine.step_log),
                                "--request-trace", "standard", "--trace-file", str(engine.trace)][-8:]
    assert engine.env["CF_HOST"] == "127.0.0.1" and engine.env["CF_PORT"] == str(engine.port)
    assert engine.stop(5.0) == "stopped"


def test_the_request_trace_is_read_until_the_loads_records_are_there(tmp_path: Path) -> None:
    engine = sleeper(tmp_path, "pass")
    engine.trace.write_text(json.dumps({"request_id": "a", "e2e_latency_s": 1.0}) + "\n{\"request_id\": \"b\"")
    found = engine.records({"a", "b"}, time.monotonic() + 0.5)  # b's line is still being written
    assert [r["request_id"] for r in found] == ["a"]
    assert engine.step_count() == 0
    engine.step_log.write_text('{"kind": "engine"}\n{"kind": "step"}\n{"kind": "step"}\n')
    assert engine.step_count() == 2


def test_the_check_inputs_refuse_before_anything_starts(tmp_path: Path) -> None:
    from carbonforge_runtime.errors import UsageError

    recipe, seconds = run.check_inputs(KEY, tmp_path / "out", "2m", os.environ)
    assert recipe.key_text == KEY and seconds == 120.0 and (tmp_path / "out").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is not a directory"):
        run.check_inputs(KEY, tmp_path / "file", "2m", os.environ)
    with pytest.raises(UsageError, match="too small"):
        run.check_inputs(KEY, tmp_path / "out", "10s", os.environ)
    (tmp_path / "out" / "recipes").mkdir()
    (tmp_path / "out" / "recipes" / "broken.yaml").write_text(yaml.safe_dump({"key": "nope"}))
    with pytest.raises(UsageError, match="does not load"):
        run.check_inputs(KEY, tmp_path / "out", "2m", os.environ)
