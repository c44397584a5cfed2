"""The recipe: everything benchmarked for one context key, validated at load."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carbonforge_runtime.core.api_contract import EFFORTS
from carbonforge_runtime.core.ordering.registry import FAMILIES, check_family
from carbonforge_runtime.core.step_models import resolve_model
from carbonforge_runtime.core.twin_data import StepCostModel
from carbonforge_runtime.errors import RecipeError, UsageError
from carbonforge_runtime.recipes.keys import ContextKey, parse_context_key
from carbonforge_runtime.recipes.vllm_parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

PLANS = ("free", "premium")
#: The drain time of a recipe that sets no drain_timeout_s (vLLM's --shutdown-timeout, in seconds).
DEFAULT_DRAIN_TIMEOUT_S = 30.0

#: vLLM knobs a recipe may set, with their type. Names are vLLM's flags in snake_case.
VLLM_KNOBS: dict[str, type] = {
    "max_num_seqs": int,
    "max_model_len": int,
    "max_num_batched_tokens": int,
    "long_prefill_token_threshold": int,
    "gpu_memory_utilization": float,
    "tensor_parallel_size": int,
    "pipeline_parallel_size": int,
    "data_parallel_size": int,
    "enable_prefix_caching": bool,
    "enable_chunked_prefill": bool,
    "enforce_eager": bool,
    "dtype": str,
    "kv_cache_dtype": str,
    "quantization": str,
    "block_size": int,
    "seed": int,
    "generation_config": str,
    "trust_remote_code": bool,
}

#: Built-in models the runtime generates itself (no download); see carbonforge_runtime.runtime.weights.tiny_model.
BUILTIN_MODELS = ("tiny-chat",)


@dataclass(frozen=True)
class ModelSpec:
    repo: str
    served_name: str
    revision: str | None = None
    builtin: str | None = None
    verified: bool = True
    note: str = ""


@dataclass(frozen=True)
class SchedulerSpec:
    family: str = "fcfs"
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ControllerSpec:
    policy: str = "none"
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ApiSpec:
    """How the API treats the model's output: the engine's parsers and the thinking budget per effort.

    ``reasoning_parser`` None: the model does not reason; ``tool_call_parser`` None: it calls no
    tools (a request with tools is refused). ``thinking_budget`` maps ``low``/``medium``/``xhigh``
    to a cap on thinking tokens (None: no cap)."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    thinking_budget: Mapping[str, int | None] = field(default_factory=dict)

    @property
    def declared(self) -> bool:
        return self.reasoning_parser is not None or self.tool_call_parser is not None


#: Which parallel dimension crosses hosts in a multi-host recipe (vLLM's multiprocessing launcher).
ACROSS_HOSTS = ("tensor", "pipeline", "data")


@dataclass(frozen=True)
class HostSplit:
    """How a multi-host recipe spans its hosts: ``nodes`` hosts of ``gpus_per_node`` GPUs each, with
    the ``across`` dimension (tensor, pipeline or data parallel) crossing host boundaries."""

    nodes: int
    gpus_per_node: int
    across: str

    def describe(self, knobs: Mapping[str, Any]) -> str:
        tp, pp, dp = (int(knobs.get(f"{axis}_parallel_size", 1)) for axis in ("tensor", "pipeline", "data"))
        return (f"{self.nodes} hosts x {self.gpus_per_node} GPUs; {self.across} parallel across hosts "
                f"(tensor {tp} x pipeline {pp} x data {dp} = {tp * pp * dp} GPUs)")


def split_problems(split: HostSplit, tp: int, pp: int, dp: int) -> list[str]:
    """What does not add up when ``split`` serves tensor ``tp`` x pipeline ``pp`` x data ``dp``
    parallel; an empty list when every host gets exactly its GPUs. vLLM numbers ranks tensor first,
    then pipeline, then data, and gives each host the next ``gpus_per_node`` of them."""
    nodes, per = split.nodes, split.gpus_per_node
    shown = f"tensor {tp} x pipeline {pp} x data {dp}"
    if tp * pp * dp != nodes * per:
        return [f"{shown} = {tp * pp * dp} GPUs, but {nodes} hosts x {per} GPUs = {nodes * per}"]
    problems = []
    if split.across == "data":
        if dp % nodes or tp * pp * (dp // nodes) != per:
            problems.append(f"data parallel across {nodes} hosts needs data_parallel_size a multiple of {nodes} "
                            f"and tensor x pipeline dividing the {per} GPUs of a host; got {shown}")
    elif split.across == "pipeline":
        if dp != 1 or pp % nodes or tp * (pp // nodes) != per:
            problems.append(f"pipeline parallel across {nodes} hosts needs data_parallel_size 1, "
                            f"pipeline_parallel_size a multiple of {nodes} and tensor x (pipeline / {nodes}) = "
                            f"{per} GPUs per host; got {shown}")
    elif dp != 1 or pp != 1 or tp != nodes * per:
        problems.append(f"tensor parallel across {nodes} hosts needs data_parallel_size 1, "
                        f"pipeline_parallel_size 1 and tensor_parallel_size {nodes * per}; got {shown}")
    return problems


@dataclass(frozen=True)
class Recipe:
    key: ContextKey
    plan: str
    description: str
    model: ModelSpec
    vllm: Mapping[str, Any]
    extra_args: tuple[str, ...]
    drain_timeout_s: float
    scheduler: SchedulerSpec
    controller: ControllerSpec
    benchmark: Mapping[str, Any]
    env: Mapping[str, str]
    source: Path
    #: None when the recipe has no ``api`` section (user recipes may omit it; shipped ones may not).
    api: ApiSpec | None = None
    #: How the recipe spans hosts; None for a single-host recipe.
    hosts: HostSplit | None = None
    #: The shipped recipe of the same key that this local one (CF_RECIPES_DIR) replaces, if any.
    replaces: Recipe | None = field(default=None, compare=False, repr=False)

    @property
    def key_text(self) -> str:
        return str(self.key)

    @property
    def is_premium(self) -> bool:
        return self.plan == "premium"

    def step_model(self, choice: str | None = None) -> StepCostModel:
        """The step-time model of this recipe: ``choice`` (``--cost-model``: a shipped name or a YAML
        file), else the shipped model of its GPU at its tensor-parallel size (none for a CPU recipe:
        the error names the fix)."""
        hardware = self.key.hardware
        tp = int(self.vllm.get("tensor_parallel_size", 1) or 1)
        return resolve_model(choice, None if hardware.is_cpu else hardware.family, tp)


class _Fields:
    """Reads fields out of one YAML mapping, naming file and field in every error."""

    def __init__(self, path: Path, data: Mapping[str, Any], prefix: str = "") -> None:
        self.path = path
        self.data = data
        self.prefix = prefix

    def fail(self, name: str, problem: str) -> RecipeError:
        return RecipeError(
            f"{self.path}: field '{self.prefix}{name}' {problem}",
            "fix the recipe file (the README's recipes section describes the fields)",
        )

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = ..., nullable: bool = False) -> Any:
        if name not in self.data:
            if default is ...:
                raise self.fail(name, "is missing")
            return default
        value = self.data[name]
        if value is None and nullable:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # bool is an int in Python; do not let `true` pass as a number or 1 as a flag.
        if isinstance(value, bool) and bool not in kinds:
            raise self.fail(name, f"must be {'/'.join(k.__name__ for k in kinds)}, got a boolean")
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds):
            raise self.fail(name, f"must be {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
        return value

    def section(self, name: str, required: bool = True) -> _Fields:
        value = self.get(name, dict, default=... if required else {})
        return _Fields(self.path, value, f"{self.prefix}{name}.")

    def reject_unknown(self, allowed: set[str]) -> None:
        for name in self.data:
            if name not in allowed:
                raise self.fail(str(name), f"is not a known field (known: {', '.join(sorted(allowed))})")


def recipe_from_mapping(data: Any, path: Path) -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping", "fix the recipe file")
    top = _Fields(path, data)
    top.reject_unknown(
        {"key", "plan", "description", "model", "vllm", "drain_timeout_s", "scheduler", "controller",
         "hardware", "benchmark", "env", "api", "hosts"}
    )
    key_text = top.get("key", str)
    try:
        key = parse_context_key(key_text)
    except Exception as exc:  # ContextKeyError: restate it against the file
        raise top.fail("key", f"is not a valid context key: {exc}") from None
    plan = top.get("plan", str)
    if plan not in PLANS:
        raise top.fail("plan", f"must be one of {', '.join(PLANS)}, got {plan!r}")

    model = _model(top.section("model"))
    vllm_fields = top.section("vllm")
    vllm_fields.reject_unknown(set(VLLM_KNOBS) | {"extra_args"})
    knobs: dict[str, Any] = {}
    for name, kind in VLLM_KNOBS.items():
        value = vllm_fields.get(name, kind, default=None, nullable=True)
        if value is not None:
            knobs[name] = value
    fraction = knobs.get("gpu_memory_utilization")
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise vllm_fields.fail("gpu_memory_utilization", f"must be in (0, 1], got {fraction}")
    for name in ("max_num_seqs", "max_model_len", "tensor_parallel_size"):
        if name in knobs and knobs[name] < 1:
            raise vllm_fields.fail(name, f"must be at least 1, got {knobs[name]}")
    if knobs.get("long_prefill_token_threshold", 0) < 0:
        raise vllm_fields.fail("long_prefill_token_threshold", "must be 0 (no threshold) or a positive number of "
                               f"tokens, got {knobs['long_prefill_token_threshold']}")
    extra = vllm_fields.get("extra_args", list, default=[])
    if not all(isinstance(arg, str) for arg in extra):
        raise vllm_fields.fail("extra_args", "must be a list of strings")

    declared = top.section("hardware", required=False)
    if declared.data:
        declared.reject_unknown({"family", "memory_gb", "count"})
        if declared.get("family", str, default=key.hardware.family) != key.hardware.family:
            raise declared.fail("family", f"disagrees with the key's hardware segment {key.hardware}")
        if declared.get("count", int, default=key.hardware.count) != key.hardware.count:
            raise declared.fail("count", f"disagrees with the key's hardware segment {key.hardware}")
    tp, pp, dp = (knobs.get(f"{axis}_parallel_size", 1) for axis in ("tensor", "pipeline", "data"))
    split = _host_split(top, key, tp, pp, dp) if "hosts" in data or key.hardware.multi_host else None
    if split is None and not key.hardware.is_cpu and tp * pp * dp != key.hardware.count:
        raise vllm_fields.fail(
            "tensor_parallel_size",
            f"x pipeline_parallel_size x data_parallel_size is {tp * pp * dp}, "
            f"but the key declares {key.hardware.count} GPU(s)",
        )

    drain = top.get("drain_timeout_s", (int, float), default=DEFAULT_DRAIN_TIMEOUT_S)
    if not drain > 0 or not float(drain).is_integer():
        # vLLM's --shutdown-timeout takes whole seconds.
        raise top.fail("drain_timeout_s", f"must be a positive whole number of seconds, got {drain!r}")

    sched = top.section("scheduler", required=False)
    sched.reject_unknown({"family", "params"})
    scheduler = SchedulerSpec(sched.get("family", str, default="fcfs"), sched.get("params", dict, default={}))
    try:  # the family's own checks, as the launch makes them (the files its parameters name are read then)
        check_family(scheduler.family, scheduler.params)
    except UsageError as exc:
        field = "params" if scheduler.family in FAMILIES else "family"
        raise RecipeError(f"{path}: field 'scheduler.{field}': {exc.message}", exc.remedy) from None

    ctl = top.section("controller", required=False)
    ctl.reject_unknown({"policy", "params"})
    controller = ControllerSpec(ctl.get("policy", str, default="none"), ctl.get("params", dict, default={}))

    env = top.get("env", dict, default={})
    if not all(isinstance(k, str) and isinstance(v, (str, int, float)) for k, v in env.items()):
        raise top.fail("env", "must map variable names to strings")

    return Recipe(
        key=key,
        plan=plan,
        description=top.get("description", str, default=""),
        model=model,
        vllm=knobs,
        extra_args=tuple(extra),
        drain_timeout_s=float(drain),
        scheduler=scheduler,
        controller=controller,
        benchmark=_benchmark(top),
        env={k: str(v) for k, v in env.items()},
        source=path,
        api=_api(top.section("api")) if "api" in data else None,
        hosts=split,
    )


#: The fields of a benchmark block; ``predicted`` is written by ``tune``.
BENCHMARK_FIELDS = {"measured_on", "date", "figures", "predicted"}
PREDICTED_FIELDS = {"measured", "by", "trace", "window", "goal", "slo", "cost_model", "candidates", "chosen",
                    "shipped", "baseline"}


#: The fields of ``benchmark.measured_on`` when it is a mapping: the host measured figures came from.
MEASURED_ON_FIELDS = {"gpu", "gpu_count", "driver", "vllm"}


def _benchmark(top: _Fields) -> dict[str, Any]:
    """The ``benchmark`` block: known fields only; predicted figures must say they were not measured,
    and measured figures must name the host they were measured on."""
    fields = top.section("benchmark", required=False)
    fields.reject_unknown(BENCHMARK_FIELDS)
    host = fields.get("measured_on", (str, dict), default=None, nullable=True)
    if isinstance(host, dict):
        where = fields.section("measured_on")
        where.reject_unknown(MEASURED_ON_FIELDS)
        if not str(where.get("gpu", str)).strip():
            raise where.fail("gpu", "must name the GPU the figures were measured on")
        where.get("gpu_count", int, default=None, nullable=True)
    figures = fields.get("figures", dict, default={}, nullable=True)
    if figures and not host:
        raise fields.fail("figures", "holds figures but benchmark.measured_on does not name the host they were "
                          "measured on (gpu, gpu_count, driver, vllm, with the date); figures the twin predicted "
                          "belong under benchmark.predicted")
    if "predicted" in fields.data:
        predicted = fields.section("predicted")
        predicted.reject_unknown(PREDICTED_FIELDS)
        if predicted.get("measured", bool) is not False:
            raise predicted.fail("measured", "must be false: predicted figures come from the twin, not a measurement")
    return dict(fields.data)


def departures_from(shipped: Recipe, local: Recipe) -> list[str]:
    """Every field that serves differently in ``local`` than in ``shipped`` (description and
    benchmark aside), as ``name: shipped -> local``."""
    out: list[str] = []

    def compare(name: str, old: Any, new: Any) -> None:
        if old != new:
            out.append(f"{name} {old!r} -> {new!r}")

    compare("plan", shipped.plan, local.plan)
    for name in ModelSpec.__dataclass_fields__:
        compare(f"model.{name}", getattr(shipped.model, name), getattr(local.model, name))
    for name in sorted(set(shipped.vllm) | set(local.vllm)):
        compare(f"vllm.{name}", shipped.vllm.get(name), local.vllm.get(name))
    compare("vllm.extra_args", list(shipped.extra_args), list(local.extra_args))
    compare("drain_timeout_s", shipped.drain_timeout_s, local.drain_timeout_s)
    compare("scheduler.family", shipped.scheduler.family, local.scheduler.family)
    compare("scheduler.params", dict(shipped.scheduler.params), dict(local.scheduler.params))
    compare("controller.policy", shipped.controller.policy, local.controller.policy)
    compare("controller.params", dict(shipped.controller.params), dict(local.controller.params))
    compare("env", dict(shipped.env), dict(local.env))
    compare("api", shipped.api, local.api)
    compare("hosts", shipped.hosts, local.hosts)
    return out


def _host_split(top: _Fields, key: ContextKey, tp: int, pp: int, dp: int) -> HostSplit:
    """The ``hosts`` section, checked against the key's hardware segment and the parallel sizes."""
    hardware = key.hardware
    if "hosts" not in top.data:
        raise top.fail("hosts", f"is missing: the key's hardware segment {hardware} names {hardware.hosts} hosts, "
                                "so the recipe must say how it spans them (nodes, gpus_per_node, across)")
    fields = top.section("hosts")
    fields.reject_unknown({"nodes", "gpus_per_node", "across"})
    split = HostSplit(fields.get("nodes", int), fields.get("gpus_per_node", int), fields.get("across", str))
    if hardware.is_cpu or not hardware.multi_host:
        raise fields.fail("nodes", f"describes a multi-host split, but the key's hardware segment {hardware} names "
                                   f"one host; name the hosts in the key (e.g. {split.nodes}x{hardware}) or remove "
                                   "the hosts section")
    if split.nodes != hardware.hosts:
        raise fields.fail("nodes", f"is {split.nodes}, but the key's hardware segment {hardware} names "
                                   f"{hardware.hosts} hosts")
    if split.gpus_per_node != hardware.count:
        raise fields.fail("gpus_per_node", f"is {split.gpus_per_node}, but the key's hardware segment {hardware} "
                                           f"names {hardware.count} GPUs per host")
    if split.across not in ACROSS_HOSTS:
        raise fields.fail("across", f"must be one of {', '.join(ACROSS_HOSTS)}, got {split.across!r}")
    problems = split_problems(split, tp, pp, dp)
    if problems:
        raise fields.fail("across", "does not add up: " + "; ".join(problems))
    return split


def _parser(fields: _Fields, name: str, known: frozenset[str]) -> str | None:
    value = fields.get(name, str, nullable=True)
    if value is not None and value not in known:
        close = difflib.get_close_matches(value, sorted(known), n=3)
        hint = f" (closest: {', '.join(close)})" if close else ""
        raise fields.fail(name, f"names {value!r}, which vLLM 0.32 does not register{hint}; "
                                f"valid names: {', '.join(sorted(known))}; null means none")
    return value


def _api(fields: _Fields) -> ApiSpec:
    fields.reject_unknown({"reasoning_parser", "tool_call_parser", "thinking_budget"})
    reasoning = _parser(fields, "reasoning_parser", REASONING_PARSERS)
    tools = _parser(fields, "tool_call_parser", TOOL_CALL_PARSERS)
    budgets = fields.section("thinking_budget", required=False)
    budgets.reject_unknown(set(EFFORTS))
    thinking_budget: dict[str, int | None] = {}
    for effort in EFFORTS:
        tokens = budgets.get(effort, int, default=None, nullable=True)
        if tokens is not None and tokens < 1:
            raise budgets.fail(effort, f"must be a positive number of tokens or null (no cap), got {tokens}")
        thinking_budget[effort] = tokens
    if reasoning is None and any(v is not None for v in thinking_budget.values()):
        raise fields.fail("thinking_budget", "caps thinking, but reasoning_parser is null (the model does not reason)")
    return ApiSpec(reasoning, tools, thinking_budget)


def _model(fields: _Fields) -> ModelSpec:
    fields.reject_unknown({"repo", "served_name", "revision", "builtin", "verified", "note"})
    repo = fields.get("repo", str)
    builtin = fields.get("builtin", str, default=None, nullable=True)
    if builtin is not None and builtin not in BUILTIN_MODELS:
        raise fields.fail("builtin", f"must be one of {', '.join(BUILTIN_MODELS)}, got {builtin!r}")
    return ModelSpec(
        repo=repo,
        served_name=fields.get("served_name", str, default=repo),
        revision=fields.get("revision", str, default=None, nullable=True),
        builtin=builtin,
        verified=fields.get("verified", bool, default=True),
        note=fields.get("note", str, default=""),
    )
