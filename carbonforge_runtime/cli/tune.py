"""``carbonforge-runtime tune TRACE --context-key KEY --goal GOAL``: search the ordering family, its
parameters and the scheduling knobs on the twin, for the operator's own trace. The search itself is
:mod:`carbonforge_runtime.offline.sim.tune`; this module runs its candidates in parallel processes."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from carbonforge_runtime.cli.errors import run_guarded
from carbonforge_runtime.cli.sim import HASH_SEED, twin_inputs

if TYPE_CHECKING:
    from carbonforge_runtime.core.twin_data import SimRequest, StepCostModel, TwinSettings
    from carbonforge_runtime.offline.sim.setup import Prepared
    from carbonforge_runtime.offline.sim.tune import Config, Figures, SearchResult, Slo

#: Candidates tune evaluates by default (the recipe included): about three rounds of the search.
DEFAULT_BUDGET = 32


def tune_command(
    trace: Path = typer.Argument(..., help="A JSONL trace (standard or full level), an Azure-format CSV or a "
                                 "Mooncake-format JSONL."),
    context_key: str = typer.Option(..., "--context-key", help="The recipe to tune."),
    goal: str = typer.Option(..., "--goal", help="mean_e2e (lowest mean end-to-end latency), p99_ttft (lowest "
                             "p99 time to first token) or throughput (highest, within the --slo limits)."),
    slo: list[str] = typer.Option([], "--slo", help="A latency limit NAME=DURATION a candidate must meet, e.g. "
                                  "ttft_p99=2s or e2e_mean=10s (repeatable)."),
    budget: int = typer.Option(DEFAULT_BUDGET, "--budget", help="Most candidates to evaluate, the recipe included."),
    jobs: int | None = typer.Option(None, "--jobs", "-j", help="Candidates evaluated at once, each in its own "
                                    "process (default: the number of CPUs)."),
    rate: float = typer.Option(1.0, "--rate", help="Speed factor on the recorded inter-arrival times."),
    load: float | None = typer.Option(None, "--load", help="Set arrivals to this fraction of the recipe's measured "
                                      "capacity on the twin (replaces --rate), e.g. 0.9."),
    token_scale: float = typer.Option(1.0, "--token-scale", help="Multiply prompt and output sizes."),
    start: int = typer.Option(0, "--start", help="Skip this many requests of the trace."),
    limit: int | None = typer.Option(None, "--limit", help="Use at most this many requests."),
    cost_model: str | None = typer.Option(None, "--cost-model", help="Step-time model: a shipped name or a YAML "
                                          "file (default: the recipe's GPU and tensor-parallel size)."),
    kv_tokens: int | None = typer.Option(None, "--kv-tokens", help="KV cache size in tokens (default: the cost "
                                         "model's)."),
    mooncake_block_tokens: int = typer.Option(512, "--mooncake-block-tokens",
                                              help="Tokens one Mooncake hash id stands for."),
    output: Path = typer.Option(Path("tune-result.json"), "--output", "-o",
                                help="Where to write every candidate's figures (JSON)."),
    write: Path | None = typer.Option(None, "--write", help="Write the tuned recipe into this directory (serve it "
                                      "with CF_RECIPES_DIR=DIR); refused if another recipe there has its key."),
    force: bool = typer.Option(False, "--force", help="With --write: replace the recipe file of the same name "
                               "if one is there."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
) -> None:
    """Search the ordering and scheduling knobs of a recipe on the twin for a goal, and print a recipe patch."""
    options: dict[str, Any] = dict(
        trace=trace, context_key=context_key, goal=goal, slo=slo, budget=budget, jobs=jobs, rate=rate, load=load,
        token_scale=token_scale, start=start, limit=limit, cost_model=cost_model, kv_tokens=kv_tokens,
        mooncake_block_tokens=mooncake_block_tokens, output=output, write=write, force=force, quiet=quiet)
    code = run_guarded(lambda: _run(**options))
    raise typer.Exit(code)


# --- the worker processes ----------------------------------------------------------------------------------

def _evaluate(requests: Sequence[SimRequest], settings: TwinSettings, cost: StepCostModel) -> Figures:
    """One candidate on the twin; a configuration the twin or vLLM refuses is infeasible, not a failure."""
    from carbonforge_runtime.core.twin_data import SimError
    from carbonforge_runtime.engine.twin import run_twin
    from carbonforge_runtime.offline.sim.tune import Figures, figures_of

    try:
        run = run_twin(requests, settings, cost)
    except SimError as exc:
        return Figures(error=exc.message)
    except ValueError as exc:  # vLLM's configuration checks (pydantic's errors are ValueErrors)
        lines = [line.strip().split(" [type=")[0] for line in str(exc).splitlines()
                 if line.strip() and not line.strip().startswith("For further information")]
        return Figures(error=lines[-1][:300] if lines else type(exc).__name__)
    return figures_of(run)


def _capacity(requests: Sequence[SimRequest], settings: TwinSettings, cost: StepCostModel) -> float:
    from carbonforge_runtime.engine.twin import measure_capacity

    return measure_capacity(requests, settings, cost)


@contextlib.contextmanager
def _hash_seed_pinned() -> Iterator[None]:
    """Workers start with ``PYTHONHASHSEED=0`` however this process was started (the command line
    pins it already; a caller importing this module may not have)."""
    previous = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = HASH_SEED
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = previous


def _pool(jobs: int) -> Any:
    """Worker processes started fresh (spawned: no state of this process leaks into them)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))


def _evaluate_all(pool: Any, requests: list[SimRequest], base: TwinSettings, cost: StepCostModel,
                  configs: list[Config], done_before: int, budget: int, progress: Any) -> list[Figures]:
    from concurrent.futures import as_completed

    futures = {pool.submit(_evaluate, requests, config.settings(base), cost): i for i, config in enumerate(configs)}
    results: dict[int, Figures] = {}
    for future in as_completed(futures):
        i = futures[future]
        figures = results[i] = future.result()
        state = (f"e2e mean {figures.e2e_mean_s:.3f} s, p99 TTFT {figures.ttft_p99_s:.3f} s" if figures.feasible
                 else f"infeasible: {figures.error}")
        progress(f"tune: candidate {done_before + i} done ({len(results)}/{len(configs)} of this round, "
                 f"budget {budget}): {state}")
    return [results[i] for i in range(len(configs))]


# --- the command -------------------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_paths(output: Path, write: Path | None, context_key: str, force: bool) -> None:
    """Refuse, before the search, outputs that could not be written (checked again when writing)."""
    from carbonforge_runtime.core.twin_data import SimError
    from carbonforge_runtime.errors import ContextKeyError
    from carbonforge_runtime.offline.sim.recipe_out import check_destination
    from carbonforge_runtime.recipes.keys import parse_context_key

    if output.is_dir():
        raise SimError(f"--output {output} is a directory", "pass --output FILE.json")
    if write is not None:
        try:
            key_text = str(parse_context_key(context_key))
        except ContextKeyError:
            return  # the recipe's resolution names the problem
        check_destination(write, key_text, force)


def _run(*, trace: Path, context_key: str, goal: str, slo: list[str], budget: int, jobs: int | None, rate: float,
         load: float | None, token_scale: float, start: int, limit: int | None, cost_model: str | None,
         kv_tokens: int | None, mooncake_block_tokens: int, output: Path, write: Path | None, force: bool,
         quiet: bool) -> int:
    from carbonforge_runtime.core.twin_data import SimError
    from carbonforge_runtime.offline.sim.setup import CAPACITY_FAMILY, at_load, capacity_engine, prepare
    from carbonforge_runtime.offline.sim.tune import Config, build_patch, parse_goal, parse_slos, search

    def progress(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    goal_name = parse_goal(goal)
    slos = parse_slos(slo)
    if budget < 1 or budget > 1000:
        raise SimError(f"budget {budget} is out of range", "pass --budget N with 1 <= N <= 1000 (1: the recipe only)")
    workers = jobs if jobs is not None else (os.cpu_count() or 1)
    if workers < 1 or workers > 256:
        raise SimError(f"jobs {workers} is out of range", "pass --jobs N with 1 <= N <= 256")
    _check_paths(output, write, context_key, force)
    prepared = prepare(twin_inputs(trace=trace, context_key=context_key, start=start, limit=limit, rate=rate,
                                   token_scale=token_scale, load=load, cost_model=cost_model, kv_tokens=kv_tokens,
                                   mooncake_block_tokens=mooncake_block_tokens))
    cost = prepared.cost
    if cost.proxy:
        progress(f"tune: cost model {cost.name} is a PROXY ({cost.scaling_rule}): the figures are rankings, "
                 "not promises")
    served = prepared.served
    recipe_config = Config.of(prepared.twin)
    started = time.monotonic()
    with _hash_seed_pinned():
        pool = _pool(workers)
        try:
            capacity: float | None = None
            factor = 1.0
            if load is not None:
                capacity = pool.submit(_capacity, served, capacity_engine(prepared.twin), cost).result()
                served, factor = at_load(served, load, capacity)
                progress(f"tune: measured capacity {capacity:.2f} req/s of the recipe's knobs with {CAPACITY_FAMILY} "
                         f"(every candidate gets the same traffic); load {load:g} -> {load * capacity:.2f} req/s")
            progress(f"tune: {len(served)} requests from {trace} on {prepared.recipe.key_text}, goal {goal_name}"
                     + (f", SLO {' '.join(s.text() for s in slos)}" if slos else "")
                     + f", at most {budget} candidates, {workers} at once")
            counter = [0]

            def evaluate(configs: list[Config]) -> list[Figures]:
                figures = _evaluate_all(pool, served, prepared.twin, cost, configs, counter[0], budget, progress)
                counter[0] += len(configs)
                return figures

            result = search(recipe_config, evaluate, goal_name, slos, budget, len(served))
        finally:
            pool.shutdown(cancel_futures=True)
    patch = build_patch(recipe_config, result.candidates[result.best].config)
    window = {"start": start, "limit": limit, "rate": rate, "load": load, "effective_rate": rate * factor,
              "measured_capacity_rps": capacity,
              "capacity_measured_with": CAPACITY_FAMILY if capacity is not None else None, "token_scale": token_scale,
              "mooncake_block_tokens": mooncake_block_tokens, "kv_tokens": prepared.twin.kv_tokens}
    document = _document(prepared, trace, goal_name, slos, budget, window, result, patch, len(served))
    from carbonforge_runtime.files import write_atomic
    from carbonforge_runtime.offline.sim.results import dump_json

    written = _write_recipe(write, prepared, document, force) if write is not None else None
    write_atomic(output, dump_json(document))
    progress(f"tune: {len(result.candidates)} candidates in {result.rounds} rounds, {time.monotonic() - started:.1f} s")
    print(_report(document, recipe_config, result, goal_name, slos, len(served)))
    print(f"result: {output}")
    if written is not None:
        print(f"recipe: {written} (serve it with CF_RECIPES_DIR={write})")
    return 0


_SHOWN = ("ttft_mean_s", "ttft_p99_s", "e2e_mean_s", "e2e_p99_s", "throughput_rps", "output_tokens_per_s")


def _document(prepared: Prepared, trace: Path, goal: str, slos: Sequence[Slo], budget: int,
              window: dict[str, Any], result: SearchResult, patch: dict[str, Any], total: int) -> dict[str, Any]:
    from carbonforge_runtime.core.figure_labels import of_cost_model
    from carbonforge_runtime.offline.sim.tune import differences, ranked, slo_met

    recipe_config = result.candidates[0].config
    rank = {c.index: i + 1 for i, c in enumerate(ranked(result, goal, slos, total))}
    cost = prepared.cost
    return {
        "tune": {
            "trace": str(trace), "trace_file": trace.name, "trace_sha256": _sha256(trace),
            "trace_kind": prepared.trace.kind, "context_key": prepared.recipe.key_text, "goal": goal,
            "slo": {s.metric: s.limit_s for s in slos}, "budget": budget, "rounds": result.rounds,
            "requests": total, "refused_as_too_long": len(prepared.rejected), "window": window,
            "cost_model": cost.to_json(), "proxy_cost_model": cost.proxy, "predicted": True,
            "label": of_cost_model(cost).to_json(),
            "best": result.best,
        },
        "patch": patch,
        "candidates": [{
            "index": c.index, "rank": rank[c.index], "round": c.round,
            "changes": differences(recipe_config, c.config),
            "config": {"family": c.config.family, "params": dict(c.config.params),
                       "max_num_seqs": c.config.max_num_seqs,
                       "max_num_batched_tokens": c.config.max_num_batched_tokens,
                       "long_prefill_token_threshold": c.config.long_prefill_token_threshold,
                       "enable_chunked_prefill": c.config.enable_chunked_prefill},
            "feasible": c.figures.feasible, "slo_met": slo_met(c.figures, slos), "figures": c.figures.to_json(),
        } for c in result.candidates],
    }


def _seconds(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.3f}"


def _report(document: dict[str, Any], recipe: Config, result: SearchResult, goal: str, slos: Sequence[Slo],
            total: int) -> str:
    import yaml

    from carbonforge_runtime.offline.sim.tune import GOALS, describe, ranked, relative_change, slo_met

    header = ("rank", "cand", "TTFT mean", "TTFT p99", "e2e mean", "e2e p99", "req/s", "SLO", "settings")
    rows = []
    for position, c in enumerate(ranked(result, goal, slos, total), start=1):
        f = c.figures
        if not f.feasible:
            rows.append((str(position), str(c.index), "-", "-", "-", "-", "-", "-",
                         f"{describe(recipe, c.config)}  [infeasible: {f.error}]"))
            continue
        rows.append((str(position), str(c.index), _seconds(f.ttft_mean_s), _seconds(f.ttft_p99_s),
                     _seconds(f.e2e_mean_s), _seconds(f.e2e_p99_s), f"{f.throughput_rps:.3f}",
                     ("yes" if slo_met(f, slos) else "no") if slos else "-", describe(recipe, c.config)))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(widths[i]) if i == len(header) - 1 else cell.rjust(widths[i])
                       for i, cell in enumerate(row)).rstrip() for row in [header, *rows]]
    tune = document["tune"]
    lines.append(f"(seconds; figures {tune['label']['text']}"
                 + (": rankings, not promises" if tune["proxy_cost_model"] else "") + ")")
    best = result.candidates[result.best]
    shipped = result.candidates[0]
    figure, _ = GOALS[goal]
    if best.index == 0:
        lines.append(f"best: the recipe as shipped (no candidate beat it on {goal}); no patch")
    else:
        lines.append(f"best: candidate {best.index} ({describe(recipe, best.config)}) against the recipe as shipped:")
        for name in _SHOWN:
            new, old = best.figures.value(name), shipped.figures.value(name)
            change = relative_change(new, old)
            mark = "  <- goal" if name == figure else ""
            lines.append(f"  {name:<20} {old:10.3f} -> {new:10.3f}  ({change:+.1%}){mark}")
        if slos and not slo_met(best.figures, slos):
            lines.append("  no candidate met every SLO: this is the one that came closest on the goal")
        lines.append(f"patch for {tune['context_key']}:")
        lines.append(yaml.safe_dump(document["patch"], sort_keys=False).rstrip())
    return "\n".join(lines)


def _write_recipe(directory: Path, prepared: Prepared, document: dict[str, Any], force: bool) -> Path:
    """The recipe with the patch applied and the prediction recorded, checked by the loader before it
    is written (whole or not at all), and the directory loaded as serve would load it afterwards
    (:func:`~carbonforge_runtime.offline.sim.recipe_out.place_recipe`)."""
    import yaml

    from carbonforge_runtime.offline.sim.recipe_out import place_recipe
    from carbonforge_runtime.offline.sim.tune import apply_patch, recipe_file_name
    from carbonforge_runtime.recipes.loader import load_recipe_file
    from carbonforge_runtime.recipes.model import recipe_from_mapping

    tune = document["tune"]
    candidates = document["candidates"]

    def shown(figures: dict[str, Any]) -> dict[str, float | None]:
        return {name: (round(figures[name], 6) if math.isfinite(figures[name]) else None) for name in _SHOWN}

    cost = tune["cost_model"]
    benchmark = {
        "measured": False,
        "by": "carbonforge-runtime tune (the twin: vLLM's scheduler in virtual time with a step-time model)",
        "trace": {"file": tune["trace_file"], "sha256": tune["trace_sha256"], "kind": tune["trace_kind"],
                  "requests": tune["requests"]},
        "window": dict(tune["window"]),
        "goal": tune["goal"],
        "slo": {f"{name}_s": limit for name, limit in tune["slo"].items()},
        "cost_model": {"name": cost["name"], "version": cost["version"], "proxy": cost["proxy"],
                       "scaling_rule": cost["scaling_rule"]},
        "candidates": len(candidates),
        "chosen": {"candidate": tune["best"], **shown(candidates[tune["best"]]["figures"])},
        "shipped": shown(candidates[0]["figures"]),
    }
    source = load_recipe_file(prepared.recipe.source)  # re-checks the file the recipe came from
    raw = yaml.safe_load(source.source.read_text(encoding="utf-8"))
    patched = apply_patch(raw, document["patch"], benchmark)
    text = ("# Tuned by carbonforge-runtime tune: the figures under benchmark.predicted are predictions of the\n"
            "# twin with the named step-time model, not measurements.\n"
            + yaml.safe_dump(patched, sort_keys=False, allow_unicode=True))
    path = directory / recipe_file_name(prepared.recipe.key_text)
    recipe_from_mapping(yaml.safe_load(text), path)  # the loader's own checks, before anything is written
    return place_recipe(directory, prepared.recipe.key_text, text, force)
