"""The decisions of ``tune``: goals and SLOs, the candidates, which is best, and the recipe patch.

Plain functions over plain data; the twin runs elsewhere (:func:`search` takes the evaluation as a
function). The search is a coordinate search: from the best configuration so far, each dimension
(a vLLM knob, the ordering family, one of the family's parameters) is moved one step up and one
step down its ladder of values, all those neighbours are evaluated together, and the best of them
becomes the next centre, until none beats the centre or the budget of candidates is spent. Candidate
0 is always the recipe as shipped. The order of everything is fixed, so the same inputs give the same
candidates, whatever runs them and in whatever order they finish.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from carbonforge_runtime.core.ordering.families import BENCHMARK_ONLY
from carbonforge_runtime.core.ordering.registry import FAMILIES
from carbonforge_runtime.core.twin_data import SimError, TwinRun, TwinSettings
from carbonforge_runtime.offline.replay.aggregate import latency_stats

# --- goals and SLOs ----------------------------------------------------------------------------------------

#: Goal name -> (figure, +1 to minimise or -1 to maximise).
GOALS: dict[str, tuple[str, int]] = {
    "mean_e2e": ("e2e_mean_s", 1),
    "p99_ttft": ("ttft_p99_s", 1),
    "throughput": ("throughput_rps", -1),
}

#: Latency figures an SLO may bound (``--slo NAME=LIMIT``), each in seconds.
SLO_METRICS = tuple(f"{what}_{stat}" for what in ("ttft", "e2e") for stat in ("mean", "p50", "p90", "p99"))

_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


def parse_goal(text: str) -> str:
    name = text.strip().lower().replace("-", "_")
    if name not in GOALS:
        raise SimError(f"unknown goal {text!r}", f"pass --goal with one of {', '.join(GOALS)}")
    return name


@dataclass(frozen=True)
class Slo:
    """An upper bound on one latency figure, in seconds."""

    metric: str  # one of SLO_METRICS
    limit_s: float

    @property
    def figure(self) -> str:
        return self.metric + "_s"

    def text(self) -> str:
        return f"{self.metric}<={self.limit_s:g}s"


def parse_slo(text: str) -> Slo:
    """``ttft_p99=2s``, ``e2e_mean=500ms`` (a bare number is seconds)."""
    name, sep, raw = text.partition("=")
    name = name.strip().lower()
    fix = f"pass e.g. --slo ttft_p99=2s or --slo e2e_mean=10s (figures: {', '.join(SLO_METRICS)})"
    if not sep:
        raise SimError(f"--slo {text!r} is not NAME=LIMIT", fix)
    if name not in SLO_METRICS:
        raise SimError(f"--slo {text!r}: unknown figure {name!r}", fix)
    match = _DURATION.match(raw)
    if match is None:
        raise SimError(f"--slo {text!r}: {raw.strip()!r} is not a duration", "write the limit as 2s, 500ms or 1.5m")
    limit = float(match.group(1)) * _UNIT_S[match.group(2)]
    if not math.isfinite(limit) or limit <= 0:
        raise SimError(f"--slo {text!r}: the limit must be above zero", "write the limit as 2s, 500ms or 1.5m")
    return Slo(name, limit)


def parse_slos(items: Sequence[str]) -> tuple[Slo, ...]:
    slos = [parse_slo(item) for item in items]
    names = [s.metric for s in slos]
    for name in names:
        if names.count(name) > 1:
            raise SimError(f"--slo {name} is given more than once", "give each figure one limit")
    return tuple(sorted(slos, key=lambda s: SLO_METRICS.index(s.metric)))


# --- what a candidate achieved ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Figures:
    """What the twin predicts for one candidate; ``error`` says why it could not run (infeasible)."""

    error: str | None = None
    completed: int = 0
    ttft_mean_s: float = math.nan
    ttft_p50_s: float = math.nan
    ttft_p90_s: float = math.nan
    ttft_p99_s: float = math.nan
    e2e_mean_s: float = math.nan
    e2e_p50_s: float = math.nan
    e2e_p90_s: float = math.nan
    e2e_p99_s: float = math.nan
    throughput_rps: float = math.nan
    output_tokens_per_s: float = math.nan
    preemptions: int = 0
    steps: int = 0

    @property
    def feasible(self) -> bool:
        return self.error is None

    def value(self, figure: str) -> float:
        return float(getattr(self, figure))

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def figures_of(run: TwinRun) -> Figures:
    """The figures of one twin run (the requests it served)."""
    done = [o for o in run.outcomes if o.completion_s is not None]
    ttft = latency_stats([o.first_token_s - o.arrival_s for o in done if o.first_token_s is not None])
    e2e = latency_stats([o.completion_s - o.arrival_s for o in done if o.completion_s is not None])
    span = run.makespan_s
    return Figures(
        completed=len(done),
        ttft_mean_s=ttft["mean"], ttft_p50_s=ttft["p50"], ttft_p90_s=ttft["p90"], ttft_p99_s=ttft["p99"],
        e2e_mean_s=e2e["mean"], e2e_p50_s=e2e["p50"], e2e_p90_s=e2e["p90"], e2e_p99_s=e2e["p99"],
        throughput_rps=len(done) / span if span > 0 else math.nan,
        output_tokens_per_s=sum(o.generated_tokens for o in done) / span if span > 0 else math.nan,
        preemptions=sum(o.preemptions for o in done), steps=run.steps)


def slo_met(figures: Figures, slos: Sequence[Slo]) -> bool:
    return figures.feasible and all(figures.value(s.figure) <= s.limit_s for s in slos)


def rank_key(figures: Figures, index: int, goal: str, slos: Sequence[Slo], total: int) -> tuple[Any, ...]:
    """Smaller is better: runs before infeasible candidates, all requests served before fewer, SLOs
    met before missed, then the goal's figure, then the lower candidate index."""
    figure, sign = GOALS[goal]
    value = figures.value(figure) if figures.feasible else math.inf
    score = sign * value if math.isfinite(value) else math.inf
    return (not figures.feasible, figures.completed < total, not slo_met(figures, slos), score, index)


# --- candidates ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One configuration of the knobs and the ordering that ``tune`` varies."""

    family: str
    params: tuple[tuple[str, Any], ...]  # sorted by name
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    enable_chunked_prefill: bool

    @classmethod
    def of(cls, twin: TwinSettings) -> Config:
        return cls(twin.family, tuple(sorted(twin.params.items())), twin.max_num_seqs, twin.max_num_batched_tokens,
                   twin.long_prefill_token_threshold, twin.enable_chunked_prefill)

    def with_params(self, params: Mapping[str, Any]) -> Config:
        return replace(self, params=tuple(sorted(params.items())))

    def settings(self, base: TwinSettings) -> TwinSettings:
        """``base`` with this configuration's knobs and ordering."""
        return replace(base, family=self.family, params=dict(self.params), max_num_seqs=self.max_num_seqs,
                       max_num_batched_tokens=self.max_num_batched_tokens,
                       long_prefill_token_threshold=self.long_prefill_token_threshold,
                       enable_chunked_prefill=self.enable_chunked_prefill)


#: The knobs searched, with their ladders (0 for the long-prefill threshold means none: the top).
KNOB_LADDERS: dict[str, tuple[Any, ...]] = {
    "enable_chunked_prefill": (True, False),
    "max_num_batched_tokens": (512, 1024, 2048, 4096, 8192, 16384, 32768),
    "max_num_seqs": (8, 16, 32, 64, 128, 256, 512, 1024),
    "long_prefill_token_threshold": (256, 512, 1024, 2048, 4096, 8192, 0),
}

_GUARD = {"max_overtake_s": (60.0, (15, 30, 60, 120, 300))}

#: For each family tune tries: parameter -> (the family's default, the ladder). The defaults are the
#: families' own (:mod:`carbonforge_runtime.core.ordering.families`).
PARAM_LADDERS: dict[str, dict[str, tuple[Any, tuple[Any, ...]]]] = {
    "fcfs": {},
    "ltr-promptlen": {**_GUARD, "aging_rate": (200.0, (20, 50, 200, 800))},
    "affinity": {**_GUARD, "min_cached_tokens": (0, (0, 256, 1024, 4096))},
    "ltr": {**_GUARD, "prompt_weight": (0.0, (0, 0.005, 0.02, 0.1))},
    "hybrid": {**_GUARD, "aging_rate": (20.0, (5, 20, 50, 200)),
               "output_weight": (1.0, (0.25, 0.5, 1, 2)), "prompt_weight": (0.02, (0.005, 0.02, 0.1, 0.5))},
}


def tuned_families() -> list[str]:
    """The families ``tune`` tries: every registered one a recipe may name that orders by itself
    (``trace`` only replays a recorded order; benchmark-only families need the true output length)."""
    return [name for name in FAMILIES if name not in BENCHMARK_ONLY and name in PARAM_LADDERS]


def _steps(ladder: Sequence[Any], current: Any, numeric: bool = True) -> list[Any]:
    """The values one step below and one step above ``current`` on ``ladder`` (``current`` placed on it)."""
    values = list(ladder)
    if current not in values:
        if not numeric:
            return values
        # Place it among the ladder's values (0 for the threshold is the top: no threshold).
        order = [math.inf if v == 0 and ladder[-1] == 0 else v for v in values]
        where = sum(1 for v in order if v < (math.inf if current == 0 and ladder[-1] == 0 else current))
        values.insert(where, current)
    at = values.index(current)
    return [v for v in (values[at - 1] if at > 0 else None, values[at + 1] if at + 1 < len(values) else None)
            if v is not None]


def neighbours(center: Config, recipe: Config) -> list[Config]:
    """The configurations one step from ``center`` along each dimension, in a fixed order."""
    out: list[Config] = []
    for knob, ladder in KNOB_LADDERS.items():
        current = getattr(center, knob)
        for value in _steps(ladder, current, numeric=not isinstance(current, bool)):
            if value != current:
                out.append(replace(center, **{knob: value}))
    for family in tuned_families():
        if family != center.family:
            params = dict(recipe.params) if family == recipe.family else {}
            out.append(replace(center, family=family, params=tuple(sorted(params.items()))))
    params = dict(center.params)
    for name, (default, ladder) in sorted(PARAM_LADDERS.get(center.family, {}).items()):
        current = params.get(name, default)
        for value in _steps(ladder, current):
            out.append(center.with_params({**params, name: value}))
    unique: list[Config] = []
    for config in out:
        if config not in unique and config != center:
            unique.append(config)
    return unique


@dataclass
class Candidate:
    index: int
    config: Config
    figures: Figures
    round: int


@dataclass
class SearchResult:
    candidates: list[Candidate]  # by index; 0 is the recipe
    best: int
    rounds: int
    notes: list[str] = field(default_factory=list)


Evaluate = Callable[[list[Config]], list[Figures]]


def search(recipe: Config, evaluate: Evaluate, goal: str, slos: Sequence[Slo], budget: int, total: int,
           max_rounds: int = 8) -> SearchResult:
    """Coordinate search from the recipe; at most ``budget`` candidates (the recipe included).
    ``evaluate`` runs a batch of configurations and returns their figures in the same order;
    ``total`` is the number of requests each run must serve."""
    if budget < 1:
        raise SimError(f"budget {budget} must be at least 1", "pass --budget N with N >= 1 (1 runs the recipe only)")
    candidates: list[Candidate] = []
    seen: set[Config] = set()

    def key(c: Candidate) -> tuple[Any, ...]:
        return rank_key(c.figures, c.index, goal, slos, total)

    batch = [recipe, *neighbours(recipe, recipe)]
    center = 0
    rounds = 0
    while batch and rounds < max_rounds:
        batch = batch[:budget - len(candidates)]
        if not batch:
            break
        figures = evaluate(batch)
        for config, figure in zip(batch, figures, strict=True):
            candidates.append(Candidate(len(candidates), config, figure, rounds))
            seen.add(config)
        rounds += 1
        winner = min(candidates, key=key)
        if winner.index == center or len(candidates) >= budget:
            break
        center = winner.index
        batch = [c for c in neighbours(winner.config, recipe) if c not in seen]
    best = min(candidates, key=key).index
    return SearchResult(candidates, best, rounds)


def ranked(result: SearchResult, goal: str, slos: Sequence[Slo], total: int) -> list[Candidate]:
    return sorted(result.candidates, key=lambda c: rank_key(c.figures, c.index, goal, slos, total))


# --- what changes in the recipe ---------------------------------------------------------------------------

_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "enable_chunked_prefill")


def differences(recipe: Config, config: Config) -> dict[str, Any]:
    """The settings of ``config`` that differ from the recipe's, by their recipe field name."""
    out: dict[str, Any] = {}
    for knob in _KNOBS:
        if getattr(config, knob) != getattr(recipe, knob):
            out[f"vllm.{knob}"] = getattr(config, knob)
    if config.family != recipe.family:
        out["scheduler.family"] = config.family
    if config.params != recipe.params:
        out["scheduler.params"] = dict(config.params)
    return out


def describe(recipe: Config, config: Config) -> str:
    diff = differences(recipe, config)
    if not diff:
        return "(recipe as shipped)"
    parts = []
    for name, value in diff.items():
        if name == "scheduler.params":
            old = dict(recipe.params)
            changed = {k: v for k, v in value.items() if old.get(k) != v}
            parts.append("params " + (",".join(f"{k}={v}" for k, v in changed.items()) or "{}"))
        else:
            parts.append(f"{name.split('.', 1)[1]}={value}")
    return " ".join(parts)


def build_patch(recipe: Config, config: Config) -> dict[str, Any]:
    """The recipe fields to change, in the recipe file's structure: ``vllm:`` knobs, and
    ``scheduler:`` with the family when it changes and the whole parameter mapping when any
    parameter does (a family's parameters are replaced together)."""
    patch: dict[str, Any] = {}
    for knob in _KNOBS:
        if getattr(config, knob) != getattr(recipe, knob):
            patch.setdefault("vllm", {})[knob] = getattr(config, knob)
    if config.family != recipe.family:
        patch.setdefault("scheduler", {})["family"] = config.family
    if config.family != recipe.family or config.params != recipe.params:
        patch.setdefault("scheduler", {})["params"] = dict(config.params)
    return patch


def apply_patch(document: Mapping[str, Any], patch: Mapping[str, Any],
                benchmark: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A copy of a recipe file's mapping with ``patch`` applied and, if given, the ``benchmark``
    block's ``predicted`` entry set."""
    out = dict(document)
    for section, fields in patch.items():
        merged = dict(out.get(section) or {})
        merged.update(fields)
        out[section] = merged
    if benchmark is not None:
        block = dict(out.get("benchmark") or {})
        block["predicted"] = dict(benchmark)
        out["benchmark"] = block
    return out


def recipe_file_name(key_text: str) -> str:
    """The file name the shipped recipes use for a key: its colons as ``--``."""
    return key_text.replace(":", "--") + ".yaml"


def relative_change(new: float, old: float) -> float:
    """(new - old) / old; NaN when it cannot be said."""
    if not (math.isfinite(new) and math.isfinite(old)) or old == 0:
        return math.nan
    return (new - old) / old
