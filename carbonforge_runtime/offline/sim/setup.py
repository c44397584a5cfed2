"""From a recipe and the command line's options to what the twin runs: the window of requests, the
engine (:class:`~carbonforge_runtime.core.twin_data.TwinSettings`), the step-time model, and the requests
the API server would refuse. Shared by ``sim`` and ``tune``; imports no vLLM.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from carbonforge_runtime.core.twin_data import SimError, SimRequest, StepCostModel, TwinSettings
from carbonforge_runtime.offline.sim.inputs import SimTrace, WindowOptions
from carbonforge_runtime.recipes.model import Recipe


@dataclass(frozen=True)
class KnobOverrides:
    """The recipe's vLLM knobs as the command line changes them (None: the recipe's value)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    long_prefill_token_threshold: int | None = None
    chunked_prefill: bool | None = None
    prefix_caching: bool | None = None
    async_scheduling: bool | None = None


@dataclass(frozen=True)
class TwinInputs:
    """The trace, window and engine options common to ``sim`` and ``tune``."""

    trace: Path
    context_key: str
    window: WindowOptions
    load: float | None = None
    cost_model: str | None = None
    kv_tokens: int | None = None
    mooncake_block_tokens: int = 512
    family: str | None = None
    params: Any = None  # a mapping of family parameters (from --param), or None
    knobs: KnobOverrides = KnobOverrides()


@dataclass
class Prepared:
    """Everything a run of the twin needs, checked."""

    recipe: Recipe
    family: str
    params: dict[str, Any]
    cost: StepCostModel
    trace: SimTrace
    requests: list[SimRequest]  # the window, in arrival order
    twin: TwinSettings
    rejected: dict[int, str]  # index -> why the API server refuses it
    served: list[SimRequest]  # the window less the refused requests


def check_options(load: float | None, mooncake_block_tokens: int, window: WindowOptions) -> None:
    if load is not None and not (math.isfinite(load) and 0 < load <= 10):
        raise SimError(f"load {load} must be a fraction of capacity above 0 (at most 10)",
                       "pass e.g. --load 0.9 for 90% of the measured capacity")
    if not 1 <= mooncake_block_tokens <= 1 << 20:
        raise SimError(f"mooncake block tokens {mooncake_block_tokens} is out of range",
                       "pass --mooncake-block-tokens 512 (the published traces' block size)")
    window.validate()


def twin_settings(recipe: Recipe, family: str, params: dict[str, Any], cost: StepCostModel,
                  requests: list[SimRequest], knobs: KnobOverrides, kv_tokens: int | None) -> TwinSettings:
    """The engine the twin models: the recipe's knobs, each replaced by its override when given."""
    vllm = recipe.vllm
    longest = max(r.prompt_tokens + r.output_tokens for r in requests)

    def pick(override: Any, name: str, default: Any) -> Any:
        if override is not None:
            return override
        value = vllm.get(name)
        return default if value is None else value

    twin = TwinSettings(
        family=family, params=params,
        max_num_seqs=int(pick(knobs.max_num_seqs, "max_num_seqs", 1024)),
        max_num_batched_tokens=int(pick(knobs.max_num_batched_tokens, "max_num_batched_tokens", 8192)),
        max_model_len=int(pick(knobs.max_model_len, "max_model_len", max(longest, 8192))),
        kv_tokens=kv_tokens if kv_tokens is not None else cost.kv_capacity_tokens,
        enable_chunked_prefill=bool(pick(knobs.chunked_prefill, "enable_chunked_prefill", True)),
        enable_prefix_caching=bool(pick(knobs.prefix_caching, "enable_prefix_caching", True)),
        long_prefill_token_threshold=int(pick(knobs.long_prefill_token_threshold, "long_prefill_token_threshold", 0)),
        block_size=int(vllm.get("block_size") or 16),
        async_scheduling=knobs.async_scheduling if knobs.async_scheduling is not None
        else not recipe.key.hardware.is_cpu,
    )
    twin.validate()
    return twin


def refused(requests: list[SimRequest], twin: TwinSettings) -> dict[int, str]:
    """What the engine would refuse at the API server: those requests never reach the scheduler."""
    out: dict[int, str] = {}
    for r in requests:
        if r.prompt_tokens + r.output_tokens > twin.max_model_len:
            out[r.index] = (f"http 400: {r.prompt_tokens} prompt + {r.output_tokens} output tokens exceed "
                            f"max-model-len {twin.max_model_len}")
        elif r.prompt_tokens + r.output_tokens > twin.kv_tokens:
            out[r.index] = f"too large: longer than the KV cache of {twin.kv_tokens} tokens"
    return out


def prepare(inputs: TwinInputs) -> Prepared:
    """Read the recipe, the step-time model and the trace, and check every option, before any run."""
    from carbonforge_runtime.core.ordering.registry import make_family
    from carbonforge_runtime.offline.sim.inputs import load_trace, window
    from carbonforge_runtime.recipes import resolve
    from carbonforge_runtime.recipes.loader import load_recipes, recipe_dirs
    from carbonforge_runtime.settings import load_settings

    check_options(inputs.load, inputs.mooncake_block_tokens, inputs.window)
    settings = load_settings(os.environ)
    recipe = resolve(inputs.context_key, load_recipes(recipe_dirs(settings.recipes_dir)))
    family = inputs.family or recipe.scheduler.family
    params = dict(recipe.scheduler.params) if inputs.family is None else {}
    params.update(inputs.params or {})
    make_family(family, params)  # refuses an unknown family or bad parameters now, with the fix
    cost = recipe.step_model(inputs.cost_model)
    sim_trace = load_trace(inputs.trace, inputs.mooncake_block_tokens)
    requests = window(sim_trace, inputs.window)
    twin = twin_settings(recipe, family, params, cost, requests, inputs.knobs, inputs.kv_tokens)
    rejected = refused(requests, twin)
    served = [r for r in requests if r.index not in rejected]
    if not served:
        raise SimError(f"{inputs.trace}: every request is longer than max-model-len {twin.max_model_len} or the "
                       "KV cache", "raise --max-model-len/--kv-tokens, or pass --token-scale below 1")
    return Prepared(recipe, family, params, cost, sim_trace, requests, twin, rejected, served)


#: The ordering the capacity behind ``--load`` is measured with, whatever family the run tries, so
#: that one ``--load`` is one traffic for every family (a family that serves a burst faster would
#: otherwise get a faster arrival rate, and its gain would be inflated).
CAPACITY_FAMILY = "fcfs"


def capacity_engine(twin: TwinSettings) -> TwinSettings:
    """The engine whose capacity ``--load`` is a fraction of: ``twin`` ordered by
    :data:`CAPACITY_FAMILY` with no family parameters (its knobs, KV cache and step-time model kept)."""
    return replace(twin, family=CAPACITY_FAMILY, params={})


def at_load(served: list[SimRequest], load: float, capacity: float) -> tuple[list[SimRequest], float]:
    """The requests with their gaps scaled so that they arrive at ``load`` times ``capacity``
    requests a second on average, and the factor applied to the arrival rate."""
    span = served[-1].arrival_s - served[0].arrival_s
    if span <= 0 or len(served) < 2:
        raise SimError("--load needs at least two requests with different arrival times",
                       "pass more requests (--limit) or use --rate")
    offered = (len(served) - 1) / span
    factor = load * capacity / offered
    return [replace(r, arrival_s=r.arrival_s / factor) for r in served], factor
