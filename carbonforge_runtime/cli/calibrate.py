"""``carbonforge-runtime calibrate --context-key KEY``: fit a step-time model on this host and check
it. The phases are :mod:`carbonforge_runtime.offline.calibrate.run`; this module parses the command
line, reads the host's GPUs and hands in the twin's prediction (``sim``'s own run)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from carbonforge_runtime.cli.errors import run_guarded

if TYPE_CHECKING:
    from carbonforge_runtime.offline.calibrate.run import Host, Prediction
    from carbonforge_runtime.offline.calibrate.served import ServedEngine

DEFAULT_BUDGET = "15m"


def calibrate_command(
    context_key: str = typer.Option(..., "--context-key", help="The recipe to serve and calibrate on this host."),
    budget: str = typer.Option(DEFAULT_BUDGET, "--budget", help="Time for everything, e.g. 90s, 15m, 1h."),
    output_dir: Path = typer.Option(Path("calibration"), "--output-dir", "-o",
                                    help="Where the fitted model (step-model.yaml), the local recipe (recipes/, "
                                    "for CF_RECIPES_DIR), the logs and the loads are written."),
) -> None:
    """Serve a recipe on this host, fit its step-time model, check it on a second load, write a local recipe."""
    code = run_guarded(lambda: _run(context_key, budget, output_dir))
    raise typer.Exit(code)


def _progress(line: str) -> None:
    print(line, flush=True)


def host() -> Host:
    """The GPUs NVML sees (none on a host without a driver); tests replace this function."""
    from carbonforge_runtime.gpu.select import default_backend
    from carbonforge_runtime.offline.calibrate.run import Host

    snapshot = default_backend().snapshot()
    if not snapshot.available:
        return Host()
    return Host(tuple(d.name for d in snapshot.devices), snapshot.driver_version or None)


def predict(*, trace: Path, limit: int, load: float, cost_model: Path, kv_tokens: int, async_scheduling: bool | None,
            output: Path, context_key: str) -> Prediction:
    """The twin's prediction of the check load: ``sim`` itself (its table printed), with the fitted
    model and the engine's KV cache and scheduling."""
    import contextlib
    import io
    import json

    from carbonforge_runtime.cli.sim import _records_path
    from carbonforge_runtime.cli.sim import _run as run_sim
    from carbonforge_runtime.offline.calibrate.run import Prediction
    from carbonforge_runtime.offline.trace_reader import numbered_records

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_sim(trace=trace, context_key=context_key, family=None, param=[], rate=1.0, load=load, token_scale=1.0,
                start=0, limit=limit, cost_model=str(cost_model), kv_tokens=kv_tokens, max_num_seqs=None,
                max_num_batched_tokens=None, max_model_len=None, long_prefill_token_threshold=None,
                chunked_prefill=None, prefix_caching=None, async_scheduling=async_scheduling,
                mooncake_block_tokens=512, output=output, records=None, quiet=True)
    document: dict[str, Any] = json.loads(output.read_text(encoding="utf-8"))
    records = [record for _, record in numbered_records(_records_path(output))]
    table = "\n".join(line for line in printed.getvalue().splitlines() if not line.startswith(("result:", "records:")))
    capacity = document.get("sim", {}).get("engine", {}).get("measured_capacity_rps")
    return Prediction(records, float(document["options"]["effective_rate"]),
                      None if capacity is None else float(capacity), table)


def served_engine(context_key: str, output_dir: Path) -> ServedEngine:
    """The runtime serving ``context_key``, as a child process of the supervisor's kind (its own session,
    a watchdog, a stop that ends in SIGKILL); tests replace this function."""
    from carbonforge_runtime.offline.calibrate.served import ServedEngine
    from carbonforge_runtime.runtime.process.supervisor import EngineProcess

    return ServedEngine(context_key, output_dir, os.environ, EngineProcess)


def _run(context_key: str, budget: str, output_dir: Path) -> int:
    from carbonforge_runtime import PINNED_VLLM_VERSION
    from carbonforge_runtime.offline.calibrate.run import Options, calibrate, check_inputs

    recipe, seconds = check_inputs(context_key, output_dir, budget, os.environ)
    options = Options(recipe.key_text, output_dir, seconds)
    engine = served_engine(recipe.key_text, output_dir)

    def twin(*, trace: Path, limit: int, load: float, cost_model: Path, kv_tokens: int,
             async_scheduling: bool | None, output: Path) -> Prediction:
        return predict(trace=trace, limit=limit, load=load, cost_model=cost_model, kv_tokens=kv_tokens,
                       async_scheduling=async_scheduling, output=output, context_key=recipe.key_text)

    outcome = calibrate(options, recipe, engine, twin, host(), PINNED_VLLM_VERSION, _progress)
    print(f"model: {outcome.model} (use it with sim --cost-model {outcome.model} and tune --cost-model "
          f"{outcome.model})")
    print(f"recipe: {outcome.recipe} (serve it with CF_RECIPES_DIR={outcome.recipe.parent})")
    print(f"summary: {outcome.summary}")
    sys.stdout.flush()
    return 0
