"""Trace tools on traces the runtime wrote while serving the real vLLM CPU engine.

One engine session (full-level trace, max_num_seqs 2) serves three phases: light sequential
load, scripted multi-turn conversations run concurrently, and a burst far above two sequences.
``summarize`` must call the light phase healthy and the burst queue-dominated, with percentiles
matching the records; ``sessions`` must recover exactly the conversations that were sent.

The engine serves its recipe as ``calibrate`` writes a local recipe after a run (the same functions:
the recipe unchanged but for a benchmark block measured on this host, placed in a directory for
``CF_RECIPES_DIR``), so that a recipe of that form is shown to load and serve; the calibration
itself is tests/e2e/test_calibrate.py's.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import yaml
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.offline.trace_tools.sketch import ALPHA, MIN_VALUE
from tests.support import TEST_RECIPES, TINY_SERVED_NAME, RuntimeProcess, wait_until
from tests.support.burst import send_burst

#: Holds with a second engine beside it (scripts/test.sh runs these modules two at a time).
pytestmark = pytest.mark.parallel_safe

KEY = "cf-tiny-q2:bf16:chat:cpu"
LIGHT_REQUESTS = 6
BURST_REQUESTS = 32  # 16 waves of two sequences: the queue dominates even if the burst arrives spread out
BILLING = "You are the billing assistant. Be brief."
SUPPORT = "You are the support assistant for Northwind Analytics. Answer from the provided context only."
CONVERSATIONS: dict[str, tuple[str, list[str]]] = {
    # Three billing conversations share the system prompt; two of them also share the first question.
    "billing-a": (BILLING, ["Where do I find my invoice history?", "And past payment receipts?",
                            "Can I export them?"]),
    "billing-b": (BILLING, ["How do I change my card?", "Does it apply to the open invoice?", "Thanks."]),
    "billing-c": (BILLING, ["Where do I find my invoice history?", "Only for 2025 please."]),
    "support": (SUPPORT, ["My dashboard shows an overdue invoice.", "It was paid on the 19th.",
                          "Please check again.", "Thank you."]),
}

#: A tagged conversation with a tool call, for the capture-to-dataset loop (list, show, export).
TASK = "glossary-e2e"
LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up in the glossary.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}
TAGGED_SYSTEM = "You explain words from the glossary."
TAGGED_QUESTIONS = ["What does idempotent mean?", "And what is a tombstone record?"]

runner = CliRunner()


def calibrated_recipes(directory: Path) -> Path:
    """The test recipe as calibrate writes it (design.recipe_text, placed by place_recipe) after a
    check on this CPU host whose figures are these: a directory for ``CF_RECIPES_DIR``."""
    from carbonforge_runtime.offline.calibrate import design
    from carbonforge_runtime.offline.sim.recipe_out import place_recipe

    source = yaml.safe_load((TEST_RECIPES / "cf-tiny-q2--bf16--chat--cpu.yaml").read_text(encoding="utf-8"))
    rows = design.compare({"mean_e2e": 0.58, "p99_e2e": 1.76, "mean_ttft": 0.082, "throughput": 8.18},
                          {"mean_e2e": 0.646, "p99_e2e": 1.869, "mean_ttft": 0.112, "throughput": 7.97})
    benchmark = design.benchmark_block(design.host_block([], None, "0.32.0", on_cpu=True), "2026-12-06", rows,
                                       str(directory / "step-model.yaml"), {"r2": 0.984, "steps": 1645},
                                       {"requests": 250, "load": 0.7})
    directory.mkdir(parents=True)
    place_recipe(directory, KEY, design.recipe_text(source, benchmark), force=True)
    return directory


def lower_quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile: the value of 1-based rank ceil(q * n) of the sorted values."""
    ordered = sorted(values)
    return ordered[max(math.ceil(round(q * len(ordered), 9)), 1) - 1]


def within_bound(estimate: float, exact: float) -> bool:
    if exact <= MIN_VALUE:
        return abs(estimate - exact) <= MIN_VALUE
    return abs(estimate - exact) <= ALPHA * exact * (1 + 1e-9)


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("trace-tools-engine")
    trace = base / "trace.jsonl"
    recipes = calibrated_recipes(base / "recipes")
    runtime = RuntimeProcess(
        ["--context-key", KEY, "--request-trace", "full", "--trace-file", str(trace)],
        base / "logs", env={"CF_RECIPES_DIR": str(recipes)},
    )
    try:
        runtime.start().wait_ready()
        client = openai.OpenAI(base_url=runtime.base_url, api_key="unused", timeout=180, max_retries=0)

        def ask(messages: list[Any], max_tokens: int, ignore_eos: bool) -> tuple[str, str]:
            response = client.chat.completions.create(
                model=TINY_SERVED_NAME, messages=messages, max_tokens=max_tokens, temperature=1.0,
                extra_body={"ignore_eos": ignore_eos},
            )
            return response.id, response.choices[0].message.content or ""

        light = [ask([{"role": "user", "content": "Count slowly to ten."}], 96, True)[0]
                 for _ in range(LIGHT_REQUESTS)]

        def converse(name: str) -> list[str]:
            system, questions = CONVERSATIONS[name]
            messages: list[Any] = [{"role": "system", "content": system}]
            ids = []
            for question in questions:
                messages.append({"role": "user", "content": question})
                request_id, answer = ask(messages, 16, False)
                messages.append({"role": "assistant", "content": answer})
                ids.append(request_id)
            return ids

        with ThreadPoolExecutor(len(CONVERSATIONS)) as pool:
            sent = dict(zip(CONVERSATIONS, pool.map(converse, CONVERSATIONS), strict=True))

        # Tagged by task (the X-CF-Task header) and metadata, with a tool call and its result in the
        # history: what the client sent and what it received, turn by turn.
        tagged: list[dict[str, Any]] = []
        history: list[Any] = [{"role": "system", "content": TAGGED_SYSTEM}]
        for turn, question in enumerate(TAGGED_QUESTIONS):
            history.append({"role": "user", "content": question})
            if turn == 1:
                history.append({"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "lookup", "arguments": json.dumps({"word": "tombstone"})}}]})
                history.append({"role": "tool", "tool_call_id": "call_1",
                                "content": "tombstone: a marker that a record was deleted"})
            response = client.chat.completions.create(
                model=TINY_SERVED_NAME, messages=history, max_tokens=16, temperature=1.0,
                tools=[LOOKUP_TOOL], metadata={"team": "docs"},
                extra_headers={"X-CF-Task": TASK},
            )
            message = response.choices[0].message
            tagged.append({"id": response.id, "sent": json.loads(json.dumps(history)),
                           "content": message.content, "tool_calls": message.tool_calls,
                           "finish_reason": response.choices[0].finish_reason,
                           "output_tokens": response.usage.completion_tokens if response.usage else None})
            history.append({"role": "assistant", "content": message.content or ""})

        # From a child process, so the whole burst reaches the engine at once and queues there.
        burst = send_burst(runtime.base_url, TINY_SERVED_NAME,
                           [f"Burst request number {i}: write a long story." for i in range(BURST_REQUESTS)], 96)
        total = LIGHT_REQUESTS + BURST_REQUESTS + sum(len(ids) for ids in sent.values()) + len(tagged)
        wait_until(lambda: len(read_records(trace)) >= total, 60, every_s=0.5)
        records = read_records(trace)
        assert len(records) >= total, f"the trace holds {len(records)} records, expected {total}"
        yield {"base": base, "trace": trace, "records": records, "light": light, "burst": burst,
               "conversations": sent, "tagged": tagged, "recipes": recipes}
    finally:
        try:
            if runtime.proc is not None and runtime.proc.poll() is None:
                runtime.stop(timeout_s=60)
        finally:
            runtime.kill()


def trace_id(record: dict[str, Any], client_ids: set[str]) -> str:
    """The client's id for a record (the trace should carry it as is; tolerate an engine suffix)."""
    rid = record["request_id"]
    if rid in client_ids:
        return rid
    matches = [cid for cid in client_ids if rid.startswith(cid + "-")]
    assert len(matches) == 1, f"trace request_id {rid} matches no client id"
    return matches[0]


def client_ids(traced: dict[str, Any]) -> set[str]:
    return (set(traced["light"]) | set(traced["burst"]) | {t["id"] for t in traced["tagged"]}
            | {i for v in traced["conversations"].values() for i in v})


def subset(traced: dict[str, Any], ids: list[str], name: str) -> tuple[Path, list[dict[str, Any]]]:
    wanted = set(ids)
    all_ids = client_ids(traced)
    chosen = [r for r in traced["records"] if trace_id(r, all_ids) in wanted]
    assert len(chosen) == len(ids)
    path = traced["base"] / name
    path.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    return path, chosen


def summarize_json(*args: str) -> dict[str, Any]:
    result = runner.invoke(cli.app, ["trace", "summarize", *args, "--json"])
    assert result.exit_code == 0, result.output
    assert "warning" not in result.stderr, result.stderr
    return json.loads(result.stdout)


def test_the_served_recipe_is_the_one_calibrate_wrote_labelled_measured(traced: dict[str, Any]) -> None:
    written = traced["recipes"] / "cf-tiny-q2--bf16--chat--cpu.yaml"
    assert written.read_text(encoding="utf-8").startswith("# Calibrated by carbonforge-runtime calibrate")
    # KEY is no shipped recipe and CF_RECIPES_DIR held only this file: every request above was served
    # by the recipe calibrate's functions wrote.
    assert list(traced["recipes"].iterdir()) == [written]
    shown = runner.invoke(cli.app, ["recipes", "show", KEY], env={"CF_RECIPES_DIR": str(traced["recipes"])})
    assert shown.exit_code == 0, shown.output
    assert f"# {written}" in shown.stdout and "benchmark.figures: measured on cpu" in shown.stdout
    assert traced["light"] and traced["records"]  # and it served: every phase above ran on it


def test_summarize_light_load_is_healthy_and_the_burst_is_queue_dominated(traced: dict[str, Any]) -> None:
    light_path, light = subset(traced, traced["light"], "light.jsonl")
    burst_path, burst = subset(traced, traced["burst"], "burst.jsonl")

    light_summary = summarize_json(str(light_path))
    assert light_summary["records"] == LIGHT_REQUESTS
    assert {w["stats"]["verdict"]["code"] for w in light_summary["windows"]} == {"healthy"}, light_summary

    burst_summary = summarize_json(str(burst_path), "--window", "1h")
    assert burst_summary["records"] == BURST_REQUESTS
    verdicts = [w["stats"]["verdict"]["code"] for w in burst_summary["windows"]]
    assert "queue-dominated" in verdicts, burst_summary["windows"]
    text = runner.invoke(cli.app, ["trace", "summarize", str(burst_path), "--window", "1h"]).stdout
    assert "add capacity or reduce client concurrency" in text

    # The figures agree with the records, computed here independently.
    for summary, records in ((light_summary, light), (burst_summary, burst)):
        overall = summary["overall"]
        columns = {
            "e2e_s": [r["e2e_latency_s"] for r in records],
            "queue_wait_s": [r["queue_wait_s"] for r in records],
            "engine_s": [r["e2e_latency_s"] - r["queue_wait_s"] for r in records],
        }
        ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
        if ttft:
            columns["ttft_s"] = ttft
        for name, values in columns.items():
            for q, key in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
                assert within_bound(overall[name][key], lower_quantile(values, q)), (name, key)
            assert overall[name]["max"] == pytest.approx(max(values))
        assert overall["output_tokens"] == sum(r["output_tokens"] for r in records)
        assert overall["queue_share"] == pytest.approx(sum(columns["queue_wait_s"]) / sum(columns["e2e_s"]))

    # The whole trace, as written, reads without a bad line.
    whole = summarize_json(str(traced["trace"]))
    assert whole["records"] == len(traced["records"]) and whole["bad_lines"] == 0


def test_sessions_recover_exactly_the_conversations_sent(traced: dict[str, Any]) -> None:
    out = traced["base"] / "sessions.jsonl"
    result = runner.invoke(cli.app, ["trace", "sessions", str(traced["trace"]), "-o", str(out)])
    assert result.exit_code == 0, result.output
    sent = traced["conversations"]
    all_ids = client_ids(traced)
    groups: dict[str, list[tuple[int, str]]] = {}
    for line in out.read_text().splitlines():
        item = json.loads(line)
        groups.setdefault(item["session_id"], []).append((item["turn"], trace_id(item, all_ids)))
    found = sorted([rid for _, rid in sorted(members)] for members in groups.values())
    tagged = [turn["id"] for turn in traced["tagged"]]
    expected = sorted([*sent.values(), tagged, *([rid] for rid in traced["light"]),
                       *([rid] for rid in traced["burst"])])
    assert found == expected
    multi = len(CONVERSATIONS) + 1
    assert f"({multi} multi-turn, {LIGHT_REQUESTS + BURST_REQUESTS} single-turn); most turns: 4" in result.stdout


def test_plot_of_the_served_trace_is_a_png(traced: dict[str, Any]) -> None:
    pytest.importorskip("matplotlib")
    out = traced["base"] / "trace.png"
    result = runner.invoke(cli.app, ["trace", "plot", str(traced["trace"]), "-o", str(out), "--window", "1s"])
    assert result.exit_code == 0, result.output
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (1200, 900)


def cli_json(*args: str) -> Any:
    result = runner.invoke(cli.app, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_tagged_traffic_is_listed_shown_and_exported_as_the_client_sent_it(traced: dict[str, Any]) -> None:
    """Capture to dataset: the tagged conversation is found by task, shown whole, and exported as the
    messages the client sent plus the answers it received, in OpenAI's chat fine-tuning format."""
    tagged = traced["tagged"]
    trace = str(traced["trace"])
    listed = cli_json("trace", "list", trace, "--filter", "output_tokens>5", "--task", TASK, "--limit", "0", "--json")
    rows = listed["rows"]
    assert sorted(row["request_id"] for row in rows) == sorted(turn["id"] for turn in tagged
                                                               if turn["output_tokens"] > 5)
    assert rows and all(row["task"] == TASK for row in rows)
    # Nothing else carries the task.
    everything = cli_json("trace", "list", trace, "--limit", "0", "--json")["rows"]
    assert len(everything) == len(traced["records"])
    assert sum(1 for row in everything if row.get("task") == TASK) == len(tagged)

    last = tagged[-1]
    shown = cli_json("trace", "show", last["id"], trace, "--json")
    assert shown["id"] == last["id"] and len(shown["records"]) == 1
    entry = shown["records"][0]
    assert entry["record"]["tags"] == {"task": TASK, "team": "docs"}
    assert entry["record"]["model"] == TINY_SERVED_NAME
    assert entry["messages"] == last["sent"] and entry["tools"] == [LOOKUP_TOOL]
    assert entry["content"] == last["content"]
    text = runner.invoke(cli.app, ["trace", "show", last["id"], trace])
    assert text.exit_code == 0, text.output
    assert "lookup" in text.stdout and "tombstone" in text.stdout and TASK in text.stdout

    out = traced["base"] / "dataset.jsonl"
    # The tiny model's random weights rarely stop on their own: take what it wrote up to max_tokens.
    finish = {turn["finish_reason"] for turn in tagged}
    assert len(finish) == 1, finish
    exported = runner.invoke(cli.app, ["trace", "export", trace, "-o", str(out), "--task", TASK,
                                       "--finish-reason", finish.pop(), "--json"])
    assert exported.exit_code == 0, exported.output
    dataset = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(dataset) == len(tagged)
    from tests.unit.offline.trace_tools.test_export import FINE_TUNING_ROW

    by_first_user = {}
    for row in dataset:
        jsonschema.validate(row, FINE_TUNING_ROW)
        by_first_user[len(row["messages"])] = row
    for turn in tagged:
        answer: dict[str, Any] = {"role": "assistant", "content": turn["content"]}
        expected = [*turn["sent"], answer]
        row = by_first_user[len(expected)]
        assert row["messages"] == expected
        assert row["tools"] == [LOOKUP_TOOL]
