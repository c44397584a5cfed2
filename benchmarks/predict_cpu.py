#!/usr/bin/env python
"""Does the twin predict the real engine? The prediction check on the CPU engine.

The served model is a random-weight Qwen2 of ``--layers`` layers (default 8, width 256) built from
the built-in tiny model's tokenizer: with the 2-layer built-in model a decode step takes about
1.5 ms and the HTTP front end, which shares a CPU with the engine core, saturates before the engine
does (the engine then sees the front end's pace, not the trace's); 8 layers make the engine the
bottleneck, as a GPU engine serving a large model is. ``--layers 0`` serves the built-in model.

1. ``traces``: two synthetic traces in our JSONL format, from different distributions and seeds:
   A (calibration: log-normal prompts, uniform outputs, an arrival rate that ramps up and down)
   and B (prediction: bimodal prompts, exponential outputs, steady Poisson arrivals). Prompts up
   to 1,500 tokens, outputs up to 200 (forced with ``max_tokens`` and ``ignore_eos`` by the
   replay). Their time stamps are written at 1 request/s on average; later phases scale them.
2. ``calibrate``: serves the recipe (FCFS) with ``--step-log``, measures the engine's capacity on
   a burst of A's first requests, replays A at a rate that ramps from about 0.5 to 1.3 times that
   capacity (so the log holds light and saturated batches), and stops it (SIGTERM).
3. ``fit``: a step-time model from that log with ``sim-calibrate`` (its fit line is printed).
4. ``predict``: sets B's rate to ``--load`` of the calibrated twin's FCFS capacity (``sim
   --load``), writes the scaled trace ``trace-b.jsonl``, and predicts it with ``sim`` for every
   family, with the served recipe's knobs, synchronous scheduling (as on CPU) and the real
   engine's KV capacity (from the step log's engine line, checked against the engine log).
5. ``real``: replays ``trace-b.jsonl`` against the real engine, one engine start per family, and
   FCFS a second time (``fcfs-again``: the noise floor), each with a step log. Every figure comes
   from the runtime's own request trace (arrival at the engine to completion), which has the same
   format as ``sim``'s per-request records. Before B is served, each engine repeats the chain
   (:func:`calibrate_locally`): it serves A at the calibration's rate, a model is fitted to those
   steps and the twin predicts B with it, still before B is sent. The machine's speed changes
   between engine starts by tens of percent; this second blind prediction is calibrated a minute
   before its run, on the same engine.
6. ``engine-side``: after the fact, the fitted model's price of each run's logged steps against
   their wall time (the machine's speed during the run); the twin predicts B again with the model
   scaled to that speed, from the offered arrivals and then from each run's own records, i.e. the
   arrival times at the scheduler (the HTTP front end taken out as well).
7. ``report``: per run, predicted against real mean and p99 e2e, mean TTFT and throughput with the
   error, for the offered arrivals (as calibrated once, as calibrated on each run's engine, at the
   run's speed) and the engine-side arrivals; the HTTP front end's delay (the client's send to the
   arrival at the scheduler); FCFS against itself per metric; and whether the twin ranks the
   families as the real engine does where the real difference exceeds the noise floor. Targets:
   mean e2e and throughput within 15%, p99 e2e within 25% (PASS/MISS printed; the exit status is 0
   either way).

Everything lands in ``--work``; each phase reads what the earlier ones wrote, so they can run
separately (``--phase calibrate``, later ``--phase real``). ``--phase all`` runs them in order
(about 12 minutes on 2 cores: four engine starts)::

    PYTHONPATH=. .venv/bin/python benchmarks/predict_cpu.py --work /work/bench-out/predict --json predict.json

The engine's worker is pinned to the first CPU and everything else to the others (as in
``bench_ordering.py``), and the engine core's spinning main thread runs at nice 19 so that the API
server and the client beside it are not starved (``lower_engine_core`` in ``harness.py``);
``--no-pin`` leaves all of them alone. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.harness import (  # noqa: E402
    EngineProcess,
    TraceTail,
    command,
    commit,
    engine_header,
    jsonl_records,
    lower_engine_core,
    percentile,
    pin_processes,
    request_figures,
    runtime,
    tiny_model_dir,
    tiny_served_name,
)
from carbonforge_runtime.offline.replay.trace import write_jsonl  # noqa: E402

PHASES = ("traces", "calibrate", "fit", "predict", "real", "engine-side", "report")
SEED_A, SEED_B = 11, 23
T0 = 1_700_000_000.0
MAX_PROMPT, MAX_OUTPUT = 1500, 200

#: The served engine: a queue forms at a few requests per second, and 512 tokens a step make long
#: prompts prefill in several chunks.
MAX_NUM_SEQS = 4
MAX_NUM_BATCHED_TOKENS = 512
KV_BLOCKS = 512
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
MAX_MODEL_LEN = 2048

#: Family parameters: the defaults. (With ``cache_lookup_limit: 128``, ltr-promptlen's steps on the
#: CPU engine took 11% longer than the FCFS-calibrated model says; the twin does not charge the
#: ordering's own CPU time, a visible share of a 3 ms step.)
PARAMS: dict[str, dict[str, Any]] = {
    "fcfs": {},
    "ltr-promptlen": {},
    "affinity": {"aging_rate": 200.0},
}
AGAIN = "fcfs-again"
TARGETS = {"mean_e2e": 0.15, "throughput": 0.15, "p99_e2e": 0.25}
METRICS = (("mean_e2e", "mean e2e s"), ("p99_e2e", "p99 e2e s"), ("mean_ttft", "mean TTFT s"),
           ("throughput", "req/s"))
#: A real difference smaller than this is not ranked, whatever the noise floor.
MIN_JUDGED = 0.02
#: For each metric, which direction is better (for the ranking).
HIGHER_IS_BETTER = {"mean_e2e": False, "p99_e2e": False, "mean_ttft": False, "throughput": True}

WORKER_CPUS: str | None = None


def log(text: str) -> None:
    print(text, flush=True)


# -- traces -------------------------------------------------------------------------------------------


def trace_a(n: int) -> list[dict[str, Any]]:
    """Calibration: log-normal prompts (median 350), uniform outputs 16..200, and a rate that ramps
    from 0.5 to 1.5 and back (mean 1 request/s), so light and saturated batches both occur."""
    rng = random.Random(SEED_A)
    out, t = [], 0.0
    for i in range(n):
        phase = i / max(n - 1, 1)
        rate = 0.5 + 2.0 * phase if phase < 0.5 else 2.5 - 2.0 * phase
        t += rng.expovariate(rate)
        prompt = min(MAX_PROMPT, max(16, round(rng.lognormvariate(math.log(350), 0.8))))
        out.append({"t_arrival": round(T0 + t, 6), "prompt_tokens": prompt,
                    "output_tokens": rng.randint(16, MAX_OUTPUT)})
    return _unit_rate(out)


def trace_b(n: int) -> list[dict[str, Any]]:
    """Prediction: 70% short prompts (40..300), 30% long ones (800..1,500), exponential outputs
    (mean 80, 4..200), steady Poisson arrivals (1 request/s)."""
    rng = random.Random(SEED_B)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(1.0)
        prompt = rng.randint(40, 300) if rng.random() < 0.7 else rng.randint(800, MAX_PROMPT)
        output = min(MAX_OUTPUT, max(4, round(rng.expovariate(1 / 80))))
        out.append({"t_arrival": round(T0 + t, 6), "prompt_tokens": prompt, "output_tokens": output})
    return _unit_rate(out)


def _unit_rate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stretch the time stamps so that the average rate is exactly 1 request/s."""
    span = records[-1]["t_arrival"] - records[0]["t_arrival"]
    factor = (len(records) - 1) / span
    return [{**r, "t_arrival": round(T0 + (r["t_arrival"] - T0) * factor, 6)} for r in records]


def scaled(records: list[dict[str, Any]], rate: float) -> list[dict[str, Any]]:
    """The same requests arriving ``rate`` times as fast."""
    first = records[0]["t_arrival"]
    return [{**r, "t_arrival": round(T0 + (r["t_arrival"] - first) / rate, 6)} for r in records]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return jsonl_records(path)


# -- the served recipe --------------------------------------------------------------------------------


def key(family: str) -> str:
    return f"cf-tiny-pred-{family}:bf16:chat:cpu"


def build_model(work: Path, layers: int) -> Path:
    """A random-weight model with the built-in model's tokenizer and ``layers`` layers of width 256:
    steps long enough that the engine, not the HTTP front end, limits what two cores serve (with the
    built-in model, a decode step takes about 1.5 ms and the API server saturates first). Seeded, so
    the same ``layers`` gives the same weights."""
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    target = work / f"model-{layers}-layers"
    if (target / "config.json").exists():
        return target
    source = tiny_model_dir()
    base = json.loads((source / "config.json").read_text())
    staging = work / f".model-{layers}-staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, staging / name)
    config = Qwen2Config(vocab_size=base["vocab_size"], hidden_size=256, intermediate_size=768,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1,
                         max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=base["bos_token_id"],
                         eos_token_id=base["eos_token_id"], pad_token_id=base["pad_token_id"])
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(dtype=torch.bfloat16).save_pretrained(staging)
    staging.rename(target)
    return target


def write_recipes(directory: Path, families: list[str], model_dir: Path | None) -> None:
    """One recipe per family, all the same engine (a copy of cf-tiny with the benchmark's knobs),
    serving ``model_dir`` (the built-in tiny model when None)."""
    served = tiny_served_name()
    directory.mkdir(parents=True, exist_ok=True)
    bind = f', VLLM_CPU_OMP_THREADS_BIND: "{WORKER_CPUS}"' if WORKER_CPUS else ""
    model = (f"{{repo: {model_dir}, served_name: {served}}}" if model_dir is not None else
             f"{{repo: carbonforge/tiny-chat, served_name: {served}, builtin: tiny-chat}}")
    for family in families:
        (directory / f"pred-{family}.yaml").write_text(f"""key: {key(family)}
plan: free
description: prediction check ({family}); the tiny model with few running sequences so that a queue forms
model: {model}
vllm:
  dtype: bfloat16
  max_model_len: {MAX_MODEL_LEN}
  max_num_seqs: {MAX_NUM_SEQS}
  max_num_batched_tokens: {MAX_NUM_BATCHED_TOKENS}
  enable_prefix_caching: true
  block_size: {BLOCK_SIZE}
  extra_args: ["--num-gpu-blocks-override", "{KV_BLOCKS}"]
drain_timeout_s: 5
env: {{VLLM_CPU_KVCACHE_SPACE: "1", HF_HUB_OFFLINE: "1"{bind}}}
scheduler: {{family: {family}, params: {json.dumps(PARAMS[family])}}}
""")


_KV_LINE = re.compile(r"KV cache size: (?P<tokens>[0-9,]+) tokens")


class Engine:
    """The runtime serving ``family``'s recipe, with its request trace (and optionally a step log);
    stopped with SIGTERM on exit, its process group killed if that does not end it."""

    def __init__(self, work: Path, family: str, name: str, step_log: Path | None = None) -> None:
        self.dir = work / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.trace = self.dir / "trace.jsonl"
        self.trace.unlink(missing_ok=True)
        args = ["--context-key", key(family), "--request-trace", "standard", "--trace-file", str(self.trace)]
        if step_log is not None:
            step_log.unlink(missing_ok=True)
            args += ["--step-log", str(step_log)]
        self.runtime: EngineProcess = runtime(args, self.dir / "logs", env={"CF_RECIPES_DIR": str(work / "recipes")})
        self.tail = TraceTail(self.trace)

    def __enter__(self) -> Engine:
        self.runtime.__enter__()
        if WORKER_CPUS is not None and not lower_engine_core(self.runtime.pid):
            log("  warning: no engine core process found to lower in priority")
        return self

    def __exit__(self, *exc: object) -> None:
        self.runtime.__exit__(*exc)

    def kv_tokens(self) -> int | None:
        """The KV capacity from the engine's own log line (None if not found)."""
        for text in (self.runtime.output(), self.runtime.engine_log()):
            found = _KV_LINE.search(text)
            if found:
                return int(found["tokens"].replace(",", ""))
        return None

    def wait_records(self, ids: set[str], timeout_s: float = 60.0) -> list[dict[str, Any]]:
        return self.tail.wait(ids, timeout_s)

    def replay(self, path: Path, rate: float = 1.0, limit: int | None = None, deadline_s: float = 400.0,
               sent: Path | None = None) -> list[dict[str, Any]]:
        """Replay ``path`` at ``rate`` times its pace; the runtime's trace records of its requests.
        With ``sent``, each request's id and Unix send time are written there (one JSON line each)."""
        from carbonforge_runtime.offline.replay.plan import PlanOptions, build_plan
        from carbonforge_runtime.offline.replay.runner import RunOptions, run_replay
        from carbonforge_runtime.offline.replay.trace import load_recording

        plan = build_plan(load_recording(path), PlanOptions(rate=rate, limit=limit, seed=0))
        options = RunOptions(base_url=self.runtime.base_url, model=tiny_served_name(), concurrency=1024,
                             deadline_s=deadline_s, request_timeout_s=deadline_s, progress_every_s=1e9)
        result = asyncio.run(run_replay(plan, options))
        for error in sorted({o.error for o in result.outcomes if o.error}):
            log(f"  warning: a request failed: {error}")
        if sent is not None:
            write_jsonl(sent, [{"request_id": o.request_id, "t_sent": round(result.started_at + o.sent_s, 6)}
                               for o in result.outcomes if o.request_id and o.sent_s is not None])
        return self.wait_records({o.request_id for o in result.outcomes if o.request_id})


# -- metrics ------------------------------------------------------------------------------------------


def completion_rate(records: list[dict[str, Any]]) -> float:
    span = max(r["t_completion"] for r in records) - min(r["t_arrival"] for r in records)
    return len(records) / span


# -- phases -------------------------------------------------------------------------------------------


def cli(args: list[str], work: Path, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    """``carbonforge-runtime ARGS`` in a child process (sim pins its own hash seed)."""
    env = {**os.environ, "CF_RECIPES_DIR": str(work / "recipes"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run([sys.executable, "-m", "carbonforge_runtime", *args], capture_output=True, text=True,
                          env=env, cwd=work, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise SystemExit(f"carbonforge-runtime {' '.join(args[:2])} failed ({done.returncode}):\n"
                         f"{done.stdout}\n{done.stderr}")
    return done


def phase_traces(work: Path, args: argparse.Namespace) -> None:
    write_jsonl(work / "trace-a.jsonl", trace_a(args.requests_a))
    write_jsonl(work / "trace-b-unit.jsonl", trace_b(args.requests_b))
    log(f"traces: {work / 'trace-a.jsonl'} ({args.requests_a} requests), "
        f"{work / 'trace-b-unit.jsonl'} ({args.requests_b} requests), both at 1 request/s until scaled")


def phase_calibrate(work: Path, args: argparse.Namespace) -> None:
    step_log = work / "steps.jsonl"
    with Engine(work, "fcfs", "calibrate", step_log=step_log) as engine:
        kv_engine = engine.kv_tokens()
        log(f"calibrate: engine ready (engine log KV capacity: {kv_engine} tokens)")
        burst = engine.replay(work / "trace-a.jsonl", rate=1e6, limit=args.burst)
        capacity = completion_rate(burst)
        # A ramps from 0.5 to 1.5 requests/s (unit time stamps): 0.5 .. 1.5 x 0.85 of the capacity.
        rate_a = 0.85 * capacity
        log(f"calibrate: FCFS capacity on a burst of {len(burst)}: {capacity:.2f} req/s; replaying A at "
            f"{rate_a:.2f} req/s on average (its rate ramps 0.5x .. 1.5x)")
        started = time.monotonic()
        records = engine.replay(work / "trace-a.jsonl", rate=rate_a)
        log(f"calibrate: A replayed in {time.monotonic() - started:.0f} s: {len(records)} records, "
            f"mean e2e {request_figures(records)['mean_e2e']:.3f} s")
    (work / "calibrate-run.json").write_text(json.dumps({
        "capacity_burst_rps": capacity, "rate_a": rate_a,
        "kv_tokens_engine_log": kv_engine,
        "real_a": request_figures(records)}, indent=1))


def phase_fit(work: Path, args: argparse.Namespace) -> None:
    """sim-calibrate on the step log the calibrate phase recorded (``steps.jsonl``)."""
    step_log = work / "steps.jsonl"
    run_path = work / "calibrate-run.json"
    run = json.loads(run_path.read_text()) if run_path.exists() else {}
    fitted = cli(["sim-calibrate", str(step_log), "-o", str(work / "model.yaml"), "--gpu", "cpu",
                  "--skip-first", str(args.skip_steps)], work)
    fit_text = fitted.stdout.strip()
    log(fit_text)
    if fitted.stderr.strip():
        log(fitted.stderr.strip())
    header = engine_header(step_log)
    kv_log = None if header is None else header.get("kv_cache_tokens")
    kv_engine = run.get("kv_tokens_engine_log")
    if kv_engine is not None and kv_log is not None and kv_engine != kv_log:
        log(f"fit: warning: the step log says {kv_log} KV tokens, the engine log {kv_engine}")
    (work / "calibrate.json").write_text(json.dumps(
        {**run, "kv_tokens": kv_log or kv_engine, "kv_tokens_step_log": kv_log, "fit": fit_text}, indent=1))


def sim_args(work: Path, family: str, kv_tokens: int, model: Path | None = None) -> list[str]:
    return ["--context-key", key(family), "--cost-model", str(model or work / "model.yaml"),
            "--kv-tokens", str(kv_tokens),
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
            "--max-model-len", str(MAX_MODEL_LEN), "--no-async-scheduling", "--quiet"]


def phase_predict(work: Path, args: argparse.Namespace, families: list[str]) -> None:
    calibration = json.loads((work / "calibrate.json").read_text())
    kv = int(calibration["kv_tokens"])
    unit = work / "trace-b-unit.jsonl"
    if args.rate_b is not None:
        rate_b = args.rate_b
    else:
        probe = work / "sim-capacity.json"
        cli(["sim", str(unit), *sim_args(work, "fcfs", kv), "--load", str(args.load), "-o", str(probe)], work)
        rate_b = float(json.loads(probe.read_text())["options"]["effective_rate"])
    write_jsonl(work / "trace-b.jsonl", scaled(read_jsonl(unit), rate_b))
    log(f"predict: trace B at {rate_b:.2f} req/s (" + (f"{args.load:g} of the twin's FCFS capacity"
        if args.rate_b is None else "--rate-b") + f"), KV {kv} tokens, model {work / 'model.yaml'}")
    predicted: dict[str, Any] = {"rate_b": rate_b, "kv_tokens": kv, "families": {}}
    for family in families:
        out = work / f"sim-{family}.json"
        cli(["sim", str(work / "trace-b.jsonl"), *sim_args(work, family, kv), "-o", str(out),
             "--records", str(work / f"sim-{family}.requests.jsonl")], work)
        predicted["families"][family] = request_figures(read_jsonl(work / f"sim-{family}.requests.jsonl"))
        m = predicted["families"][family]
        log(f"predict: {family}: mean e2e {m['mean_e2e']:.3f} s, p99 {m['p99_e2e']:.3f} s, "
            f"TTFT {m['mean_ttft']:.3f} s, {m['throughput']:.2f} req/s")
    (work / "predicted.json").write_text(json.dumps(predicted, indent=1))


def phase_real(work: Path, args: argparse.Namespace, families: list[str]) -> None:
    results_path = work / "real.json"
    results: dict[str, Any] = json.loads(results_path.read_text()) if results_path.exists() else {}
    runs = [families[0], *families[1:], AGAIN] if families[0] == "fcfs" else [*families, AGAIN]
    local_path = work / "local.json"
    locals_: dict[str, Any] = json.loads(local_path.read_text()) if local_path.exists() else {}
    for run in runs:
        if run in results and not args.redo:
            log(f"real: {run}: already measured (--redo to measure again)")
            continue
        family = "fcfs" if run == AGAIN else run
        steps = work / f"real-{run}" / "steps.jsonl"
        with Engine(work, family, f"real-{run}", step_log=steps) as engine:
            engine.replay(work / "trace-b.jsonl", rate=1e6, limit=args.warmup)  # compile shapes, not measured
            locals_[run] = calibrate_locally(work, engine, steps, run, family)
            local_path.write_text(json.dumps(locals_, indent=1))
            warm_steps = len(read_jsonl(steps)) if steps.exists() else 0
            started = time.monotonic()
            records = engine.replay(work / "trace-b.jsonl", sent=work / f"real-{run}" / "sent.jsonl")
        write_jsonl(work / f"real-{run}" / "records.jsonl", sorted(records, key=lambda r: r["t_arrival"]))
        (work / f"real-{run}" / "warmup-lines.txt").write_text(f"{warm_steps}\n")
        results[run] = request_figures(records)
        m = results[run]
        log(f"real: {run}: {m['n']:.0f} done in {time.monotonic() - started:.0f} s: mean e2e {m['mean_e2e']:.3f} s, "
            f"p99 {m['p99_e2e']:.3f} s, TTFT {m['mean_ttft']:.3f} s, {m['throughput']:.2f} req/s")
        results_path.write_text(json.dumps(results, indent=1))


def window_ratio(steps: Path, coefficients: dict[str, float], t_from: float, t_to: float) -> tuple[float, int]:
    """The logged wall time of the steps that ended in [t_from, t_to] over the model's price of them,
    and how many there were."""
    import numpy as np

    from carbonforge_runtime.offline.sim.calibrate import predict_ms

    rows = [r for r in read_jsonl(steps) if r.get("kind") == "step" and t_from <= r["t"] <= t_to]
    if not rows:
        return float("nan"), 0
    price = predict_ms(coefficients, *(np.asarray([float(r[k]) for r in rows])
                                       for k in ("batched_tokens", "kv_read_tokens", "attention_units")))
    return sum(r["wall_s"] for r in rows) * 1000.0 / float(price.sum()), len(rows)


def wait_for_steps(steps: Path, until: float, timeout_s: float = 30.0) -> None:
    """Until the step log holds a step that ended at ``until`` or later (its writer may lag)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r.get("kind") == "step" and r["t"] >= until for r in read_jsonl(steps)[-8:]):
            return
        time.sleep(0.3)


def calibrate_locally(work: Path, engine: Engine, steps: Path, run: str, family: str) -> dict[str, Any]:
    """The whole chain again on this engine, just before trace B is served on it: replay trace A at
    the calibration's rate, fit a step-time model to the steps logged meanwhile, and predict B with
    it (this run's family). Blind like the first prediction (B has not been served), but calibrated
    a minute before the run on the same engine process: a shared or virtual machine's speed drifts by
    tens of percent between engine starts and within minutes, a drift no model of the engine can
    know, and this takes most of it out."""
    calibration = json.loads((work / "calibrate.json").read_text())
    started = time.time()
    records = engine.replay(work / "trace-a.jsonl", rate=float(calibration["rate_a"]))
    until = max(r["t_completion"] for r in records)
    wait_for_steps(steps, until)
    window = [r for r in read_jsonl(steps) if r.get("kind") == "engine" or started <= r.get("t", 0.0) <= until]
    local_log = work / f"real-{run}" / "steps-a.jsonl"
    write_jsonl(local_log, window)
    model = work / f"model-local-{run}.yaml"
    fitted = cli(["sim-calibrate", str(local_log), "-o", str(model), "--gpu", "cpu"], work)
    fit = " ".join(" ".join(line.split()) for line in fitted.stdout.splitlines() if line.startswith("R2"))
    kv = int(calibration["kv_tokens"])
    out = work / f"local-sim-{run}.requests.jsonl"
    cli(["sim", str(work / "trace-b.jsonl"), *sim_args(work, family, kv, model),
         "-o", str(work / f"local-sim-{run}.json"), "--records", str(out)], work)
    predicted = request_figures(read_jsonl(out))
    speed = window_ratio(local_log, yaml_coefficients(work / "model.yaml"), started, until)[0]
    log(f"  calibrated again on this engine ({len(window) - 1} steps of A, {fit}; the first model prices them at "
        f"{1 / speed:.2f}x their wall time): the twin predicts mean e2e {predicted['mean_e2e']:.3f} s, "
        f"p99 {predicted['p99_e2e']:.3f} s")
    return {"steps": len(window) - 1, "fit": fit, "speed": speed, "predicted": predicted}


def write_scaled_model(source: Path, target: Path, factor: float) -> None:
    """``source``'s step-time model with every coefficient multiplied by ``factor``."""
    import yaml

    model = yaml.safe_load(source.read_text())
    model["coefficients_ms"] = {k: float(v) * factor for k, v in model["coefficients_ms"].items()}
    model["name"] = f"{model['name']}-x{factor:.3f}"
    model["provenance"] = f"{model['provenance']} Every coefficient scaled by {factor:.3f}."
    target.write_text(yaml.safe_dump(model, sort_keys=False))


def step_model_error(work: Path, run: str) -> dict[str, float] | None:
    """How the fitted step-time model prices the steps the real run took: the sum of its step times
    against the sum of the logged wall times, and its mean relative error per step (None without a
    step log of the run)."""
    import numpy as np

    from carbonforge_runtime.offline.sim.calibrate import predict_ms, read_step_log

    if not (work / f"real-{run}" / "steps.jsonl").exists():
        return None
    skip = int((work / f"real-{run}" / "warmup-lines.txt").read_text().strip() or 0)
    data = read_step_log(work / f"real-{run}" / "steps.jsonl", skip_first=max(skip - 1, 0))
    coefficients = yaml_coefficients(work / "model.yaml")
    wall = np.asarray(data.wall_ms)
    pred = predict_ms(coefficients, np.asarray(data.batched), np.asarray(data.kv_read), np.asarray(data.attention))
    return {"steps": float(len(wall)), "sum_ratio": float(pred.sum() / wall.sum()),
            "mean_relative_error": float(np.mean(np.abs(pred - wall) / wall))}


def front_end_delay(work: Path, run: str) -> dict[str, float] | None:
    """From the client's send to the request's arrival at the scheduler, per request of a real run:
    the HTTP front end's time, which the twin does not model (None without the run's send times)."""
    sent_path = work / f"real-{run}" / "sent.jsonl"
    if not sent_path.exists():
        return None
    sent = {r["request_id"]: r["t_sent"] for r in read_jsonl(sent_path)}
    delays = sorted(r["t_arrival"] - sent[r["request_id"]]
                    for r in read_jsonl(work / f"real-{run}" / "records.jsonl") if r["request_id"] in sent)
    if not delays:
        return None
    return {"requests": float(len(delays)), "mean_s": statistics.fmean(delays),
            "p50_s": percentile(delays, 0.5), "p99_s": percentile(delays, 0.99)}


def yaml_coefficients(path: Path) -> dict[str, float]:
    import yaml

    return {k: float(v) for k, v in yaml.safe_load(path.read_text())["coefficients_ms"].items()}


def phase_engine_side(work: Path, args: argparse.Namespace, families: list[str]) -> None:
    """After the fact, two things the twin cannot know beforehand taken out, one at a time:

    - the machine's drift: the fitted model's price of each real run's logged steps against their
      wall time gives the speed the machine ran at; the twin predicts B's offered arrivals again
      with the model scaled to it (one number from the run, none of its latencies);
    - and the HTTP front end as well: the twin fed each run's own records at that speed, i.e. the
      arrival times at the scheduler (the runtime's trace records: when each request reached it,
      its prompt and output tokens) rather than the offered ones. This tests the scheduler loop and
      the step-time model alone."""
    real = json.loads((work / "real.json").read_text())
    calibration = json.loads((work / "calibrate.json").read_text())
    kv = int(calibration["kv_tokens"])
    out: dict[str, Any] = {}
    for run in real:
        family = "fcfs" if run == AGAIN else run
        records = work / f"real-{run}" / "records.jsonl"
        if family not in families or not records.exists():
            continue
        sm = step_model_error(work, run)
        model = work / "model.yaml"
        if sm is not None:
            model = work / f"model-run-{run}.yaml"
            write_scaled_model(work / "model.yaml", model, 1.0 / sm["sum_ratio"])
        result: dict[str, Any] = {"real": real[run], "step_model": sm}
        for name, trace in (("offered", work / "trace-b.jsonl"), ("predicted", records)):
            stem = f"engine-side-{run}" if name == "predicted" else f"run-speed-{run}"
            cli(["sim", str(trace), *sim_args(work, family, kv, model), "-o", str(work / f"{stem}.json"),
                 "--records", str(work / f"{stem}.requests.jsonl")], work)
            result[name] = request_figures(read_jsonl(work / f"{stem}.requests.jsonl"))
        out[run] = result
        log(f"engine-side: {run}: " + ("" if sm is None else
            f"the model on the run's {sm['steps']:.0f} steps: total {sm['sum_ratio']:.2f}x the wall time, mean "
            f"relative error {sm['mean_relative_error']:.0%}; ") + f"at the run's speed, mean e2e "
            f"{result['offered']['mean_e2e']:.3f} s from the offered arrivals, {result['predicted']['mean_e2e']:.3f} s "
            f"from the engine's (real {real[run]['mean_e2e']:.3f})")
    (work / "engine-side.json").write_text(json.dumps(out, indent=1))


def error(pred: float, real: float) -> float:
    return (pred - real) / real if real else float("nan")


def comparison(predicted: dict[str, Any], real: dict[str, Any], runs: list[str],
               figures: dict[str, Any]) -> list[str]:
    """Predicted against real per run, and the targets; fills ``figures`` (errors, targets)."""
    lines = ["| run | " + " | ".join(f"{label} pred / real (err)" for _, label in METRICS) + " |",
             "|---|" + "---|" * len(METRICS)]
    figures.setdefault("errors", {})
    for run in runs:
        if run not in predicted or run not in real:
            lines.append(f"| {run} | " + " | ".join("-" for _ in METRICS) + " |")
            continue
        errs = {m: error(predicted[run][m], real[run][m]) for m, _ in METRICS}
        figures["errors"][run] = errs
        cells = [f"{predicted[run][m]:.3f} / {real[run][m]:.3f} ({errs[m]:+.0%})" for m, _ in METRICS]
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    lines += ["", "Targets (every run):"]
    figures["targets"] = {}
    for metric, limit in TARGETS.items():
        worst = [abs(e[metric]) for e in figures["errors"].values()]
        ok = bool(worst) and all(w <= limit for w in worst)
        figures["targets"][metric] = {"limit": limit, "worst_abs_error": max(worst, default=None), "pass": ok}
        lines.append(f"  {metric:<10s} within {limit:.0%}: worst {max(worst, default=float('nan')):.0%} "
                     f"-> {'PASS' if ok else 'MISS'}")
    return lines


def report(work: Path, families: list[str]) -> tuple[str, dict[str, Any]]:
    predicted = json.loads((work / "predicted.json").read_text())["families"]
    real = json.loads((work / "real.json").read_text())
    calibration = json.loads((work / "calibrate.json").read_text())
    fit = [" ".join(line.split()) for line in calibration.get("fit", "").splitlines()
           if line.startswith(("R2", "mean relative error", "p90 relative error"))]
    lines = [f"Step-time model {work / 'model.yaml'}: {', '.join(fit) or '?'}",
             f"KV capacity {calibration['kv_tokens']} tokens; max_num_seqs {MAX_NUM_SEQS}, "
             f"max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS}, synchronous scheduling", "",
             "## Offered arrivals: the twin predicts trace B before it is served", ""]
    offered: dict[str, Any] = {}
    # FCFS served twice: both runs are predictions of the same offered trace.
    predicted_runs = {**predicted, **({AGAIN: predicted["fcfs"]} if "fcfs" in predicted else {})}
    runs = [*families, AGAIN]
    lines += comparison(predicted_runs, real, runs, offered)
    figures: dict[str, Any] = {"calibration": calibration, "predicted": predicted, "real": real,
                               "offered": offered, "noise_floor": {}, "ranking": []}
    noise = {}
    if "fcfs" in real and AGAIN in real:
        noise = {m: abs(error(real[AGAIN][m], real["fcfs"][m])) for m, _ in METRICS}
        figures["noise_floor"] = noise
        lines += ["", "Noise floor (the same trace served twice with FCFS): " + ", ".join(
            f"{m} {real[AGAIN][m]:.3f} vs {real['fcfs'][m]:.3f} ({noise[m]:.0%})" for m, _ in METRICS)]
    local_path = work / "local.json"
    local = json.loads(local_path.read_text()) if local_path.exists() else {}
    if local:
        figures["local"] = side = {"runs": local}
        lines += ["", "## Calibrated again on each run's engine, just before B is served", "",
                  "(trace A replayed on the same engine at the calibration's rate, a model fitted to those steps, "
                  "and B predicted with it, all before B is sent)", ""]
        lines += comparison({run: v["predicted"] for run, v in local.items()}, real, [r for r in runs if r in local],
                            side)
        lines += ["", "Step times of A on each run's engine against the first calibration (above 1 slower): "
                  + ", ".join(f"{run} {v['speed']:.2f}x ({v['steps']} steps; {' '.join(v['fit'].split())})"
                              for run, v in local.items())]
    delays = {run: d for run in runs if run in real and (d := front_end_delay(work, run)) is not None}
    if delays:
        figures["front_end_delay"] = delays
        lines += ["", "HTTP front end (the client's send to the arrival at the scheduler, not modelled by the twin): "
                  + "; ".join(f"{run} mean {d['mean_s'] * 1000:.0f} ms, p50 {d['p50_s'] * 1000:.0f} ms, "
                              f"p99 {d['p99_s'] * 1000:.0f} ms" for run, d in delays.items())]
    engine_side_path = work / "engine-side.json"
    if engine_side_path.exists():
        engine_side = json.loads(engine_side_path.read_text())
        ordered = [r for r in runs if r in engine_side]
        figures["run_speed"] = at_speed = {"runs": {r: v.get("offered") for r, v in engine_side.items()}}
        lines += ["", "## After the fact, at the machine's speed during each run",
                  "", "(the model scaled by its price of the run's own logged steps against their wall time)", ""]
        lines += comparison({r: v["offered"] for r, v in engine_side.items() if "offered" in v},
                            {r: v["real"] for r, v in engine_side.items()}, ordered, at_speed)
        figures["engine_side"] = side = {"runs": engine_side}
        lines += ["", "## ... and fed each run's own arrival times at the scheduler", "",
                  "(the HTTP front end, which the twin does not model, taken out as well)", ""]
        lines += comparison({r: v["predicted"] for r, v in engine_side.items()},
                            {r: v["real"] for r, v in engine_side.items()}, ordered, side)
        lines += ["", "The fitted step-time model on each real run's own steps (after the warm-up):"]
        for run, v in engine_side.items():
            sm = v["step_model"]
            if sm is None:
                continue
            lines.append(f"  {run}: {sm['steps']:.0f} steps, model total {sm['sum_ratio']:.2f}x the logged wall time, "
                         f"mean relative error per step {sm['mean_relative_error']:.0%}")
    lines += ["", "Ranking (pairs whose real difference exceeds the noise floor):"]
    measured = [f for f in families if f in real and f in predicted]
    for i, a in enumerate(measured):
        for b in measured[i + 1:]:
            for metric, _ in METRICS:
                diff = abs(error(real[a][metric], real[b][metric]))
                floor = noise.get(metric)
                if floor is None or not diff > max(floor, MIN_JUDGED):
                    lines.append(f"  {a} vs {b}, {metric}: real difference {diff:.0%} under {MIN_JUDGED:.0%} or "
                                 f"within the noise floor "
                                 f"({floor if floor is None else f'{floor:.0%}'}): not judged")
                    continue
                real_better = (real[a][metric] > real[b][metric]) == HIGHER_IS_BETTER[metric]
                pred_better = (predicted[a][metric] > predicted[b][metric]) == HIGHER_IS_BETTER[metric]
                agrees = real_better == pred_better
                entry = {"a": a, "b": b, "metric": metric, "real_diff": diff, "agrees": agrees}
                line = (f"  {a} vs {b}, {metric}: real: {a if real_better else b} better by {diff:.0%} "
                        f"(floor {floor:.0%}); twin: {a if pred_better else b} -> "
                        f"{'AGREES' if agrees else 'DISAGREES'}")
                # Each real run had its own machine speed: the twin calibrated on each run's engine, and
                # at each run's speed, ranks them too.
                others = (("local", "calibrated on each engine", {r: v["predicted"] for r, v in local.items()}),
                          ("at_run_speed", "at each run's speed", figures.get("run_speed", {}).get("runs", {})))
                for name, label, pred in others:
                    if pred.get(a) and pred.get(b):
                        other_better = (pred[a][metric] > pred[b][metric]) == HIGHER_IS_BETTER[metric]
                        entry[f"agrees_{name}"] = other_better == real_better
                        line += (f"; {label}: {a if other_better else b} -> "
                                 f"{'AGREES' if other_better == real_better else 'DISAGREES'}")
                figures["ranking"].append(entry)
                lines.append(line)
    return "\n".join(lines), figures


def main() -> int:
    global WORKER_CPUS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/work/bench-out/predict"))
    parser.add_argument("--phase", default="all", help=f"all, or a comma list of {', '.join(PHASES)}")
    parser.add_argument("--families", default="fcfs,ltr-promptlen", help=f"of {', '.join(PARAMS)}; fcfs first")
    parser.add_argument("--requests-a", type=int, default=300)
    parser.add_argument("--requests-b", type=int, default=250)
    parser.add_argument("--load", type=float, default=0.8, help="B's rate as a fraction of the twin's FCFS capacity")
    parser.add_argument("--rate-b", type=float, default=None, help="B's rate in req/s instead of --load")
    parser.add_argument("--burst", type=int, default=40, help="requests of A in the capacity burst")
    parser.add_argument("--warmup", type=int, default=16, help="requests of B sent (not measured) before each run")
    parser.add_argument("--skip-steps", type=int, default=0, help="sim-calibrate --skip-first")
    parser.add_argument("--redo", action="store_true", help="real: measure families already in real.json again")
    parser.add_argument("--no-pin", action="store_true",
                        help="do not pin the engine worker to a CPU of its own nor lower the engine core's priority")
    parser.add_argument("--layers", type=int, default=8,
                        help="serve a random model of this many layers (width 256) built from the tiny model's "
                             "tokenizer; 0: the built-in 2-layer model")
    parser.add_argument("--json", type=Path, default=None, help="save the figures here")
    args = parser.parse_args()
    phases = list(PHASES) if args.phase == "all" else args.phase.split(",")
    unknown = [p for p in phases if p not in PHASES]
    families = [f for f in args.families.split(",") if f]
    if unknown or not families or any(f not in PARAMS for f in families):
        parser.error(f"unknown phase(s) {unknown} or family list {families}")
    families = ["fcfs", *[f for f in families if f != "fcfs"]]
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not args.no_pin and {"calibrate", "real"} & set(phases):
        WORKER_CPUS = pin_processes()
    write_recipes(work / "recipes", families, build_model(work, args.layers) if args.layers else None)
    started = time.monotonic()
    for phase in phases:
        log(f"\n== {phase} ({time.monotonic() - started:.0f} s)")
        if phase == "traces":
            phase_traces(work, args)
        elif phase == "calibrate":
            phase_calibrate(work, args)
        elif phase == "fit":
            phase_fit(work, args)
        elif phase == "predict":
            phase_predict(work, args, families)
        elif phase == "real":
            phase_real(work, args, families)
        elif phase == "engine-side":
            phase_engine_side(work, args, families)
        else:
            text, figures = report(work, families)
            made = {"commit": commit(), "command": command()}
            text += f"\n\nCommit: `{made['commit']}`; command: `{made['command']}`"
            log(text)
            (work / "report.md").write_text(text + "\n")
            if args.json is not None:
                args.json.write_text(json.dumps({**figures, **made}, indent=1, default=str))
                log(f"figures: {args.json}")
    log(f"\ntotal {time.monotonic() - started:.0f} s; files in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
