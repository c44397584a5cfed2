"""``sim-calibrate``: fit a step-time model to the steps of a real engine.

Reads a step log (``serve --step-log``, :mod:`carbonforge_runtime.engine.step_log`) through the
offline tools' bounded reader, and fits the twin's step-time model
(:func:`carbonforge_runtime.core.twin_data.step_time_s`)

``t = max(floor, a * batched) + b * kv_read + c * attention + overhead``  (milliseconds)

to the steps' wall times by least squares with non-negative coefficients.

The ``max`` makes the model piecewise linear in the batched tokens, with a knee at
``floor / a`` tokens. For a fixed knee ``k`` it is linear: ``a * max(batched, k) + b * kv_read +
c * attention + overhead``, with ``floor = a * k``. So every candidate knee (none, and the
batched-token counts at the 5th, 10th, ... 95th percentile of the log, then finer grids around
the best of them) gets an exact non-negative least-squares fit, and the knee with the smallest
squared error wins. With four
coefficients the exact fit is found by solving the unconstrained problem on every subset of the
terms and keeping the best solution whose coefficients are all non-negative (the optimum of a
non-negative least-squares problem is the unconstrained optimum on its set of positive terms).
A term the log never exercises (no decoding steps, no prompt chunks) has no data to fit: it is
fixed at 0 and the output says so.

The log's ``request`` lines give the host's admission delay
(:func:`carbonforge_runtime.core.twin_data.admission_delay_s`: arrival stamp to the engine core's
input queue), ``base + per_prompt_token * prompt_tokens`` milliseconds, fitted by
:func:`fit_admission`. A request's delay is known exactly when the engine was waiting for work and
took it in at once, and otherwise only to lie within its intake window (it waited in the engine
core's queue for the end of a step, which the twin models itself). The fit minimises the squared
distance of each predicted delay to its request's interval (zero inside it), with non-negative
terms. A log without request lines (written before they existed) fits no delay, and the model
file then has none.

Everything here is deterministic: the same log and options give the same model file, byte for
byte (the date in its provenance is the log's own, not the time of the fit).
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from carbonforge_runtime.core.quantiles import nearest_rank
from carbonforge_runtime.core.step_models import model_from_mapping
from carbonforge_runtime.core.twin_data import SimError, StepCostModel
from carbonforge_runtime.offline.trace_reader import (
    MAX_REQUEST_TOKENS,
    DamagedInput,
    NotJson,
    TraceInputError,
    check_readable,
    json_lines,
)

#: Steps read at most; a longer log is read up to here (a fit of five million steps says all it can).
MAX_STEPS = 5_000_000
#: Fewer steps than this fit nothing worth writing.
MIN_STEPS = 20
#: A step longer than an hour is no engine step.
MAX_WALL_S = 3600.0
MAX_KV_READ_TOKENS = 10**12
MAX_ATTENTION_UNITS = 1e20
TERMS = ("per_batched_token", "per_kv_token_read", "attention", "overhead")
#: Requests read at most, and fewer than this fit no admission delay.
MAX_REQUESTS = 1_000_000
MIN_REQUESTS = 10
#: Rounds of the admission delay's fit at most (it converges in a handful).
ADMISSION_ROUNDS = 500
#: Candidate knees: the batched tokens at these percentiles of the log (and no knee at all).
KNEE_PERCENTILES = tuple(range(5, 100, 5))
#: Rounds of a finer grid around the best knee.
KNEE_REFINEMENTS = 3

_LINE_FIX = "a step log has one JSON object per line, as serve --step-log writes it"


@dataclass
class StepLogData:
    """The steps of one log, as columns."""

    path: Path
    # Columns of doubles (8 bytes a value: a log of MAX_STEPS steps stays in memory comfortably).
    batched: array[float] = field(default_factory=lambda: array("d"))
    kv_read: array[float] = field(default_factory=lambda: array("d"))
    attention: array[float] = field(default_factory=lambda: array("d"))
    wall_ms: array[float] = field(default_factory=lambda: array("d"))
    headers: list[dict[str, Any]] = field(default_factory=list)
    # The request lines (Unix seconds): arrival stamp, entry into the scheduler, intake window, prompt.
    arrival: array[float] = field(default_factory=lambda: array("d"))
    added: array[float] = field(default_factory=lambda: array("d"))
    window: array[float] = field(default_factory=lambda: array("d"))
    prompt: array[float] = field(default_factory=lambda: array("d"))
    requests_skipped: int = 0  # request lines before the last step skipped by --skip-first
    first_t: float | None = None
    last_t: float | None = None
    logged: int = 0  # step lines in the file
    skipped: int = 0  # by --skip-first
    empty: int = 0  # steps with no token (not fitted)
    truncated: bool = False  # more than MAX_STEPS steps: the rest were not read


def _fail(path: Path, line: int, problem: str) -> SimError:
    return SimError(f"{path}:{line}: {problem}", _LINE_FIX)


def _count(path: Path, line: int, record: Mapping[str, Any], name: str, maximum: int) -> int:
    raw = record.get(name)
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= maximum:
        raise _fail(path, line, f"{name}={str(raw)[:40]} is not a whole number in 0..{maximum:,}")
    return raw


def _real(path: Path, line: int, record: Mapping[str, Any], name: str, low: float, high: float,
          low_open: bool = False) -> float:
    raw = record.get(name)
    if not isinstance(raw, bool) and isinstance(raw, (int, float)) and math.isfinite(raw):
        value = float(raw)
        if (value > low if low_open else value >= low) and value <= high:
            return value
    bound = f"above {low:g}" if low_open else f"at least {low:g}"
    raise _fail(path, line, f"{name}={str(raw)[:40]} is not a number {bound} and at most {high:g}")


def read_step_log(path: Path, skip_first: int = 0, max_steps: int = MAX_STEPS) -> StepLogData:
    """Every step of the log (plain or gzip JSONL), validated; raises with the file and line."""
    check_readable(path, "step log", "--step-log of serve")
    data = StepLogData(path)
    try:
        for number, record in json_lines(path):
            if isinstance(record, NotJson):
                raise _fail(path, number, f"is not JSON ({record.problem[:80]})")
            if not isinstance(record, dict):
                raise _fail(path, number, "is not a JSON object")
            kind = record.get("kind")
            if kind == "engine":
                if len(data.headers) < 1000:
                    data.headers.append(record)
                continue
            if kind == "request":
                if data.logged < skip_first:
                    data.requests_skipped += 1
                elif len(data.added) < MAX_REQUESTS:
                    data.prompt.append(_count(path, number, record, "prompt_tokens", MAX_REQUEST_TOKENS))
                    data.window.append(_real(path, number, record, "intake_window_s", 0.0, MAX_WALL_S))
                    data.arrival.append(_real(path, number, record, "t_arrival", 0.0, 1e11))
                    data.added.append(_real(path, number, record, "t_added", 0.0, 1e11))
                continue
            if kind != "step":
                raise _fail(path, number, f"is not a step-log line (kind {str(kind)[:40]!r}; a request "
                                          "trace is not a step log)")
            data.logged += 1
            if data.logged <= skip_first:
                data.skipped += 1
                continue
            if len(data.wall_ms) >= max_steps:
                data.truncated = True
                continue
            batched = _count(path, number, record, "batched_tokens", MAX_REQUEST_TOKENS)
            kv_read = _count(path, number, record, "kv_read_tokens", MAX_KV_READ_TOKENS)
            attention = _real(path, number, record, "attention_units", 0.0, MAX_ATTENTION_UNITS)
            wall_s = _real(path, number, record, "wall_s", 0.0, MAX_WALL_S, low_open=True)
            t = _real(path, number, record, "t", 0.0, 1e11)
            if batched == 0:
                data.empty += 1
                continue
            data.batched.append(batched)
            data.kv_read.append(kv_read)
            data.attention.append(attention)
            data.wall_ms.append(wall_s * 1000.0)
            data.first_t = t if data.first_t is None else min(data.first_t, t)
            data.last_t = t if data.last_t is None else max(data.last_t, t)
    except DamagedInput as exc:
        raise TraceInputError(f"{path}: {exc.reason}; the lines up to {exc.lines_read} were read",
                              "copy the file again, or decompress what is left (zcat FILE > FILE.jsonl) and use "
                              "that") from None
    if len(data.wall_ms) < MIN_STEPS:
        raise SimError(f"{path}: {len(data.wall_ms)} step(s) with tokens to fit (after skipping {data.skipped}); "
                       f"at least {MIN_STEPS} are needed",
                       "log more of the engine's steps (serve --step-log, under the traffic to model)")
    return data


@dataclass(frozen=True)
class Fit:
    floor_ms: float
    per_batched_token_ms: float
    per_kv_token_read_ms: float
    attention_ms: float
    overhead_ms: float
    knee_tokens: int  # floor / per_batched_token (0: no floor)
    steps: int
    r2: float
    mae_ms: float
    mean_rel_error: float
    p90_rel_error: float
    #: Terms the log gave no data for (fixed at 0).
    unfitted: tuple[str, ...] = ()

    def coefficients(self) -> dict[str, float]:
        return {"floor": self.floor_ms, "per_batched_token": self.per_batched_token_ms,
                "per_kv_token_read": self.per_kv_token_read_ms, "attention": self.attention_ms,
                "overhead": self.overhead_ms}


def _nnls_gram(gram: Any, xty: Any, yty: float) -> tuple[Any, float]:
    """Non-negative least squares from the normal equations, exactly, by trying every subset of the
    terms (few terms: at most 2**4 small solves). Returns (coefficients, squared error)."""
    import numpy as np

    size = len(xty)
    best = np.zeros(size)
    best_sse = yty
    for count in range(1, size + 1):
        for subset in itertools.combinations(range(size), count):
            index = list(subset)
            solution = np.linalg.lstsq(gram[np.ix_(index, index)], xty[index], rcond=None)[0]
            if np.any(solution < 0):
                continue
            full = np.zeros(size)
            full[index] = solution
            sse = float(yty - 2.0 * full @ xty + full @ gram @ full)
            if sse < best_sse - 1e-12 * max(abs(yty), 1.0):
                best, best_sse = full, sse
    return best, best_sse


def predict_ms(coefficients: Mapping[str, float], batched: Any, kv_read: Any, attention: Any) -> Any:
    """The model's step times in ms for arrays of steps (the twin's formula)."""
    import numpy as np

    return (np.maximum(coefficients["floor"], coefficients["per_batched_token"] * batched)
            + coefficients["per_kv_token_read"] * kv_read + coefficients["attention"] * attention
            + coefficients["overhead"])


def fit_steps(batched_tokens: Sequence[float], kv_read_tokens: Sequence[float], attention_units: Sequence[float],
              wall_ms: Sequence[float]) -> Fit:
    """The step-time model that fits the steps best (see the module's description)."""
    import numpy as np

    batched = np.asarray(batched_tokens, dtype=float)
    kv_read = np.asarray(kv_read_tokens, dtype=float)
    attention = np.asarray(attention_units, dtype=float)
    y = np.asarray(wall_ms, dtype=float)
    n = len(y)
    if n < 1 or not (len(batched) == len(kv_read) == len(attention) == n):
        raise ValueError("fit_steps needs columns of the same, non-zero length")
    ones = np.ones(n)
    fixed = [not np.any(column) for column in (batched, kv_read, attention)]
    unfitted = tuple(name for name, unused in zip(TERMS[:3], fixed, strict=True) if unused)

    def solve(knee: float) -> tuple[Any, float]:
        columns = [np.maximum(batched, knee), kv_read, attention, ones]
        used = [i for i in range(4) if i == 3 or not fixed[i]]
        x = np.stack([columns[i] for i in used], axis=1)
        scale = np.sqrt(np.mean(x * x, axis=0))
        scale[scale == 0] = 1.0
        xs = x / scale
        solution, _ = _nnls_gram(xs.T @ xs, xs.T @ y, float(y @ y))
        out = np.zeros(4)
        out[used] = solution / scale
        residual = y - x @ (solution / scale)
        return out, float(residual @ residual)

    knees = [0.0]
    if not fixed[0]:
        ordered = np.sort(batched)
        for q in KNEE_PERCENTILES:
            value = float(ordered[nearest_rank(q / 100.0, n)])
            if value > 0 and value not in knees:
                knees.append(value)
    best: tuple[Any, float, float] | None = None
    for _ in range(1 + KNEE_REFINEMENTS):
        for knee in knees:
            coefficients, sse = solve(knee)
            if best is None or sse < best[1] * (1 - 1e-9):
                best = (coefficients, sse, knee)
        assert best is not None
        if best[2] == 0:
            break
        # A finer grid between the best knee's neighbours among the candidates just tried.
        ordered_knees = sorted(knees)
        at = ordered_knees.index(best[2])
        low = ordered_knees[max(at - 1, 0)]
        high = ordered_knees[min(at + 1, len(ordered_knees) - 1)]
        knees = [*sorted({round(low + (high - low) * i / 16, 3) for i in range(17)} - {best[2]}), best[2]]
    assert best is not None
    (a, b, c, overhead), _, knee = best
    if a <= 0:
        knee = 0.0
    values = {"floor": float(a * knee), "per_batched_token": float(a), "per_kv_token_read": float(b),
              "attention": float(c), "overhead": float(overhead)}
    predicted = predict_ms(values, batched, kv_read, attention)
    residual = predicted - y
    sse = float(residual @ residual)
    sst = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - sse / sst if sst > 0 else (1.0 if sse <= 1e-12 else 0.0)
    relative = np.sort(np.abs(residual) / y)
    return Fit(
        floor_ms=values["floor"], per_batched_token_ms=values["per_batched_token"],
        per_kv_token_read_ms=values["per_kv_token_read"], attention_ms=values["attention"],
        overhead_ms=values["overhead"], knee_tokens=round(knee), steps=n, r2=r2,
        mae_ms=float(np.mean(np.abs(residual))), mean_rel_error=float(np.mean(relative)),
        p90_rel_error=float(relative[nearest_rank(0.9, n)]), unfitted=unfitted,
    )


# ---- the host's admission delay ----------------------------------------------------------------


@dataclass(frozen=True)
class AdmissionFit:
    """The admission delay fitted to a log's requests (milliseconds of host time)."""

    base_ms: float
    per_prompt_token_ms: float
    requests: int
    exact: int  # requests whose delay is known exactly (taken in by a waiting engine)
    mean_ms: float  # the fitted delay, averaged over the requests
    mean_to_scheduler_ms: float  # arrival stamp to entering the scheduler (the step boundary's wait included)
    mean_miss_ms: float  # how far the fitted delays fall outside the requests' intervals, on average
    #: Terms the log gave no data for (fixed at 0): the per-token term when every prompt had one length.
    unfitted: tuple[str, ...] = ()

    def coefficients(self) -> dict[str, float]:
        return {"base": self.base_ms, "per_prompt_token": self.per_prompt_token_ms}


def admission_intervals(data: StepLogData) -> tuple[Any, Any, Any]:
    """(prompt tokens, shortest delay, longest delay) of every request line, delays in milliseconds:
    the request reached the engine core's queue within its intake window before it entered the
    scheduler, and not before its arrival stamp."""
    import numpy as np

    arrival = np.asarray(data.arrival, dtype=float)
    added = np.asarray(data.added, dtype=float)
    window = np.asarray(data.window, dtype=float)
    high = np.maximum(added - arrival, 0.0) * 1000.0
    low = np.minimum(np.maximum(added - window - arrival, 0.0) * 1000.0, high)
    return np.asarray(data.prompt, dtype=float), low, high


def fit_admission(prompt_tokens: Sequence[float] | Any, low_ms: Sequence[float] | Any,
                  high_ms: Sequence[float] | Any) -> AdmissionFit | None:
    """``base + per_prompt_token * prompt_tokens`` closest to every request's interval
    ``[low_ms, high_ms]`` (squared distance, zero inside), both terms non-negative; None with fewer
    than :data:`MIN_REQUESTS` requests.

    The loss is convex and piecewise quadratic. Each round takes the better of two moves: the
    least-squares fit to every prediction clipped into its interval (a majorise-minimise step, which
    never increases the loss), and the exact minimum of the current quadratic piece (the requests
    outside their intervals fitted to the nearer bound: a Newton step, which ends the search once
    the set of those requests stops changing). It starts from the intervals' midpoints."""
    import numpy as np

    prompt = np.asarray(prompt_tokens, dtype=float)
    low = np.asarray(low_ms, dtype=float)
    high = np.asarray(high_ms, dtype=float)
    n = len(prompt)
    if not len(low) == len(high) == n:
        raise ValueError("fit_admission needs columns of the same length")
    if n < MIN_REQUESTS:
        return None
    varies = bool(prompt.max() > prompt.min())
    x = np.stack([np.ones(n), prompt], axis=1) if varies else np.ones((n, 1))
    scale = np.sqrt(np.mean(x * x, axis=0))
    scale[scale == 0] = 1.0
    xs = x / scale

    def solve(rows: Any, target: Any) -> Any:
        part = xs[rows]
        solution, _ = _nnls_gram(part.T @ part, part.T @ target, float(target @ target))
        return solution

    def loss(beta: Any) -> float:
        predicted = xs @ beta
        miss = np.maximum(low - predicted, 0.0) + np.maximum(predicted - high, 0.0)
        return float(miss @ miss)

    everyone = np.ones(n, dtype=bool)
    beta = solve(everyone, (low + high) / 2.0)
    current = loss(beta)
    for _ in range(ADMISSION_ROUNDS):
        if current <= 0.0:
            break
        predicted = xs @ beta
        candidates = [solve(everyone, np.clip(predicted, low, high))]
        outside = (predicted < low) | (predicted > high)
        if outside.any():
            candidates.append(solve(outside, np.where(predicted < low, low, high)[outside]))
        best = min(candidates, key=loss)
        value = loss(best)
        if value >= current - 1e-12 * max(current, 1e-12):
            break
        beta, current = best, value
    coefficients = beta / scale
    base = float(coefficients[0])
    per_token = float(coefficients[1]) if varies else 0.0
    predicted = base + per_token * prompt
    miss = np.maximum(low - predicted, 0.0) + np.maximum(predicted - high, 0.0)
    return AdmissionFit(base_ms=base, per_prompt_token_ms=per_token, requests=n, exact=int(np.sum(high - low <= 0.0)),
                        mean_ms=float(predicted.mean()), mean_to_scheduler_ms=float(high.mean()),
                        mean_miss_ms=float(miss.mean()), unfitted=() if varies else ("per_prompt_token",))


def fit_log_admission(data: StepLogData) -> AdmissionFit | None:
    """The admission delay of a log's request lines (None: too few, e.g. a log written before they existed)."""
    return fit_admission(*admission_intervals(data))


def admission_provenance(fit: AdmissionFit) -> str:
    return (f" Admission delay (the API server's arrival stamp to the engine core's queue, host time) fitted to "
            f"{fit.requests} requests ({fit.exact} taken in by a waiting engine, the rest known to within the time "
            f"between two steps): {_yaml_float(fit.base_ms)} ms + {_yaml_float(fit.per_prompt_token_ms)} ms per "
            f"prompt token, {fit.mean_ms:.3g} ms on average ({fit.mean_to_scheduler_ms:.3g} ms to the scheduler with "
            f"the wait for a step boundary).")


def format_admission(fit: AdmissionFit | None) -> str:
    if fit is None:
        return (f"admission delay  not fitted: fewer than {MIN_REQUESTS} request lines in the log (a log written "
                "before they existed); the model has none")
    rows = [("admission delay", f"{_yaml_float(fit.base_ms)} ms + {_yaml_float(fit.per_prompt_token_ms)} ms per "
                                f"prompt token"),
            ("requests", f"{fit.requests} ({fit.exact} known exactly)"),
            ("mean delay", f"{fit.mean_ms:.3g} ms (to the scheduler {fit.mean_to_scheduler_ms:.3g} ms, "
                           f"with the wait for a step boundary)"),
            ("mean miss", f"{fit.mean_miss_ms:.3g} ms outside the requests' intervals")]
    if fit.unfitted:
        rows.append(("not in the log", "prompts of different lengths (all had one): per_prompt_token fixed at 0"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


# ---- the model file ----------------------------------------------------------------------------


def _yaml_float(value: float) -> str:
    """Six significant digits, spelled so that YAML 1.1 (PyYAML) reads a float back."""
    text = repr(float(f"{value:.6g}"))
    if "e" in text:
        mantissa, exponent = text.split("e")
        if "." not in mantissa:
            mantissa += ".0"
        text = f"{mantissa}e{exponent}"
    return text


def _utc(t: float | None) -> str:
    if t is None:
        return "?"
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M UTC")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    version: int
    gpu: str
    tensor_parallel_size: int
    kv_capacity_tokens: int


def engine_facts(headers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What the log's ``engine`` lines agree on (a fact they disagree on is left out)."""
    facts: dict[str, Any] = {}
    for name in ("vllm", "model", "tensor_parallel_size", "kv_cache_tokens", "async_scheduling",
                 "max_num_batched_tokens", "max_num_seqs", "emulated_cost_model", "emulated_slowdown"):
        values = {repr(h.get(name)) for h in headers if h.get(name) is not None}
        first = next((h[name] for h in headers if h.get(name) is not None), None)
        if len(values) == 1 and isinstance(first, (str, int, float, bool)):
            facts[name] = first if not isinstance(first, str) else first[:200]
    return facts


def provenance(data: StepLogData, fit: Fit, facts: Mapping[str, Any], source: str,
               admission: AdmissionFit | None = None, writer: str = "sim-calibrate") -> str:
    engine = []
    if "vllm" in facts:
        engine.append(f"vLLM {facts['vllm']}")
    if "model" in facts:
        engine.append(str(facts["model"]))
    if "tensor_parallel_size" in facts:
        engine.append(f"TP {facts['tensor_parallel_size']}")
    if "async_scheduling" in facts:
        engine.append("asynchronous scheduling" if facts["async_scheduling"] else "synchronous scheduling")
    if "emulated_cost_model" in facts:
        engine.append(f"a paced engine (serve --emulate) whose steps follow the step-time model "
                      f"{facts['emulated_cost_model']} at slowdown {facts.get('emulated_slowdown', '?')}: "
                      "the fit gives back that model, not the hardware's")
    text = (f"Fitted by carbonforge-runtime {writer} to the step log {source}: {fit.steps} steps with tokens "
            f"logged from {_utc(data.first_t)} to {_utc(data.last_t)}"
            + (f" ({', '.join(engine)})" if engine else "")
            + (f", the first {data.skipped} skipped" if data.skipped else "")
            + (f", only the first {MAX_STEPS} read" if data.truncated else "")
            + ". Non-negative least squares on the steps' wall time"
            + (f", the floor's knee at {fit.knee_tokens} batched tokens" if fit.knee_tokens else ", no floor")
            + f". Fit: R2 {fit.r2:.4f}, mean absolute error {fit.mae_ms:.3g} ms, mean relative error "
            f"{fit.mean_rel_error:.1%}, p90 relative error {fit.p90_rel_error:.1%}.")
    if fit.unfitted:
        text += (f" The log has no steps that exercise {', '.join(fit.unfitted)}: fixed at 0, so the model "
                 "is only valid for steps like the logged ones.")
    if admission is not None:
        text += admission_provenance(admission)
    return text


def model_text(fit: Fit, info: ModelInfo, provenance_text: str, admission: AdmissionFit | None = None,
               writer: str = "sim-calibrate") -> str:
    """The model as a YAML file in the shipped format (checked by the shipped loader), with the
    admission delay's section when one was fitted; ``writer`` is the subcommand that fitted it."""
    coefficients = fit.coefficients()
    delay = [] if admission is None else [
        "admission_delay_ms:  # host time: the API server's arrival stamp to the engine core's queue",
        *[f"  {name}: {_yaml_float(value)}" for name, value in admission.coefficients().items()]]
    lines = [
        f"# Step-time model fitted by carbonforge-runtime {writer} from an engine's step log. "
        "Milliseconds per step.",
        yaml.safe_dump({"name": info.name}, allow_unicode=False, width=1000).rstrip("\n"),
        f"version: {info.version}",
        yaml.safe_dump({"gpu": info.gpu}, allow_unicode=False, width=1000).rstrip("\n"),
        f"tensor_parallel_size: {info.tensor_parallel_size}",
        "coefficients_ms:",
        *[f"  {name}: {_yaml_float(coefficients[name])}" for name in
          ("floor", "per_batched_token", "per_kv_token_read", "attention", "overhead")],
        f"kv_capacity_tokens: {info.kv_capacity_tokens}",
        *delay,
        "proxy: false",
        yaml.safe_dump({"provenance": provenance_text}, allow_unicode=False, width=100).rstrip("\n"),
    ]
    return "\n".join(lines) + "\n"


def check_model_text(text: str, path: Path) -> StepCostModel:
    """The file as ``sim --cost-model`` will read it (refuses what the loader refuses)."""
    return model_from_mapping(yaml.safe_load(text), path)


@dataclass(frozen=True)
class FittedModel:
    """A step log's fit, its admission delay, and the model file's text with the model it loads as."""

    fit: Fit
    admission: AdmissionFit | None
    text: str
    model: StepCostModel


def fit_model(data: StepLogData, info: ModelInfo, facts: Mapping[str, Any], source: str, path: Path,
              writer: str = "sim-calibrate") -> FittedModel:
    """Fit the step times and the admission delay of ``data`` and write them up as the model file for
    ``path`` (checked as ``sim --cost-model`` will read it); ``source`` names the log in the provenance
    and ``writer`` the subcommand (``sim-calibrate`` or ``calibrate``) in the file's header."""
    fit = fit_steps(data.batched, data.kv_read, data.attention, data.wall_ms)
    admission = fit_log_admission(data)
    text = model_text(fit, info, provenance(data, fit, facts, source, admission, writer), admission, writer)
    return FittedModel(fit, admission, text, check_model_text(text, path))


def format_fit(fit: Fit) -> str:
    rows = [(name, _yaml_float(value) + " ms") for name, value in fit.coefficients().items()]
    rows += [
        ("knee", f"{fit.knee_tokens} batched tokens" if fit.knee_tokens else "none (no floor)"),
        ("steps fitted", str(fit.steps)),
        ("R2", f"{fit.r2:.4f}"),
        ("mean absolute error", f"{fit.mae_ms:.3g} ms"),
        ("mean relative error", f"{fit.mean_rel_error:.1%}"),
        ("p90 relative error", f"{fit.p90_rel_error:.1%}"),
    ]
    if fit.unfitted:
        rows.append(("not in the log", ", ".join(fit.unfitted) + " (fixed at 0)"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)
