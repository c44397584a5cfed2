"""The decisions of ``tune``: goals and SLOs, bounded and deterministic candidates, ranking, the patch."""

from __future__ import annotations

import math

import pytest

from carbonforge_runtime.core.ordering.registry import make_family
from carbonforge_runtime.core.twin_data import SimError, TwinSettings
from carbonforge_runtime.offline.sim.tune import (
    PARAM_LADDERS,
    Config,
    Figures,
    apply_patch,
    build_patch,
    neighbours,
    parse_goal,
    parse_slos,
    rank_key,
    recipe_file_name,
    search,
    tuned_families,
)

RECIPE = Config.of(TwinSettings(family="hybrid", params={"aging_rate": 20, "max_overtake_s": 60},
                                max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=32768, kv_tokens=100000))


def test_goals_and_slos_parse_and_bad_text_is_refused_with_the_fix() -> None:
    assert parse_goal("mean-e2e") == "mean_e2e" and parse_goal("THROUGHPUT") == "throughput"
    slos = parse_slos(["e2e_mean=10s", "ttft_p99=500ms", "ttft_p50=1.5m"])
    assert [(s.metric, s.limit_s) for s in slos] == [("ttft_p50", 90.0), ("ttft_p99", 0.5), ("e2e_mean", 10.0)]
    for bad, message in [("fastest", "unknown goal")]:
        with pytest.raises(SimError, match=message) as refused:
            parse_goal(bad)
        assert "mean_e2e, p99_ttft, throughput" in refused.value.remedy
    for items, message in [(["ttft_p99"], "not NAME=LIMIT"), (["tpot_p99=1s"], "unknown figure"),
                           (["ttft_p99=fast"], "not a duration"), (["ttft_p99=0s"], "above zero"),
                           (["ttft_p99=1s", "ttft_p99=2s"], "more than once")]:
        with pytest.raises(SimError, match=message) as refused:
            parse_slos(items)
        assert refused.value.remedy and refused.value.exit_code == 2


def test_every_tuned_family_and_ladder_value_is_accepted_by_the_registry() -> None:
    assert set(tuned_families()) == {"fcfs", "ltr-promptlen", "affinity", "ltr", "hybrid"}
    for family in tuned_families():
        for name, (_, ladder) in PARAM_LADDERS[family].items():
            for value in ladder:
                make_family(family, {name: value})


def test_neighbours_are_bounded_deterministic_and_one_step_away() -> None:
    first = neighbours(RECIPE, RECIPE)
    assert first == neighbours(RECIPE, RECIPE) and len(first) == len(set(first)) and RECIPE not in first
    assert len(first) <= 20
    batched = sorted(c.max_num_batched_tokens for c in first if c.max_num_batched_tokens != 8192)
    assert batched == [4096, 16384]
    assert {c.long_prefill_token_threshold for c in first} == {0, 8192}  # 0 (none) is the top of its ladder
    switched = [c for c in first if c.family != "hybrid"]
    assert {c.family for c in switched} == {"fcfs", "ltr-promptlen", "affinity", "ltr"}
    assert all(c.params == () for c in switched)  # another family starts from its own defaults
    knobs = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "enable_chunked_prefill")
    for c in first:  # one dimension moved: one knob, or the ordering (family and its parameters)
        moved = [k for k in knobs if getattr(c, k) != getattr(RECIPE, k)]
        moved += ["ordering"] if (c.family, c.params) != (RECIPE.family, RECIPE.params) else []
        assert len(moved) == 1, c


def fake_figures(config: Config) -> Figures:
    """A made-up landscape: mean e2e falls with max_num_seqs up to 256 and with fcfs."""
    e2e = 10.0 + abs(math.log2(config.max_num_seqs / 256)) + (0 if config.family == "fcfs" else 1.5)
    if not config.enable_chunked_prefill:
        return Figures(error="too small")
    return Figures(completed=100, e2e_mean_s=e2e, ttft_p99_s=e2e / 2, throughput_rps=1.0)


def test_search_keeps_the_budget_starts_from_the_recipe_and_climbs() -> None:
    calls: list[int] = []

    def evaluate(configs: list[Config]) -> list[Figures]:
        calls.append(len(configs))
        return [fake_figures(c) for c in configs]

    result = search(RECIPE, evaluate, "mean_e2e", (), budget=40, total=100)
    again = search(RECIPE, evaluate, "mean_e2e", (), budget=40, total=100)
    assert [c.config for c in result.candidates] == [c.config for c in again.candidates]
    assert len(result.candidates) <= 40 and result.candidates[0].config == RECIPE
    best = result.candidates[result.best].config
    assert best.family == "fcfs" and best.max_num_seqs > 64
    assert result.candidates[result.best].figures.e2e_mean_s < fake_figures(RECIPE).e2e_mean_s - 2
    small = search(RECIPE, evaluate, "mean_e2e", (), budget=5, total=100)
    assert len(small.candidates) == 5
    with pytest.raises(SimError, match="budget"):
        search(RECIPE, evaluate, "mean_e2e", (), budget=0, total=100)


def test_ranking_puts_slo_and_feasibility_before_the_goal() -> None:
    slos = parse_slos(["ttft_p99=1s"])
    fast_but_late = Figures(completed=10, throughput_rps=5.0, ttft_p99_s=3.0)
    slower_in_slo = Figures(completed=10, throughput_rps=4.0, ttft_p99_s=0.5)
    infeasible = Figures(error="no")
    keys = [rank_key(f, i, "throughput", slos, 10) for i, f in enumerate([fast_but_late, slower_in_slo, infeasible])]
    assert sorted(range(3), key=lambda i: keys[i]) == [1, 0, 2]
    assert rank_key(fast_but_late, 0, "throughput", (), 10) < rank_key(slower_in_slo, 1, "throughput", (), 10)


def test_the_patch_holds_only_what_changes_in_the_recipe_files_shape() -> None:
    assert build_patch(RECIPE, RECIPE) == {}
    knob = Config(**{**RECIPE.__dict__, "max_num_seqs": 128})
    assert build_patch(RECIPE, knob) == {"vllm": {"max_num_seqs": 128}}
    family = Config(**{**RECIPE.__dict__, "family": "ltr-promptlen", "params": (("max_overtake_s", 120),)})
    patch = build_patch(RECIPE, family)
    assert patch == {"scheduler": {"family": "ltr-promptlen", "params": {"max_overtake_s": 120}}}
    document = {"key": "k", "vllm": {"max_num_seqs": 64, "dtype": "bf16"}, "scheduler": {"family": "hybrid",
                "params": {"aging_rate": 20}}, "benchmark": {"measured_on": None}}
    patched = apply_patch(document, {**patch, "vllm": {"max_num_seqs": 128}}, {"measured": False})
    assert patched["vllm"] == {"max_num_seqs": 128, "dtype": "bf16"}
    assert patched["scheduler"] == {"family": "ltr-promptlen", "params": {"max_overtake_s": 120}}
    assert patched["benchmark"] == {"measured_on": None, "predicted": {"measured": False}}
    assert document["vllm"]["max_num_seqs"] == 64  # the original is left alone
    assert recipe_file_name("qwen3-32b:fp8:chat:a100-80x1") == "qwen3-32b--fp8--chat--a100-80x1.yaml"


def test_the_loader_accepts_a_predicted_benchmark_block_and_stays_strict() -> None:
    from pathlib import Path

    import yaml

    from carbonforge_runtime.errors import RecipeError
    from carbonforge_runtime.recipes.loader import shipped_recipes_dir
    from carbonforge_runtime.recipes.model import recipe_from_mapping

    path = shipped_recipes_dir() / "qwen3-32b--fp8--chat--a100-80x1.yaml"
    document = yaml.safe_load(path.read_text())
    ok = apply_patch(document, {}, {"measured": False, "goal": "mean_e2e", "chosen": {"e2e_mean_s": 1.0}})
    assert recipe_from_mapping(ok, Path("x.yaml")).benchmark["predicted"]["goal"] == "mean_e2e"
    for bad, message in [({"measured": True}, "must be false"), ({"measured": False, "guess": 1}, "guess"),
                         ({"goal": "mean_e2e"}, "measured' is missing")]:
        with pytest.raises(RecipeError, match=message):
            recipe_from_mapping(apply_patch(document, {}, bad), Path("x.yaml"))
    with pytest.raises(RecipeError, match=r"'benchmark\.measured_by' is not a known field"):
        recipe_from_mapping({**document, "benchmark": {"measured_by": "me"}}, Path("x.yaml"))
