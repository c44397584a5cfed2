"""Tenants and priority classes in the traces ``sim`` reads, and its per-tenant report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.offline.sim.inputs import WindowOptions, load_trace, window

KEY = "qwen3-32b:fp8:chat:a100-80x1"
runner = CliRunner()


def jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_format_reads_a_tenant_and_a_priority_where_present(tmp_path: Path) -> None:
    ours = jsonl(tmp_path / "t.jsonl", [
        {"t_arrival": 10.0, "prompt_tokens": 5, "output_tokens": 2, "tenant": "team-a", "priority": 2},
        {"t_arrival": 11.0, "prompt_tokens": 5, "output_tokens": 2, "tenant": None},
        {"t_arrival": 12.0, "prompt_tokens": 5, "output_tokens": 2}])
    assert [(r.tenant, r.priority) for r in window(load_trace(ours), WindowOptions())] == [
        ("team-a", 2), (None, 0), (None, 0)]
    csv = tmp_path / "a.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,tenant,priority\n0,10,3,free,0\n1,10,3,paid,1\n"
                   "2,10,3,,\n")
    assert [(r.tenant, r.priority) for r in load_trace(csv).requests] == [("free", 0), ("paid", 1), (None, 0)]
    plain = tmp_path / "p.csv"
    plain.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,3\n")
    assert [(r.tenant, r.priority) for r in load_trace(plain).requests] == [(None, 0)]
    moon = jsonl(tmp_path / "m.jsonl", [{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1],
                                         "tenant": "x", "priority": -1}])
    assert [(r.tenant, r.priority) for r in load_trace(moon).requests] == [("x", -1)]


@pytest.mark.parametrize(("row", "message"), [
    ({"tenant": 7}, "tenant=7 is not a tenant name"),
    ({"tenant": "a\nb"}, "is not a tenant name"),
    ({"priority": "high"}, "priority='high' is not a whole number"),
    ({"priority": 1.5}, "priority=1.5 is not a whole number"),
    ({"priority": True}, "priority=True"),
])
def test_a_bad_tenant_or_priority_is_refused_with_its_line(tmp_path: Path, row: dict[str, object],
                                                           message: str) -> None:
    path = jsonl(tmp_path / "t.jsonl", [{"t_arrival": 0.0, "prompt_tokens": 5, "output_tokens": 2, **row}])
    with pytest.raises(UsageError, match=message) as caught:
        load_trace(path)
    assert ":1:" in caught.value.message


def run_sim(tmp_path: Path, rows: list[dict[str, object]], *extra: str) -> tuple[dict[str, object], str]:
    trace = jsonl(tmp_path / "t.jsonl", rows)
    out = tmp_path / "r.json"
    result = runner.invoke(cli.app, ["sim", str(trace), "--context-key", KEY, "-o", str(out), "--kv-tokens", "20000",
                                     "--family", "fcfs", "-q", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.output


def test_sim_reports_each_tenant_and_class_when_there_are_several(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    rows: list[dict[str, object]] = [
        {"t_arrival": i * 0.05, "prompt_tokens": 200, "output_tokens": 50, "tenant": "flood"} for i in range(60)]
    rows += [{"t_arrival": 0.5 + i, "prompt_tokens": 200, "output_tokens": 50, "tenant": "steady", "priority": 1}
             for i in range(3)]
    rows.sort(key=lambda r: float(r["t_arrival"]))  # type: ignore[arg-type]
    doc, text = run_sim(tmp_path, rows, "--max-num-seqs", "4")
    sim = doc["sim"]
    assert isinstance(sim, dict)
    tenants = sim["tenants"]
    assert list(tenants) == ["flood", "steady"]
    assert tenants["flood"]["requests"] == 60 and tenants["steady"]["completed"] == 3
    for group in tenants.values():
        assert group["e2e_s"]["p99"] >= group["e2e_s"]["p50"] > 0 and group["ttft_s"]["p99"] > 0
        assert group["request_rate"] > 0 and group["output_token_rate"] > 0
    assert list(sim["priority_classes"]) == ["1", "0"]
    # the steady class-1 tenant is admitted ahead of the flood's queue
    assert tenants["steady"]["ttft_s"]["p99"] < tenants["flood"]["ttft_s"]["p50"]
    assert "tenant " in text and "priority class" in text and "steady" in text
    requests = doc["requests"]
    assert isinstance(requests, list) and {r.get("tenant") for r in requests} == {"flood", "steady"}
    records = [json.loads(line) for line in (tmp_path / "r.requests.jsonl").read_text().splitlines()]
    assert {r["tenant"] for r in records} == {"flood", "steady"}


def test_sim_with_one_tenant_adds_no_per_tenant_section(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    rows: list[dict[str, object]] = [{"t_arrival": i * 0.1, "prompt_tokens": 100, "output_tokens": 20}
                                     for i in range(10)]
    doc, text = run_sim(tmp_path, rows)
    sim = doc["sim"]
    assert isinstance(sim, dict) and "tenants" not in sim and "priority_classes" not in sim
    assert "priority class" not in text
