"""The replayer without an engine: reading traces, planning, refusing nonsense, and a real HTTP run
against a small stand-in OpenAI server (the real openai SDK on the client side)."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli.main import app
from carbonforge_runtime.offline.replay.aggregate import RequestOutcome, percentile, summarize
from carbonforge_runtime.offline.replay.plan import PlanOptions, build_plan
from carbonforge_runtime.offline.replay.runner import TRUE_OUTPUT_TOKENS_ARG, RunOptions, run_replay
from carbonforge_runtime.offline.replay.trace import ReplayError, load_recording
from carbonforge_runtime.offline.replay.workloads import prefill_heavy, templated, window
from carbonforge_runtime.offline.trace_reader import TraceInputError

AZURE = Path("/work/shared/data/azure-llm-2023/AzureLLMInferenceTrace_conv.csv")
AZURE_HEAD = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.6805900,374,44\n"
              "2023-11-16 18:15:50.9951690,396,109\n"
              "2023-11-16 18:15:51.2224670,879,55\n"
              "2023-11-16 18:15:51.3910170,91,16\n")


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_azure_csv_is_read_with_relative_arrivals(tmp_path: Path) -> None:
    rec = load_recording(write(tmp_path / "a.csv", AZURE_HEAD))
    assert rec.kind == "azure-csv"
    assert [r.prompt_tokens for r in rec.requests] == [374, 396, 879, 91]
    assert [r.output_tokens for r in rec.requests] == [44, 109, 55, 16]
    assert rec.requests[0].arrival_s == 0.0
    assert rec.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert rec.requests[3].arrival_s == pytest.approx(4.710427, abs=1e-6)


@pytest.mark.skipif(not AZURE.is_file(), reason="the shared Azure trace is not on this machine")
def test_the_shared_azure_conversation_trace_loads() -> None:
    rec = load_recording(AZURE)
    assert len(rec.requests) == 19366
    assert 3400 < rec.requests[-1].arrival_s < 3600


def test_jsonl_standard_and_full_levels(tmp_path: Path) -> None:
    rows = [{"request_id": "x", "t_arrival": 100.5, "prompt_tokens": 30, "output_tokens": 8, "e2e_latency_s": 1},
            {"request_id": "y", "t_arrival": 100.0, "prompt_tokens": 12, "output_tokens": 0}]
    rec = load_recording(write(tmp_path / "s.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n"))
    assert rec.kind == "jsonl-standard"
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in rec.requests] == [(0.0, 12, 1), (0.5, 30, 8)]
    for row in rows:
        row["prompt_text"] = "hello"
    full = load_recording(write(tmp_path / "f.jsonl", "\n".join(json.dumps(r) for r in rows)))
    assert full.kind == "jsonl-full" and full.requests[0].prompt_text == "hello"
    plan = build_plan(full, PlanOptions())
    assert [p.prompt for p in plan] == ["hello", "hello"]


@pytest.mark.parametrize(("name", "text", "message"), [
    ("empty.csv", "", "empty"),
    ("header-only.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
    ("extra.csv", "TIMESTAMP,ContextTokens,GeneratedTokens,Model\n1,2,3,x\n", "unknown column"),
    ("missing.csv", "TIMESTAMP,ContextTokens\n1,2\n", "missing column"),
    ("negative.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,-5,3\n", ":2: ContextTokens=-5"),
    ("words.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,3\n", "TIMESTAMP"),
    ("empty.jsonl", "\n\n", "empty"),
    ("fields.jsonl", '{"t_arrival": 1, "prompt_tokens": 3}\n', r"lacks the field\(s\) output_tokens"),
    ("bad.jsonl", '{"t_arrival": "soon", "prompt_tokens": 3, "output_tokens": 1}\n', "t_arrival"),
])
def test_nonsense_traces_are_refused_clearly(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(ReplayError, match=message) as exc:
        load_recording(write(tmp_path / name, text))
    assert exc.value.remedy


def test_a_missing_trace_is_told_what_replay_reads(tmp_path: Path) -> None:
    with pytest.raises(TraceInputError) as caught:
        load_recording(tmp_path / "azure.csv")
    assert caught.value.remedy == ("check the path (the trace is an Azure-format CSV or a trace written by serve's "
                                   "--trace-file)")


def test_unreadable_traces_are_refused_by_the_shared_reader(tmp_path: Path) -> None:
    with pytest.raises(TraceInputError, match="does not exist"):
        load_recording(tmp_path / "nope.jsonl")
    with pytest.raises(TraceInputError, match=":2: is not JSON") as exc:
        good = '{"t_arrival": 1, "prompt_tokens": 3, "output_tokens": 1}'
        load_recording(write(tmp_path / "notjson.jsonl", good + "\n{nope\n"))
    assert exc.value.remedy and exc.value.exit_code == 1


def test_plan_scales_time_and_tokens_and_generates_exact_prompts(tmp_path: Path) -> None:
    rec = load_recording(write(tmp_path / "a.csv", AZURE_HEAD))
    plan = build_plan(rec, PlanOptions(rate=2.0, token_scale=0.1, max_output_tokens=10, start=1, limit=2))
    assert [p.index for p in plan] == [1, 2]
    assert plan[0].send_at_s == 0.0
    assert plan[1].send_at_s == pytest.approx(0.227298 / 2, abs=1e-6)
    assert [p.prompt_tokens for p in plan] == [40, 88]
    assert [len(p.prompt) for p in plan] == [40, 88]
    assert [p.output_tokens for p in plan] == [10, 6]
    assert all(isinstance(t, int) and 100 <= t < 4000 for p in plan for t in p.prompt)  # type: ignore[union-attr]
    # Deterministic, and different requests start differently (no accidental shared prefix).
    again = build_plan(rec, PlanOptions(rate=2.0, token_scale=0.1, max_output_tokens=10, start=1, limit=2))
    assert again == plan
    assert plan[0].prompt[:4] != plan[1].prompt[:4]
    words = build_plan(rec, PlanOptions(prompt_format="text", limit=1))
    assert isinstance(words[0].prompt, str) and len(words[0].prompt.split()) == 374


@pytest.mark.parametrize(("options", "message"), [
    (PlanOptions(rate=-1), "rate"),
    (PlanOptions(rate=0), "rate"),
    (PlanOptions(token_scale=0), "token scale"),
    (PlanOptions(limit=0), "limit"),
    (PlanOptions(start=99), "no request left"),
    (PlanOptions(prompt_format="pictures"), "prompt format"),
    (PlanOptions(token_id_low=10, token_id_high=10), "token id range"),
])
def test_nonsense_options_are_refused(tmp_path: Path, options: PlanOptions, message: str) -> None:
    rec = load_recording(write(tmp_path / "a.csv", AZURE_HEAD))
    with pytest.raises(ReplayError, match=message):
        build_plan(rec, options)


def test_summary_percentiles_and_failures() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0  # nearest rank: the 2nd of 4
    assert percentile([1.0, 2.0, 3.0, 4.0], 51) == 3.0
    assert percentile([5.0], 99) == 5.0
    outcomes = [RequestOutcome(i, 0.0, sent_s=float(i), done_s=float(i) + 1 + i, output_tokens=10) for i in range(4)]
    outcomes.append(RequestOutcome(9, 1.0, sent_s=1.2, error="http 500: boom"))
    outcomes.append(RequestOutcome(10, 1.0, error="deadline: not sent"))
    s = summarize(outcomes, duration_s=10.0)
    assert (s["requests"], s["ok"], s["failed"]) == (6, 4, 2)
    assert s["errors"] == {"http 500": 1, "deadline": 1}
    assert s["e2e_latency_s"]["mean"] == 2.5
    assert s["e2e_latency_s"]["max"] == 4.0
    assert s["latency_per_output_token_s"] == pytest.approx(0.25)
    assert s["send_lag_s"]["max"] == pytest.approx(3.0)


def test_workload_generators_are_deterministic_and_shaped() -> None:
    a = templated(300, seed=3, rate=5.0)
    assert a == templated(300, seed=3, rate=5.0)
    assert a != templated(300, seed=4, rate=5.0)
    templates = {r["template"] for r in a}
    assert len(templates) == 6
    # Each template shares its system prompt: requests of one template share a long prefix.
    same = [r["prompt_text"] for r in a if r["template"] == "classify"][:2]
    assert same[0][:300] == same[1][:300]
    span = a[-1]["t_arrival"] - a[0]["t_arrival"]
    assert 40 < span < 80  # about 300 / 5 req/s
    rec = load_recording(write_tmp_jsonl(a))
    assert rec.kind == "jsonl-full"
    heavy = prefill_heavy(rec, prompt_factor=2.0, output_divisor=4.0)
    assert [h["prompt_tokens"] for h in heavy] == [2 * r.prompt_tokens for r in rec.requests]
    cut = window(rec, 10, 5)
    assert len(cut) == 5 and cut[0]["t_arrival"] == 1_700_000_000.0


def write_tmp_jsonl(records: list[dict[str, Any]]) -> Path:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as handle:
        for r in records:
            handle.write(json.dumps(r) + "\n")
    return Path(handle.name)


# -- a real HTTP run against a stand-in server ---------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    bodies: list[dict[str, Any]]
    times: list[float]
    frozen: list[int]

    def handle_error(self, request: Any, client_address: Any) -> None:
        return  # a client that gave up (the deadline test) is expected


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:
        return

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.endswith("/models"):
            self._json(200, {"object": "list", "data": [{"id": "stand-in", "object": "model", "created": 0,
                                                          "owned_by": "test"}]})
        else:
            self._json(404, {"error": "no"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.times.append(time.monotonic())
        self.server.frozen.append(gc.get_freeze_count())
        self.server.bodies.append(body)
        if body["max_tokens"] == 13:
            self._json(500, {"error": {"message": "boom", "type": "server_error"}})
            return
        if body["max_tokens"] == 17:
            time.sleep(3.0)
        prompt = body["prompt"]
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        self._json(200, {
            "id": f"cmpl-{len(self.server.bodies)}", "object": "text_completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": body["max_tokens"],
                      "total_tokens": n_prompt + body["max_tokens"]},
        })


@pytest.fixture()
def stand_in() -> Iterator[_Server]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.bodies, server.times, server.frozen = [], [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_replay_against_an_http_server_keeps_pace_sizes_and_records_failures(stand_in: _Server,
                                                                           tmp_path: Path) -> None:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i, out in enumerate([5, 6, 13, 7, 8, 9]):
        lines.append(f"{i * 0.4:.3f},{10 + i},{out}")
    rec = load_recording(write(tmp_path / "t.csv", "\n".join(lines) + "\n"))
    plan = build_plan(rec, PlanOptions(rate=2.0))
    base = f"http://127.0.0.1:{stand_in.server_address[1]}/v1"
    result = asyncio.run(run_replay(plan, RunOptions(base_url=base, send_true_length=True, progress_every_s=0.1)))
    assert result.model == "stand-in"
    assert len(stand_in.bodies) == 6
    for body, item in zip(sorted(stand_in.bodies, key=lambda b: len(b["prompt"])), plan, strict=True):
        assert body["max_tokens"] == item.output_tokens
        assert body["ignore_eos"] is True
        assert body["vllm_xargs"] == {TRUE_OUTPUT_TOKENS_ARG: item.output_tokens}
        assert len(body["prompt"]) == item.prompt_tokens
    # 0.4 s recorded gaps at rate 2: sent every 0.2 s (a busy machine adds some jitter).
    assert [o.scheduled_s for o in result.outcomes] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0], abs=1e-3)
    lags = [o.sent_s - o.scheduled_s for o in result.outcomes if o.sent_s is not None]
    assert len(lags) == 6 and max(lags) < 0.3, lags
    span = stand_in.times[-1] - stand_in.times[0]
    assert 0.7 < span < 1.4, span
    summary = result.summary()
    assert summary["ok"] == 5 and summary["errors"] == {"http 500": 1}
    assert summary["output_tokens"] == 5 + 6 + 7 + 8 + 9


def test_what_exists_before_the_clock_is_out_of_the_collectors_sweeps_until_the_run_ends(
        stand_in: _Server, tmp_path: Path) -> None:
    """A full sweep of a large heap would hold the event loop and send a burst late; the replay
    freezes what exists when its clock starts and lets it go at the end."""
    rec = load_recording(write(tmp_path / "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n0,3,4\n0.1,3,5\n"))
    base = f"http://127.0.0.1:{stand_in.server_address[1]}/v1"
    assert gc.get_freeze_count() == 0
    held = [[i] for i in range(10_000)]  # the caller's own data, alive across the run
    result = asyncio.run(run_replay(build_plan(rec, PlanOptions()), RunOptions(base_url=base)))
    assert result.summary()["ok"] == 2
    assert len(stand_in.frozen) == 2 and min(stand_in.frozen) >= len(held)
    assert gc.get_freeze_count() == 0


def test_the_overall_deadline_cancels_what_is_left(stand_in: _Server, tmp_path: Path) -> None:
    rec = load_recording(write(tmp_path / "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n0,3,17\n5,3,4\n"))
    base = f"http://127.0.0.1:{stand_in.server_address[1]}/v1"
    started = time.monotonic()
    result = asyncio.run(run_replay(build_plan(rec, PlanOptions()), RunOptions(base_url=base, deadline_s=1.0)))
    assert time.monotonic() - started < 2.5
    errors = sorted(o.error or "" for o in result.outcomes)
    assert errors[0].startswith("deadline: cancelled in flight")
    assert errors[1].startswith("deadline: not sent")


def test_cli_writes_the_json_result_and_refuses_nonsense(stand_in: _Server, tmp_path: Path) -> None:
    trace = write(tmp_path / "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n0,3,4\n0.1,5,6\n")
    base = f"http://127.0.0.1:{stand_in.server_address[1]}/v1"
    out = tmp_path / "res" / "r.json"
    runner = CliRunner()
    result = runner.invoke(app, ["replay", str(trace), "--base-url", base, "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "e2e latency" in result.output
    assert f"figures: measured by this client against {base} (the serving host is not recorded" in result.output
    doc = json.loads(out.read_text())
    assert doc["summary"]["ok"] == 2 and len(doc["requests"]) == 2
    assert doc["label"]["kind"] == "measured or emulated"
    assert all(r["latency_s"] > 0 for r in doc["requests"])
    bad = runner.invoke(app, ["replay", str(trace), "--base-url", base, "--rate", "-2"])
    assert bad.exit_code == 2 and "rate -2.0 must be a positive number" in bad.output
    assert "Traceback" not in bad.output
    down = runner.invoke(app, ["replay", str(trace), "--base-url", "http://127.0.0.1:9/v1", "-o", str(out)])
    assert down.exit_code == 2 and "cannot reach" in down.output
