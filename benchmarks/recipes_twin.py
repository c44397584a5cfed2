#!/usr/bin/env python3
"""Every shipped GPU recipe on the twin: its own engine (vLLM knobs, step-time model) serving the
whole trace of its workload at 90% of its FCFS capacity, with its scheduler as shipped against FCFS,
the other deployable families with their default parameters and the total-cost oracle. ``--write``
records the shipped scheduler's predicted figures in each recipe's ``benchmark.predicted`` block.

Workload to trace (the traces of ``ordering_twin.py``, whole):

* ``chat``    the Azure conversation trace (2023), as recorded;
* ``coding``  prefill-heavy: its arrivals with prompts x3 (at most 24,576 tokens) and outputs / 10;
* ``agentic`` the Mooncake synthetic trace (long prompts that share hash-id blocks: prefix reuse).

Recipes served by the CPU engine are left out: no step-time model ships for a CPU (calibrate one
with ``sim-calibrate``). A multi-host recipe is simulated per engine, as ``sim`` does.

    PYTHONPATH=. .venv/bin/python benchmarks/recipes_twin.py [--load 0.9] [--jobs N] [--cache DIR]
        [--json benchmarks/results/recipes_twin.json] [--markdown benchmarks/results/recipes_twin.md] [--write]

Every figure is a PREDICTION with the recipe's step-time model (proxies say so); runs are
deterministic, and with the same ``--cache`` as ``ordering_twin.py`` the cells both scripts run
are computed once.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.ordering_twin import (  # noqa: E402
    TIE,
    TraceSpec,
    best_deployable,
    cached,
    capacity_job,
    label_of,
    make_traces,
    pct,
    pin_hash_seed,
    rel,
    run_job,
    twin_params,
    write_outputs,
)

WORKLOAD_TRACE = {"chat": "azure-conv", "coding": "prefill", "agentic": "mooncake"}
#: Deployable families tried on every recipe, with their default parameters.
FAMILIES = ("fcfs", "ltr-promptlen", "affinity", "ltr", "hybrid")
FIGURES = ("e2e_mean_s", "e2e_p99_s", "ttft_mean_s", "ttft_p99_s", "throughput_rps")
#: A family is chosen over FCFS only if its p99 e2e is no worse than FCFS's by more than this.
P99_SLACK = 0.05
BLOCK_COMMENT = ("# benchmark.predicted: figures PREDICTED by the twin (vLLM's scheduler in virtual time with\n"
                 "# the named step-time model), not measured; written by benchmarks/recipes_twin.py --write.\n")


def recipe_candidates(recipe: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, family, params): the deployable families, the recipe's own scheduler, the oracle."""
    out = {label_of(f, twin_params(f, {})): (f, twin_params(f, {})) for f in FAMILIES}
    own = twin_params(recipe.scheduler.family, recipe.scheduler.params)
    out.setdefault(shipped_label(recipe), (recipe.scheduler.family, own))
    out["oracle-cost"] = ("oracle-cost", {})
    return [(label, f, p) for label, (f, p) in sorted(out.items(), key=lambda kv: (kv[0] != "fcfs", kv[0]))]


def shipped_label(recipe: Any) -> str:
    return label_of(recipe.scheduler.family, twin_params(recipe.scheduler.family, recipe.scheduler.params))


def best(rows: dict[str, dict[str, Any]]) -> str:
    """The deployable family with the lowest mean e2e among those whose p99 e2e stays within
    P99_SLACK of FCFS's; FCFS unless it beats FCFS by more than TIE."""
    f = rows["fcfs"]
    return best_deployable({label: r for label, r in rows.items()
                            if rel(r["e2e_p99_s"], f["e2e_p99_s"]) <= P99_SLACK}, "e2e_mean_s")


def figures(row: dict[str, Any], fcfs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The predicted figures of a run, and their change against FCFS's when given."""
    out: dict[str, Any] = {k: round(row[k], 4) for k in FIGURES}
    if fcfs is not None:
        out["vs_fcfs"] = {k: f"{rel(row[k], fcfs[k]) * 100:+.1f}%" for k in FIGURES}
    return out


def predicted_block(recipe: Any, trace: TraceSpec, cap: dict[str, Any], load: float, rows: dict[str, Any],
                    model: Any, whole: bool) -> dict[str, Any]:
    label = shipped_label(recipe)
    return {
        "measured": False,
        "by": "benchmarks/recipes_twin.py (the twin: vLLM 0.32's scheduler in virtual time with a step-time model)",
        "trace": {"name": trace.name, "file": Path(trace.path).name, "requests": cap["requests"],
                  "served": cap["served"], "note": trace.note},
        "window": {"whole_trace": whole, "load": load, "capacity_rps": round(cap["capacity_rps"], 4)},
        "goal": f"lowest mean e2e, p99 e2e within {P99_SLACK:.0%} of FCFS",
        "cost_model": {"name": model.name, "version": model.version, "proxy": model.proxy,
                       "scaling_rule": model.scaling_rule},
        "candidates": len(rows),
        "chosen": {"candidate": label, "family": recipe.scheduler.family,
                   "params": dict(recipe.scheduler.params), **figures(rows[label], rows["fcfs"])},
        "baseline": {"candidate": "fcfs", **figures(rows["fcfs"])},
    }


def write_block(path: Path, block: dict[str, Any]) -> None:
    """Replace the recipe file's ``benchmark`` block (its last top-level key) with one whose
    ``predicted`` entry is ``block``; the rest of the file, comments included, is kept."""
    import yaml

    from carbonforge_runtime.recipes.model import recipe_from_mapping

    text = path.read_text(encoding="utf-8")
    found = re.search(r"^(# benchmark\.predicted:[^\n]*\n(#[^\n]*\n)*)?benchmark:", text, re.M)
    if found is None or re.search(r"^[A-Za-z_]", text[found.end():], re.M):
        raise SystemExit(f"{path}: the benchmark block is not the file's last top-level key; not rewritten")
    current = yaml.safe_load(text[found.start():]) or {}
    bench = dict(current.get("benchmark") or {})
    bench["predicted"] = block
    new = text[:found.start()] + BLOCK_COMMENT + yaml.safe_dump({"benchmark": bench}, sort_keys=False, width=100)
    recipe_from_mapping(yaml.safe_load(new), path)  # the loader's checks, before anything is written
    tmp = path.with_suffix(".tmp")
    tmp.write_text(new, encoding="utf-8")
    tmp.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=float, default=0.9)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache", type=Path, default=None, help="as in ordering_twin.py")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "recipes_twin.json")
    parser.add_argument("--markdown", type=Path, default=REPO / "benchmarks" / "results" / "recipes_twin.md")
    parser.add_argument("--write", action="store_true", help="record the figures in the shipped recipes' files")
    parser.add_argument("--limit", type=int, default=None,
                        help="the first N requests of each trace (a quick look; the recipes record whole traces)")
    parser.add_argument("--only", default="", help="context keys to run (comma-separated; default every GPU recipe)")
    args = parser.parse_args()
    if args.write and args.limit is not None:
        parser.error("--write records whole traces: drop --limit")
    pin_hash_seed()
    from carbonforge_runtime.recipes import load_recipes, recipe_dirs

    loaded = load_recipes(recipe_dirs(None))
    only = [k for k in args.only.split(",") if k]
    recipes = [loaded[k] for k in sorted(loaded) if (not only or k in only) and not loaded[k].key.hardware.is_cpu]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cf-recipes-twin-") as workdir:
        traces = {t.name: t for t in make_traces(Path(workdir), args.limit)}
        plan = []
        for recipe in recipes:
            base = traces[WORKLOAD_TRACE[recipe.key.workload]]
            plan.append((recipe, dataclasses.replace(base, context_key=recipe.key_text)
                         if base.context_key != recipe.key_text else base))
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=ctx) as pool:
            caps = {r.key_text: pool.submit(cached, args.cache, capacity_job, t, args.limit, "nominal")
                    for r, t in plan}
            capacities = {k: f.result() for k, f in caps.items()}
            for k, c in capacities.items():
                print(f"[{time.perf_counter() - started:6.0f}s] capacity {k}: {c['capacity_rps']:.3f} req/s",
                      file=sys.stderr, flush=True)
            futures = {(r.key_text, label): pool.submit(cached, args.cache, run_job, t, args.limit, "nominal",
                                                        args.load, capacities[r.key_text]["capacity_rps"], label,
                                                        family, params)
                       for r, t in plan for label, family, params in recipe_candidates(r)}
            results: dict[str, dict[str, Any]] = {}
            for (key, label), fut in futures.items():
                row = fut.result()
                results.setdefault(key, {})[label] = row
                print(f"[{time.perf_counter() - started:6.0f}s] {key} {label}: mean e2e {row['e2e_mean_s']:.2f} s",
                      file=sys.stderr, flush=True)
    lines = ["# Shipped recipes on the twin (predicted)", "",
             f"PREDICTED by the twin with each recipe's step-time model at {args.load:.0%} of its FCFS capacity, "
             "whole traces. Not measured on a GPU.", "",
             f"Command: `python benchmarks/recipes_twin.py --load {args.load:g}`", "",
             "| Recipe | Trace | Cost model | Capacity req/s | Shipped family | Best (rule) | Family | mean e2e s | "
             "vs FCFS | p99 e2e s | vs FCFS | mean TTFT s | vs FCFS | req/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    out: dict[str, Any] = {"meta": {"load": args.load, "p99_slack": P99_SLACK, "tie": TIE, "predicted": True,
                                    "measured": False}, "recipes": {}}
    for recipe, trace in plan:
        key = recipe.key_text
        rows, cap = results[key], capacities[key]
        model = recipe.step_model()
        chosen, shipped = best(rows), shipped_label(recipe)
        block = predicted_block(recipe, trace, cap, args.load, rows, model, args.limit is None)
        out["recipes"][key] = {"trace": trace.name, "capacity": cap, "best": chosen, "shipped": shipped,
                               "rows": rows, "block": block}
        f = rows["fcfs"]
        cost = f"{model.name} v{model.version}" + (" (PROXY)" if model.proxy else "")
        for label in sorted(rows, key=lambda x: (rows[x]["e2e_mean_s"], x)):
            r = rows[label]
            lines.append(f"| {key} | {trace.name} | {cost} | {cap['capacity_rps']:.3f} | {shipped} | {chosen} | "
                         f"{label} | {r['e2e_mean_s']:.2f} | {pct(rel(r['e2e_mean_s'], f['e2e_mean_s']))} | "
                         f"{r['e2e_p99_s']:.2f} | "
                         f"{pct(rel(r['e2e_p99_s'], f['e2e_p99_s']))} | {r['ttft_mean_s']:.2f} | "
                         f"{pct(rel(r['ttft_mean_s'], f['ttft_mean_s']))} | {r['throughput_rps']:.3f} |")
        if args.write:
            write_block(recipe.source, block)
    lines += ["", f"Best (rule): the deployable family with the lowest mean e2e whose p99 e2e is within "
              f"{P99_SLACK:.0%} of FCFS's, or fcfs when none beats FCFS's mean by more than {TIE:.0%}."]
    markdown = "\n".join(lines) + "\n"
    for entry in out["recipes"].values():
        entry["capacity"].pop("cpu_s", None)
        for r in entry["rows"].values():
            r.pop("cpu_s", None)
    write_outputs(args.json, args.markdown, out, markdown, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
