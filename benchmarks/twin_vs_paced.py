#!/usr/bin/env python3
"""The twin held to the paced engine: predict first, then serve the same arrivals, then compare.

For every cell (a trace window, a load, a family) the twin (vLLM's scheduler in virtual time,
:mod:`carbonforge_runtime.engine.twin`) predicts the run and the prediction is printed; only then
is the window served by the paced engine (``serve --emulate``: vLLM's real API server, engine
core, scheduler and KV cache on this machine's CPU, every step lasting what the recipe's
step-time model says) and the two are compared. All predictions of the matrix are made and written
before the first request is sent.

What both sides get:

* the same requests: a window of ``--limit`` requests of each trace (Azure conversation, Mooncake
  with its prefix hash ids, prefill-heavy, templated; built as ``ordering_twin.py`` builds them),
  with the same prompt sizes and the same prefix-sharing structure (the twin's content blocks are
  spelled as token ids the stand-in model accepts, sent to ``/v1/completions``; ``max_tokens`` is
  the recorded output with ``ignore_eos``);
* the same arrivals: ``--loads`` of the twin's FCFS capacity on that window (measured once per
  window, as ``sim --load`` does), the same times for every family;
* the same engine: the recipe as ``serve --emulate`` serves it (its knobs; KV blocks of 32 tokens,
  the CPU engine's, and the KV cache that many blocks hold; synchronous scheduling, the only kind
  the CPU engine has);
* the same step times: the recipe's step-time model; with ``--emulate-slowdown K`` every step
  lasts K times the model, so the twin runs with every coefficient and every gap between arrivals
  K times longer (its ordering families' time constants then see the same clock as the engine's),
  and every figure is reported in the modelled GPU's seconds (divided by K);
* the same host: the API server's delay between a request's arrival stamp and the engine core
  (rendering, tokenisation, the hand-over), which the twin adds before a request may enter
  (:func:`carbonforge_runtime.core.twin_data.admission_delay_s`). ``--admission-delay calibrate``
  (the default) measures it before anything is predicted: a paced engine of its own serves a short
  calibration load (for each trace, a few dozen of its window's requests, Poisson arrivals at the
  lowest load's rate), and the delay is fitted to the request lines of its step log
  (:func:`carbonforge_runtime.offline.sim.calibrate.fit_admission`). ``--admission-delay FILE``
  takes it from a model file (its ``admission_delay_ms``) or fits it to a step log;
  ``--admission-delay none`` leaves it out, as the twin did before it had one.

Engines: one per family (the family is fixed when the engine starts; ``bench_switch`` would hand
the waiting queue its own overtaking bound and prefix-lookup limit, not the served family's). FCFS
serves every cell twice (the second pass after all the first), for the engine's own noise. Before
the runs on an engine, a short burst (not measured) warms it up. Each run's prompts carry a run
salt, so no run finds another's blocks in the prefix cache.

Per cell, the table gives the twin against the paced engine (mean and p99 e2e, mean TTFT,
throughput), the relative errors and pass/fail against the targets (5%, 10%, 10%, 3%), FCFS served
twice against itself (3%), the paced engine's late-step share in that run (from its metrics
counters; a run with more than 1% of its steps late is not faithful), the worst lag of an arrival
behind its due time beyond the run's usual hand-over (a stall of the load generator or the API server
of more than 50 ms also makes a run not faithful) and the machine's load average. A run that is not
faithful is served again, up to three attempts; the report lists every discarded attempt and why.
The ranking check: for each cell and metric, wherever the paced engine's difference between two
families exceeds the FCFS noise of that cell, whether the twin puts them the same way round. A pair
whose two runs both admitted every request in arrival order (no request overtook an earlier one, read
from the trace records' queue waits) is not judged: the families made FCFS's decisions, so the
difference is noise; the report says whether the twin predicted a tie there.

    PYTHONPATH=. .venv/bin/python benchmarks/twin_vs_paced.py --emulate-slowdown 0.5 \\
        --json benchmarks/results/twin_vs_paced.json --markdown benchmarks/results/twin_vs_paced.md

``--only TRACE[,TRACE]``, ``--loads`` and ``--families`` run a part of the matrix; ``--predict-only``
stops after the predictions (the admission delay's calibration, when asked for, runs before them).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness import (  # noqa: E402
    EngineProcess,
    TraceTail,
    command,
    commit,
    free_port,
    jsonl_records,
    log,
    request_figures,
    runtime,
)

HASH_SEED = "0"
RECIPE = "qwen3-32b:fp8:chat:a100-80x1"
TRACES = ("azure-conv", "mooncake", "prefill", "templated")
#: Requests of each trace's window (each run then lasts about a minute at slowdown 0.5).
DEFAULT_LIMITS = {"azure-conv": 200, "mooncake": 60, "prefill": 200, "templated": 300}
LOADS = (0.7, 0.9)
#: Families of every cell, and the extra family of some traces.
BASE_FAMILIES = ("fcfs", "ltr-promptlen")
EXTRA_FAMILY = {"mooncake": "affinity", "templated": "hybrid"}
AGAIN = "fcfs-again"
#: Relative error allowed per metric, twin against the paced engine; and FCFS against itself.
TARGETS = {"mean_e2e": 0.05, "p99_e2e": 0.10, "mean_ttft": 0.10, "throughput": 0.03}
REPEAT_TARGET = 0.03
METRICS = (("mean_e2e", "mean e2e"), ("p99_e2e", "p99 e2e"), ("mean_ttft", "mean TTFT"), ("throughput", "req/s"))
LOWER_IS_BETTER = {"mean_e2e": True, "p99_e2e": True, "mean_ttft": True, "throughput": False}
LATE_LIMIT = 0.01
# An arrival stamped this much later than the run's usual hand-over means the host stalled (the
# load generator or the API server): on this machine a run's worst is 5-18 ms, a stall 100s of ms.
ARRIVAL_STALL_S = 0.05
# A run that is not faithful (late steps over LATE_LIMIT, a stalled arrival, a request lost) is
# served again, at most this many times in all; every attempt stays in the JSON.
MAX_ATTEMPTS = 3
# Requests the engine admits in one step are stamped within this of each other (a paced step is
# tens of milliseconds of real time).
SAME_STEP_S = 0.001
#: Token ids the stand-in model accepts (its vocabulary has 4,102).
TOKEN_LOW, TOKEN_HIGH = 100, 4000
WARMUP_REQUESTS = 12
#: The admission delay's calibration: per trace, requests drawn from its window (at most, at least)
#: arriving over about this many seconds at the lowest load's rate.
CALIBRATION_REQUESTS = (40, 10)
CALIBRATION_SPAN_S = 20.0
NO_DELAY = {"base_ms": 0.0, "per_prompt_token_ms": 0.0, "source": "none"}


# -- the cells -----------------------------------------------------------------------------------------


def families_of(trace: str) -> list[str]:
    extra = EXTRA_FAMILY.get(trace)
    return [*BASE_FAMILIES, *([extra] if extra else [])]


def twin_inputs(trace: Any, limit: int, slowdown: float, delay: dict[str, Any] | None = None) -> dict[str, Any]:
    """The window, the engine as ``serve --emulate`` serves the recipe, and the step-time model
    (every coefficient times ``slowdown``) with the host's admission delay (``delay``, from
    :func:`admission_delay`; none without it)."""
    from carbonforge_runtime.offline.sim.inputs import WindowOptions
    from carbonforge_runtime.offline.sim.setup import KnobOverrides, TwinInputs, prepare
    from carbonforge_runtime.runtime.planning.emulate import cpu_block_size, kv_blocks

    base = prepare(TwinInputs(trace=Path(trace.path), context_key=RECIPE, window=WindowOptions(limit=limit),
                              family="fcfs", knobs=KnobOverrides(async_scheduling=False)))
    block = cpu_block_size(int(base.recipe.vllm.get("block_size") or 16))
    kv_tokens = kv_blocks(base.cost, block) * block
    twin = dataclasses.replace(base.twin, block_size=block, kv_tokens=kv_tokens, async_scheduling=False)
    c = base.cost
    delay = delay or NO_DELAY
    # The twin runs on the paced engine's clock: every step K times the model (K = slowdown), every
    # gap between arrivals K times the trace's (the arrivals are sent at those times), and every
    # figure is divided by K afterwards to give the modelled GPU's seconds. The admission delay is
    # not a step: the API server renders, tokenises and hands a request over on this machine's CPU in
    # real seconds, whatever K is. So it enters the twin as measured, NOT times K; dividing the
    # figures by K afterwards then turns a delay of d seconds into d / K modelled seconds (2d at
    # K = 0.5), as dividing the paced engine's figures by K does to the same real delay there. On a
    # GPU host (no slowdown) the same delay enters as it is.
    cost = dataclasses.replace(
        c, floor_ms=c.floor_ms * slowdown, per_batched_token_ms=c.per_batched_token_ms * slowdown,
        per_kv_token_read_ms=c.per_kv_token_read_ms * slowdown, attention_ms=c.attention_ms * slowdown,
        overhead_ms=c.overhead_ms * slowdown, admission_base_ms=float(delay["base_ms"]),
        admission_per_prompt_token_ms=float(delay["per_prompt_token_ms"]))
    from carbonforge_runtime.offline.sim.setup import refused

    served = [r for r in base.requests if r.index not in refused(base.requests, twin)]
    return {"base": base, "twin": twin, "cost": cost, "served": served}


def twin_metrics(run: Any) -> dict[str, float]:
    records = [{"t_arrival": o.arrival_s, "t_completion": o.completion_s, "e2e_latency_s": o.completion_s - o.arrival_s,
                "ttft_s": None if o.first_token_s is None else o.first_token_s - o.arrival_s,
                "finish_reason": "length"} for o in run.outcomes if o.completion_s is not None]
    return request_figures(records)


def scaled_metrics(m: dict[str, float], slowdown: float) -> dict[str, float]:
    """Seconds of a dilated run as the modelled GPU's seconds."""
    return {"n": m["n"], "mean_e2e": m["mean_e2e"] / slowdown, "p99_e2e": m["p99_e2e"] / slowdown,
            "mean_ttft": m["mean_ttft"] / slowdown, "throughput": m["throughput"] * slowdown}


def predict(traces: list[Any], limits: dict[str, int], loads: list[float], slowdown: float,
            wanted: set[str] | None, delay: dict[str, Any]) -> dict[str, Any]:
    """Every cell's prediction (and the arrivals the engine will be sent), printed as it is made."""
    from carbonforge_runtime.engine.twin import measure_capacity, run_twin
    from carbonforge_runtime.offline.sim.setup import at_load, capacity_engine

    out: dict[str, Any] = {}
    for trace in traces:
        inputs = twin_inputs(trace, limits[trace.name], slowdown, delay)
        twin, cost, served = inputs["twin"], inputs["cost"], inputs["served"]
        capacity = measure_capacity(served, capacity_engine(twin), cost)
        entry: dict[str, Any] = {
            "requests": len(inputs["base"].requests), "served": len(served), "capacity_rps": capacity * slowdown,
            "block_size": twin.block_size, "kv_tokens": twin.kv_tokens, "max_num_seqs": twin.max_num_seqs,
            "max_num_batched_tokens": twin.max_num_batched_tokens, "cost_model": inputs["base"].cost.name,
            "proxy": inputs["base"].cost.proxy, "admission_delay": delay, "loads": {}}
        log(f"twin: {trace.name}: {len(served)} requests, FCFS capacity {capacity * slowdown:.3f} req/s "
            f"(modelled GPU), KV {twin.kv_tokens} tokens in blocks of {twin.block_size}")
        for load in loads:
            requests, factor = at_load(served, load, capacity)
            cell: dict[str, Any] = {"rate_factor": factor, "arrivals": [
                {"index": r.index, "arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                 "output_tokens": r.output_tokens, "blocks": list(r.blocks) if r.blocks is not None else None,
                 "block_tokens": r.block_tokens} for r in requests], "twin": {}}
            for family in families_of(trace.name):
                if wanted is not None and family not in wanted:
                    continue
                started = time.process_time()
                run = run_twin(requests, dataclasses.replace(twin, family=family, params={}), cost)
                m = scaled_metrics(twin_metrics(run), slowdown)
                m["preemptions"] = float(sum(o.preemptions for o in run.outcomes))
                m["prefix_hit"] = (sum(o.cached_prompt_tokens or 0 for o in run.outcomes)
                                   / max(1, sum(o.prompt_tokens for o in run.outcomes)))
                cell["twin"][family] = m
                log(f"twin: {trace.name} @ {load:.0%} {family}: mean e2e {m['mean_e2e']:.2f} s, p99 "
                    f"{m['p99_e2e']:.2f} s, TTFT {m['mean_ttft']:.2f} s, {m['throughput']:.3f} req/s, "
                    f"{m['preemptions']:.0f} preemptions, prefix hits {m['prefix_hit']:.0%} "
                    f"({time.process_time() - started:.1f} s CPU)")
            entry["loads"][f"{load:g}"] = cell
        out[trace.name] = entry
    return out


# -- the paced engine ----------------------------------------------------------------------------------


def engine_prompt(arrival: dict[str, Any], salt: int) -> list[int]:
    """Token ids with the twin's prompt structure: each named content block is the same tokens
    wherever it appears (within one run), the rest is the request's own."""
    def block(key: tuple[Any, ...], size: int) -> list[int]:
        rng = random.Random(hash((salt, *key)))
        return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(size)]

    size_total = int(arrival["prompt_tokens"])
    blocks, size = arrival.get("blocks"), int(arrival.get("block_tokens") or 0)
    if not blocks or size < 1:
        return block(("own", arrival["index"]), size_total)
    out: list[int] = []
    for block_id in blocks:
        if len(out) >= size_total:
            break
        out.extend(block(("block", block_id), size))
    if len(out) < size_total:
        out.extend(block(("rest", arrival["index"]), size_total - len(out)))
    return out[:size_total]


def metric_counter(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith(name + "_created"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class PacedEngine:
    """``serve --emulate`` of the recipe with one family, its request trace and metrics."""

    def __init__(self, work: Path, family: str, slowdown: float, name: str | None = None) -> None:
        self.dir = work / f"engine-{name or family}"
        self.dir.mkdir(parents=True, exist_ok=True)
        recipes = self.dir / "recipes"
        recipes.mkdir(exist_ok=True)
        self.key = RECIPE if family == "fcfs" else RECIPE.replace("qwen3-32b:", f"qwen3-32b-tvp-{family}:", 1)
        if family != "fcfs":
            text = (REPO / "recipes" / "qwen3-32b--fp8--chat--a100-80x1.yaml").read_text()
            text = text.split("\nbenchmark:")[0].replace(f"key: {RECIPE}", f"key: {self.key}")
            text = text.replace("  family: fcfs\n  params: {}", f"  family: {family}\n  params: {{}}")
            (recipes / "recipe.yaml").write_text(text + "\n")
        self.trace = self.dir / "trace.jsonl"
        self.trace.unlink(missing_ok=True)
        self.steps = self.dir / "steps.jsonl"
        self.steps.unlink(missing_ok=True)
        self.metrics_port = free_port()
        self.process: EngineProcess = runtime(
            ["--context-key", self.key, "--emulate", "--emulate-slowdown", f"{slowdown:g}", "--metrics",
             "--request-trace", "standard", "--trace-file", str(self.trace), "--step-log", str(self.steps)],
            self.dir / "logs", env={"CF_RECIPES_DIR": str(recipes), "CF_METRICS_PORT": str(self.metrics_port)})
        self.tail = TraceTail(self.trace)
        self.served_name = "Qwen/Qwen3-32B-FP8"
        self.last_arrivals: dict[str, float] = {}

    def __enter__(self) -> PacedEngine:
        self.process.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.__exit__(*exc)

    def counters(self) -> tuple[float, float]:
        return (metric_counter(self.metrics_port, "carbonforge_engine_emulated_steps_total"),
                metric_counter(self.metrics_port, "carbonforge_engine_emulated_late_steps_total"))

    def serve(self, arrivals: list[dict[str, Any]], salt: int,
              deadline_s: float = 1800.0) -> tuple[list[dict[str, Any]], list[str]]:
        """Send ``arrivals`` at their times (the twin's, already dilated); the runtime's trace records."""
        from carbonforge_runtime.offline.replay.plan import PlannedRequest
        from carbonforge_runtime.offline.replay.runner import RunOptions, run_replay

        prompts = {a["index"]: engine_prompt(a, salt) for a in arrivals}

        class Planned(PlannedRequest):
            @property
            def prompt(self) -> list[int]:  # type: ignore[override]
                return prompts[self.index]

        first = arrivals[0]["arrival_s"]
        plan = [Planned(a["index"], a["arrival_s"] - first, a["prompt_tokens"], a["output_tokens"])
                for a in arrivals]
        options = RunOptions(base_url=self.process.base_url, model=self.served_name, concurrency=1024,
                             deadline_s=deadline_s, request_timeout_s=deadline_s, progress_every_s=1e9)
        with CollectorPauses() as pauses:
            result = asyncio.run(run_replay(plan, options))
        errors = sorted({o.error for o in result.outcomes if o.error})
        records = self.tail.wait({o.request_id for o in result.outcomes if o.request_id})
        during = pauses.worst_s(result.started_at, result.started_at + result.duration_s)
        self.last_arrivals = {**arrival_timing(result, records), "collector_pause_s": during}
        return records, errors


class CollectorPauses:
    """The garbage collector's pauses in this process (the load generator) while in the block, each
    with the Unix time it began, so that the ones inside the replay's clock can be told apart from
    the collection the replay makes before its clock starts."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float]] = []  # (Unix seconds at the start, seconds long)
        self._began: tuple[float, float] | None = None

    def _note(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = (time.time(), time.perf_counter())
        elif self._began is not None:
            self.pauses.append((self._began[0], time.perf_counter() - self._began[1]))
            self._began = None

    def worst_s(self, start: float, end: float) -> float:
        """The longest pause that began between ``start`` and ``end`` (Unix seconds)."""
        return max((length for at, length in self.pauses if start <= at <= end), default=0.0)

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._note)


def arrival_timing(result: Any, records: list[dict[str, Any]]) -> dict[str, float]:
    """How closely the arrivals the engine saw kept to the schedule, in real seconds.

    A request's lag is its arrival stamp (the API server's) less the time it was due; the run's
    median lag is the usual hand-over, so ``worst_excess_s`` is how much later than usual the most
    delayed request arrived: a stall of the load generator or of the API server. ``client_lag_s``
    is the load generator's own worst lateness in sending, which tells the two apart.
    """
    stamps = {r["request_id"]: r["t_arrival"] for r in records}
    lags = sorted(stamps[o.request_id] - (result.started_at + o.scheduled_s)
                  for o in result.outcomes if o.request_id in stamps)
    usual = lags[len(lags) // 2] if lags else 0.0
    sent = [o.sent_s - o.scheduled_s for o in result.outcomes if o.sent_s is not None]
    return {"worst_excess_s": (lags[-1] - usual) if lags else 0.0,
            "stalled": float(sum(lag - usual > ARRIVAL_STALL_S for lag in lags)),
            "client_lag_s": max(sent, default=0.0)}


def overtakers(records: list[dict[str, Any]]) -> int:
    """How many requests the engine admitted ahead of one that had arrived before them.

    A request is admitted at its arrival stamp plus its queue wait; requests taken in the same step
    share that moment (within ``SAME_STEP_S``). Zero means the run served in arrival order, so a
    family that reorders made the same decisions as FCFS there.
    """
    admitted = sorted((float(r["t_arrival"]), float(r["t_arrival"]) + float(r["queue_wait_s"]))
                      for r in records if r.get("queue_wait_s") is not None)
    latest, count = -math.inf, 0
    for _, at in admitted:
        count += at < latest - SAME_STEP_S
        latest = max(latest, at)
    return count


# -- the host's admission delay --------------------------------------------------------------------------


def calibration_loads(traces: list[Any], limits: dict[str, int], loads: list[float],
                      slowdown: float) -> dict[str, list[dict[str, Any]]]:
    """Per trace, the admission delay's calibration load: requests drawn (seeded) from its window,
    arriving as a Poisson process at the rate of its lowest load's cell (on the paced engine's clock),
    over about :data:`CALIBRATION_SPAN_S` seconds. Not the cells' own arrivals."""
    from carbonforge_runtime.engine.twin import measure_capacity
    from carbonforge_runtime.offline.sim.setup import at_load, capacity_engine

    out: dict[str, list[dict[str, Any]]] = {}
    for trace in traces:
        inputs = twin_inputs(trace, limits[trace.name], slowdown)
        served = inputs["served"]
        capacity = measure_capacity(served, capacity_engine(inputs["twin"]), inputs["cost"])
        cell, _ = at_load(served, min(loads), capacity)
        rate = (len(cell) - 1) / (cell[-1].arrival_s - cell[0].arrival_s)
        most, least = CALIBRATION_REQUESTS
        count = max(least, min(most, round(rate * CALIBRATION_SPAN_S), len(served)))
        rng = random.Random(f"calibration:{trace.name}")
        now, arrivals = 0.0, []
        for number, r in enumerate(rng.sample(served, min(count, len(served)))):
            arrivals.append({"index": number, "arrival_s": now, "prompt_tokens": r.prompt_tokens,
                             "output_tokens": r.output_tokens, "block_tokens": r.block_tokens,
                             "blocks": list(r.blocks) if r.blocks is not None else None})
            now += rng.expovariate(rate)
        out[trace.name] = arrivals
    return out


def request_intervals(step_log: Path) -> tuple[Any, Any, Any, Any]:
    """(arrival stamps, prompt tokens, shortest and longest delays in ms) of a step log's request lines."""
    import numpy as np

    from carbonforge_runtime.offline.sim.calibrate import admission_intervals, read_step_log

    data = read_step_log(step_log)
    return (np.asarray(data.arrival, dtype=float), *admission_intervals(data))


def fit_figures(fit: Any) -> dict[str, Any]:
    """What the report keeps of an admission delay's fit (an AdmissionFit)."""
    return {"base_ms": fit.base_ms, "per_prompt_token_ms": fit.per_prompt_token_ms, "requests": fit.requests,
            "exact": fit.exact, "mean_ms": fit.mean_ms, "mean_to_scheduler_ms": fit.mean_to_scheduler_ms,
            "mean_miss_ms": fit.mean_miss_ms}


def calibrate_admission(work: Path, traces: list[Any], limits: dict[str, int], loads: list[float],
                        slowdown: float) -> dict[str, Any]:
    """Serve the calibration loads on a paced engine of their own (FCFS) and fit the admission delay
    to its step log's request lines (the warm-up's left out); per trace, the mean time from the
    arrival stamp to the scheduler and the fitted mean delay are kept for the report."""
    from carbonforge_runtime.offline.sim.calibrate import fit_admission

    loads_by_trace = calibration_loads(traces, limits, loads, slowdown)
    log(f"\n== the host's admission delay: a paced engine serves {sum(map(len, loads_by_trace.values()))} "
        f"calibration requests ({', '.join(f'{k} {len(v)}' for k, v in loads_by_trace.items())})")
    started = time.monotonic()
    spans: dict[str, tuple[float, float]] = {}
    with PacedEngine(work, "fcfs", slowdown, name="calibration") as engine:
        log(f"calibration: ready in {time.monotonic() - started:.0f} s")
        warm = next(iter(loads_by_trace.values()))[:WARMUP_REQUESTS]
        engine.serve([{**a, "arrival_s": 0.0} for a in warm], 10_000)
        for number, (name, arrivals) in enumerate(loads_by_trace.items()):
            begin = time.time()
            records, errors = engine.serve(arrivals, 10_001 + number)
            spans[name] = (begin, time.time())
            log(f"calibration: {name}: {len(records)}/{len(arrivals)} served"
                + (f"; errors: {errors}" if errors else ""))
    # The engine has stopped, so its step log is complete.
    arrival, prompt, low, high = request_intervals(engine.steps)
    keep = arrival >= min(begin for begin, _ in spans.values())
    fit = fit_admission(prompt[keep], low[keep], high[keep])
    if fit is None:
        raise SystemExit(f"calibration: too few request lines in {engine.steps} to fit the admission delay; "
                         "pass --admission-delay none, or a model file or step log that has them")
    per_trace = {}
    for name, (begin, end) in spans.items():
        chosen = (arrival >= begin) & (arrival <= end)
        if chosen.any():
            per_trace[name] = {"requests": int(chosen.sum()), "mean_to_scheduler_ms": float(high[chosen].mean()),
                               "mean_fitted_ms": float((fit.base_ms + fit.per_prompt_token_ms * prompt[chosen]).mean())}
    delay = {**fit_figures(fit), "source": f"calibrated on this host ({fit.requests} requests, {fit.exact} known "
             "exactly)", "per_trace": per_trace, "calibration_s": time.monotonic() - started}
    log(f"calibration: admission delay {fit.base_ms:.3g} ms + {fit.per_prompt_token_ms:.3g} ms per prompt token of "
        f"host time, {fit.mean_ms:.3g} ms on average ({fit.mean_to_scheduler_ms:.3g} ms to the scheduler with the "
        f"wait for a step boundary); {delay['calibration_s']:.0f} s")
    for name, figures in per_trace.items():
        log(f"calibration: {name}: to the scheduler {figures['mean_to_scheduler_ms']:.3g} ms, fitted delay "
            f"{figures['mean_fitted_ms']:.3g} ms on average ({figures['requests']} requests)")
    return delay


def admission_delay(choice: str, work: Path, traces: list[Any], limits: dict[str, int], loads: list[float],
                    slowdown: float) -> dict[str, Any]:
    """The host's admission delay the twin is given: measured here (``calibrate``), none, or read from
    a model file (its ``admission_delay_ms``) or fitted to a step log's request lines."""
    if choice == "none":
        return dict(NO_DELAY)
    if choice == "calibrate":
        return calibrate_admission(work, traces, limits, loads, slowdown)
    path = Path(choice)
    if path.suffix in (".yaml", ".yml"):
        from carbonforge_runtime.core.step_models import load_model_file

        model = load_model_file(path)
        if not model.has_admission_delay:
            log(f"admission delay: {path} has none (no admission_delay_ms section): the twin adds none")
        return {"base_ms": model.admission_base_ms, "per_prompt_token_ms": model.admission_per_prompt_token_ms,
                "source": f"the model file {path}"}
    from carbonforge_runtime.offline.sim.calibrate import fit_admission

    fit = fit_admission(*request_intervals(path)[1:])
    if fit is None:
        raise SystemExit(f"{path}: too few request lines to fit the admission delay (a step log written before "
                         "they existed?); pass --admission-delay calibrate, none, or a model file")
    return {**fit_figures(fit), "source": f"fitted to the step log {path} ({fit.requests} requests)"}


def run_order(predicted: dict[str, Any], wanted: set[str] | None) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(family, its runs in order as (run name, trace, load)): one engine per family; FCFS serves
    every cell twice, the second pass after the first."""
    families: list[str] = []
    for trace in predicted:
        for family in families_of(trace):
            if family not in families and (wanted is None or family in wanted):
                families.append(family)
    order = []
    for family in families:
        runs: list[tuple[str, str, str]] = []
        for run_name in ([family, AGAIN] if family == "fcfs" else [family]):
            for trace, entry in predicted.items():
                if family in families_of(trace):
                    runs.extend((run_name, trace, load) for load in entry["loads"])
        order.append((family, runs))
    return order


def run_engines(work: Path, predicted: dict[str, Any], slowdown: float, wanted: set[str] | None,
                results: dict[str, Any], save: Any) -> None:
    salt = 0
    for family, runs in run_order(predicted, wanted):
        log(f"\npaced: starting the engine for {family} (slowdown {slowdown:g})")
        started = time.monotonic()
        with PacedEngine(work, family, slowdown) as engine:
            log(f"paced: ready in {time.monotonic() - started:.0f} s")
            warm = next(iter(next(iter(predicted.values()))["loads"].values()))["arrivals"][:WARMUP_REQUESTS]
            salt += 1
            engine.serve([{**a, "arrival_s": 0.0} for a in warm], salt)
            for run_name, trace, load in runs:
                cell = predicted[trace]["loads"][load]
                discarded: list[dict[str, Any]] = []
                for attempt in range(1, MAX_ATTEMPTS + 1):
                    salt += 1
                    row = serve_run(engine, cell, salt, slowdown)
                    tw = cell["twin"].get(family, {})
                    log(f"paced: {trace} @ {float(load):.0%} {run_name}: {row['n']:.0f}/{row['sent']} in "
                        f"{row['wall_s']:.0f} s: mean e2e {row['mean_e2e']:.2f} s "
                        f"(twin {tw.get('mean_e2e', math.nan):.2f}), "
                        f"p99 {row['p99_e2e']:.2f} s ({tw.get('p99_e2e', math.nan):.2f}), "
                        f"TTFT {row['mean_ttft']:.2f} s ({tw.get('mean_ttft', math.nan):.2f}), "
                        f"{row['throughput']:.3f} req/s ({tw.get('throughput', math.nan):.3f}); "
                        f"late {row['late_steps']:.0f}/{row['steps']:.0f} steps; arrivals at worst "
                        f"{row['arrival_excess_s'] * 1000:.0f} ms late; load {row['loadavg_start']:.2f}"
                        + (f"; errors: {row['errors']}" if row["errors"] else ""))
                    why = unfaithful(row)
                    if not why or attempt == MAX_ATTEMPTS:
                        break
                    log(f"paced: not faithful ({why}): served again (attempt {attempt + 1} of {MAX_ATTEMPTS})")
                    discarded.append({**row, "why": why})
                results.setdefault(trace, {}).setdefault(load, {})[run_name] = {**row, "discarded": discarded}
                save()


def serve_run(engine: PacedEngine, cell: dict[str, Any], salt: int, slowdown: float) -> dict[str, Any]:
    """One run of a cell's arrivals: the request figures (modelled seconds), step and arrival counts."""
    steps0, late0 = engine.counters()
    load0, t0 = loadavg(), time.monotonic()
    records, errors = engine.serve(cell["arrivals"], salt)
    wall = time.monotonic() - t0
    steps1, late1 = engine.counters()
    m = scaled_metrics(request_figures(records), slowdown)
    steps, late = steps1 - steps0, late1 - late0
    arrivals = engine.last_arrivals
    return {**m, "steps": steps, "late_steps": late, "late_share": late / steps if steps else 0.0,
            "arrival_excess_s": arrivals["worst_excess_s"], "stalled_arrivals": arrivals["stalled"],
            "client_lag_s": arrivals["client_lag_s"], "collector_pause_s": arrivals["collector_pause_s"],
            "overtakers": overtakers(records), "loadavg_start": load0, "loadavg_end": loadavg(),
            "wall_s": wall, "errors": errors, "sent": len(cell["arrivals"])}


def unfaithful(row: dict[str, Any]) -> str:
    """Why a paced run does not show what the modelled GPU would do ('' when it does)."""
    why = []
    if row["late_share"] > LATE_LIMIT:
        why.append(f"{row['late_share']:.1%} of steps late")
    if row.get("stalled_arrivals", 0):
        why.append(f"{row['stalled_arrivals']:.0f} arrivals stalled, the worst {row['arrival_excess_s'] * 1000:.0f} ms"
                   f" (load generator's worst send lag {row['client_lag_s'] * 1000:.0f} ms, its longest "
                   f"collector pause {row.get('collector_pause_s', math.nan) * 1000:.0f} ms)")
    if row["n"] != row["sent"]:
        why.append(f"{row['sent'] - row['n']:.0f} requests not served")
    return "; ".join(why)


def gpu_block_check(traces: list[Any], limits: dict[str, int], predicted: dict[str, Any],
                    slowdown: float) -> dict[str, Any]:
    """The twin's FCFS prediction of each cell with the GPU's KV blocks of 16 tokens (and the KV cache
    the GPU's token count holds in them) against the served engine's blocks of 32: how much the CPU
    engine's coarser prefix-cache granularity moves the figures."""
    from carbonforge_runtime.core.twin_data import SimRequest
    from carbonforge_runtime.engine.twin import run_twin
    from carbonforge_runtime.runtime.planning.emulate import GPU_BLOCK_SIZE

    out: dict[str, Any] = {}
    for trace in traces:
        if trace.name not in predicted:
            continue
        inputs = twin_inputs(trace, limits[trace.name], slowdown, predicted[trace.name].get("admission_delay"))
        base = inputs["base"]
        gpu = dataclasses.replace(inputs["twin"], block_size=GPU_BLOCK_SIZE,
                                  kv_tokens=base.cost.kv_capacity_tokens // GPU_BLOCK_SIZE * GPU_BLOCK_SIZE,
                                  family="fcfs", params={})
        for load, cell in predicted[trace.name]["loads"].items():
            if "fcfs" not in cell["twin"]:
                continue
            requests = [SimRequest(a["index"], a["arrival_s"], a["prompt_tokens"], a["output_tokens"],
                                   tuple(a["blocks"]) if a["blocks"] is not None else None, a["block_tokens"])
                        for a in cell["arrivals"]]
            m = scaled_metrics(twin_metrics(run_twin(requests, gpu, inputs["cost"])), slowdown)
            change = {k: rel(m[k], cell["twin"]["fcfs"][k]) for k, _ in METRICS}
            out.setdefault(trace.name, {})[load] = {"twin_block16": m, "change_vs_block32": change}
            log(f"blocks of 16: {trace.name} @ {float(load):.0%} fcfs: " + ", ".join(
                f"{label} {change[k]:+.1%}" for k, label in METRICS) + " against blocks of 32")
    return out


def run_speeds(work: Path, traces: list[Any], limits: dict[str, int], predicted: dict[str, Any],
               results: dict[str, Any], slowdown: float, wanted: set[str] | None) -> None:
    """After the fact, from each engine's step log: how much longer than modelled each run's steps
    lasted in all (``speed``: their wall time over their modelled time; ``late_excess_share``: the
    time late steps ran past their modelled ends, over the run's busy time), and the twin's
    prediction again with every step that much longer (``twin_at_run_speed``). The second is not a
    prediction (it uses the run's own step log); it tells how much of a miss the late steps explain.
    Where the step log has request lines, the admission delay fitted to the run's own requests
    (``admission_in_run``) says how well the calibration's delay held during the run."""
    from carbonforge_runtime.core.twin_data import step_time_s
    from carbonforge_runtime.engine.twin import run_twin
    from carbonforge_runtime.offline.sim.calibrate import fit_admission
    from carbonforge_runtime.offline.sim.inputs import WindowOptions  # noqa: F401 (twin_inputs reads it)

    by_name = {t.name: t for t in traces}
    inputs: dict[str, dict[str, Any]] = {}
    for family, runs in run_order(predicted, wanted):
        directory = work / f"engine-{family}"
        if not (directory / "trace.jsonl").exists() or not (directory / "steps.jsonl").exists():
            continue
        records = sorted(jsonl_records(directory / "trace.jsonl"), key=lambda r: float(r["t_arrival"]))
        steps = [r for r in jsonl_records(directory / "steps.jsonl")
                 if r.get("kind") == "step" and r.get("batched_tokens", 0) > 0]
        stamps, prompts, shortest, longest = request_intervals(directory / "steps.jsonl")
        position = WARMUP_REQUESTS
        for run_name, trace, load in runs:
            cell = predicted[trace]["loads"][load]
            chunk = records[position:position + len(cell["arrivals"])]
            position += len(cell["arrivals"])
            row = results.get(trace, {}).get(load, {}).get(run_name)
            if row is None or not chunk:
                continue
            if trace not in inputs:
                inputs[trace] = twin_inputs(by_name[trace], limits[trace], slowdown,
                                            predicted[trace].get("admission_delay"))
            twin, cost = inputs[trace]["twin"], inputs[trace]["cost"]
            low = min(float(r["t_arrival"]) for r in chunk)
            high = max(float(r["t_completion"]) for r in chunk)
            window = [r for r in steps if low <= r["t"] <= high + 1e-3]
            modelled = [step_time_s(cost, r["batched_tokens"], r["kv_read_tokens"], r["attention_units"])
                        for r in window]
            walls = [float(r["wall_s"]) for r in window]
            if not window or sum(modelled) <= 0:
                continue
            speed = sum(walls) / sum(modelled)
            excess = sum(w - m for w, m in zip(walls, modelled, strict=True) if w > m * 1.02)
            row["speed"] = speed
            row["late_excess_share"] = excess / sum(walls)
            row["step_log_steps"] = len(window)
            chosen = (stamps >= low) & (stamps <= high)
            fitted = fit_admission(prompts[chosen], shortest[chosen], longest[chosen])
            if fitted is not None:
                row["admission_in_run"] = fit_figures(fitted)
                log(f"admission: {trace} @ {float(load):.0%} {run_name}: the run's own requests give "
                    f"{fitted.mean_ms:.3g} ms on average (to the scheduler {fitted.mean_to_scheduler_ms:.3g} ms)")
            slower = dataclasses.replace(
                cost, floor_ms=cost.floor_ms * speed, per_batched_token_ms=cost.per_batched_token_ms * speed,
                per_kv_token_read_ms=cost.per_kv_token_read_ms * speed, attention_ms=cost.attention_ms * speed,
                overhead_ms=cost.overhead_ms * speed)
            from carbonforge_runtime.core.twin_data import SimRequest

            requests = [SimRequest(a["index"], a["arrival_s"], a["prompt_tokens"], a["output_tokens"],
                                   tuple(a["blocks"]) if a["blocks"] is not None else None, a["block_tokens"])
                        for a in cell["arrivals"]]
            family_of_run = "fcfs" if run_name == AGAIN else run_name
            run = run_twin(requests, dataclasses.replace(twin, family=family_of_run, params={}), slower)
            row["twin_at_run_speed"] = scaled_metrics(twin_metrics(run), slowdown)
            log(f"run speed: {trace} @ {float(load):.0%} {run_name}: steps {speed - 1:+.2%} against the model "
                f"(late steps' overrun {row['late_excess_share']:.2%} of the busy time); the twin at that speed: "
                f"mean e2e {row['twin_at_run_speed']['mean_e2e']:.2f} s (paced {row['mean_e2e']:.2f})")


# -- the report ----------------------------------------------------------------------------------------


def admission_line(delay: dict[str, Any], slowdown: float) -> str:
    """The report's sentence on the admission delay the twin was given."""
    if not (delay.get("base_ms") or delay.get("per_prompt_token_ms")):
        return "The twin adds no admission delay (the API server's time before the engine core).\n\n"
    text = (f"The twin adds the host's admission delay, {delay['base_ms']:.3g} ms + "
            f"{delay['per_prompt_token_ms']:.3g} ms per prompt token of real time ({delay['source']}), not "
            f"dilated by the slowdown: in the modelled GPU's seconds it counts {1 / slowdown:g} times.")
    if "mean_ms" in delay:
        text += (f" Mean delay {delay['mean_ms']:.3g} ms; arrival stamp to the scheduler "
                 f"{delay['mean_to_scheduler_ms']:.3g} ms with the wait for a step boundary.")
    for name, figures in delay.get("per_trace", {}).items():
        text += (f" {name}: {figures['mean_to_scheduler_ms']:.3g} ms to the scheduler, fitted delay "
                 f"{figures['mean_fitted_ms']:.3g} ms.")
    return text + "\n\n"


def rel(pred: float, real: float) -> float:
    return (pred - real) / real if real and math.isfinite(pred) and math.isfinite(real) else math.nan


def report(predicted: dict[str, Any], results: dict[str, Any], slowdown: float) -> tuple[str, dict[str, Any]]:
    lines = ["| trace | load | family | " + " | ".join(f"{label} twin / paced (err)" for _, label in METRICS)
             + " | meets targets | FCFS vs FCFS (e2e, p99, TTFT, req/s) | late steps; worst arrival lag (real)"
             " | steps vs model (late overrun)"
             " | twin at the run's step speed: errors (e2e, p99, TTFT, req/s) | load avg |",
             "|---|---|---|" + "---|" * len(METRICS) + "---|---|---|---|---|---|"]
    cells: list[dict[str, Any]] = []
    ranking: list[dict[str, Any]] = []
    for trace, entry in predicted.items():
        for load, cell in entry["loads"].items():
            served = results.get(trace, {}).get(load, {})
            repeat = None
            if "fcfs" in served and AGAIN in served:
                repeat = {m: abs(rel(served[AGAIN][m], served["fcfs"][m])) for m, _ in METRICS}
            for run_name in [*families_of(trace)[:1], AGAIN, *families_of(trace)[1:]]:
                family = "fcfs" if run_name == AGAIN else run_name
                twin = cell["twin"].get(family)
                paced = served.get(run_name)
                if twin is None or paced is None:
                    continue
                errs = {m: rel(twin[m], paced[m]) for m, _ in METRICS}
                ok = {m: math.isfinite(errs[m]) and abs(errs[m]) <= TARGETS[m] for m, _ in METRICS}
                faithful = not unfaithful(paced)
                at_speed = paced.get("twin_at_run_speed")
                errs_speed = None if at_speed is None else {m: rel(at_speed[m], paced[m]) for m, _ in METRICS}
                cells.append({"trace": trace, "load": float(load), "run": run_name, "family": family, "twin": twin,
                              "paced": paced, "errors": errs, "pass": ok, "all_pass": all(ok.values()),
                              "faithful": faithful, "repeat": repeat, "errors_at_run_speed": errs_speed,
                              "all_pass_at_run_speed": None if errs_speed is None else all(
                                  math.isfinite(errs_speed[m]) and abs(errs_speed[m]) <= TARGETS[m]
                                  for m, _ in METRICS)})
                speed = ("-" if "speed" not in paced else
                         f"{paced['speed'] - 1:+.1%} ({paced['late_excess_share']:.1%})")
                speed_errs = "-" if errs_speed is None else ", ".join(f"{errs_speed[m]:+.1%}" for m, _ in METRICS)
                rep = ("-" if repeat is None else ", ".join(
                    f"{repeat[m]:.1%}{'' if repeat[m] <= REPEAT_TARGET else '!'}" for m, _ in METRICS))
                missed = [label for m, label in METRICS if not ok[m]]
                verdict = "yes" if not missed else "no: " + ", ".join(missed)
                late = (f"{paced['late_share']:.2%} ({paced['late_steps']:.0f}/{paced['steps']:.0f}); "
                        + ("-" if "arrival_excess_s" not in paced else f"{paced['arrival_excess_s'] * 1000:.0f} ms")
                        + (f"; attempt {len(paced['discarded']) + 1}" if paced.get("discarded") else ""))
                lines.append(
                    f"| {trace} | {float(load):.0%} | {run_name} | " + " | ".join(
                        f"{twin[m]:.3f} / {paced[m]:.3f} ({errs[m]:+.1%})" for m, _ in METRICS)
                    + f" | {verdict} | {rep if run_name == 'fcfs' else ''} | {late}"
                    + ("" if faithful else " NOT FAITHFUL")
                    + f" | {speed} | {speed_errs} | {paced['loadavg_start']:.1f}-{paced['loadavg_end']:.1f} |")
            # Ranking: pairs of families whose paced difference exceeds FCFS's own noise on this cell.
            fams = [f for f in families_of(trace) if f in served and f in cell["twin"]]
            for i, a in enumerate(fams):
                for b in fams[i + 1:]:
                    for m, _ in METRICS:
                        diff = abs(rel(served[a][m], served[b][m]))
                        floor = None if repeat is None else repeat[m]
                        # Both families admitted every request in arrival order: the same decisions,
                        # so what differs between the two runs is the engine's noise, not the family.
                        same_order = served[a].get("overtakers") == 0 and served[b].get("overtakers") == 0
                        judged = floor is not None and diff > floor and not same_order
                        entry_r = {"trace": trace, "load": float(load), "a": a, "b": b, "metric": m,
                                   "paced_diff": diff, "noise": floor, "judged": judged, "same_order": same_order,
                                   "twin_tie": abs(rel(cell["twin"][a][m], cell["twin"][b][m])) < 1e-6}
                        if judged:
                            paced_a = (served[a][m] < served[b][m]) == LOWER_IS_BETTER[m]
                            twin_a = (cell["twin"][a][m] < cell["twin"][b][m]) == LOWER_IS_BETTER[m]
                            tie = entry_r["twin_tie"]
                            entry_r.update({"paced_better": a if paced_a else b,
                                            "twin_better": "neither (a tie)" if tie else (a if twin_a else b),
                                            "agrees": not tie and paced_a == twin_a})
                        ranking.append(entry_r)
    judged_pairs = [r for r in ranking if r["judged"]]
    agree = sum(r["agrees"] for r in judged_pairs)
    passed = sum(c["all_pass"] for c in cells)
    repeat_ok = [c for c in cells if c["run"] == "fcfs" and c["repeat"] is not None]
    speed_cells = [c for c in cells if c["all_pass_at_run_speed"] is not None]
    faithful_cells = [c for c in cells if c["faithful"]]
    lines += ["", f"Cells meeting every target: {passed} of {len(cells)} (of the {len(faithful_cells)} faithful ones: "
              f"{sum(c['all_pass'] for c in faithful_cells)}). With the twin's steps as long "
              f"as each run's own steps were (after the fact, not a prediction): "
              f"{sum(bool(c['all_pass_at_run_speed']) for c in speed_cells)} of {len(speed_cells)}.",
              "", f"FCFS served twice within {REPEAT_TARGET:.0%} of itself on every metric: "
              f"{sum(all(v <= REPEAT_TARGET for v in c['repeat'].values()) for c in repeat_ok)} of {len(repeat_ok)} "
              f"cells. Ranking: {agree} of {len(judged_pairs)} judged pairs (family pairs and metrics whose paced "
              f"difference exceeds that cell's FCFS noise) ranked by the twin as by the paced engine."]
    alike = [r for r in ranking if r["same_order"]]
    if alike:
        where = ", ".join(sorted({f"{r['trace']} @ {r['load']:.0%}" for r in alike}))
        lines[-1] += (f" Not judged: {len(alike)} family pairs and metrics where both families admitted every "
                      f"request in arrival order on the paced engine, so they made the same decisions and their "
                      f"difference is the engine's noise ({where}); the twin predicts a tie on "
                      f"{sum(r['twin_tie'] for r in alike)} of them.")
    again = [c for c in cells if c["paced"].get("discarded")]
    lines += ["", f"Runs served again because an attempt was not faithful (more than 1% of steps late, an arrival "
              f"stalled more than {ARRIVAL_STALL_S * 1000:.0f} ms, a request lost; at most {MAX_ATTEMPTS} attempts, "
              f"every one in the JSON): {len(again)}."]
    for c in again:
        for k, d in enumerate(c["paced"]["discarded"], 1):
            lines.append(f"- {c['trace']} @ {c['load']:.0%} {c['run']}, attempt {k}: {d['why']}; its mean TTFT "
                         f"{d['mean_ttft']:.3f} s, mean e2e {d['mean_e2e']:.3f} s (kept attempt: "
                         f"{c['paced']['mean_ttft']:.3f} s, {c['paced']['mean_e2e']:.3f} s)")
    for r in judged_pairs:
        if not r["agrees"]:
            lines.append(f"- disagrees: {r['trace']} @ {r['load']:.0%} {r['a']} vs {r['b']}, {r['metric']}: paced "
                         f"{r['paced_better']} better by {r['paced_diff']:.1%} (noise {r['noise']:.1%}), twin "
                         f"{r['twin_better']}")
    figures = {"cells": cells, "ranking": ranking, "targets": TARGETS, "repeat_target": REPEAT_TARGET,
               "late_limit": LATE_LIMIT, "slowdown": slowdown, "recipe": RECIPE,
               "traces": {t: {k: v for k, v in e.items() if k != "loads"} | {"loads": {
                   load: {"rate_factor": c["rate_factor"], "requests": len(c["arrivals"]), "twin": c["twin"]}
                   for load, c in e["loads"].items()}} for t, e in predicted.items()}}
    return "\n".join(lines), figures


def main() -> int:
    if os.environ.get("PYTHONHASHSEED") != HASH_SEED:
        os.environ["PYTHONHASHSEED"] = HASH_SEED
        os.execv(sys.executable, [sys.executable, *sys.argv])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--emulate-slowdown", type=float, default=0.5, help="every step (and gap) K times the model")
    parser.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS))
    parser.add_argument("--only", default=",".join(TRACES), help="traces to run")
    parser.add_argument("--families", default=None, help="only these families (default: every family of a cell)")
    parser.add_argument("--limit", action="append", default=[], metavar="TRACE=N",
                        help="requests of a trace's window (defaults: "
                             + ", ".join(f"{k}={v}" for k, v in DEFAULT_LIMITS.items()) + ")")
    parser.add_argument("--work", type=Path, default=Path("/work/bench-out/twin_vs_paced"))
    parser.add_argument("--admission-delay", default="calibrate", metavar="calibrate|none|FILE",
                        help="the host's delay from a request's arrival stamp to the engine core, which the twin "
                             "adds: measured here before the predictions (calibrate, the default), none, or from a "
                             "model file (.yaml, its admission_delay_ms) or a step log with request lines")
    parser.add_argument("--predict-only", action="store_true")
    parser.add_argument("--report-only", action="store_true",
                        help="no new runs: the report from the predictions and paced runs already in --work")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    from benchmarks.ordering_twin import make_traces

    limits = dict(DEFAULT_LIMITS)
    for item in args.limit:
        name, _, value = item.partition("=")
        limits[name] = int(value)
    only = [t for t in args.only.split(",") if t]
    loads = [float(x) for x in args.loads.split(",") if x]
    wanted = set(args.families.split(",")) if args.families else None
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    made = {"commit": commit(), "command": command()}
    with tempfile.TemporaryDirectory() as tmp:
        traces = [t for t in make_traces(Path(tmp), max(limits.values())) if t.name in only]
        if args.report_only:
            predicted = json.loads((work / "predicted.json").read_text())
            results: dict[str, Any] = json.loads((work / "paced.json").read_text())
            timing = json.loads((work / "timing.json").read_text()) if (work / "timing.json").exists() else {}
            wall = float(timing.get("wall_s", (work / "paced.json").stat().st_mtime
                                    - (work / "predicted.json").stat().st_mtime))
            if "commit" in timing:  # the runs' own provenance beside the report's
                made = {**made, "runs_commit": timing["commit"], "runs_command": timing["command"]}
        else:
            delay = admission_delay(args.admission_delay, work, traces, limits, loads, args.emulate_slowdown)
            log(f"\n== the twin predicts every cell first ({RECIPE}, slowdown {args.emulate_slowdown:g}, admission "
                f"delay {delay['base_ms']:.3g} ms + {delay['per_prompt_token_ms']:.3g} ms per prompt token of host "
                f"time: {delay['source']})")
            predicted = predict(traces, limits, loads, args.emulate_slowdown, wanted, delay)
            (work / "predicted.json").write_text(json.dumps(predicted))
            log(f"predictions written to {work / 'predicted.json'} ({time.monotonic() - started:.0f} s)")
            results = {}

            def save() -> None:
                (work / "paced.json").write_text(json.dumps(results, indent=1))

            if not args.predict_only:
                log("\n== the paced engine serves the same arrivals")
                run_engines(work, predicted, args.emulate_slowdown, wanted, results, save)
            wall = time.monotonic() - started
            (work / "timing.json").write_text(json.dumps({"wall_s": wall, **made}))
        if results:
            log("\n== after the fact: each run's step times against the model")
            run_speeds(work, traces, limits, predicted, results, args.emulate_slowdown, wanted)
        log("\n== the twin with the GPU's KV blocks of 16 tokens instead of the CPU engine's 32")
        blocks16 = gpu_block_check(traces, limits, predicted, args.emulate_slowdown)
    text, figures = report(predicted, results, args.emulate_slowdown)
    figures["gpu_blocks"] = blocks16
    if blocks16:
        worst = max((abs(v) for t in blocks16.values() for c in t.values() for v in c["change_vs_block32"].values()
                     if math.isfinite(v)), default=0.0)
        text += (f"\n\nThe twin's FCFS prediction with the GPU's KV blocks of 16 tokens instead of the CPU "
                 f"engine's 32 changes by at most {worst:.1%} on any figure of any cell (JSON: `gpu_blocks`).")
    model = next(iter(predicted.values()))["cost_model"] if predicted else "?"
    used = next(iter(predicted.values())).get("admission_delay", NO_DELAY) if predicted else NO_DELAY
    header = (f"Twin against the paced engine: {RECIPE} (step-time model {model}, a proxy), `serve --emulate "
              f"--emulate-slowdown {args.emulate_slowdown:g}`, all figures in the modelled GPU's seconds. "
              f"Matrix wall time {wall / 60:.0f} min.\n\n" + admission_line(used, args.emulate_slowdown))
    runs = (f"\nRuns made at commit `{made['runs_commit']}` by `{made['runs_command']}`"
            if "runs_commit" in made else "")
    text = header + text + f"\n\nCommit: `{made['commit']}`\nCommand: `{made['command']}`{runs}\n"
    log("\n" + text)
    if args.markdown is not None:
        args.markdown.write_text(text)
    if args.json is not None:
        args.json.write_text(json.dumps({**figures, **made, "wall_s": wall, "paced": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
