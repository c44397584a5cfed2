"""trace summarize --by tenant: the chargeback table on synthetic trace files (no engine)."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.core.quantiles import quantile
from carbonforge_runtime.offline.trace_tools.chargeback import render_text, summarize_by_tenant
from carbonforge_runtime.offline.trace_tools.sketch import ALPHA

runner = CliRunner()
T0 = 1_796_455_800.0  # 2026-12-05 07:30:00 UTC
_ABSENT = object()


def rec(i: int, tenant: Any = _ABSENT, e2e: float = 1.0, prompt: int = 100, output: int = 20,
        cached: int | None = 40, energy: float | None = None, finish: str = "stop") -> dict[str, Any]:
    record: dict[str, Any] = {
        "request_id": f"chatcmpl-{i}", "t_arrival": T0 + i, "t_completion": T0 + i + e2e, "prompt_tokens": prompt,
        "output_tokens": output, "e2e_latency_s": e2e, "ttft_s": 0.1, "queue_wait_s": 0.01,
        "scheduler_family": "fcfs", "priority_score": None, "finish_reason": finish,
        "cached_prompt_tokens": cached, "energy_j": energy,
    }
    if tenant is not _ABSENT:
        record["tenant"] = tenant
    return record


def write(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_usage_is_summed_per_tenant_and_records_without_one_are_default(tmp_path: Path) -> None:
    trace = write(tmp_path / "t.jsonl", [
        rec(0, "acme", prompt=10, output=5, cached=4, energy=2.0),
        rec(1, "acme", prompt=30, output=15, cached=None, energy=None, finish="error"),
        rec(2, "beta", prompt=50, output=0, cached=0, finish="abort"),
        rec(3, None, prompt=7, output=3),  # null: no named key
        rec(4, prompt=1, output=1),  # written before the field existed
    ])
    result = summarize_by_tenant([trace])
    usage = {u.tenant: u for u in result.tenants}
    assert list(usage) == ["acme", "beta", "default"]
    acme, beta, default = usage["acme"], usage["beta"], usage["default"]
    assert (acme.requests, acme.prompt_tokens, acme.output_tokens, acme.cached_prompt_tokens) == (2, 40, 20, 4)
    assert acme.finish_reasons == {"error": 1, "stop": 1}
    assert (acme.energy_j, acme.energy_metered_records) == (2.0, 1)  # the metered record only
    assert beta.energy_j is None and beta.energy_metered_records == 0  # nothing metered: no figure, not 0
    assert (default.requests, default.prompt_tokens, default.output_tokens) == (2, 8, 4)
    assert result.total.requests == 5 and result.total.prompt_tokens == 98 and result.total.energy_j == 2.0
    assert acme.token_share == pytest.approx(60 / 122) and result.total.token_share == pytest.approx(1.0)


def test_mean_and_p99_match_the_exact_values(tmp_path: Path) -> None:
    rng = random.Random(7)
    latencies = {name: [rng.lognormvariate(0, 1) for _ in range(n)] for name, n in (("acme", 1500), ("beta", 37))}
    records = [rec(i, name, e2e=v) for name, values in latencies.items() for i, v in enumerate(values)]
    rng.shuffle(records)
    result = summarize_by_tenant([write(tmp_path / "t.jsonl", records)])
    for usage in result.tenants:
        values = latencies[usage.tenant]
        assert usage.e2e_mean_s == pytest.approx(sum(values) / len(values), rel=1e-9)
        exact = quantile(values, 0.99)
        assert exact is not None and usage.e2e_p99_s is not None
        assert abs(usage.e2e_p99_s - exact) <= ALPHA * exact
        if len(values) < 100:  # the p99 is the largest value: exact
            assert usage.e2e_p99_s == exact
        assert usage.e2e_max_s == max(values)
    every = [v for values in latencies.values() for v in values]
    exact_all = quantile(every, 0.99)
    assert exact_all is not None and result.total.e2e_p99_s is not None
    assert abs(result.total.e2e_p99_s - exact_all) <= ALPHA * exact_all


def test_bad_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    trace = write(tmp_path / "t.jsonl", [
        rec(0, "acme"), "not json", "[1, 2]", {**rec(1, "acme"), "e2e_latency_s": "slow"},
        {**rec(2, "acme"), "prompt_tokens": -3}, {**rec(3, "acme"), "energy_j": "lots"},
        {k: v for k, v in rec(4, "acme").items() if k != "output_tokens"},
        '{"e2e_latency_s": NaN, "prompt_tokens": 1, "output_tokens": 1}', "",
        {**rec(5), "tenant": 42},  # not a name: the default tenant
    ])
    result = summarize_by_tenant([trace])
    assert result.records == 2 and result.bad_lines == 7
    assert {u.tenant: u.requests for u in result.tenants} == {"acme": 1, "default": 1}
    reasons = [bad.reason for bad in result.bad_line_examples]
    assert "missing field 'output_tokens'" in reasons and any("energy_j" in r for r in reasons)


def test_the_command_prints_the_table_and_json(tmp_path: Path) -> None:
    records = [rec(i, "acme" if i % 2 else None, e2e=0.5 + i / 10, energy=1.5) for i in range(10)]
    trace = tmp_path / "t.jsonl.gz"
    trace.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    text = runner.invoke(cli.app, ["trace", "summarize", "--by", "tenant", str(trace)])
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    header = next(line for line in lines if line.startswith("tenant"))
    assert header.split() == ["tenant", "reqs", "error", "abort", "prompt", "tok", "cached", "tok", "output", "tok",
                              "tok", "share", "e2e", "mean", "e2e", "p99", "energy", "J"]
    acme = next(line for line in lines if line.startswith("acme")).split()
    # acme: i = 1, 3, 5, 7, 9 -> e2e 0.6 .. 1.4, mean 1.0, p99 the largest
    assert acme == ["acme", "5", "0", "0", "500", "200", "100", "50.0%", "1.000", "1.400", "7.5"]
    assert next(line for line in lines if line.startswith("total")).split()[1] == "10"
    as_json = runner.invoke(cli.app, ["trace", "summarize", "--by", "tenant", "--json", str(trace)])
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.stdout)
    assert data["by"] == "tenant" and data["records"] == 10
    assert [(t["tenant"], t["requests"], t["energy_j"]) for t in data["tenants"]] == [("acme", 5, 7.5),
                                                                                      ("default", 5, 7.5)]
    assert data["tenants"][0]["e2e_mean_s"] == pytest.approx(1.0)
    assert data["first_arrival_utc"] == "2026-12-05 07:30:00"


def test_unmetered_traces_say_so_and_an_unknown_grouping_is_refused(tmp_path: Path) -> None:
    trace = write(tmp_path / "t.jsonl", [rec(0, "acme"), rec(1, "beta")])
    text = render_text(summarize_by_tenant([trace]))
    assert "energy: not metered" in text
    refused = runner.invoke(cli.app, ["trace", "summarize", "--by", "model", str(trace)])
    assert refused.exit_code == 2 and "--by 'model' is not a grouping" in refused.output
    empty = runner.invoke(cli.app, ["trace", "summarize", "--by", "tenant", str(write(tmp_path / "e.jsonl", []))])
    assert empty.exit_code == 1 and "no trace records" in empty.output
