"""``carbonforge-runtime sim TRACE --context-key KEY``: replay a trace through the twin (vLLM's real
scheduler in virtual time). Imports nothing heavy until it runs."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from carbonforge_runtime.cli.errors import run_guarded

if TYPE_CHECKING:
    from carbonforge_runtime.offline.sim.setup import KnobOverrides, TwinInputs

#: The hash seed the twin's results are reproducible under (vLLM iterates sets of request ids).
HASH_SEED = "0"


def pin_hash_seed(argv: list[str]) -> None:
    """Run again under ``PYTHONHASHSEED=0`` unless already so: string hashing decides the order in
    which vLLM walks its sets of request ids, and with it block eviction and cache hits."""
    if os.environ.get("PYTHONHASHSEED") == HASH_SEED:
        return
    import carbonforge_runtime

    # The same package again, whatever the working directory holds.
    home = str(Path(carbonforge_runtime.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONHASHSEED=HASH_SEED, PYTHONPATH=home + (os.pathsep + path if path else ""))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "carbonforge_runtime", *argv], env)


def _parse_params(items: list[str]) -> dict[str, Any]:
    import yaml

    from carbonforge_runtime.core.twin_data import SimError

    params: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise SimError(f"--param {item!r} is not NAME=VALUE", "pass e.g. --param aging_rate=20")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        if isinstance(value, (dict, list)):
            raise SimError(f"--param {name}: a family parameter is a number, a flag or a word",
                           "pass e.g. --param max_overtake_s=60")
        params[name.strip()] = value
    return params


def sim_command(
    trace: Path = typer.Argument(..., help="A JSONL trace (standard or full level), an Azure-format CSV or a "
                                 "Mooncake-format JSONL."),
    context_key: str = typer.Option(..., "--context-key", help="The recipe whose engine is modelled."),
    family: str | None = typer.Option(None, "--family", help="Try another ordering family (default: the recipe's)."),
    param: list[str] = typer.Option([], "--param", help="A family parameter NAME=VALUE (repeatable)."),
    rate: float = typer.Option(1.0, "--rate", help="Speed factor on the recorded inter-arrival times."),
    load: float | None = typer.Option(None, "--load",
                                      help="Set arrivals to this fraction of the twin's measured capacity "
                                      "(replaces --rate), e.g. 0.9; capacity is measured with FCFS whatever "
                                      "--family is tried, so one load is one traffic."),
    token_scale: float = typer.Option(1.0, "--token-scale", help="Multiply prompt and output sizes."),
    start: int = typer.Option(0, "--start", help="Skip this many requests of the trace."),
    limit: int | None = typer.Option(None, "--limit", help="Simulate at most this many requests."),
    cost_model: str | None = typer.Option(None, "--cost-model",
                                          help="Step-time model: a shipped name or a YAML file (default: the "
                                          "recipe's GPU and tensor-parallel size)."),
    kv_tokens: int | None = typer.Option(None, "--kv-tokens", help="KV cache size in tokens (default: the cost "
                                         "model's)."),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", help="Override the recipe's max_num_seqs."),
    max_num_batched_tokens: int | None = typer.Option(None, "--max-num-batched-tokens",
                                                      help="Override the recipe's max_num_batched_tokens."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="Override the recipe's max_model_len."),
    long_prefill_token_threshold: int | None = typer.Option(None, "--long-prefill-token-threshold",
                                                            help="Override the recipe's long-prefill threshold "
                                                            "(0: vLLM's default, no threshold)."),
    chunked_prefill: bool | None = typer.Option(None, "--chunked-prefill/--no-chunked-prefill",
                                                help="Override the recipe's enable_chunked_prefill."),
    prefix_caching: bool | None = typer.Option(None, "--prefix-caching/--no-prefix-caching",
                                               help="Override the recipe's enable_prefix_caching."),
    async_scheduling: bool | None = typer.Option(None, "--async-scheduling/--no-async-scheduling",
                                                 help="One step in flight, as vLLM on a GPU (default: on for GPU "
                                                 "recipes)."),
    mooncake_block_tokens: int = typer.Option(512, "--mooncake-block-tokens",
                                              help="Tokens one Mooncake hash id stands for."),
    output: Path = typer.Option(Path("sim-result.json"), "--output", "-o", help="Where to write the JSON result."),
    records: Path | None = typer.Option(None, "--records",
                                        help="Per-request JSONL for trace summarize/plot (default: the output's "
                                        "name with .requests.jsonl)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
) -> None:
    """Replay a trace through vLLM's real scheduler in virtual time and write the result as JSON."""
    options: dict[str, Any] = dict(
                   trace=trace, context_key=context_key, family=family, param=param, rate=rate, load=load,
                   token_scale=token_scale, start=start, limit=limit, cost_model=cost_model, kv_tokens=kv_tokens,
                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                   max_model_len=max_model_len, long_prefill_token_threshold=long_prefill_token_threshold,
                   chunked_prefill=chunked_prefill, prefix_caching=prefix_caching,
                   async_scheduling=async_scheduling, mooncake_block_tokens=mooncake_block_tokens, output=output,
                   records=records, quiet=quiet)
    code = run_guarded(lambda: _run(**options))
    raise typer.Exit(code)


def _records_path(output: Path) -> Path:
    name = output.name[:-5] if output.name.endswith(".json") else output.name
    return output.with_name(name + ".requests.jsonl")


def _check_output(path: Path, flag: str) -> None:
    from carbonforge_runtime.core.twin_data import SimError

    if path.is_dir():
        raise SimError(f"{flag} {path} is a directory", f"pass {flag} FILE")


def twin_inputs(*, trace: Path, context_key: str, start: int, limit: int | None, rate: float, token_scale: float,
                load: float | None, cost_model: str | None, kv_tokens: int | None, mooncake_block_tokens: int,
                family: str | None = None, param: list[str] | None = None,
                knobs: KnobOverrides | None = None) -> TwinInputs:
    """The options ``sim`` and ``tune`` share, as :class:`~carbonforge_runtime.offline.sim.setup.TwinInputs`."""
    from carbonforge_runtime.offline.sim.inputs import WindowOptions
    from carbonforge_runtime.offline.sim.setup import KnobOverrides, TwinInputs

    return TwinInputs(trace=trace, context_key=context_key,
                      window=WindowOptions(start=start, limit=limit, rate=rate, token_scale=token_scale),
                      load=load, cost_model=cost_model, kv_tokens=kv_tokens,
                      mooncake_block_tokens=mooncake_block_tokens, family=family,
                      params=_parse_params(param or []), knobs=knobs if knobs is not None else KnobOverrides())


def _run(*, trace: Path, context_key: str, family: str | None, param: list[str], rate: float, load: float | None,
         token_scale: float, start: int, limit: int | None, cost_model: str | None, kv_tokens: int | None,
         max_num_seqs: int | None, max_num_batched_tokens: int | None, max_model_len: int | None,
         long_prefill_token_threshold: int | None, chunked_prefill: bool | None, prefix_caching: bool | None,
         async_scheduling: bool | None, mooncake_block_tokens: int, output: Path, records: Path | None,
         quiet: bool) -> int:
    from carbonforge_runtime.core.figure_labels import of_cost_model
    from carbonforge_runtime.core.twin_data import SimError
    from carbonforge_runtime.files import write_atomic
    from carbonforge_runtime.offline.sim.results import (
        build_document,
        dump_json,
        dump_jsonl,
        format_sim_table,
    )
    from carbonforge_runtime.offline.sim.results import (
        records as build_records,
    )
    from carbonforge_runtime.offline.sim.setup import (
        CAPACITY_FAMILY,
        KnobOverrides,
        at_load,
        capacity_engine,
        prepare,
    )

    def progress(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    records_path = records if records is not None else _records_path(output)
    _check_output(output, "--output")
    _check_output(records_path, "--records")
    if records_path.resolve() == output.resolve():
        raise SimError("--records and --output name the same file", "pass two different paths")
    knobs = KnobOverrides(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, long_prefill_token_threshold=long_prefill_token_threshold,
                          chunked_prefill=chunked_prefill, prefix_caching=prefix_caching,
                          async_scheduling=async_scheduling)
    prepared = prepare(twin_inputs(trace=trace, context_key=context_key, start=start, limit=limit, rate=rate,
                                   token_scale=token_scale, load=load, cost_model=cost_model, kv_tokens=kv_tokens,
                                   mooncake_block_tokens=mooncake_block_tokens, family=family, param=param,
                                   knobs=knobs))
    recipe, family_name, params, cost = prepared.recipe, prepared.family, prepared.params, prepared.cost
    twin, rejected, requests, served = prepared.twin, prepared.rejected, prepared.requests, prepared.served
    sim_trace = prepared.trace
    label = of_cost_model(cost)
    if cost.proxy:
        progress(f"sim: cost model {cost.name} is a PROXY ({cost.scaling_rule})")

    from carbonforge_runtime.engine.twin import measure_capacity, run_twin

    effective_rate = rate
    capacity: float | None = None
    if load is not None:
        capacity = measure_capacity(served, capacity_engine(twin), cost)
        served, factor = at_load(served, load, capacity)
        effective_rate = rate * factor
        progress(f"sim: measured capacity {capacity:.2f} req/s with {CAPACITY_FAMILY} (the same traffic for every "
                 f"family); load {load:g} -> {load * capacity:.2f} req/s (rate x{effective_rate:.3g})")

    progress(f"sim: {len(served)} requests from {trace} ({sim_trace.kind}) on {recipe.key_text} with family "
             f"{family_name}, cost model {cost.name}" + (f", {len(rejected)} refused as too long" if rejected else ""))
    started = time.monotonic()
    last = [started]

    def step_progress(done: int, total: int, now: float) -> None:
        wall = time.monotonic()
        if wall - last[0] >= 5.0:
            last[0] = wall
            progress(f"sim: {done}/{total} done, virtual {now:.0f} s, {wall - started:.0f} s")

    run = run_twin(served, twin, cost, step_progress)
    if rejected:
        from carbonforge_runtime.core.twin_data import SimOutcome

        merged = {o.index: o for o in run.outcomes}
        for r in requests:
            if r.index in rejected:
                merged[r.index] = SimOutcome(r.index, r.arrival_s, r.prompt_tokens, r.output_tokens,
                                             finish_reason="error", tenant=r.tenant, priority=r.priority)
        run.outcomes = [merged[r.index] for r in requests]
    engine = {"recipe": recipe.key_text, "family": family_name, "params": params,
              "max_num_seqs": twin.max_num_seqs, "max_num_batched_tokens": twin.max_num_batched_tokens,
              "max_model_len": twin.max_model_len, "kv_tokens": twin.kv_tokens,
              "enable_chunked_prefill": twin.enable_chunked_prefill,
              "enable_prefix_caching": twin.enable_prefix_caching,
              "long_prefill_token_threshold": twin.long_prefill_token_threshold, "block_size": twin.block_size,
              "async_scheduling": twin.async_scheduling, "measured_capacity_rps": capacity,
              "capacity_measured_with": CAPACITY_FAMILY if capacity is not None else None}
    document = build_document(
        trace=str(trace), trace_kind=sim_trace.kind, model=recipe.model.served_name,
        options={"rate": rate, "effective_rate": effective_rate, "load": load, "token_scale": token_scale,
                 "start": start, "limit": limit, "cost_model": cost.name, "records": str(records_path)},
        run=run, rejected=rejected, cost=cost, engine=engine, label=label)
    rows = build_records(run, rejected, family_name, origin_s=0.0)
    write_atomic(records_path, dump_jsonl(rows))
    write_atomic(output, dump_json(document))
    progress(f"sim: {run.steps} steps in {time.monotonic() - started:.1f} s")
    print(format_sim_table(document))
    print(f"result: {output}")
    print(f"records: {records_path}")
    return 0


#: Below this R2, or above this p90 relative error, sim-calibrate warns that the fit is poor.
POOR_FIT_R2 = 0.8
POOR_FIT_P90 = 0.3


def calibrate_command(
    step_log: Path = typer.Argument(..., help="A step log (serve --step-log), plain or gzip JSONL."),
    output: Path = typer.Option(Path("step-model.yaml"), "--output", "-o",
                                help="Where to write the fitted step-time model (YAML, for sim --cost-model)."),
    name: str | None = typer.Option(None, "--name", help="The model's name (default: the output file's stem)."),
    version: int = typer.Option(1, "--version", min=1, help="The model's version number."),
    gpu: str = typer.Option("unknown", "--gpu", help="The GPU the steps ran on, e.g. h100."),
    tensor_parallel_size: int | None = typer.Option(None, "--tensor-parallel-size", min=1,
                                                    help="Tensor-parallel size of the engine (default: the step "
                                                    "log's, else 1)."),
    kv_tokens: int | None = typer.Option(None, "--kv-tokens", min=16,
                                         help="KV cache size in tokens (default: the step log's, as the engine log's "
                                         "'GPU KV cache size')."),
    skip_first: int = typer.Option(0, "--skip-first", min=0, help="Leave out the log's first N steps (warm-up)."),
) -> None:
    """Fit a step-time model to an engine's step log by least squares and write it for sim --cost-model."""
    code = run_guarded(lambda: _calibrate(step_log, output, name, version, gpu, tensor_parallel_size, kv_tokens,
                                          skip_first))
    raise typer.Exit(code)


def _calibrate(step_log: Path, output: Path, name: str | None, version: int, gpu: str,
               tensor_parallel_size: int | None, kv_tokens: int | None, skip_first: int) -> int:
    from carbonforge_runtime.core.twin_data import SimError
    from carbonforge_runtime.files import write_atomic
    from carbonforge_runtime.offline.sim.calibrate import (
        ModelInfo,
        engine_facts,
        fit_model,
        format_admission,
        format_fit,
        read_step_log,
    )

    _check_output(output, "--output")
    if output.exists() and step_log.exists() and output.resolve() == step_log.resolve():
        raise SimError("--output names the step log itself", "pass another path for the model, e.g. -o model.yaml")
    if not output.name.endswith((".yaml", ".yml")):
        raise SimError(f"--output {output} does not end in .yaml", "sim --cost-model reads a path ending in .yaml "
                       "or .yml: pass e.g. -o step-model.yaml")
    model_name = (name if name is not None else output.name.rsplit(".", 1)[0]).strip()
    if not model_name or not gpu.strip():
        raise SimError("--name and --gpu must not be empty", "pass e.g. --name h100-tp2-fitted --gpu h100")
    data = read_step_log(step_log, skip_first)
    facts = engine_facts(data.headers)
    kv = kv_tokens if kv_tokens is not None else facts.get("kv_cache_tokens")
    if not isinstance(kv, int) or isinstance(kv, bool) or kv < 16:
        raise SimError(f"{step_log}: no KV cache size in the log (its engine lines are missing or disagree)",
                       "pass --kv-tokens N with the engine log's 'GPU KV cache size: N tokens'")
    tp = tensor_parallel_size if tensor_parallel_size is not None else facts.get("tensor_parallel_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        tp = 1
    fitted = fit_model(data, ModelInfo(model_name[:200], version, gpu.strip()[:200], tp, kv), facts, str(step_log),
                       output)
    fit, model = fitted.fit, fitted.model

    def write(handle: Any) -> None:
        handle.write(fitted.text)

    write_atomic(output, write)
    if data.truncated:
        print(f"sim-calibrate: the log has more than {len(data.wall_ms)} steps; the fit uses the first "
              f"{len(data.wall_ms)}", file=sys.stderr)
    print(f"sim-calibrate: {fit.steps} steps from {step_log}" +
          (f" ({data.skipped} skipped)" if data.skipped else "") +
          (f", {data.empty} without tokens left out" if data.empty else ""))
    print(format_fit(fit))
    print(format_admission(fitted.admission))
    if fit.r2 < POOR_FIT_R2 or fit.p90_rel_error > POOR_FIT_P90:
        print(f"sim-calibrate: warning: a poor fit (R2 {fit.r2:.2f}, p90 relative error {fit.p90_rel_error:.0%}): "
              "the step times vary for reasons the model does not see (other load on the host, step jitter, "
              "features it leaves out); simulations with this model inherit that error", file=sys.stderr)
    print(f"model: {output} ({model.describe()}, KV capacity {model.kv_capacity_tokens} tokens); "
          f"use it with sim --cost-model {output}")
    return 0
