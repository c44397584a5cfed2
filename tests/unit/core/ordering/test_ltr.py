"""The learned ranker: its model, Kendall tau, `ltr fit` on a full-level trace, and the ltr family using it."""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli.main import app
from carbonforge_runtime.core.ordering.base import WaitingRequest
from carbonforge_runtime.core.ordering.ltr import (
    PREFIX_HASH_TOKENS,
    Example,
    LtrModel,
    LtrParams,
    evaluate,
    fit,
    kendall_tau_b,
    prefix_hash,
)
from carbonforge_runtime.core.ordering.registry import make_family
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.offline.ltr_fit import load_tokenize
from carbonforge_runtime.offline.replay.workloads import templated, tokenizer_counter


def brute_tau_b(a: list[float], b: list[float]) -> float:
    conc = disc = tie_a = tie_b = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        if da == 0 and db == 0:
            continue
        if da == 0:
            tie_a += 1
        elif db == 0:
            tie_b += 1
        elif da * db > 0:
            conc += 1
        else:
            disc += 1
    return (conc - disc) / math.sqrt((conc + disc + tie_a) * (conc + disc + tie_b))


def test_kendall_tau_b_matches_the_definition() -> None:
    rng = random.Random(1)
    for n in (2, 7, 50, 301):
        a = [float(rng.randint(0, 9)) for _ in range(n)]
        b = [float(rng.randint(0, 9)) for _ in range(n)]
        if len(set(a)) > 1 and len(set(b)) > 1:
            assert kendall_tau_b(a, b) == pytest.approx(brute_tau_b(a, b))
    assert kendall_tau_b([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert kendall_tau_b([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(kendall_tau_b([1, 1, 1], [1, 2, 3]))


def test_an_empty_model_predicts_a_default_and_learns_per_prefix() -> None:
    model = LtrModel()
    assert model.predict(1, 100) == pytest.approx(128.0)
    for _ in range(50):
        model.observe(1, 100, 10)
        model.observe(2, 100, 1000)
    assert model.predict(1, 100) == pytest.approx(10, rel=0.3)
    assert model.predict(2, 100) == pytest.approx(1000, rel=0.3)
    # An unseen prefix gets the global fit, between the two.
    assert 10 < model.predict(3, 100) < 1000
    # A single observation of a new key is shrunk towards the global mean.
    model.observe(4, 100, 5000)
    assert model.predict(4, 100) < 3000


def test_per_prefix_slope_ranks_by_size_within_a_template() -> None:
    model = LtrModel()
    rng = random.Random(0)
    for _ in range(400):
        words = rng.randint(20, 400)
        model.observe(9, words, int(words * 0.3))
    assert model.predict(9, 50) < model.predict(9, 200) < model.predict(9, 400)
    assert model.predict(9, 300) == pytest.approx(90, rel=0.2)


def test_the_model_is_deterministic_and_round_trips_through_json(tmp_path: Path) -> None:
    def build() -> LtrModel:
        model = LtrModel(params=LtrParams(max_keys=50))
        rng = random.Random(5)
        for _ in range(2000):
            key = rng.randint(0, 80)
            model.observe(key * 0x9E3779B97F4A7C15 - 2**62, rng.randint(1, 900), rng.randint(1, 700))
        return model

    a, b = build(), build()
    assert a.to_json() == b.to_json()
    assert len(a.keys) == 50  # the least recently updated keys were dropped
    path = tmp_path / "m.json"
    a.save(path)
    loaded = LtrModel.load(path)
    for key in list(a.keys)[:10]:
        assert loaded.predict(key, 123) == a.predict(key, 123)
    # Hashes beyond 2**53 and negative ones survive JSON exactly.
    assert set(loaded.keys) == set(a.keys)


def test_old_evidence_fades_past_max_weight() -> None:
    model = LtrModel(params=LtrParams(max_weight=50))
    for _ in range(200):
        model.observe(1, 100, 10)
    for _ in range(100):
        model.observe(1, 100, 500)
    assert model.keys[1].n == pytest.approx(50)
    assert model.predict(1, 100) > 200  # the recent regime dominates (without fading: about 40)


def test_prediction_costs_microseconds() -> None:
    model = LtrModel()
    for i in range(5000):
        model.observe(i % 40, 100 + i % 700, 1 + i % 300)
    started = time.perf_counter()
    for i in range(20_000):
        model.predict(i % 50, 100 + i % 900, None)
    per_call_us = (time.perf_counter() - started) / 20_000 * 1e6
    assert per_call_us < 20, per_call_us


def test_bad_model_params_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="prior_weight"):
        LtrParams.from_mapping({"prior_weight": -1})
    with pytest.raises(UsageError, match="max_keys"):
        LtrParams.from_mapping({"max_keys": 0})


def test_the_offline_prefix_hash_is_the_engines() -> None:
    from carbonforge_runtime.engine import scheduler as shim

    rng = random.Random(2)
    assert shim.PREFIX_HASH_TOKENS == PREFIX_HASH_TOKENS
    for n in (0, 1, 10, 64, 65, 500):
        ids = [rng.randrange(0, 150_000) for _ in range(n)]
        assert prefix_hash(ids) == shim.prefix_hash(ids)
    assert prefix_hash(list(range(100))) == prefix_hash(list(range(64)) + [7] * 10)


@pytest.fixture(scope="module")
def templated_trace(tmp_path_factory: pytest.TempPathFactory, tiny_model: str) -> Path:
    """A full-level trace of the templated workload, token counts from the tiny model's tokenizer."""
    records = templated(1500, seed=11, rate=8.0, count_tokens=tokenizer_counter(tiny_model))
    path = tmp_path_factory.mktemp("ltr") / "templated-full.jsonl"
    with path.open("w") as handle:
        for i, record in enumerate(records):
            handle.write(json.dumps({"request_id": f"cmpl-{i}", **record, "output_text": "x"}) + "\n")
    return path


def test_ltr_fit_on_a_full_trace_reaches_tau_half_on_held_out_templated_requests(
        templated_trace: Path, tiny_model: str, tmp_path: Path) -> None:
    model_path = tmp_path / "ltr-model.json"
    result = CliRunner().invoke(app, ["ltr", "fit", str(templated_trace), "-o", str(model_path),
                                      "--tokenizer", tiny_model, "--holdout", "0.3"])
    assert result.exit_code == 0, result.output
    assert "held-out requests" in result.output
    reported = float(result.output.split("held-out requests: ")[1].split()[0])
    assert reported >= 0.5
    assert json.loads(model_path.read_text())["format"] == "carbonforge-ltr"

    # The family with that model, scoring requests the way the engine builds them: the prefix hash
    # of the token ids the served model's tokenizer makes of the prompt.
    tokenize = load_tokenize(tiny_model)
    records = [json.loads(line) for line in templated_trace.read_text().splitlines()]
    held_out = records[int(len(records) * 0.7):]
    # A model fitted on the first 70% only, so the held-out part is really unseen.
    train_path = tmp_path / "train.jsonl"
    train_path.write_text("".join(json.dumps(r) + "\n" for r in records[: int(len(records) * 0.7)]))
    train_model = tmp_path / "train-model.json"
    fitted = CliRunner().invoke(app, ["ltr", "fit", str(train_path), "-o", str(train_model), "--tokenizer",
                                      tiny_model, "--holdout", "0"])
    assert fitted.exit_code == 0, fitted.output
    family = make_family("ltr", {"model": str(train_model), "aging_rate": 0, "learn": False})
    predicted, actual = [], []
    for i, r in enumerate(held_out):
        ids = tokenize(r["prompt_text"])
        assert len(ids) == r["prompt_tokens"]
        wr = WaitingRequest(f"r{i}", r["t_arrival"], r["prompt_tokens"], 0, None, prefix_hash(ids), 0)
        score = family.score(wr, r["t_arrival"])
        assert score is not None
        predicted.append(-score)
        actual.append(r["output_tokens"])
    tau = kendall_tau_b(predicted, actual)
    assert tau >= 0.5, tau
    # Prompt length alone ranks much worse on this workload.
    assert kendall_tau_b([r["prompt_tokens"] for r in held_out], actual) < tau - 0.15


def test_ltr_eval_and_fit_refuse_what_they_cannot_use(templated_trace: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    no_tok = runner.invoke(app, ["ltr", "fit", str(templated_trace), "-o", str(tmp_path / "m.json")])
    assert no_tok.exit_code == 2 and "--tokenizer" in no_tok.output
    standard = tmp_path / "std.jsonl"
    standard.write_text('{"t_arrival": 1, "prompt_tokens": 5, "output_tokens": 3}\n')
    res = runner.invoke(app, ["ltr", "fit", str(standard), "-o", str(tmp_path / "m.json")])
    assert res.exit_code == 2 and "full-level" in res.output
    res = runner.invoke(app, ["ltr", "fit", str(templated_trace), "-o", str(tmp_path / "m.json"), "--holdout", "1.5"])
    assert res.exit_code == 2 and "holdout" in res.output
    # A trace that carries the engine's prefix_hash needs no tokenizer.
    with_hash = tmp_path / "hash.jsonl"
    with_hash.write_text("".join(json.dumps({"t_arrival": i, "prompt_tokens": 10, "output_tokens": 5 + 50 * (i % 2),
                                             "prefix_hash": i % 2}) + "\n" for i in range(40)))
    res = runner.invoke(app, ["ltr", "fit", str(with_hash), "-o", str(tmp_path / "h.json"), "--holdout", "0.25"])
    assert res.exit_code == 0 and "held-out requests: 1.000" in res.output, res.output
    res = runner.invoke(app, ["ltr", "eval", str(tmp_path / "h.json"), str(with_hash)])
    assert res.exit_code == 0 and "Kendall tau over 40 requests: 1.000" in res.output


def test_online_learning_alone_ranks_the_templated_workload(templated_trace: Path, tiny_model: str) -> None:
    tokenize = load_tokenize(tiny_model)
    records = [json.loads(line) for line in templated_trace.read_text().splitlines()]
    examples = [Example(prefix_hash(tokenize(r["prompt_text"])), r["prompt_tokens"], r["output_tokens"])
                for r in records]
    assert len({e.prefix_hash for e in examples}) == 6  # one key per template
    # Starting from nothing and learning as requests complete, as the engine does.
    assert evaluate(LtrModel(), examples, learn=True) >= 0.5
    assert evaluate(fit(examples[:300]), examples[300:]) >= 0.5


def test_ltr_refuses_binary_models_gzip_traces_of_garbage_and_huge_numbers(tmp_path: Path) -> None:
    import gzip

    runner = CliRunner()
    garbage = tmp_path / "model.bin"
    garbage.write_bytes(bytes(range(256)) * 4)
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"t_arrival": 1, "prompt_tokens": 3, "output_tokens": 2, "prefix_hash": 1}) + "\n")
    res = runner.invoke(app, ["ltr", "eval", str(garbage), str(trace)])
    assert res.exit_code == 2 and "not text" in res.output, res.output
    huge = tmp_path / "huge.jsonl"
    huge.write_text('{"t_arrival": 1, "prompt_tokens": 1e999, "output_tokens": 2, "prefix_hash": 1}\n')
    res = runner.invoke(app, ["ltr", "fit", str(huge), "-o", str(tmp_path / "m.json")])
    assert res.exit_code == 2 and ":1: not a trace record" in res.output, res.output
    packed = tmp_path / "packed.jsonl.gz"
    packed.write_bytes(gzip.compress(b"\x00\xff binary \xfe\n" * 10))
    res = runner.invoke(app, ["ltr", "fit", str(packed), "-o", str(tmp_path / "m.json")])
    assert res.exit_code == 1 and ":1: is not JSON" in res.output, res.output
