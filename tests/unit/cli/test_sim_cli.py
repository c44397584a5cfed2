"""``carbonforge-runtime sim``: the result files and clear refusals. Byte-identical output from two
separate processes (issue 16, acceptance 2) is checked in tests/integration/test_sim_processes.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from tests.support import offline_argv

KEY = "qwen3-32b:fp8:chat:a100-80x1"
runner = CliRunner()


def mooncake(path: Path, count: int = 60, seed: int = 3) -> Path:
    """A Mooncake-format trace with shared prefixes (a few system prompts, multi-turn growth)."""
    rng = random.Random(seed)
    rows = []
    next_id = 1000
    for i in range(count):
        shared = [rng.randrange(4)] + ([10 + rng.randrange(3)] if rng.random() < 0.5 else [])
        own = list(range(next_id, next_id + rng.randrange(1, 6)))
        next_id += len(own)
        ids = shared + own
        rows.append({"timestamp": i * 150, "input_length": 512 * len(ids) - rng.randrange(300),
                     "output_length": rng.randrange(1, 300), "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def invoke(*args: str) -> object:
    return runner.invoke(cli.app, ["sim", *args])


def test_sim_writes_replays_result_shape_and_records_trace_summarize_reads(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from carbonforge_runtime.offline.replay.aggregate import summarize

    trace = mooncake(tmp_path / "m.jsonl")
    out = tmp_path / "out" / "r.json"
    result = runner.invoke(cli.app, ["sim", str(trace), "--context-key", KEY, "-o", str(out), "--kv-tokens", "20000",
                                     "--family", "ltr-promptlen", "--param", "max_overtake_s=30", "-q"])
    assert result.exit_code == 0, result.output
    assert "PROXY" in result.output and "prefix cache" in result.output
    doc = json.loads(out.read_text())
    assert list(doc)[:9] == ["trace", "trace_kind", "base_url", "model", "started_at", "options", "summary", "sim",
                             "label"]
    label = "predicted by the twin with step-time model a100-80-tp1 v1, a proxy"
    assert doc["label"]["kind"] == "predicted" and doc["label"]["text"] == label
    assert doc["label"]["step_model"] == {"name": "a100-80-tp1", "version": 1, "proxy": True}
    assert f"figures: {label}" in result.output
    assert set(doc["summary"]) == set(summarize([], 1.0))
    assert doc["summary"]["ok"] == 60 and doc["trace_kind"] == "mooncake-jsonl"
    sim = doc["sim"]
    assert sim["proxy_cost_model"] is True and sim["cost_model"]["name"] == "a100-80-tp1"
    assert sim["engine"]["family"] == "ltr-promptlen" and sim["engine"]["params"] == {"max_overtake_s": 30}
    assert sim["prefix_cache"]["hit_rate"] > 0.1
    assert sim["kv_use"]["timeline"] and 0 < sim["kv_use"]["max"] <= 1
    for name in ("ttft_s", "queue_wait_s", "tpot_s"):
        assert sim[name]["p99"] >= sim[name]["p50"] >= 0
    records_path = tmp_path / "out" / "r.requests.jsonl"
    records = [json.loads(line) for line in records_path.read_text().splitlines()]
    assert len(records) == 60 and {r["scheduler_family"] for r in records} == {"ltr-promptlen"}
    summary = runner.invoke(cli.app, ["trace", "summarize", str(records_path), "--json"])
    assert summary.exit_code == 0, summary.output
    assert json.loads(summary.output)["records"] == 60
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    plot = runner.invoke(cli.app, ["trace", "plot", str(records_path), "-o", str(png), "--window", "10s"])
    assert plot.exit_code == 0, plot.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("args", "code", "message"), [
    (["missing.jsonl"], 1, "does not exist"),
    (["TRACE", "--rate", "0"], 2, "--rate"),
    (["TRACE", "--token-scale", "-1"], 2, "--token-scale"),
    (["TRACE", "--limit", "0"], 2, "--limit"),
    (["TRACE", "--load", "0"], 2, "--load"),
    (["TRACE", "--family", "nope"], 2, "unknown scheduler family"),
    (["TRACE", "--param", "no_equals"], 2, "NAME=VALUE"),
    (["TRACE", "--family", "fcfs", "--param", "x=1"], 2, "takes no parameters"),
    (["TRACE", "--cost-model", "nope"], 2, "no step-time model named"),
    (["TRACE", "--cost-model", "BADMODEL"], 2, "missing field"),
    (["TRACE", "--kv-tokens", "0"], 2, "kv-tokens"),
    (["TRACE", "--max-num-seqs", "0"], 2, "max-num-seqs"),
    (["TRACE", "--output", "DIR"], 2, "is a directory"),
    (["TRACE", "--context-key", "cf-tiny:bf16:chat:cpu"], 2, "--cost-model"),
    (["TRACE", "--context-key", "nope:bf16:chat:cpu"], 2, "no recipe"),
    (["TRACE", "--max-model-len", "100"], 2, "max-model-len"),
])
def test_bad_input_is_refused_in_one_line_without_output(tmp_path: Path, args: list[str], code: int,
                                                         message: str) -> None:
    trace = mooncake(tmp_path / "m.jsonl", count=5)
    bad_model = tmp_path / "bad.yaml"
    bad_model.write_text("name: x\nversion: 1\n")
    (tmp_path / "d").mkdir()
    mapping = {"TRACE": str(trace), "BADMODEL": str(bad_model), "DIR": str(tmp_path / "d"),
               "missing.jsonl": str(tmp_path / "missing.jsonl")}
    out = tmp_path / "r.json"
    argv = offline_argv(args, mapping, KEY, out)
    result = runner.invoke(cli.app, ["sim", *argv])
    assert result.exit_code == code, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert not out.exists() and not (tmp_path / "r.requests.jsonl").exists()


def test_load_sets_arrivals_from_the_measured_capacity(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    trace = mooncake(tmp_path / "m.jsonl", count=40)
    out = tmp_path / "r.json"
    result = runner.invoke(cli.app, ["sim", str(trace), "--context-key", KEY, "--load", "0.5", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "measured capacity" in result.output
    doc = json.loads(out.read_text())
    capacity = doc["sim"]["engine"]["measured_capacity_rps"]
    assert capacity > 0 and doc["options"]["load"] == 0.5
    arrivals = [r["scheduled_s"] for r in doc["requests"]]
    offered = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    assert offered == pytest.approx(0.5 * capacity, rel=1e-6)


def test_two_families_at_one_load_get_identical_arrivals(tmp_path: Path) -> None:
    """Capacity is measured with FCFS whatever family is tried, so one --load is one traffic."""
    pytest.importorskip("vllm")
    from carbonforge_runtime.engine.twin import measure_capacity
    from carbonforge_runtime.offline.sim.inputs import WindowOptions
    from carbonforge_runtime.offline.sim.setup import TwinInputs, capacity_engine, prepare

    trace = mooncake(tmp_path / "m.jsonl", count=40)
    docs = {}
    for family in ("fcfs", "ltr-promptlen"):
        out = tmp_path / f"{family}.json"
        result = runner.invoke(cli.app, ["sim", str(trace), "--context-key", KEY, "--family", family,
                                         "--load", "0.85", "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert "with fcfs (the same traffic for every family)" in result.output
        docs[family] = json.loads(out.read_text())
    fcfs, other = docs["fcfs"], docs["ltr-promptlen"]
    assert other["sim"]["engine"]["family"] == "ltr-promptlen"
    assert [r["scheduled_s"] for r in fcfs["requests"]] == [r["scheduled_s"] for r in other["requests"]]
    assert fcfs["options"]["effective_rate"] == other["options"]["effective_rate"]
    for doc in (fcfs, other):
        assert doc["sim"]["engine"]["capacity_measured_with"] == "fcfs"
    # The check has teeth: measured with the family being tried, the capacity (and so the traffic) differs.
    prepared = prepare(TwinInputs(trace=trace, context_key=KEY, window=WindowOptions(), family="ltr-promptlen"))
    own = measure_capacity(prepared.served, prepared.twin, prepared.cost)
    shared = measure_capacity(prepared.served, capacity_engine(prepared.twin), prepared.cost)
    assert shared == pytest.approx(fcfs["sim"]["engine"]["measured_capacity_rps"], rel=1e-12)
    assert own != pytest.approx(shared, rel=1e-3)
