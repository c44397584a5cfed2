"""The label vocabulary every printed or shipped figure carries."""

from __future__ import annotations

import datetime

import pytest

from carbonforge_runtime.core import figure_labels as fl


def test_predicted_names_the_model_and_whether_it_is_a_proxy() -> None:
    assert fl.predicted("a100-80-tp1", 1, proxy=True).text() == \
        "predicted by the twin with step-time model a100-80-tp1 v1, a proxy"
    assert fl.predicted("mine.yaml", None, proxy=False).text() == \
        "predicted by the twin with step-time model mine.yaml, not a proxy"
    assert fl.predicted("x", 2, True).to_json() == {
        "kind": "predicted", "step_model": {"name": "x", "version": 2, "proxy": True},
        "text": "predicted by the twin with step-time model x v2, a proxy"}


def test_emulated_gives_the_late_share_and_flags_an_unfaithful_run() -> None:
    ok = fl.emulated("h100-tp2", 1, True, late_steps=3, steps=1000)
    assert ok.faithful and ok.text().endswith("; 0.30% of 1,000 steps late")
    assert ok.text().startswith("emulated: the real engine paced to step-time model h100-tp2 v1, a proxy")
    bad = fl.emulated("h100-tp2", 1, True, late_steps=11, steps=1000)
    assert not bad.faithful and "not faithful" in bad.text()
    assert bad.to_json()["late_share"] == 0.011
    assert "late steps not recorded" in fl.emulated("m", None, False, None, None).text()


def test_measured_names_the_host_and_date() -> None:
    label = fl.measured("NVIDIA A100-SXM4-80GB", 1, "550.54.15", "0.32.0", "2026-12-05")
    assert label.text() == "measured on 1 x NVIDIA A100-SXM4-80GB, driver 550.54.15, vLLM 0.32.0, 2026-12-05"
    assert label.to_json()["host"] == {"gpu": "NVIDIA A100-SXM4-80GB", "gpu_count": 1, "driver": "550.54.15",
                                       "vllm": "0.32.0"}
    assert fl.measured(None, None, None, None, None).text() == (
        "measured on an unrecorded GPU, driver not recorded, vLLM version not recorded, date not recorded")


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown figure label"):
        fl.FigureLabel("guessed")


def test_benchmark_block_labels() -> None:
    assert fl.benchmark_labels({"measured_on": None, "date": None, "figures": {}}) == []
    assert fl.describe_benchmark(None) == "no benchmark figures (neither measured nor predicted)"
    predicted_block = {"measured_on": None, "predicted": {"measured": False, "cost_model": {
        "name": "a100-80-tp1", "version": 1, "proxy": True}}}
    assert fl.describe_benchmark(predicted_block) == \
        "predicted by the twin with step-time model a100-80-tp1 v1, a proxy"
    host = {"gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 2, "driver": "560.35.03", "vllm": "0.32.0"}
    measured_block = {**predicted_block, "measured_on": host, "date": datetime.date(2026, 12, 1), "figures": {"x": 1}}
    parts = fl.benchmark_labels(measured_block)
    assert [(part, label.kind) for part, label in parts] == [("figures", "measured"), ("predicted", "predicted")]
    assert parts[0][1].text() == "measured on 2 x NVIDIA H100 80GB HBM3, driver 560.35.03, vLLM 0.32.0, 2026-12-01"
    assert fl.benchmark_labels({"measured_on": "a lab box"})[0][1].text().startswith("measured on a lab box,")
