"""``serve --emulate``: a recipe served on the CPU build of vLLM by the built-in tiny model, every
engine step paced to the recipe's step-time model. Pure functions over plain data.

:func:`emulated_recipe` turns a recipe into the one actually served: the same vLLM knobs, scheduler
family, API section and served model name, with the built-in model standing in for the weights
(accepting the recipe's context length), a KV cache of the modelled GPU's size in tokens, one
process (no tensor, pipeline or data parallelism, no second host), and no licence (no premium
weights are served). :func:`emulation_contract` is what the engine's scheduler is told
(:mod:`carbonforge_runtime.engine.pacing` paces the steps).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from carbonforge_runtime.core.contract import EMULATION_NOT_FAITHFUL_MARK, EMULATION_SUMMARY_MARK, Emulation
from carbonforge_runtime.core.twin_data import StepCostModel
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.recipes.keys import HardwareSpec
from carbonforge_runtime.recipes.model import ControllerSpec, ModelSpec, Recipe

#: The built-in model that stands in for a recipe's weights.
STAND_IN_BUILTIN = "tiny-chat"
STAND_IN_REPO = "carbonforge/tiny-chat"
#: The context length the stand-in's own config accepts.
STAND_IN_MAX_POSITIONS = 4096
#: Block size of the emulated KV cache when the recipe sets none: vLLM's on a GPU (the twin's too).
GPU_BLOCK_SIZE = 16
#: vLLM 0.32's CPU attention takes blocks of a multiple of this many tokens only.
CPU_BLOCK_MULTIPLE = 32
#: The stand-in's KV bytes per token (2 layers, 1 KV head of 64, keys and values in bfloat16).
STAND_IN_KV_BYTES_PER_TOKEN = 2 * 1 * 64 * 2 * 2
#: Knobs that only a GPU deployment has: an emulated engine is one CPU process.
GPU_ONLY_KNOBS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "gpu_memory_utilization",
                  "quantization", "kv_cache_dtype")
#: Slowdowns accepted by --emulate-slowdown.
MIN_SLOWDOWN = 0.01
MAX_SLOWDOWN = 1000.0


@dataclass(frozen=True)
class EmulateOptions:
    """The emulation flags of ``serve``."""

    cost_model: StepCostModel
    slowdown: float = 1.0


def check_slowdown(slowdown: float) -> float:
    if not (math.isfinite(slowdown) and MIN_SLOWDOWN <= slowdown <= MAX_SLOWDOWN):
        raise UsageError(f"--emulate-slowdown {slowdown:g} is out of range",
                         f"give a factor between {MIN_SLOWDOWN:g} and {MAX_SLOWDOWN:g} (2 makes every step twice "
                         "as long as the model says)")
    return float(slowdown)


def cpu_block_size(block_size: int) -> int:
    """The nearest KV block size at or above ``block_size`` that the CPU engine takes."""
    return max(CPU_BLOCK_MULTIPLE, math.ceil(block_size / CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE)


def kv_blocks(model: StepCostModel, block_size: int) -> int:
    """KV blocks that hold the modelled GPU's token count."""
    return max(1, math.ceil(model.kv_capacity_tokens / block_size))


def kv_space_gib(blocks: int, block_size: int) -> int:
    """VLLM_CPU_KVCACHE_SPACE (whole GiB) that fits ``blocks`` blocks of the stand-in, with room to spare."""
    need = blocks * block_size * STAND_IN_KV_BYTES_PER_TOKEN
    return max(1, math.ceil(need * 1.25 / (1 << 30)))


def emulated_recipe(recipe: Recipe, options: EmulateOptions) -> tuple[Recipe, list[str]]:
    """The recipe actually served under ``--emulate``, and what the emulation changed (notes)."""
    model = options.cost_model
    notes: list[str] = []
    vllm = {name: value for name, value in recipe.vllm.items() if name not in GPU_ONLY_KNOBS}
    dropped = [f"{name} {recipe.vllm[name]}" for name in GPU_ONLY_KNOBS if name in recipe.vllm]
    if dropped:
        notes.append(f"emulated: one CPU process, so the GPU settings {', '.join(dropped)} are not passed to vLLM")
    gpu_block = int(vllm.get("block_size") or GPU_BLOCK_SIZE)
    block = cpu_block_size(gpu_block)
    if block != gpu_block:
        notes.append(f"emulated: KV blocks of {block} tokens, not the GPU's {gpu_block} (the CPU engine takes "
                     f"multiples of {CPU_BLOCK_MULTIPLE} only): the prefix cache shares whole blocks of {block}")
    vllm["block_size"] = block
    vllm["dtype"] = "bfloat16"
    max_len = int(recipe.vllm.get("max_model_len") or 2048)
    blocks = kv_blocks(model, block)
    # The stand-in accepts the recipe's context length; its KV cache holds the modelled GPU's tokens.
    extra = (*recipe.extra_args, "--num-gpu-blocks-override", str(blocks))
    if max_len > STAND_IN_MAX_POSITIONS:
        extra += ("--hf-overrides", json.dumps({"max_position_embeddings": max_len}, separators=(",", ":")))
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib(blocks, block)), "VLLM_USE_AOT_COMPILE": "0",
           "HF_HUB_OFFLINE": "1"}
    skipped = sorted(name for name in recipe.env if name not in env)
    if skipped:
        notes.append(f"emulated: the recipe's GPU environment ({', '.join(skipped)}) is not set")
    notes.append(f"emulated: KV cache of {blocks * block} tokens ({blocks} blocks of {block}), the modelled GPU's "
                 f"{model.kv_capacity_tokens} ({model.name})")
    served = replace(
        recipe,
        key=replace(recipe.key, hardware=HardwareSpec("cpu", None, 1)),
        plan="free",
        description=f"{recipe.key_text} emulated on CPU: {recipe.description}",
        model=ModelSpec(repo=STAND_IN_REPO, served_name=recipe.model.served_name, builtin=STAND_IN_BUILTIN,
                        note=f"stand-in for {recipe.model.repo}"),
        vllm=vllm,
        extra_args=extra,
        controller=ControllerSpec(),
        env=env,
        hosts=None,
        replaces=None,
    )
    return served, notes


def emulation_contract(options: EmulateOptions) -> Emulation:
    model = options.cost_model
    return Emulation(model=model.name, version=model.version, proxy=model.proxy, floor_ms=model.floor_ms,
                     per_batched_token_ms=model.per_batched_token_ms, per_kv_token_read_ms=model.per_kv_token_read_ms,
                     attention_ms=model.attention_ms, overhead_ms=model.overhead_ms, slowdown=options.slowdown)



def emulation_report(engine_log_tail: Sequence[str]) -> list[tuple[str, str]]:
    """(level, text) of the paced engine's last summary and not-faithful warning in the tail of its
    log, without vLLM's prefix, for the runtime's own log at the end of a serve."""
    found: dict[str, str] = {}
    for line in engine_log_tail:
        for level, mark in (("info", EMULATION_SUMMARY_MARK), ("warning", EMULATION_NOT_FAITHFUL_MARK)):
            if mark in line and "emulated" in line:
                found[level] = line[line.index("emulated"):].strip()
    return [(level, found[level]) for level in ("info", "warning") if level in found]


def describe_emulation(original: Recipe, options: EmulateOptions) -> list[str]:
    """The dry run's lines about the emulation."""
    model = options.cost_model
    return [
        f"emulate:            {original.key_text} paced on this machine's CPU (figures are labelled emulated)",
        f"stand-in model:     built-in {STAND_IN_BUILTIN} for {original.model.repo} (random weights)",
        f"step-time model:    {model.describe()}, every step x{options.slowdown:g}",
        "licence need:       none: --emulate serves no premium weights",
    ]
