"""Scores of every scheduling family and the starvation guard, without vLLM."""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from carbonforge_runtime.core.ordering.base import WaitingRequest
from carbonforge_runtime.core.ordering.families import Affinity, Hybrid, Ranker
from carbonforge_runtime.core.ordering.ltr import LtrModel
from carbonforge_runtime.core.ordering.registry import FAMILIES, make_family, pick_next
from carbonforge_runtime.errors import UsageError

REORDERING = ("ltr-promptlen", "affinity", "ltr", "hybrid", "oracle")


def req(rid: str = "r", arrival: float = 0.0, prompt: int = 100, cached: int = 0, max_tokens: int | None = None,
        prefix: int = 0, true_out: int | None = None) -> WaitingRequest:
    return WaitingRequest(rid, arrival, prompt, cached, max_tokens, prefix, 0, true_out)


def order(family_name: str, params: Mapping[str, Any], reqs: list[WaitingRequest], now: float) -> list[str]:
    family = make_family(family_name, params)
    scores: list[float] = []
    for r in reqs:
        score = family.score(r, now)
        assert isinstance(score, float)
        scores.append(score)
    return [r.request_id for _, r in sorted(zip(scores, reqs, strict=True), key=lambda p: -p[0])]


def test_every_reordering_family_is_registered_and_reorders() -> None:
    for name in REORDERING:
        family = make_family(name, {})
        assert family.name == name
        assert family.reorders is True
        assert family.max_overtake_s > 0  # type: ignore[attr-defined]
    assert not make_family("fcfs", {}).reorders


def test_unknown_and_unimplemented_families_fail_with_a_clear_error() -> None:
    with pytest.raises(UsageError, match="not implemented") as exc:
        make_family("tie", {})
    assert "ltr-promptlen" in exc.value.remedy
    with pytest.raises(UsageError, match="unknown scheduler family 'sjf'"):
        make_family("sjf", {})


@pytest.mark.parametrize("name", REORDERING)
def test_unknown_or_bad_parameters_are_usage_errors(name: str) -> None:
    with pytest.raises(UsageError, match="no parameter"):
        make_family(name, {"agin_rate": 3})
    with pytest.raises(UsageError, match="aging_rate"):
        make_family(name, {"aging_rate": -1})
    with pytest.raises(UsageError, match="max_overtake_s"):
        make_family(name, {"max_overtake_s": 0})
    with pytest.raises(UsageError, match="aging_rate"):
        make_family(name, {"aging_rate": True})


def test_promptlen_prefers_fewer_uncached_prompt_tokens() -> None:
    reqs = [req("long", prompt=900), req("short", prompt=50), req("mid-but-cached", prompt=800, cached=768),
            req("mid", prompt=300)]
    assert order("ltr-promptlen", {"aging_rate": 0}, reqs, now=1.0) == ["mid-but-cached", "short", "mid", "long"]
    family = make_family("ltr-promptlen", {"aging_rate": 0})
    assert family.needs_cache_lookup
    assert family.score(req(prompt=800, cached=768), 5.0) == -32.0
    ignoring_cache = make_family("ltr-promptlen", {"aging_rate": 0, "count_cached": False})
    assert not ignoring_cache.needs_cache_lookup


def test_affinity_prefers_more_cached_tokens_and_ties_keep_arrival_order() -> None:
    reqs = [req("cold", 0.0, cached=0), req("warm", 1.0, cached=64), req("hot", 2.0, cached=512),
            req("cold2", 3.0, cached=0)]
    family = make_family("affinity", {"aging_rate": 0})
    assert family.needs_cache_lookup
    now = 4.0
    scores = [family.score(r, now) for r in reqs]
    picked = []
    waiting, left = list(reqs), list(scores)
    while waiting:
        i = pick_next(waiting, left, now, 60.0)  # type: ignore[arg-type]
        picked.append(waiting.pop(i).request_id)
        left.pop(i)
    assert picked == ["hot", "warm", "cold", "cold2"]
    assert isinstance(family, Affinity) and family.cache_lookup_limit == 64
    # Below min_cached_tokens a hit counts as none.
    fussy = make_family("affinity", {"aging_rate": 0, "min_cached_tokens": 100})
    assert fussy.score(req(cached=64), 1.0) == 0.0


def test_affinity_falls_back_to_arrival_order_when_nothing_is_looked_up() -> None:
    # Past max_queue the shim passes cached_tokens=0: the guard alone orders, i.e. by arrival.
    family = make_family("affinity", {"aging_rate": 5, "max_queue": 2})
    reqs = [req(str(i), arrival=float(i)) for i in range(5)]
    scores = [family.score(r, 10.0) or 0.0 for r in reqs]
    assert scores == sorted(scores, reverse=True)
    assert len(set(scores)) == 5


def test_ltr_ranks_by_predicted_output_and_learns_online() -> None:
    family = make_family("ltr", {"aging_rate": 0})
    assert isinstance(family, Ranker)
    for _ in range(30):
        family.observe(req(prefix=1, prompt=200), 10)  # short answers
        family.observe(req(prefix=2, prompt=200), 400)  # long answers
    a, b = req("short-app", prefix=1, prompt=200), req("long-app", prefix=2, prompt=200)
    sa, sb = family.score(a, 0.0), family.score(b, 0.0)
    assert sa is not None and sb is not None and sa > sb
    assert family.predicted_output(a) == pytest.approx(10, rel=0.3)
    assert family.predicted_output(b) == pytest.approx(400, rel=0.3)
    frozen = make_family("ltr", {"learn": False})
    frozen.observe(a, 10)
    assert isinstance(frozen, Ranker) and frozen.model.observations == 0


def test_ltr_caps_predictions_at_max_tokens_unless_told_not_to() -> None:
    family = make_family("ltr", {"aging_rate": 0})
    for _ in range(10):
        family.observe(req(prefix=3), 500)
    assert family.score(req(prefix=3, max_tokens=20), 0.0) == pytest.approx(-20.0)
    blind = make_family("ltr", {"aging_rate": 0, "use_max_tokens": False})
    for _ in range(10):
        blind.observe(req(prefix=3), 500)
    assert (blind.score(req(prefix=3, max_tokens=20), 0.0) or 0.0) < -100


def test_ltr_starts_from_a_saved_model(tmp_path: Path) -> None:
    model = LtrModel()
    for _ in range(20):
        model.observe(7, 100, 300)
        model.observe(8, 100, 3)
    path = tmp_path / "m.json"
    model.save(path)
    family = make_family("ltr", {"model": str(path), "aging_rate": 0})
    assert family.score(req(prefix=8), 0.0) > family.score(req(prefix=7), 0.0)  # type: ignore[operator]
    with pytest.raises(UsageError, match="cannot read ranker model"):
        make_family("ltr", {"model": str(tmp_path / "missing.json")})
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(UsageError, match="not a ranker model"):
        make_family("ltr", {"model": str(tmp_path / "bad.json")})


def test_hybrid_is_the_documented_weighted_sum() -> None:
    family = make_family("hybrid", {"aging_rate": 0, "output_weight": 2.0, "prompt_weight": 0.5,
                                    "cache_weight": 0.25, "learn": False})
    assert isinstance(family, Hybrid)
    r = req(prompt=400, cached=160)
    predicted = family.predicted_output(r)
    expected = 2.0 * predicted + 0.5 * (400 - 160) - 0.25 * 160
    assert family.score(r, 3.0) == pytest.approx(-expected)
    assert family.needs_cache_lookup
    # A cost never goes below zero (a huge cache bonus does not beat the guard forever).
    assert family.score(req(prompt=10, cached=10_000), 0.0) == 0.0


def test_oracle_uses_the_true_output_length() -> None:
    reqs = [req("a", true_out=300), req("b", true_out=5), req("c", true_out=40)]
    assert order("oracle", {"aging_rate": 0}, reqs, 1.0) == ["b", "c", "a"]
    family = make_family("oracle", {"aging_rate": 0})
    assert family.score(req(true_out=None, max_tokens=77), 0.0) == -77.0
    assert family.score(req(true_out=None), 0.0) == -256.0


@pytest.mark.parametrize("name", ["ltr-promptlen", "ltr", "hybrid", "oracle", "affinity"])
def test_linear_guard_grows_with_waiting_time_at_the_given_rate(name: str) -> None:
    family = make_family(name, {"aging_rate": 7.5})
    r = req(prompt=300, cached=32, true_out=50)
    s0, s1, s2 = (family.score(r, r.arrival_time + t) for t in (0.0, 1.0, 3.0))
    assert s1 - s0 == pytest.approx(7.5)  # type: ignore[operator]
    assert s2 - s0 == pytest.approx(22.5)  # type: ignore[operator]
    # A request from the future (clock step) gets no negative credit.
    assert family.score(r, r.arrival_time - 5.0) == s0


def test_ratio_guard_is_a_response_ratio() -> None:
    family = make_family("oracle", {"aging": "ratio", "aging_rate": 10})
    small, big = req(true_out=10), req(true_out=1000)
    assert family.score(small, 0.0) == family.score(big, 0.0) == 1.0
    assert family.score(small, 2.0) == pytest.approx(3.0)  # (10 + 20) / 10
    assert family.score(big, 2.0) == pytest.approx(1.02)
    with pytest.raises(UsageError, match="aging"):
        make_family("affinity", {"aging": "ratio"})


def test_linear_aging_limits_who_may_overtake_to_arrivals_within_cost_over_rate() -> None:
    # cost 1000 tokens, rate 10 tokens/s: only a request arriving within 100 s can pass it.
    family = make_family("ltr-promptlen", {"aging_rate": 10})
    old_long = req("old", arrival=0.0, prompt=1000)
    for now in (160.0, 500.0):
        soon_short = req("soon", arrival=50.0, prompt=10)
        late_short = req("late", arrival=150.0, prompt=10)
        assert family.score(soon_short, now) > family.score(old_long, now)  # type: ignore[operator]
        assert family.score(late_short, now) < family.score(old_long, now)  # type: ignore[operator]


def test_pick_next_breaks_ties_by_arrival_and_serves_overdue_requests_oldest_first() -> None:
    waiting = [req("b", arrival=2.0), req("a", arrival=1.0), req("c", arrival=3.0)]
    assert pick_next(waiting, [5.0, 5.0, 1.0], now=4.0, max_overtake_s=10.0) == 1
    assert pick_next(waiting, [0.0, 1.0, 9.0], now=4.0, max_overtake_s=10.0) == 2
    # At now=12 "a" (waited 11 s) and "b" (10 s... not over) : "a" is overdue and goes first.
    assert pick_next(waiting, [0.0, 1.0, 9.0], now=12.0, max_overtake_s=10.0) == 1
    assert pick_next(waiting, [0.0, 1.0, 9.0], now=13.0, max_overtake_s=10.0) == 1
    with pytest.raises(ValueError):
        pick_next([], [], 0.0, 1.0)


@pytest.mark.parametrize("name", REORDERING)
def test_no_request_is_overtaken_beyond_the_bound_in_a_queue_of_10000_arrivals(name: str) -> None:
    """A continuous-batching queue at overload: later arrivals never pass a request older than the bound."""
    bound_s = 20.0
    family = make_family(name, {"aging_rate": 0.5, "max_overtake_s": bound_s})
    rng = random.Random(42)
    slots, now, arrivals = 4, 0.0, []
    # Arrivals at about 105% of capacity so the queue grows and the guard has work to do.
    mean_service_s = 2.0
    for i in range(10_000):
        now += rng.expovariate(slots / mean_service_s * 1.05)
        size = max(1, int(rng.lognormvariate(4.5, 1.0)))
        arrivals.append(req(f"r{i}", now, prompt=rng.randint(10, 2000), cached=rng.choice([0, 0, 64, 512]) % 2000,
                            prefix=i % 7, true_out=size))
    # Family learning: feed a few completions so ltr/hybrid produce varied predictions.
    waiting: list[WaitingRequest] = []
    running: list[float] = []  # finish times (a heap)
    served_waits: list[float] = []
    next_arrival = 0
    clock = 0.0
    worst_overtaken_s = 0.0
    while next_arrival < len(arrivals) or waiting:
        # Advance to the next event: an arrival or a finish.
        t_arrival = arrivals[next_arrival].arrival_time if next_arrival < len(arrivals) else math.inf
        t_finish = running[0] if running else math.inf
        if len(running) < slots and waiting:
            pass  # admit now
        elif t_arrival <= t_finish:
            clock = t_arrival
            waiting.append(arrivals[next_arrival])
            next_arrival += 1
            continue
        else:
            clock = heapq.heappop(running)
            continue
        scores = [family.score(r, clock) for r in waiting]
        i = pick_next(waiting, scores, clock, family.max_overtake_s)  # type: ignore[arg-type,attr-defined]
        chosen = waiting.pop(i)
        # Everyone still waiting who arrived earlier than the chosen one has just been overtaken.
        for other in waiting:
            if other.arrival_time < chosen.arrival_time:
                worst_overtaken_s = max(worst_overtaken_s, clock - other.arrival_time)
        served_waits.append(clock - chosen.arrival_time)
        service = (chosen.true_output_tokens or 1) * mean_service_s / math.exp(4.5 + 0.5)
        heapq.heappush(running, clock + service)
        family.observe(chosen, chosen.true_output_tokens or 1)
    assert len(served_waits) == 10_000
    assert worst_overtaken_s <= bound_s + 1e-9, f"{name}: overtaken after {worst_overtaken_s:.1f} s"
    # The queue did build up: the bound was actually exercised.
    assert max(served_waits) > bound_s


def test_registry_keeps_the_arrival_order_families() -> None:
    assert {"fcfs", "trace", *REORDERING} <= set(FAMILIES)


def _recipe_yaml(key: str, family: str) -> str:
    return (f"key: {key}\nplan: free\nmodel: {{repo: carbonforge/tiny-chat, builtin: tiny-chat}}\n"
            f"vllm: {{max_num_seqs: 1}}\nscheduler: {{family: {family}, params: {{}}}}\n"
            "api: {reasoning_parser: null, tool_call_parser: null}\n")


def test_oracle_is_refused_in_the_shipped_recipes_but_allowed_in_a_benchmark_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from carbonforge_runtime.errors import RecipeError
    from carbonforge_runtime.recipes import loader

    shipped, bench = tmp_path / "shipped", tmp_path / "bench"
    shipped.mkdir()
    bench.mkdir()
    (shipped / "a.yaml").write_text(_recipe_yaml("cf-tiny:bf16:chat:cpu", "fcfs"))
    (bench / "b.yaml").write_text(_recipe_yaml("cf-tiny-oracle:bf16:chat:cpu", "oracle"))
    monkeypatch.setattr(loader, "shipped_recipes_dir", lambda: shipped)
    recipes = loader.load_recipes([shipped, bench])
    assert recipes["cf-tiny-oracle:bf16:chat:cpu"].scheduler.family == "oracle"
    (shipped / "c.yaml").write_text(_recipe_yaml("cf-tiny-x:bf16:chat:cpu", "oracle"))
    with pytest.raises(RecipeError, match="benchmark-only") as exc:
        loader.load_recipes([shipped, bench])
    assert "c.yaml" in exc.value.message


def test_every_shipped_recipe_names_a_family_that_starts() -> None:
    from carbonforge_runtime.recipes import load_recipes, shipped_recipes_dir

    for recipe in load_recipes([shipped_recipes_dir()]).values():
        family = make_family(recipe.scheduler.family, recipe.scheduler.params)
        assert family.name == recipe.scheduler.family


def test_families_that_read_the_prefix_cache_bound_their_lookups() -> None:
    # The shim stops asking the prefix cache beyond cache_lookup_limit waiting requests.
    assert make_family("ltr-promptlen", {}).cache_lookup_limit == 16  # type: ignore[attr-defined]
    assert make_family("ltr-promptlen", {"cache_lookup_limit": 8}).cache_lookup_limit == 8  # type: ignore[attr-defined]
    assert make_family("hybrid", {}).cache_lookup_limit == 16  # type: ignore[attr-defined]
    assert make_family("affinity", {"max_queue": 10}).cache_lookup_limit == 10  # type: ignore[attr-defined]
    with pytest.raises(UsageError, match="cache_lookup_limit"):
        make_family("hybrid", {"cache_lookup_limit": -1})
    # Families that never read the cache do not ask for lookups at all.
    assert not make_family("ltr", {}).needs_cache_lookup
    assert not make_family("oracle", {}).needs_cache_lookup
    assert make_family("oracle", {"prompt_weight": 0.1}).needs_cache_lookup


@pytest.mark.parametrize(("family", "message"), [
    ("tie", "the 'tie' family is not implemented"),
    ("shortest-first", "unknown scheduler family 'shortest-first'"),
])
def test_a_recipe_naming_tie_or_an_unknown_family_fails_at_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, message: str) -> None:
    from typer.testing import CliRunner

    from carbonforge_runtime.cli.main import app

    (tmp_path / "r.yaml").write_text(_recipe_yaml("cf-tiny-x:bf16:chat:cpu", family))
    monkeypatch.setenv("CF_RECIPES_DIR", str(tmp_path))
    result = CliRunner().invoke(app, ["serve", "--context-key", "cf-tiny-x:bf16:chat:cpu", "--dry-run"])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
