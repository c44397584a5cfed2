#!/usr/bin/env python
"""Ordering benchmark: every scheduling family on the real CPU engine, side by side with FCFS.

The tiny CPU recipe is served with a small ``max_num_seqs`` (4) and a small KV cache, so that a
queue forms and prefixes get evicted, and the same traces are replayed at the same loads:

* ``conv``      -- windows of the Azure conversation trace (token counts scaled down);
* ``prefill``   -- the same arrivals with long prompts and short outputs (code-like traffic);
* ``templated`` -- a generated workload of six applications, each with its own system prompt
  (shared prefix) and output-length distribution.

The load where FCFS saturates is measured first (a ladder of replay speeds); the runs then
replay each trace at about 60% and 90% of it. Every metric comes from the runtime's own trace
of the replay (server-side arrival to completion) and is printed as a ratio to FCFS on the same
trace, seed and load (the mean over seeds, with the spread); the prefix-cache hit rate as the
difference in points.

Two modes. ``--mode sessions`` serves the recipe once per family, in turn. On a shared machine
the engine's speed drifts by tens of percent between sessions minutes apart, which swamps the
differences being measured; so the default ``--mode switch`` serves one engine whose recipe
names a benchmark-only family (``scripts/bench_switch/sitecustomize.py``) that delegates to the
family named in a control file, and the families take turns run by run.

    .venv/bin/python scripts/bench_ordering.py --out /work/bench-out/ordering

About 40 minutes with the defaults on 2 cores. ``--quick`` runs one seed of fcfs and oracle;
``--ltr-check-only`` fits the ranker on the runtime's own full-level trace of the templated
replays and reports its Kendall tau on a held-out seed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from carbonforge_runtime.replay.plan import PlanOptions, build_plan  # noqa: E402
from carbonforge_runtime.replay.runner import RunOptions, run_replay  # noqa: E402
from carbonforge_runtime.replay.trace import load_recording, write_jsonl  # noqa: E402
from carbonforge_runtime.replay.workloads import prefill_heavy, templated, tokenizer_counter, window  # noqa: E402
from tests.support import TINY_SERVED_NAME, RuntimeProcess, tiny_model_dir  # noqa: E402

AZURE = Path("/work/shared/data/azure-llm-2023/AzureLLMInferenceTrace_conv.csv")
FAMILY_ORDER = ("fcfs", "ltr-promptlen", "affinity", "ltr", "hybrid", "oracle")
SWITCH = "bench-switch"
SWITCH_DIR = REPO / "scripts" / "bench_switch"
WORKLOADS = ("conv", "prefill", "templated")
LOADS = (0.6, 0.9)

#: Bench parameters of each family. The replay forces each output length with max_tokens, so the
#: learned families must not read max_tokens (use_max_tokens: false) or they would see the answer.
PARAMS: dict[str, dict[str, Any]] = {
    "fcfs": {},
    "ltr-promptlen": {"aging_rate": 400.0, "cache_lookup_limit": 128},
    "affinity": {"aging_rate": 200.0},
    "ltr": {"aging_rate": 20.0, "use_max_tokens": False},
    "hybrid": {"aging_rate": 20.0, "use_max_tokens": False, "prompt_weight": 0.02, "cache_weight": 0.02,
               "cache_lookup_limit": 128},
    "oracle": {"aging_rate": 20.0},
}
#: Token scaling per workload, so prompt + output fit the tiny model's 2048-token context.
PLAN: dict[str, dict[str, Any]] = {
    "conv": {"token_scale": 0.4, "max_prompt_tokens": 1700, "max_output_tokens": 300},
    "prefill": {"token_scale": 0.4, "max_prompt_tokens": 1900, "max_output_tokens": 100},
    "templated": {"token_scale": 1.0},
}


def bench_recipe(family: str, max_num_seqs: int, kv_blocks: int, block_size: int,
                 params: dict[str, Any] | None = None) -> str:
    return f"""key: cf-tiny-bench-{family}:bf16:chat:cpu
plan: free
description: ordering benchmark ({family}); few running sequences and a small KV cache so that order matters
model: {{repo: carbonforge/tiny-chat, served_name: {TINY_SERVED_NAME}, builtin: tiny-chat}}
vllm:
  dtype: bfloat16
  max_model_len: 2048
  max_num_seqs: {max_num_seqs}
  max_num_batched_tokens: 2048
  enable_prefix_caching: true
  block_size: {block_size}
  extra_args: ["--num-gpu-blocks-override", "{kv_blocks}"]
drain_timeout_s: 5
env: {{VLLM_CPU_KVCACHE_SPACE: "1", HF_HUB_OFFLINE: "1", VLLM_SERVER_DEV_MODE: "1"}}
scheduler: {{family: {family}, params: {json.dumps(PARAMS[family] if params is None else params)}}}
"""


# -- workloads ----------------------------------------------------------------------------------------


def make_workloads(out: Path, seeds: list[int], n: int, ltr_train: int) -> dict[tuple[str, int], Path]:
    """One JSONL file per (workload, seed), plus the training trace of the offline ltr model."""
    recording = load_recording(AZURE)
    count = tokenizer_counter(str(tiny_model_dir()))
    files: dict[tuple[str, int], Path] = {}
    for seed in seeds:
        # Windows spread over the hour of the trace; each seed its own.
        start = 1500 + seed * 5000
        conv = window(recording, start, n)
        files["conv", seed] = out / f"conv-s{seed}.jsonl"
        write_jsonl(files["conv", seed], conv)
        files["prefill", seed] = out / f"prefill-s{seed}.jsonl"
        write_jsonl(files["prefill", seed],
                    prefill_heavy(load_recording(files["conv", seed]), prompt_factor=2.0, output_divisor=16.0))
        files["templated", seed] = out / f"templated-s{seed}.jsonl"
        write_jsonl(files["templated", seed], templated(n, seed=seed, rate=10.0, count_tokens=count))
    train = out / "templated-train.jsonl"
    write_jsonl(train, templated(ltr_train, seed=1000, rate=10.0, count_tokens=count))
    files["train", 0] = train
    return files


def recorded_rate(path: Path) -> float:
    reqs = load_recording(path).requests
    return (len(reqs) - 1) / reqs[-1].arrival_s


# -- one engine session ------------------------------------------------------------------------------


class Session:
    def __init__(self, family: str, out: Path, args: argparse.Namespace, level: str = "standard",
                 name: str | None = None) -> None:
        self.family = family
        self.dir = out / (name or f"session-{family}")
        self.dir.mkdir(parents=True, exist_ok=True)
        recipes = self.dir / "recipes"
        recipes.mkdir(exist_ok=True)
        env = {"CF_RECIPES_DIR": str(recipes)}
        params = None
        self.control = self.dir / "active-family.json"
        if family == SWITCH:
            # One engine for every family: the bench-only family in scripts/bench_switch delegates to
            # the family named in the control file.
            params = {"control": str(self.control), "families": {f: PARAMS[f] for f in FAMILY_ORDER}}
            self.control.write_text(json.dumps({"family": "fcfs"}))
            env["CF_BENCH_SWITCH"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SWITCH_DIR), os.environ.get("PYTHONPATH", "")) if p)
        (recipes / "bench.yaml").write_text(bench_recipe(family, args.max_num_seqs, args.kv_blocks, args.block_size,
                                                         params))
        self.trace = self.dir / "trace.jsonl"
        self.trace.unlink(missing_ok=True)
        self.runtime = RuntimeProcess(
            ["--context-key", f"cf-tiny-bench-{family}:bf16:chat:cpu", "--request-trace", level,
             "--trace-file", str(self.trace)],
            self.dir / "logs", env=env,
        )
        self._offset = 0
        self._records: dict[str, dict[str, Any]] = {}

    def __enter__(self) -> Session:
        self.runtime.start().wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.runtime.stop(timeout_s=60)
        finally:
            self.runtime.kill()

    def activate(self, family: str) -> None:
        """Switch the bench-switch family (takes effect within 0.1 s, before the next run starts)."""
        self.control.write_text(json.dumps({"family": family}))
        time.sleep(0.5)

    def reset_prefix_cache(self) -> None:
        url = self.runtime.base_url.removesuffix("/v1") + "/reset_prefix_cache"
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30) as resp:
            assert resp.status == 200

    def _read_new(self) -> None:
        if not self.trace.exists():
            return
        with self.trace.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            record = json.loads(line)
            self._records[record["request_id"]] = record

    def records(self, ids: set[str], timeout_s: float = 60.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            self._read_new()
            missing = ids - self._records.keys()
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        if missing:
            print(f"  warning: {len(missing)} trace records missing", file=sys.stderr)
        return [self._records[i] for i in ids if i in self._records]

    def replay(self, path: Path, workload: str, rate: float, seed: int,
               limit: int | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        plan = build_plan(load_recording(path), PlanOptions(rate=rate, seed=seed, limit=limit, **PLAN[workload]))
        self.reset_prefix_cache()
        options = RunOptions(base_url=self.runtime.base_url, model=TINY_SERVED_NAME, concurrency=1024,
                             deadline_s=900, send_true_length=True, progress_every_s=1e9)
        result = asyncio.run(run_replay(plan, options))
        summary = result.summary()
        ids = {o.request_id for o in result.outcomes if o.request_id}
        return self.records(ids), summary


def saturation(session: Session, path: Path, workload: str) -> float:
    """The rate factor (on the recorded arrival times) at which FCFS stops keeping up with the trace.

    A first guess from an all-at-once burst (completions per second, an overestimate: big
    prefill batches); then the trace is replayed on a ladder of rate factors 1.2x apart until
    the engine completes the window at less than 90% of the rate its requests arrived at (the
    backlog no longer drains in time): the lowest such factor is saturation.
    """
    records, _ = session.replay(path, workload, rate=1e6, seed=0)
    bound = len(records) / (max(r["t_completion"] for r in records) - min(r["t_arrival"] for r in records))
    base = recorded_rate(path)

    def saturated(factor: float) -> bool:
        records, _ = session.replay(path, workload, rate=factor, seed=0)
        first = min(r["t_arrival"] for r in records)
        arrival_rate = (len(records) - 1) / (max(r["t_arrival"] for r in records) - first)
        done_rate = (len(records) - 1) / (max(r["t_completion"] for r in records) - first)
        wait = statistics.fmean(r["queue_wait_s"] for r in records)
        print(f"  {workload}: x{factor:.2f}: arrivals {arrival_rate:.2f} req/s, completions {done_rate:.2f} req/s, "
              f"mean queue wait {wait:.3f} s", flush=True)
        return done_rate < 0.9 * arrival_rate

    factor = 0.5 * bound / base
    if saturated(factor):
        while factor > 0.05 and saturated(factor / 1.2):
            factor /= 1.2
    else:
        for _ in range(12):
            factor *= 1.2
            if saturated(factor):
                break
    print(f"  {workload}: FCFS saturates at rate factor {factor:.2f} (about {factor * base:.2f} req/s; "
          f"all-at-once bound {bound:.2f} req/s)", flush=True)
    return factor


# -- metrics -----------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    e2e = [r["e2e_latency_s"] for r in records]
    per_token = [r["e2e_latency_s"] / r["output_tokens"] for r in records if r["output_tokens"]]
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r.get("cached_prompt_tokens") or 0 for r in records)
    return {
        "n": float(len(records)),
        "mean": statistics.fmean(e2e),
        "p50": pct(e2e, 50),
        "p99": pct(e2e, 99),
        "max": max(e2e),
        "wait": statistics.fmean(r["queue_wait_s"] for r in records),
        "per_tok": statistics.fmean(per_token),
        "hit": 100.0 * cached / prompt if prompt else 0.0,
    }


COLUMNS = ("mean", "p50", "p99", "max", "wait", "per_tok", "hit")
HEADERS = {"mean": "mean e2e", "p50": "p50", "p99": "p99", "max": "max", "wait": "queue wait",
           "per_tok": "lat/out tok", "hit": "cache hit"}


def tables(results: dict[str, Any], families: list[str], seeds: list[int]) -> str:
    """One table per load: rows workload x family, each cell the ratio to FCFS (mean [min..max] over seeds)."""
    out = []
    for load in LOADS:
        out.append(f"\n### Load {load:.0%} of FCFS saturation\n")
        out.append("| workload | family | " + " | ".join(HEADERS[c] for c in COLUMNS) + " |")
        out.append("|---|---|" + "---|" * len(COLUMNS))
        for workload in WORKLOADS:
            base_runs = [results.get(f"fcfs/{workload}/{load}/{s}") for s in seeds]
            if not all(base_runs):
                continue
            cells = []
            for c in COLUMNS:
                value = statistics.fmean(r[c] for r in base_runs)  # type: ignore[index]
                cells.append(f"{value:.1f}%" if c == "hit" else f"{value * 1000:.1f} ms" if c == "per_tok"
                             else f"{value:.3f} s")
            out.append(f"| {workload} | fcfs (absolute) | " + " | ".join(cells) + " |")
            for family in families:
                if family == "fcfs":
                    continue
                runs = [(results[f"{family}/{workload}/{load}/{s}"], results[f"fcfs/{workload}/{load}/{s}"])
                        for s in seeds if f"{family}/{workload}/{load}/{s}" in results
                        and f"fcfs/{workload}/{load}/{s}" in results]
                if not runs:
                    continue
                row = []
                for c in COLUMNS:
                    if c == "hit":
                        diffs = [r[c] - b[c] for r, b in runs]
                        row.append(f"{statistics.fmean(diffs):+.1f} pt [{min(diffs):+.1f}..{max(diffs):+.1f}]")
                    else:
                        ratios = [r[c] / b[c] for r, b in runs if b[c] > 0]
                        row.append(f"{statistics.fmean(ratios):.2f} [{min(ratios):.2f}..{max(ratios):.2f}]")
                out.append(f"| {workload} | {family} | " + " | ".join(row) + " |")
    return "\n".join(out)


def capture_gain(results: dict[str, Any], families: list[str], seeds: list[int], workload: str,
                 load: float) -> str:
    lines = []
    fcfs = [results[f"fcfs/{workload}/{load}/{s}"]["mean"] for s in seeds if f"fcfs/{workload}/{load}/{s}" in results]
    oracle = [results[f"oracle/{workload}/{load}/{s}"]["mean"] for s in seeds
              if f"oracle/{workload}/{load}/{s}" in results]
    if len(fcfs) != len(oracle) or not fcfs:
        return ""
    oracle_gain = 1 - statistics.fmean(o / f for o, f in zip(oracle, fcfs, strict=True))
    lines.append(f"{workload} at {load:.0%}: oracle cuts mean e2e by {oracle_gain:.1%}")
    for family in families:
        if family in ("fcfs", "oracle"):
            continue
        keys = [f"{family}/{workload}/{load}/{s}" for s in seeds]
        if not all(k in results for k in keys):
            continue
        gain = 1 - statistics.fmean(results[k]["mean"] / f for k, f in zip(keys, fcfs, strict=True))
        p99 = statistics.fmean(results[k]["p99"] / results[f"fcfs/{workload}/{load}/{s}"]["p99"]
                               for k, s in zip(keys, seeds, strict=True))
        share = gain / oracle_gain if oracle_gain > 0 else float("nan")
        lines.append(f"  {family:14s} gain {gain:+.1%} ({share:.0%} of the oracle's), p99 x{p99:.2f}")
    return "\n".join(lines)


def ltr_check(out: Path, files: dict[tuple[str, int], Path], seeds: list[int], args: argparse.Namespace) -> str:
    """Offline ranker from the runtime's own full-level trace: fit on the templated replays of all
    seeds but the last, Kendall tau on the last (held out)."""
    from typer.testing import CliRunner

    from carbonforge_runtime.cli import app

    per_seed: dict[int, list[dict[str, Any]]] = {}
    with Session("fcfs", out, args, level="full", name="ltr-check") as session:
        for seed in seeds:
            per_seed[seed], _ = session.replay(files["templated", seed], "templated", rate=1e6, seed=seed)
    train, test = session.dir / "train-full.jsonl", session.dir / "held-out-full.jsonl"
    write_jsonl(train, [r for seed in seeds[:-1] for r in per_seed[seed]])
    write_jsonl(test, per_seed[seeds[-1]])
    model = session.dir / "ltr-model.json"
    tokenizer = str(tiny_model_dir())
    fitted = CliRunner().invoke(app, ["ltr", "fit", str(train), "-o", str(model), "--tokenizer", tokenizer,
                                      "--holdout", "0"])
    evaluated = CliRunner().invoke(app, ["ltr", "eval", str(model), str(test), "--tokenizer", tokenizer])
    return (f"ltr fit on the runtime's full trace ({train.name}): {fitted.output.strip()}\n"
            f"held-out seed {seeds[-1]}: {evaluated.output.strip()}")


# -- main --------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/work/bench-out/ordering"))
    parser.add_argument("--families", default=",".join(FAMILY_ORDER))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=96, help="KV cache size in blocks (prefix-cache pressure)")
    parser.add_argument("--quick", action="store_true", help="one seed, fcfs and oracle only")
    parser.add_argument("--mode", choices=("switch", "sessions"), default="switch",
                        help="switch: one engine, families take turns run by run (default); "
                        "sessions: one engine session per family")
    parser.add_argument("--ltr-check-only", action="store_true",
                        help="only fit the ranker on the runtime's own full trace of the templated replays")
    args = parser.parse_args()
    families = args.families.split(",")
    workloads = [w for w in args.workloads.split(",") if w]
    seeds = list(range(args.seeds))
    if args.quick:
        families, seeds = ["fcfs", "oracle"], [0]
    if families[0] != "fcfs":
        families = ["fcfs", *[f for f in families if f != "fcfs"]]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results: dict[str, Any] = json.loads(results_path.read_text()) if results_path.exists() else {}

    files = make_workloads(out, seeds, args.requests, ltr_train=1500)
    # The ltr and hybrid families start from a model fitted offline on a full-level trace of the
    # templated workload (a different seed from the replayed ones), then keep learning online.
    model = out / "ltr-model.json"
    from typer.testing import CliRunner

    from carbonforge_runtime.cli import app

    fitted = CliRunner().invoke(app, ["ltr", "fit", str(files["train", 0]), "-o", str(model),
                                      "--tokenizer", str(tiny_model_dir()), "--holdout", "0.2"])
    print(fitted.output.strip())
    PARAMS["ltr"]["model"] = str(model)
    PARAMS["hybrid"]["model"] = str(model)

    if args.ltr_check_only:
        text = ltr_check(out, files, seeds, args)
        print(text)
        (out / "ltr-check.txt").write_text(text + "\n")
        return 0

    capacity: dict[str, float] = results.get("saturation_req_per_s", {})
    started = time.monotonic()

    def measure(session: Session, family: str, workload: str, load: float, seed: int) -> None:
        key = f"{family}/{workload}/{load}/{seed}"
        if key in results:
            return
        path = files[workload, seed]
        records, summary = session.replay(path, workload, load * capacity[workload] / recorded_rate(path), seed)
        results[key] = metrics(records)
        results[key]["failed"] = summary["failed"]
        m = results[key]
        print(f"  {key}: n={m['n']:.0f} mean {m['mean']:.3f} p99 {m['p99']:.3f} "
              f"wait {m['wait']:.3f} hit {m['hit']:.1f}% ({time.monotonic() - started:.0f} s)", flush=True)
        results_path.write_text(json.dumps(results, indent=1))

    def warm_up_and_saturate(session: Session) -> None:
        for workload in workloads:  # warm-up (first shapes compile, caches fill); not measured
            session.replay(files[workload, 0], workload, rate=1e6, seed=99, limit=60)
        for workload in workloads:
            if workload not in capacity:
                # Saturation in requests per second (the seed-0 window's recorded rate x factor).
                factor = saturation(session, files[workload, 0], workload)
                capacity[workload] = factor * recorded_rate(files[workload, 0])
        results["saturation_req_per_s"] = capacity
        results_path.write_text(json.dumps(results, indent=1))

    if args.mode == "switch":
        # One engine; the families take turns run by run (the order rotates), so each comparison
        # with FCFS is between runs minutes apart on the same engine.
        with Session(SWITCH, out, args) as session:
            session.activate("fcfs")
            warm_up_and_saturate(session)
            turn = 0
            for seed in seeds:
                for workload in workloads:
                    for load in LOADS:
                        order = families[turn % len(families):] + families[: turn % len(families)]
                        turn += 1
                        for family in order:
                            session.activate(family)
                            measure(session, family, workload, load, seed)
    else:
        # The literal way: one engine session per family (session-to-session speed drift included).
        for family in families:
            print(f"\n== {family} ({time.monotonic() - started:.0f} s)", flush=True)
            with Session(family, out, args) as session:
                if family == "fcfs":
                    warm_up_and_saturate(session)
                else:
                    for workload in workloads:
                        session.replay(files[workload, 0], workload, rate=1e6, seed=99, limit=60)
                for seed in seeds:
                    for workload in workloads:
                        for load in LOADS:
                            measure(session, family, workload, load, seed)
    report = [tables(results, families, seeds), ""]
    for workload in workloads:
        report.append(capture_gain(results, families, seeds, workload, 0.9))
    text = "\n".join(report)
    print(text)
    (out / "report.md").write_text(text + "\n")
    print(f"\ntotal {time.monotonic() - started:.0f} s; results in {results_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
