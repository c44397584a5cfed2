"""The phases of ``calibrate`` in order, each within its part of the budget
(:func:`~carbonforge_runtime.offline.calibrate.design.allowance`).

:func:`check_inputs` refuses bad input before anything starts (exit 2). :func:`calibrate` then runs
the engine start, the calibration load, the fit, the twin's prediction of the check load, the check
load served, and the writing of the model and the local recipe. A phase that fails raises
:class:`~carbonforge_runtime.offline.calibrate.design.CalibrationStopped` naming it, what was done
and what was written; the engine is stopped on every path out.

The twin's prediction is handed in (:class:`Predictor`): the twin runs vLLM's scheduler, which only
the command line's ``sim`` machinery may import. The engine is handed in too (a factory of
:class:`~carbonforge_runtime.offline.calibrate.served.ServedEngine`), so tests can run the phases
against a stand-in.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from carbonforge_runtime.core.twin_data import SimError
from carbonforge_runtime.errors import CarbonForgeError, UsageError
from carbonforge_runtime.files import probe_writable
from carbonforge_runtime.offline.calibrate import design
from carbonforge_runtime.offline.calibrate.design import (
    CALIBRATION,
    CHECK,
    FIT,
    PREDICTION,
    START,
    WRITE,
    CalibrationStopped,
    EngineLimits,
    LoadRequest,
)
from carbonforge_runtime.offline.calibrate.served import EngineTrouble
from carbonforge_runtime.offline.replay.aggregate import RequestOutcome
from carbonforge_runtime.offline.replay.plan import PlannedRequest
from carbonforge_runtime.recipes.model import Recipe

#: A fit below this R2 is too poor to write a recipe on.
MIN_R2 = 0.8
#: The runtime's own drain and stop, after SIGTERM, before its process group is killed.
STOP_GRACE_S = 12.0
#: The longest one wave of the calibration load may take.
MAX_WAVE_S = 120.0


class Engine(Protocol):
    """What the phases need of the served engine (:class:`~.served.ServedEngine`)."""

    step_log: Path
    trace: Path
    log_dir: Path

    def start(self) -> None: ...
    def wait_ready(self, deadline: float, progress: Callable[[str], None] | None = None) -> float: ...
    def stop(self, grace_s: float) -> str: ...
    def send(self, plan: Sequence[PlannedRequest], deadline_s: float) -> list[RequestOutcome]: ...
    def step_count(self) -> int: ...
    def records(self, request_ids: set[str], deadline: float) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class Prediction:
    """The twin's prediction of the check load: its per-request records, the arrival rate it set
    (times the trace's recorded pace) and the capacity it measured."""

    records: list[dict[str, Any]]
    effective_rate: float
    capacity_rps: float | None
    table: str


class Predictor(Protocol):
    def __call__(self, *, trace: Path, limit: int, load: float, cost_model: Path, kv_tokens: int,
                 async_scheduling: bool | None, output: Path) -> Prediction: ...


@dataclass(frozen=True)
class Host:
    """The host as the GPU module sees it: the GPUs' names and the driver (empty: no GPU)."""

    gpu_names: tuple[str, ...] = ()
    driver: str | None = None


@dataclass
class Options:
    context_key: str
    output_dir: Path
    budget_s: float


@dataclass
class Outcome:
    model: Path
    recipe: Path
    summary: Path
    rows: list[design.Row] = field(default_factory=list)
    r2: float = float("nan")


def check_inputs(context_key: str, output_dir: Path, budget: str, environ: Mapping[str, str]) -> tuple[Recipe, float]:
    """The recipe and the budget in seconds; raises a usage error (exit 2) naming the fix for an
    unknown key, a bad budget or an output directory that cannot be written."""
    from carbonforge_runtime.offline.sim.recipe_out import check_destination
    from carbonforge_runtime.recipes import resolve
    from carbonforge_runtime.recipes.loader import load_recipes, recipe_dirs
    from carbonforge_runtime.settings import load_settings

    seconds = design.parse_budget(budget)
    recipe = resolve(context_key, load_recipes(recipe_dirs(load_settings(environ).recipes_dir)))
    if recipe.hosts is not None:
        raise UsageError(f"{recipe.key_text} is served by a group of hosts; calibrate serves one host",
                         "calibrate a recipe served by one host")
    fix = "pass --output-dir with a directory you can write (it is created if missing)"
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output-dir {output_dir} is not a directory", fix)
    try:
        probe_writable(output_dir)
    except OSError as exc:
        raise UsageError(f"--output-dir {output_dir} cannot be written ({exc.strerror or exc})", fix) from None
    try:
        check_destination(output_dir / "recipes", recipe.key_text, force=True)
    except SimError as exc:
        raise UsageError(exc.message, fix) from None
    return recipe, seconds


class _Run:
    """One calibration's clock, progress and record of what was done and written."""

    def __init__(self, budget_s: float, progress: Callable[[str], None], clock: Callable[[], float]) -> None:
        self.clock = clock
        self.end = clock() + budget_s
        self.progress = progress
        self.done: list[str] = []
        self.written: list[str] = []
        self.phase = START

    def left(self) -> float:
        return self.end - self.clock()

    def say(self, text: str) -> None:
        self.progress(f"calibrate [{self.phase}, {design.format_duration(self.left())} left] {text}")

    def enter(self, phase: str) -> float:
        """Start ``phase``; its deadline (a clock value). Stops when nothing is left for it."""
        self.phase = phase
        share = design.allowance(phase, self.left())
        if share <= 1.0:
            raise self.stop("the budget is exhausted", "pass a larger --budget")
        return self.clock() + share

    def stop(self, problem: str, remedy: str) -> CalibrationStopped:
        return CalibrationStopped(self.phase, problem, self.done, self.written, remedy)


def _plan(wave: Sequence[LoadRequest], first_index: int) -> list[PlannedRequest]:
    return [PlannedRequest(first_index + i, 0.0, r.prompt_tokens, r.output_tokens) for i, r in enumerate(wave)]


def _failures(outcomes: Sequence[RequestOutcome]) -> list[str]:
    """Errors other than the deadline's (a request cut by the budget is no fault of the engine)."""
    return [o.error for o in outcomes if o.error is not None and not o.error.startswith("deadline")]


def _engine_facts(step_log: Path) -> dict[str, Any]:
    from carbonforge_runtime.offline.sim.calibrate import engine_facts
    from carbonforge_runtime.offline.trace_reader import loads_line

    headers = []
    try:
        with step_log.open("rb") as handle:
            for line in handle:
                if b'"engine"' not in line:
                    continue
                try:
                    record = loads_line(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("kind") == "engine":
                    headers.append(record)
    except OSError:
        pass
    return engine_facts(headers)


def _settled_steps(engine: Engine, clock: Callable[[], float], wait_s: float = 3.0) -> int:
    """The step count once the step log's writer has caught up (two equal reads), at most ``wait_s``."""
    until = clock() + wait_s
    count = engine.step_count()
    while clock() < until:
        time.sleep(0.3)
        again = engine.step_count()
        if again == count:
            return count
        count = again
    return count


def _calibration_load(run: _Run, engine: Engine, limits: EngineLimits) -> tuple[int, int]:
    """The warm-up, then waves until the phase's share is spent; (steps to skip, waves sent)."""
    deadline = run.enter(CALIBRATION)
    index = 0
    warm = _plan(design.warmup_wave(limits), index)
    index += len(warm)
    errors = _failures(engine.send(warm, min(MAX_WAVE_S, deadline - run.clock())))
    if errors:
        raise run.stop(f"the warm-up requests failed ({errors[0]})", "check the runtime's log in "
                       f"{engine.log_dir} (the engine may have run out of memory or refused the request sizes)")
    skip = _settled_steps(engine, run.clock)
    waves = design.calibration_waves(limits)
    sent = 0
    last_said = run.clock()
    for wave in waves:
        remaining = deadline - run.clock()
        if remaining <= 1.0:
            break
        plan = _plan(wave, index)
        index += len(plan)
        errors = _failures(engine.send(plan, min(MAX_WAVE_S, remaining)))
        if errors:
            raise run.stop(f"{len(errors)} request(s) of wave {sent + 1} failed ({errors[0]})",
                           f"check the runtime's log in {engine.log_dir}")
        sent += 1
        if run.clock() - last_said >= 10.0:
            last_said = run.clock()
            run.say(f"{sent}/{len(waves)} waves sent")
    steps = _settled_steps(engine, run.clock) - skip
    run.done.append(f"calibration load: {sent} of {len(waves)} waves ({steps} steps logged after the warm-up)")
    run.say(f"{sent}/{len(waves)} waves sent, {steps} steps logged")
    return skip, sent


def _fit(run: _Run, engine: Engine, skip: int, options: Options, gpu: str, tp: int,
         kv_tokens: int) -> tuple[Path, Any]:
    from carbonforge_runtime.files import write_text_atomic
    from carbonforge_runtime.offline.sim.calibrate import (
        ModelInfo,
        engine_facts,
        fit_model,
        format_admission,
        format_fit,
        read_step_log,
    )

    run.enter(FIT)
    try:
        data = read_step_log(engine.step_log, skip_first=skip)
    except CarbonForgeError as exc:
        raise run.stop(f"no fit is possible: {exc.message}", "pass a larger --budget so that the calibration load "
                       "logs more steps") from None
    model_path = options.output_dir / "step-model.yaml"
    name = f"{options.context_key.split(':', 1)[0]}-{gpu}-tp{tp}-calibrated"
    fitted = fit_model(data, ModelInfo(name[:200], 1, gpu, tp, kv_tokens), engine_facts(data.headers),
                       str(engine.step_log), model_path, writer="calibrate")
    fit = fitted.fit
    write_text_atomic(model_path, fitted.text)
    run.written.append(str(model_path))
    run.progress(format_fit(fit))
    run.progress(format_admission(fitted.admission))
    if not (math.isfinite(fit.r2) and fit.r2 >= MIN_R2):
        raise run.stop(f"the fit is poor (R2 {fit.r2:.3f}, below {MIN_R2}): the step times vary for reasons the "
                       "model does not see (other work on the host, a load too short)",
                       "run calibrate on an otherwise idle host, with a larger --budget")
    run.done.append(f"fit: {fit.steps} steps, R2 {fit.r2:.4f}")
    return model_path, fit


def _estimate_capacity(fit: Any, limits: EngineLimits, records: Sequence[Mapping[str, Any]]) -> float:
    """Requests a second the fitted model can serve, roughly: full decode batches and each prompt
    prefilled alone (sizes the check load only; the twin measures the capacity it predicts at)."""
    prompt = sum(r["prompt_tokens"] for r in records) / len(records)
    output = sum(r["output_tokens"] for r in records) / len(records)
    batch = limits.max_num_seqs
    coefficients = fit.coefficients()
    decode_ms = (max(coefficients["floor"], coefficients["per_batched_token"] * batch)
                 + coefficients["per_kv_token_read"] * batch * (prompt + output / 2) + coefficients["overhead"])
    chunks = max(1, math.ceil(prompt / limits.max_num_batched_tokens))
    prefill_ms = (max(coefficients["floor"], coefficients["per_batched_token"] * prompt)
                  + coefficients["attention"] * prompt * prompt / 2 + coefficients["overhead"] * chunks)
    per_request_ms = output * decode_ms / batch + prefill_ms
    return 1000.0 / per_request_ms if per_request_ms > 0 else float("nan")


def calibrate(options: Options, recipe: Recipe, engine: Engine, predict: Predictor, host: Host,
              vllm_version: str, progress: Callable[[str], None],
              clock: Callable[[], float] = time.monotonic, today: Callable[[], str] | None = None) -> Outcome:
    """Every phase in order (see the module's description); the engine is stopped on every path."""
    run = _Run(options.budget_s, progress, clock)
    on_cpu = recipe.key.hardware.is_cpu
    try:
        deadline = run.enter(START)
        run.say(f"serving {recipe.key_text} with its step log (logs in {engine.log_dir})")
        try:
            engine.start()
            took = engine.wait_ready(deadline, run.say)
        except EngineTrouble as exc:
            raise run.stop(str(exc), f"run `carbonforge-runtime doctor --context-key {recipe.key_text}`, read "
                           f"{engine.log_dir}, or pass a larger --budget if the start was only slow") from None
        run.done.append(f"engine start: ready after {took:.0f} s")
        facts = _engine_facts(engine.step_log)
        limits = design.limits_of(recipe.vllm, facts)
        run.say(f"ready after {took:.0f} s; limits: max model len {limits.max_model_len}, "
                f"{limits.max_num_batched_tokens} batched tokens, {limits.max_num_seqs} sequences, "
                f"KV cache {limits.kv_tokens} tokens")
        try:
            skip, _ = _calibration_load(run, engine, limits)
        except EngineTrouble as exc:
            raise run.stop(str(exc), "pass a larger --budget") from None
        gpu = design.CPU_HOST_NAME if on_cpu or not host.gpu_names else _family(host.gpu_names[0])
        tp = int(recipe.vllm.get("tensor_parallel_size", 1) or 1)
        model_path, fit = _fit(run, engine, skip, options, gpu, tp, limits.kv_tokens)

        # The prediction: before the check load is sent.
        check_deadline_share = design.allowance(CHECK, run.left() - design.allowance(PREDICTION, run.left()))
        run.enter(PREDICTION)
        unit = design.check_records(400, limits)
        capacity_estimate = _estimate_capacity(fit, limits, unit)
        size = design.check_size(check_deadline_share, capacity_estimate)
        trace_path = options.output_dir / "check-load.jsonl"
        from carbonforge_runtime.offline.replay.trace import write_jsonl

        write_jsonl(trace_path, unit[:size])
        run.written.append(str(trace_path))
        run.say(f"predicting the check load ({size} requests at {design.CHECK_LOAD:.0%} of the twin's capacity) "
                f"with {model_path}")
        try:
            prediction = predict(trace=trace_path, limit=size, load=design.CHECK_LOAD, cost_model=model_path,
                                 kv_tokens=limits.kv_tokens, async_scheduling=facts.get("async_scheduling"),
                                 output=options.output_dir / "check-prediction.json")
        except CarbonForgeError as exc:
            raise run.stop(f"the twin could not predict the check load: {exc.message}", exc.remedy) from None
        run.written.append(str(options.output_dir / "check-prediction.json"))
        run.progress("predicted (before it is served):\n" + prediction.table)
        predicted = design.figures_of(prediction.records)
        run.done.append(f"prediction: {size} requests at {prediction.effective_rate:.3g} req/s")

        deadline = run.enter(CHECK)
        from carbonforge_runtime.offline.replay.plan import PlanOptions, build_plan
        from carbonforge_runtime.offline.replay.trace import load_recording

        plan = build_plan(load_recording(trace_path), PlanOptions(rate=prediction.effective_rate, limit=size))
        run.say(f"serving the check load: {len(plan)} requests over {plan[-1].send_at_s:.0f} s")
        try:
            outcomes = engine.send(plan, deadline - run.clock())
        except EngineTrouble as exc:
            raise run.stop(str(exc), "pass a larger --budget") from None
        errors = [o.error for o in outcomes if o.error is not None]
        if errors:
            budget = all(e.startswith("deadline") for e in errors)
            raise run.stop(f"{len(errors)} of {len(outcomes)} check requests did not complete ({errors[0]})",
                           "pass a larger --budget" if budget else f"check the runtime's log in {engine.log_dir}")
        ids = {o.request_id for o in outcomes if o.request_id}
        records = engine.records(ids, min(deadline, run.clock() + 30.0))
        if len(records) < len(ids):
            raise run.stop(f"the request trace holds {len(records)} of the {len(ids)} check requests",
                           f"check the runtime's log in {engine.log_dir}")
        served = design.figures_of(records)
        run.done.append(f"check load: {len(records)} requests served")
        rows = design.compare(predicted, served)
        run.progress("predicted against served (the check load):\n" + design.format_comparison(rows))
        run.say(f"engine {engine.stop(STOP_GRACE_S)}")

        run.enter(WRITE)
        date = today() if today is not None else datetime.now(UTC).strftime("%Y-%m-%d")
        host_info = design.host_block(host.gpu_names, host.driver, str(facts.get("vllm") or vllm_version), on_cpu)
        fit_info = {"name": f"{options.context_key.split(':', 1)[0]}-{gpu}-tp{tp}-calibrated",
                    "steps": fit.steps, "r2": round(fit.r2, 6),
                    "mean_relative_error": round(fit.mean_rel_error, 6),
                    "p90_relative_error": round(fit.p90_rel_error, 6)}
        span = plan[-1].send_at_s - plan[0].send_at_s
        load_info = {"requests": len(records), "offered_rps": round((len(plan) - 1) / span, 6) if span > 0 else None,
                     "load_of_predicted_capacity": design.CHECK_LOAD,
                     "predicted_capacity_rps": None if prediction.capacity_rps is None
                     else round(prediction.capacity_rps, 6)}
        benchmark = design.benchmark_block(host_info, date, rows, str(model_path.resolve()), fit_info, load_info)
        recipe_path = _write_recipe(run, options, recipe, benchmark)
        summary = options.output_dir / "calibration.json"
        from carbonforge_runtime.files import write_text_atomic

        write_text_atomic(summary, json.dumps({"context_key": recipe.key_text, "limits": limits.__dict__,
                                               "benchmark": benchmark, "recipe": str(recipe_path),
                                               "model": str(model_path)}, indent=1) + "\n")
        run.written.append(str(summary))
        return Outcome(model_path, recipe_path, summary, rows, fit.r2)
    finally:
        ended = engine.stop(STOP_GRACE_S)
        if ended not in ("stopped", "never started") and not ended.startswith("had exited"):
            progress(f"calibrate: engine {ended}")


def _family(name: str) -> str:
    from carbonforge_runtime.gpu.types import gpu_family

    return gpu_family(name) or name


def _write_recipe(run: _Run, options: Options, recipe: Recipe, benchmark: Mapping[str, Any]) -> Path:
    import yaml

    from carbonforge_runtime.offline.sim.recipe_out import place_recipe
    from carbonforge_runtime.recipes.model import recipe_from_mapping

    source = yaml.safe_load(recipe.source.read_text(encoding="utf-8"))
    text = design.recipe_text(source, benchmark)
    directory = options.output_dir / "recipes"
    target = directory / (recipe.key_text.replace(":", "--") + ".yaml")
    try:
        recipe_from_mapping(yaml.safe_load(text), target)
        directory.mkdir(parents=True, exist_ok=True)
        path = place_recipe(directory, recipe.key_text, text, force=True)
    except (CarbonForgeError, OSError) as exc:
        problem = exc.message if isinstance(exc, CarbonForgeError) else str(exc)
        raise run.stop(f"the local recipe could not be written: {problem}",
                       "pass --output-dir a directory of your own") from None
    run.written.append(str(path))
    run.done.append("write: the local recipe")
    return path

