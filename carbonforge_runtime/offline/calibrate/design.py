"""The decisions of ``calibrate``, as plain functions over plain data. Pure: no clock, no files.

* **Budget.** :func:`parse_budget` reads ``90s``, ``15m``, ``1h``, ``1h30m`` or plain seconds.
  :func:`allowance` gives a phase its part of the time left: the phases' weights
  (:data:`PHASE_WEIGHTS`) split what is left between the phase and those after it, so time a phase
  did not need flows to the later ones.
* **Calibration load** (:func:`calibration_waves`): bursts ("waves") of requests sent together,
  the next when the last one is done. Their sizes span the step-time model's terms: prompts from a
  few tokens to several chunks of ``max_num_batched_tokens`` and up to the context limit (prompt
  chunks of every size, attention over long contexts), and waves of 1, 2, 4 ... ``max_num_seqs``
  requests (decode batches of every size, reading short and long contexts). The first rounds
  already cover every batch size, so a run cut short by its budget still spans the terms.
* **Check load** (:func:`check_records`): a different traffic, to test the fitted model on what it
  was not fitted to: Poisson arrivals (written at 1 request a second, scaled later to a share of
  the capacity the twin predicts), a mix of short and long prompts, exponential output lengths.
* **The comparison** (:func:`figures_of`, :func:`compare`, :func:`format_comparison`): mean and
  p99 end-to-end latency, mean time to first token and throughput, predicted against served, with
  the relative error, from the twin's per-request records and the runtime's request trace (the same
  fields).
* **What is written**: :func:`host_block` (the ``measured_on`` block), :func:`benchmark_block` and
  :func:`recipe_text` (the local recipe: the served recipe with its benchmark block measured here).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from carbonforge_runtime.core.quantiles import quantile
from carbonforge_runtime.errors import CarbonForgeError, UsageError

# --- the budget --------------------------------------------------------------------------------------

#: The phases, in order.
START, CALIBRATION, FIT, PREDICTION, CHECK, WRITE = (
    "engine start", "calibration load", "fit", "prediction", "check load", "write")
PHASES = (START, CALIBRATION, FIT, PREDICTION, CHECK, WRITE)
#: How the time left is shared between a phase and the phases after it. The engine start gets the
#: largest part (a cold start compiles); what it leaves goes on to the loads.
PHASE_WEIGHTS = {START: 0.55, CALIBRATION: 0.16, FIT: 0.03, PREDICTION: 0.08, CHECK: 0.15, WRITE: 0.03}
#: Below this, no engine start and two loads fit: refused before anything starts.
MIN_BUDGET_S = 60.0
MAX_BUDGET_S = 24 * 3600.0
#: Kept back from every phase for stopping the engine (its drain and the kill after it).
STOP_RESERVE_S = 15.0

_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}
_BUDGET_PART = re.compile(r"(\d+(?:\.\d+)?)([smh])")
_BUDGET_FIX = f"pass --budget like 90s, 15m, 1h or 1h30m (at least {MIN_BUDGET_S:.0f}s)"


def parse_budget(text: str) -> float:
    """Seconds of ``90s``, ``15m``, ``1h``, ``1h30m`` or ``600``; raises :class:`UsageError`."""
    raw = text.strip().lower()
    if re.fullmatch(r"\d+(?:\.\d+)?", raw):
        seconds = float(raw)
    else:
        parts = _BUDGET_PART.findall(raw)
        if not parts or "".join(number + unit for number, unit in parts) != raw:
            raise UsageError(f"budget {text!r} is not a duration", _BUDGET_FIX)
        units = [unit for _, unit in parts]
        if len(set(units)) != len(units):
            raise UsageError(f"budget {text!r} names a unit twice", _BUDGET_FIX)
        seconds = sum(float(number) * _UNIT_S[unit] for number, unit in parts)
    if not math.isfinite(seconds) or seconds < MIN_BUDGET_S:
        raise UsageError(f"budget {text!r} is too small: an engine start and two loads need at least "
                         f"{MIN_BUDGET_S:.0f} s", _BUDGET_FIX)
    if seconds > MAX_BUDGET_S:
        raise UsageError(f"budget {text!r} is over {MAX_BUDGET_S / 3600:.0f} h", _BUDGET_FIX)
    return seconds


def allowance(phase: str, left_s: float) -> float:
    """The seconds ``phase`` may take when ``left_s`` of the budget is left (the stop reserve
    excepted): its weight's share of the weights of it and every later phase."""
    at = PHASES.index(phase)
    later = sum(PHASE_WEIGHTS[p] for p in PHASES[at:])
    usable = max(0.0, left_s - STOP_RESERVE_S)
    return usable * PHASE_WEIGHTS[phase] / later


def format_duration(seconds: float) -> str:
    """``1m05s`` or ``42s``."""
    whole = max(0, round(seconds))
    minutes, rest = divmod(whole, 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{rest}s"


class CalibrationStopped(CarbonForgeError):
    """A phase failed: the message names it, what was done and what was written; exit 1."""

    exit_code = 1

    def __init__(self, phase: str, problem: str, done: Sequence[str], written: Sequence[str], remedy: str) -> None:
        lines = [f"calibrate stopped in the {phase} phase: {problem}"]
        lines.append("  done: " + ("; ".join(done) if done else "nothing"))
        lines.append("  written: " + (", ".join(written) if written else "nothing"))
        super().__init__("\n".join(lines), remedy)
        self.phase = phase
        self.problem = problem


# --- the engine's limits ------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineLimits:
    """What bounds a load: the recipe's (and the running engine's) scheduler limits."""

    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_tokens: int

    def __post_init__(self) -> None:
        if min(self.max_model_len, self.max_num_batched_tokens, self.max_num_seqs, self.kv_tokens) < 1:
            raise ValueError(f"engine limits must be positive: {self}")


#: vLLM's defaults where neither the recipe nor the engine says.
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_MODEL_LEN = 4096


def limits_of(vllm_knobs: Mapping[str, Any], facts: Mapping[str, Any]) -> EngineLimits:
    """The limits of the running engine: its step log's ``engine`` line (``facts``) first, then the
    recipe's knobs, then vLLM's defaults; the KV cache from the engine line (else the largest
    request the context limit allows, times the sequences)."""

    def whole(*values: Any) -> int | None:
        for value in values:
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    max_model_len = whole(facts.get("max_model_len"), vllm_knobs.get("max_model_len")) or DEFAULT_MAX_MODEL_LEN
    batched = whole(facts.get("max_num_batched_tokens"), vllm_knobs.get("max_num_batched_tokens"))
    seqs = whole(facts.get("max_num_seqs"), vllm_knobs.get("max_num_seqs")) or DEFAULT_MAX_NUM_SEQS
    kv = whole(facts.get("kv_cache_tokens")) or max_model_len * seqs
    return EngineLimits(max_model_len, batched or DEFAULT_MAX_NUM_BATCHED_TOKENS, seqs, kv)


# --- the loads ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadRequest:
    prompt_tokens: int
    output_tokens: int


#: Output tokens of every calibration request: enough decode steps per wave to fit the decode terms.
def wave_output_tokens(limits: EngineLimits) -> int:
    return max(4, min(64, limits.max_model_len // 16))


def longest_prompt(limits: EngineLimits, output_tokens: int) -> int:
    """The longest prompt a request with ``output_tokens`` may have (the context limit, less one)."""
    return max(1, min(limits.max_model_len, limits.kv_tokens) - output_tokens - 1)


def prompt_grid(limits: EngineLimits, output_tokens: int) -> list[int]:
    """Prompt sizes from 16 tokens up to the longest allowed: powers of four below one step's token
    budget, then a half, one and two chunks, then the context limit."""
    top = longest_prompt(limits, output_tokens)
    chunk = limits.max_num_batched_tokens
    sizes = {16, 64, 256, chunk // 2, chunk, 2 * chunk, top}
    return sorted(s for s in sizes if 1 <= s <= top)


def concurrency_grid(limits: EngineLimits) -> list[int]:
    """1, 2, 4, ... and ``max_num_seqs`` itself."""
    out, c = [], 1
    while c < limits.max_num_seqs:
        out.append(c)
        c *= 2
    out.append(limits.max_num_seqs)
    return out


def calibration_waves(limits: EngineLimits) -> list[list[LoadRequest]]:
    """The calibration load (see the module's description): round ``r`` sends, for every batch size,
    one wave whose requests take the prompt sizes of the grid from position ``r`` on. Every wave fits
    the KV cache (prompts are cut, never the batch size)."""
    output = wave_output_tokens(limits)
    grid = prompt_grid(limits, output)
    waves = []
    for round_ in range(len(grid)):
        for batch in concurrency_grid(limits):
            fitting = max(1, int(0.9 * limits.kv_tokens / batch) - output)
            waves.append([LoadRequest(min(grid[(round_ + j) % len(grid)], fitting), output) for j in range(batch)])
    return waves


#: The warm-up before the calibration load (its steps are not fitted): new shapes compile here.
def warmup_wave(limits: EngineLimits) -> list[LoadRequest]:
    output = wave_output_tokens(limits)
    top = longest_prompt(limits, output)
    return [LoadRequest(min(size, top), output) for size in (16, limits.max_num_batched_tokens, top)]


#: Time stamps of the check load start here (a made-up epoch: only the gaps count).
CHECK_EPOCH = 1_700_000_000.0
#: The share of the twin's capacity the check load is offered at.
CHECK_LOAD = 0.7


def check_records(n: int, limits: EngineLimits, seed: int = 23) -> list[dict[str, Any]]:
    """``n`` requests of the check load as trace records (``t_arrival``, ``prompt_tokens``,
    ``output_tokens``) arriving at 1 request a second on average: 70% short prompts, 30% long ones up
    to three chunks or the context limit, exponential outputs (mean a quarter of the calibration
    waves' length up to it twice over)."""
    if n < 2:
        raise ValueError("a check load needs at least two requests")
    rng = random.Random(seed)
    wave_out = wave_output_tokens(limits)
    out_cap = max(2, 2 * wave_out)
    top = longest_prompt(limits, out_cap)
    short_high = max(2, min(top, limits.max_num_batched_tokens // 2))
    long_low, long_high = min(top, limits.max_num_batched_tokens), min(top, 3 * limits.max_num_batched_tokens)
    records, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(1.0)
        if rng.random() < 0.7:
            prompt = rng.randint(min(8, short_high), short_high)
        else:
            prompt = rng.randint(min(long_low, long_high), long_high)
        output = min(out_cap, max(2, round(rng.expovariate(1.0 / max(2.0, wave_out * 0.75)))))
        records.append({"t_arrival": round(CHECK_EPOCH + t, 6), "prompt_tokens": prompt, "output_tokens": output})
    return records


def check_size(allowance_s: float, capacity_rps: float, load: float = CHECK_LOAD, lowest: int = 20,
               highest: int = 250) -> int:
    """How many requests the check load can have so that serving them (at ``load`` times the capacity)
    takes about half of ``allowance_s``: the rest covers the queue draining at the end and the records.
    At least ``lowest`` (fewer say nothing) and at most ``highest``."""
    if not (math.isfinite(capacity_rps) and capacity_rps > 0):
        return lowest
    return max(lowest, min(highest, int(0.5 * allowance_s * load * capacity_rps)))


# --- the comparison -----------------------------------------------------------------------------------

#: The figures compared, with the label printed and the key in a figures dict.
METRICS = (("mean e2e", "mean_e2e_s"), ("p99 e2e", "p99_e2e_s"), ("mean TTFT", "mean_ttft_s"),
           ("throughput", "throughput_rps"))


def figures_of(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The compared figures from per-request records (the runtime's request trace or ``sim``'s
    records): completed requests only; throughput over the span from the first arrival to the last
    completion. NaN where nothing completed."""
    done = [r for r in records if r.get("finish_reason") in ("length", "stop") and r.get("e2e_latency_s") is not None]
    nan = float("nan")
    if not done:
        return {"requests": 0.0, "mean_e2e_s": nan, "p99_e2e_s": nan, "mean_ttft_s": nan, "throughput_rps": nan}
    e2e = [float(r["e2e_latency_s"]) for r in done]
    ttft = [float(r["ttft_s"]) for r in done if r.get("ttft_s") is not None]
    span = max(float(r["t_completion"]) for r in done) - min(float(r["t_arrival"]) for r in done)
    p99 = quantile(e2e, 0.99)
    return {
        "requests": float(len(done)),
        "mean_e2e_s": sum(e2e) / len(e2e),
        "p99_e2e_s": float(p99) if p99 is not None else nan,
        "mean_ttft_s": sum(ttft) / len(ttft) if ttft else nan,
        "throughput_rps": len(done) / span if span > 0 else nan,
    }


@dataclass(frozen=True)
class Row:
    name: str
    key: str
    predicted: float
    served: float

    @property
    def relative_error(self) -> float:
        """(predicted - served) / served; NaN when either is missing or served is 0."""
        if not (math.isfinite(self.predicted) and math.isfinite(self.served)) or self.served == 0:
            return float("nan")
        return (self.predicted - self.served) / self.served


def compare(predicted: Mapping[str, float], served: Mapping[str, float]) -> list[Row]:
    """One row per compared figure (:data:`METRICS`)."""
    nan = float("nan")
    return [Row(name, key, float(predicted.get(key, nan)), float(served.get(key, nan))) for name, key in METRICS]


def _shown(value: float, unit: str) -> str:
    return "-" if not math.isfinite(value) else f"{value:.3f} {unit}"


def format_comparison(rows: Sequence[Row]) -> str:
    """The predicted-against-served table, one line per figure."""
    header = ("figure", "predicted", "served", "error")
    lines = [header]
    for row in rows:
        unit = "req/s" if row.key == "throughput_rps" else "s"
        error = row.relative_error
        lines.append((row.name, _shown(row.predicted, unit), _shown(row.served, unit),
                      "-" if not math.isfinite(error) else f"{error:+.1%}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i])
                               for i, cell in enumerate(line)).rstrip() for line in lines)


def _rounded(value: float) -> float | None:
    return round(value, 6) if math.isfinite(value) else None


def table_json(rows: Sequence[Row]) -> dict[str, dict[str, float | None]]:
    """The table for a file: ``{mean_e2e_s: {predicted, served, relative_error}, ...}``."""
    return {row.key: {"predicted": _rounded(row.predicted), "served": _rounded(row.served),
                      "relative_error": _rounded(row.relative_error)} for row in rows}


# --- the host and the local recipe --------------------------------------------------------------------

#: What a CPU host is called in ``measured_on``: the CPU engine, no GPU and so no GPU driver.
CPU_HOST_NAME = "cpu"
CPU_DRIVER = "none (the CPU engine)"


def host_block(gpu_names: Sequence[str], driver: str | None, vllm_version: str, on_cpu: bool) -> dict[str, Any]:
    """The ``measured_on`` block: the GPU's name and count, the driver and vLLM's version. On the CPU
    engine the GPU is ``cpu``, its count 0 and the driver :data:`CPU_DRIVER` (whatever GPUs the host
    has, the engine did not use them)."""
    if on_cpu or not gpu_names:
        return {"gpu": CPU_HOST_NAME, "gpu_count": 0, "driver": CPU_DRIVER, "vllm": vllm_version}
    names = sorted(set(gpu_names))
    return {"gpu": " + ".join(names), "gpu_count": len(gpu_names), "driver": driver or None, "vllm": vllm_version}


def benchmark_block(host: Mapping[str, Any], date: str, rows: Sequence[Row], model_file: str,
                    fit: Mapping[str, Any], load: Mapping[str, Any]) -> dict[str, Any]:
    """The local recipe's ``benchmark`` block: measured on ``host`` on ``date``; its figures are the
    check load's, served and predicted by the fitted model, with the errors."""
    return {
        "measured_on": dict(host),
        "date": date,
        "figures": {
            "by": "carbonforge-runtime calibrate (the check load served on this host, and the twin's prediction "
                  "of it with the step-time model fitted here)",
            "check_load": dict(load),
            "step_model": {"file": model_file, **dict(fit)},
            "predicted_against_served": table_json(rows),
        },
    }


RECIPE_HEADER = ("# Calibrated by carbonforge-runtime calibrate: benchmark.figures were measured on the host named\n"
                 "# in benchmark.measured_on (served there), beside the twin's prediction with the fitted model.\n")


def recipe_text(source: Mapping[str, Any], benchmark: Mapping[str, Any]) -> str:
    """The served recipe (its YAML mapping, as read) with ``benchmark`` in place of its own block."""
    import yaml

    data = {name: value for name, value in source.items() if name != "benchmark"}
    data["benchmark"] = dict(benchmark)
    return RECIPE_HEADER + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100)
