"""trace summarize / sessions / plot on synthetic trace files (no engine)."""

from __future__ import annotations

import gzip
import json
import math
import random
import struct
import sys
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.offline.trace_tools.sessions import output_variants, reconstruct
from carbonforge_runtime.offline.trace_tools.sketch import ALPHA, MIN_VALUE, QuantileSketch
from carbonforge_runtime.offline.trace_tools.summarize import Summarizer, parse_window

runner = CliRunner()
T0 = 1_789_038_000.0  # a whole hour, so windows start at phase boundaries
QS = (0.5, 0.9, 0.99)


def invoke(*args: str) -> Any:
    return runner.invoke(cli.app, list(args))


def lower_quantile(values: Sequence[float], q: float) -> float:
    """Reference, written out independently: the nearest-rank quantile, the value of 1-based rank
    ceil(q * n) of the sorted values."""
    ordered = sorted(values)
    return ordered[max(math.ceil(round(q * len(ordered), 9)), 1) - 1]


def within_bound(estimate: float | None, exact: float) -> bool:
    assert estimate is not None
    if exact <= MIN_VALUE:
        return abs(estimate - exact) <= MIN_VALUE
    return abs(estimate - exact) <= ALPHA * exact * (1 + 1e-9)


def record(i: int, t_arrival: float, e2e: float, queue: float, *, prompt: int = 100, output: int = 50,
           family: str = "fcfs", ttft: float | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "request_id": f"chatcmpl-{i:016x}", "t_arrival": t_arrival, "t_completion": t_arrival + e2e,
        "prompt_tokens": prompt, "output_tokens": output, "e2e_latency_s": e2e, "ttft_s": ttft,
        "queue_wait_s": queue, "scheduler_family": family, "priority_score": None, **extra,
    }


def write_jsonl(path: Path, records: Iterable[dict[str, Any]], *, compress: bool = False) -> Path:
    text = "".join(json.dumps(item) + "\n" for item in records)
    if compress:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------
# The sketch


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.just(0.0), st.floats(min_value=1e-7, max_value=1e5)), min_size=1, max_size=400),
       st.integers(min_value=1, max_value=5))
def test_sketch_quantiles_within_relative_bound_and_merge_like_one_stream(values: list[float], parts: int) -> None:
    whole = QuantileSketch()
    whole.add_many(values)
    pieces = []
    for k in range(parts):
        piece = QuantileSketch()
        piece.add_many(values[k::parts])
        pieces.append(piece)
    merged = QuantileSketch.merged(pieces)
    for q in (0.0, 0.25, 0.5, 0.9, 0.99, 1.0):
        exact = lower_quantile(values, q)
        assert within_bound(whole.quantile(q), exact), (q, whole.quantile(q), exact)
        assert merged.quantile(q) == whole.quantile(q)
    assert whole.quantile(1.0) == max(values)
    assert whole.count == len(values)


def test_sketch_of_values_near_the_largest_float_answers_without_overflow() -> None:
    sketch = QuantileSketch()
    sketch.add_many([1.0, 1.7e308, 1.79e308])
    assert sketch.quantiles([0.5, 0.9, 0.99]) == pytest.approx([1.7e308, 1.79e308, 1.79e308], rel=0.01)


def test_sketch_memory_is_bounded_by_the_value_range_not_the_count() -> None:
    sketch = QuantileSketch()
    rng = random.Random(3)
    for _ in range(20):
        sketch.add_many([rng.lognormvariate(0, 2) for _ in range(10_000)])
    # 200,000 values spread over many decades still fit in a few hundred buckets.
    assert sketch.count == 200_000
    assert len(sketch.buckets) < 1500


# ---------------------------------------------------------------------------------------------
# summarize


def synthetic_trace(n: int, seed: int = 7) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    t = T0
    out = []
    for i in range(n):
        t += rng.expovariate(20.0)
        queue = 0.0 if rng.random() < 0.3 else rng.expovariate(10.0)
        e2e = queue + rng.lognormvariate(-1.0, 0.6)
        ttft = queue + 0.01 + rng.random() * 0.05 if i % 3 else None
        out.append(record(i, round(t, 6), round(e2e, 6), round(queue, 6), prompt=rng.randint(5, 900),
                          output=rng.randint(1, 300), ttft=None if ttft is None else round(ttft, 6)))
    return out


def test_summarize_percentiles_totals_and_windows_match_independent_computation(tmp_path: Path) -> None:
    records = synthetic_trace(5000)
    path = write_jsonl(tmp_path / "trace.jsonl", records)
    result = invoke("trace", "summarize", str(path), "--window", "30s", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    overall = data["overall"]
    assert data["records"] == overall["requests"] == 5000
    assert overall["prompt_tokens"] == sum(r["prompt_tokens"] for r in records)
    assert overall["output_tokens"] == sum(r["output_tokens"] for r in records)
    span = max(r["t_completion"] for r in records) - min(r["t_arrival"] for r in records)
    assert data["span_s"] == pytest.approx(span)
    assert data["requests_per_s"] == pytest.approx(5000 / span)
    columns = {
        "e2e_s": [r["e2e_latency_s"] for r in records],
        "queue_wait_s": [r["queue_wait_s"] for r in records],
        "engine_s": [r["e2e_latency_s"] - r["queue_wait_s"] for r in records],
        "ttft_s": [r["ttft_s"] for r in records if r["ttft_s"] is not None],
    }
    for name, values in columns.items():
        for q, key in zip(QS, ("p50", "p90", "p99"), strict=True):
            assert within_bound(overall[name][key], lower_quantile(values, q)), (name, key)
        assert overall[name]["max"] == pytest.approx(max(values))
    assert overall["ttft_records"] == len(columns["ttft_s"])
    share = sum(columns["queue_wait_s"]) / sum(columns["e2e_s"])
    assert overall["queue_share"] == pytest.approx(share)

    # Per window (by arrival), against the same records grouped independently.
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(int(r["t_arrival"] // 30), []).append(r)
    assert [w["start"] for w in data["windows"]] == [k * 30.0 for k in sorted(groups)]
    for window in data["windows"]:
        members = groups[int(window["start"] // 30)]
        stats = window["stats"]
        assert stats["requests"] == len(members)
        for q, key in zip(QS, ("p50", "p90", "p99"), strict=True):
            assert within_bound(stats["e2e_s"][key], lower_quantile([r["e2e_latency_s"] for r in members], q))
            assert within_bound(stats["queue_wait_s"][key], lower_quantile([r["queue_wait_s"] for r in members], q))


def test_summarize_gzip_and_plain_give_the_same_figures(tmp_path: Path) -> None:
    records = synthetic_trace(800)
    plain = write_jsonl(tmp_path / "a.jsonl", records)
    packed = write_jsonl(tmp_path / "a.jsonl.gz", records, compress=True)
    results = []
    for path in (plain, packed):
        summarizer = Summarizer(60.0)
        summarizer.feed_file(path)
        results.append(summarizer.result().to_json())
    for item in results:
        item.pop("files")
    assert results[0] == results[1]


def test_standard_library_parser_gives_the_same_summary_and_bad_lines(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from carbonforge_runtime.offline.trace_tools import summarize as summary_mod

    lines = [json.dumps(r) for r in synthetic_trace(500)]
    lines[10] = "{broken"
    lines[20] = lines[20] + " extra"
    lines[30] = lines[30].replace('"queue_wait_s": ', '"queue_wait_s": NaN, "x": ')
    lines[40] = "  " + lines[40] + "\r"
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"t_arrival": "\xff"}\n')
    results = []
    for parser in (summary_mod.orjson, None):
        monkeypatch.setattr(summary_mod, "orjson", parser)
        summarizer = Summarizer(60.0)
        summarizer.feed_file(path)
        result = summarizer.result().to_json()
        results.append((result, [(b["line"], b["reason"]) for b in result["bad_line_examples"]]))
    assert results[0] == results[1]
    assert results[0][0]["records"] == 497
    assert [line for line, _ in results[0][1]] == [11, 21, 31, 501]


def test_summarize_reads_several_files_and_concatenated_gzip_members(tmp_path: Path) -> None:
    records = synthetic_trace(300)
    path = tmp_path / "rotated.jsonl.gz"
    first = "".join(json.dumps(r) + "\n" for r in records[:100]).encode()
    second = "".join(json.dumps(r) + "\n" for r in records[100:200]).encode()
    path.write_bytes(gzip.compress(first) + gzip.compress(second))
    other = write_jsonl(tmp_path / "rest.jsonl", records[200:])
    result = invoke("trace", "summarize", str(path), str(other), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["records"] == 300


def test_summarize_reads_a_directory_of_rank_files_as_one_trace(tmp_path: Path) -> None:
    records = synthetic_trace(300)
    traces = tmp_path / "traces"
    traces.mkdir()
    # two data-parallel ranks, interleaved in time; one has rotated a compressed part away
    write_jsonl(traces / "requests.dp0.jsonl", records[0:200:2])
    (traces / "requests.dp0.1.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(r) + "\n" for r in records[200::2]).encode()))
    write_jsonl(traces / "requests.dp1.jsonl", records[1::2])
    (traces / "notes.txt").write_text("not a trace")
    (traces / "old.jsonl").mkdir()  # a directory with a trace-like name is not a file
    result = invoke("trace", "summarize", str(traces), str(traces / "requests.dp1.jsonl"), "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["records"] == 300  # each request once, the file named twice read once
    assert sorted(Path(f["path"]).name for f in summary["files"]) == [
        "requests.dp0.1.jsonl.gz", "requests.dp0.jsonl", "requests.dp1.jsonl"]
    whole = invoke("trace", "summarize", str(write_jsonl(tmp_path / "all.jsonl", records)), "--json")
    alone = json.loads(whole.stdout)["overall"]
    for figure in ("e2e_s", "queue_wait_s"):  # the same figures as the one file (sums up to rounding)
        for key, value in alone[figure].items():
            assert summary["overall"][figure][key] == pytest.approx(value, rel=1e-9), (figure, key)


def test_an_empty_directory_is_refused_with_the_fix(tmp_path: Path) -> None:
    result = invoke("trace", "summarize", str(tmp_path))
    assert result.exit_code != 0
    assert f"{tmp_path} holds no trace files" in result.output and "Traceback" not in result.output


def phase(start_index: int, t_start: float, count: int, gap_s: float, e2e: float, queue: float,
          output: int) -> list[dict[str, Any]]:
    return [record(start_index + k, t_start + k * gap_s, e2e, queue, output=output) for k in range(count)]


def test_verdicts_healthy_queue_dominated_and_engine_bound_windows(tmp_path: Path) -> None:
    records = (
        phase(0, T0 + 1, 50, 1.0, e2e=1.0, queue=0.01, output=100)  # light: 1 s per request, no queue
        + phase(100, T0 + 121, 50, 1.0, e2e=6.0, queue=5.0, output=100)  # requests wait 5 s of 6
        + phase(200, T0 + 241, 50, 1.0, e2e=4.0, queue=0.05, output=100)  # no queue, 4x slower engine
        + phase(300, T0 + 361, 50, 1.0, e2e=1.3, queue=0.3, output=100)  # 23 % queueing
    )
    path = write_jsonl(tmp_path / "phases.jsonl", records)
    result = invoke("trace", "summarize", str(path), "--window", "2m", "--json")
    assert result.exit_code == 0, result.output
    verdicts = [w["stats"]["verdict"]["code"] for w in json.loads(result.stdout)["windows"]]
    assert verdicts == ["healthy", "queue-dominated", "engine-bound", "queue-building"]
    text = invoke("trace", "summarize", str(path), "--window", "2m")
    assert "queue-dominated (83% of latency is queueing): add capacity or reduce client concurrency" in text.stdout
    assert "engine-bound: engine time per generated token is 4.0x" in text.stdout


def test_mixed_scheduler_families_are_reported_separately(tmp_path: Path) -> None:
    records = [record(i, T0 + i, 1.0 if i % 2 else 3.0, 0.0 if i % 2 else 2.0,
                      family="fcfs" if i % 2 else "ltr-promptlen") for i in range(40)]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    data = json.loads(invoke("trace", "summarize", str(path), "--json").stdout)
    families = data["families"]
    assert set(families) == {"fcfs", "ltr-promptlen"}
    assert families["fcfs"]["requests"] == families["ltr-promptlen"]["requests"] == 20
    assert families["fcfs"]["e2e_s"]["max"] == 1.0
    assert families["ltr-promptlen"]["queue_share"] == pytest.approx(2 / 3)
    assert families["ltr-promptlen"]["verdict"]["code"] == "queue-dominated"
    text = invoke("trace", "summarize", str(path)).stdout
    assert "per scheduler family:" in text and "ltr-promptlen" in text


def test_bad_lines_are_reported_by_number_counted_and_skipped(tmp_path: Path) -> None:
    good = synthetic_trace(6)
    lines = [
        json.dumps(good[0]),
        "{not json",
        json.dumps(good[1]),
        json.dumps({k: v for k, v in good[2].items() if k != "queue_wait_s"}),
        json.dumps({**good[3], "e2e_latency_s": "slow"}),
        "[1, 2, 3]",
        json.dumps(good[4]) + " trailing",
        "",
        json.dumps({**good[5], "queue_wait_s": -1}),
        json.dumps(good[5]),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = invoke("trace", "summarize", str(path), "--json")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    data = json.loads(result.stdout)
    assert data["records"] == 3
    assert data["bad_lines"] == 6
    stderr = result.stderr
    for line_number, words in ((2, "not valid JSON"), (4, "missing field 'queue_wait_s'"),
                               (5, "e2e_latency_s is \"slow\", not a number"), (6, "not a trace record"),
                               (7, "unexpected text after the JSON object"), (9, "queue_wait_s is negative")):
        assert f"{path}:{line_number}: {words}" in stderr, stderr


def test_empty_file_says_so_without_traceback(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    result = invoke("trace", "summarize", str(path))
    assert result.exit_code == 1
    assert f"{path}: empty, no trace records to summarize" in result.stderr
    assert "Traceback" not in result.output
    only_blank = tmp_path / "blank.jsonl"
    only_blank.write_text("\n\n")
    assert "empty" in invoke("trace", "summarize", str(only_blank)).stderr
    missing = invoke("trace", "summarize", str(tmp_path / "nope.jsonl"))
    assert missing.exit_code == 1 and "does not exist" in missing.stderr


def test_only_bad_lines_is_an_error_naming_the_count(tmp_path: Path) -> None:
    path = tmp_path / "junk.jsonl"
    path.write_text("hello\nworld\n")
    result = invoke("trace", "summarize", str(path))
    assert result.exit_code == 1
    assert "no valid trace records (2 bad lines skipped)" in result.stderr


def test_truncated_gzip_counts_records_before_the_damage(tmp_path: Path) -> None:
    records = synthetic_trace(3000)
    full = gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode())
    cut = full[: len(full) // 2]
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(cut)
    # Independently: what zlib can recover from the cut stream, in whole lines.
    recovered = zlib.decompressobj(wbits=31).decompress(cut)
    expected = recovered.count(b"\n")
    assert 0 < expected < 3000
    result = invoke("trace", "summarize", str(path), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["records"] == expected
    assert "gzip data is truncated" in result.stderr
    assert f"{expected} complete lines before the damage were read" in result.stderr
    assert "Traceback" not in result.output


def test_corrupt_gzip_is_reported_not_raised(tmp_path: Path) -> None:
    data = bytearray(gzip.compress("".join(json.dumps(r) + "\n" for r in synthetic_trace(2000)).encode()))
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(64)
    path = tmp_path / "corrupt.jsonl.gz"
    path.write_bytes(bytes(data))
    result = invoke("trace", "summarize", str(path))
    assert "Traceback" not in result.output
    assert "gzip data is corrupt" in result.stderr or "bad lines" in result.stderr


def test_window_option_is_validated() -> None:
    assert parse_window("60s") == 60.0
    assert parse_window("5m") == 300.0
    assert parse_window("1h") == 3600.0
    assert parse_window("250ms") == 0.25
    assert parse_window("15") == 15.0
    result = invoke("trace", "summarize", "whatever.jsonl", "--window", "soon")
    assert result.exit_code == 2
    assert "--window 'soon' is not a duration" in result.stderr


def test_trace_is_a_subcommand_of_the_runtime_command_line() -> None:
    assert cli._dispatch(["trace", "summarize", "x.jsonl"], {}) == ["trace", "summarize", "x.jsonl"]


# ---------------------------------------------------------------------------------------------
# sessions


def render(messages: Sequence[tuple[str, str]]) -> str:
    """The tiny model's chat template, with the generation prompt."""
    body = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return body + "<|im_start|>assistant\n"


def conversation_records(conversations: dict[str, list[str]], systems: dict[str, str], seed: int = 5,
                         end_marker: str = "") -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """Interleave the conversations turn by turn; return records and the request ids of each."""
    rng = random.Random(seed)
    history: dict[str, list[tuple[str, str]]] = {name: [("system", systems[name])] for name in conversations}
    sent: dict[str, list[str]] = {name: [] for name in conversations}
    records: list[dict[str, Any]] = []
    t = T0
    for turn in range(max(len(turns) for turns in conversations.values())):
        for name, turns in conversations.items():
            if turn >= len(turns):
                continue
            history[name].append(("user", turns[turn]))
            prompt = render(history[name])
            answer = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "(x)", "\n"]) for _ in range(8))
            i = len(records)
            t += 0.5
            records.append(record(i, t, 0.4, 0.01, prompt=len(prompt) // 4, output=8,
                                  prompt_text=prompt, output_text=answer + end_marker))
            history[name].append(("assistant", answer.strip()))
            sent[name].append(f"chatcmpl-{i:016x}")
    # The file is in completion order, which need not be arrival order.
    rng.shuffle(records)
    return records, sent


def grouping(path: Path, out: Path) -> dict[str, list[str]]:
    result = invoke("trace", "sessions", str(path), "-o", str(out))
    assert result.exit_code == 0, result.output
    groups: dict[str, list[tuple[int, str]]] = {}
    for line in out.read_text().splitlines():
        item = json.loads(line)
        groups.setdefault(item["session_id"], []).append((item["turn"], item["request_id"]))
    return {sid: [rid for _, rid in sorted(members)] for sid, members in groups.items()}


SYSTEMS = {
    "billing-1": "You are the billing assistant. Be brief.",
    "billing-2": "You are the billing assistant. Be brief.",
    "billing-3": "You are the billing assistant. Be brief.",
    "support": "You are the support assistant for Northwind Analytics.",
    "single": "You are the billing assistant. Be brief.",
}
CONVERSATIONS = {
    "billing-1": ["Where do I find my invoice history?", "And past payment receipts?", "Thanks. Can I export them?"],
    "billing-2": ["How do I change my card?", "Does it apply to the open invoice?"],
    "billing-3": ["Where do I find my invoice history?", "Only for 2025 please.", "As CSV?", "Great."],
    "support": ["My dashboard shows an overdue invoice.", "It was paid on the 19th."],
    "single": ["What is the VAT rate?"],
}


@pytest.mark.parametrize("end_marker", ["", "<|im_end|>"])
def test_sessions_recover_interleaved_conversations_with_shared_system_prompts(tmp_path: Path,
                                                                                end_marker: str) -> None:
    records, sent = conversation_records(CONVERSATIONS, SYSTEMS, end_marker=end_marker)
    path = write_jsonl(tmp_path / "full.jsonl", records)
    groups = grouping(path, tmp_path / "sessions.jsonl")
    assert sorted(groups.values()) == sorted(sent.values())
    text = invoke("trace", "sessions", str(path)).stdout
    assert "sessions: 5 (4 multi-turn, 1 single-turn); most turns: 4" in text


def test_identical_first_turns_of_different_conversations_are_not_merged(tmp_path: Path) -> None:
    # Same system prompt, same first question, same answer: still two conversations.
    conversations = {"a": ["Hello?", "Tell me about invoices."], "b": ["Hello?", "Tell me about receipts."]}
    systems = {"a": "Be brief.", "b": "Be brief."}
    records, sent = conversation_records(conversations, systems)
    by_id = {r["request_id"]: r for r in records}
    by_id[sent["b"][0]]["output_text"] = by_id[sent["a"][0]]["output_text"]
    for turn_two, turn_one in ((sent["a"][1], sent["a"][0]), (sent["b"][1], sent["b"][0])):
        first = by_id[turn_one]
        question = "Tell me about invoices." if turn_two == sent["a"][1] else "Tell me about receipts."
        by_id[turn_two]["prompt_text"] = (first["prompt_text"] + first["output_text"].strip() + "<|im_end|>\n"
                                          + f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    path = write_jsonl(tmp_path / "twins.jsonl", records)
    groups = grouping(path, tmp_path / "out.jsonl")
    assert len(groups) == 2
    assert all(len(members) == 2 for members in groups.values())


def test_sessions_tolerate_a_reasoning_template_that_drops_thinking(tmp_path: Path) -> None:
    system = "<|im_start|>system\nYou are the billing assistant. Be brief.<|im_end|>\n"
    reply = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    first_prompt = system + "<|im_start|>user\nWhere is my invoice?<|im_end|>\n" + reply
    first_output = "<think>\nThe user wants invoices.\n</think>\n\nBilling > Invoices."
    second_prompt = (system + "<|im_start|>user\nWhere is my invoice?<|im_end|>\n<|im_start|>assistant\n"
                     "Billing > Invoices.<|im_end|>\n<|im_start|>user\nAnd receipts?<|im_end|>\n"
                     + reply)
    other_prompt = system + "<|im_start|>user\nWhere is my receipt?<|im_end|>\n" + reply
    records = [
        record(0, T0, 1.0, 0.0, prompt_text=first_prompt, output_text=first_output),
        record(1, T0 + 5, 1.0, 0.0, prompt_text=second_prompt, output_text="Same page."),
        record(2, T0 + 6, 1.0, 0.0, prompt_text=other_prompt, output_text="Billing > Receipts."),
    ]
    path = write_jsonl(tmp_path / "think.jsonl", records)
    groups = grouping(path, tmp_path / "out.jsonl")
    assert sorted(groups.values()) == [["chatcmpl-0000000000000000", "chatcmpl-0000000000000001"],
                                       ["chatcmpl-0000000000000002"]]


def test_sessions_follow_a_template_that_opens_the_thinking_itself(tmp_path: Path) -> None:
    """The prompt ends with ``<think>``; the next turn renders the answer without the thinking."""
    user = "<|im_start|>user\nWhere is my invoice?<|im_end|>\n"
    first_prompt = user + "<|im_start|>assistant\n<think>\n"
    first_output = "The user wants invoices.\n</think>\n\nBilling > Invoices."
    second_prompt = (user + "<|im_start|>assistant\nBilling > Invoices.<|im_end|>\n"
                     "<|im_start|>user\nAnd receipts?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    records = [
        record(0, T0, 1.0, 0.0, prompt_text=first_prompt, output_text=first_output),
        record(1, T0 + 5, 1.0, 0.0, prompt_text=second_prompt, output_text="x</think>Same page."),
    ]
    groups = grouping(write_jsonl(tmp_path / "open.jsonl", records), tmp_path / "out.jsonl")
    assert sorted(groups.values()) == [["chatcmpl-0000000000000000", "chatcmpl-0000000000000001"]]


def test_two_replies_to_the_same_turn_branch_into_a_new_session(tmp_path: Path) -> None:
    first_prompt = render([("system", "S"), ("user", "Q1")])
    records = [record(0, T0, 1.0, 0.0, prompt_text=first_prompt, output_text="A1")]
    for i, question in ((1, "Q2"), (2, "Q2 again, differently")):
        prompt = render([("system", "S"), ("user", "Q1"), ("assistant", "A1"), ("user", question)])
        records.append(record(i, T0 + 5 * i, 1.0, 0.0, prompt_text=prompt, output_text="A2"))
    path = write_jsonl(tmp_path / "fork.jsonl", records)
    result = reconstruct(path)
    assert [(s.session_id, s.turns, s.branch_of) for s in result.sessions] == [("s1", 2, None), ("s2", 1, "s1")]
    assignments = {a.request_id: (a.session_id, a.turn, a.parent_request_id) for a in result.assignments}
    assert assignments["chatcmpl-0000000000000002"] == ("s2", 2, "chatcmpl-0000000000000000")


def test_sessions_on_a_standard_level_trace_say_the_full_level_is_needed(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "standard.jsonl", synthetic_trace(10))
    result = invoke("trace", "sessions", str(path))
    assert result.exit_code == 1
    assert "sessions need the full trace level" in result.stderr
    assert "--request-trace full" in result.stderr
    assert "Traceback" not in result.output


def test_sessions_skip_records_without_text_and_bad_lines(tmp_path: Path) -> None:
    records, _ = conversation_records({"a": ["one", "two"]}, {"a": "sys"})
    lines = [json.dumps(r) for r in records] + ["{broken", json.dumps(synthetic_trace(1)[0])]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = invoke("trace", "sessions", str(path), "-o", str(tmp_path / "o.jsonl"))
    assert result.exit_code == 0, result.output
    assert f"{path}:3: not valid JSON" in result.stderr
    assert "1 records carry no text" in result.stdout
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 2


def test_output_variants_drop_end_markers_whitespace_and_thinking() -> None:
    assert output_variants("  Hello.<|im_end|>\n") == {"Hello."}
    assert output_variants("<think>x</think>\n\nHi") >= {"<think>x</think>\n\nHi", "Hi"}
    assert "ab" in output_variants("a<|im_end|>b")


def test_sessions_scale_linearly_on_many_conversations(tmp_path: Path) -> None:
    conversations = {f"c{k}": [f"question {k}.{turn}" for turn in range(4)] for k in range(600)}
    systems = dict.fromkeys(conversations, "You are the billing assistant. Be brief.")
    records, sent = conversation_records(conversations, systems)
    path = write_jsonl(tmp_path / "many.jsonl", records)
    result = reconstruct(path)
    assert len(result.sessions) == 600
    got = sorted(tuple(s.request_ids) for s in result.sessions)
    assert got == sorted(tuple(ids) for ids in sent.values())


# ---------------------------------------------------------------------------------------------
# plot


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data[-8:-4] == b"IEND"
    return width, height


def test_plot_writes_a_png_of_the_expected_size(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = (phase(0, T0 + 1, 60, 1.0, e2e=1.0, queue=0.01, output=100)
               + phase(100, T0 + 61, 120, 0.5, e2e=6.0, queue=5.0, output=100))
    path = write_jsonl(tmp_path / "t.jsonl", records)
    out = tmp_path / "out.png"
    result = invoke("trace", "plot", str(path), "-o", str(out), "--window", "20s")
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stdout
    assert png_size(out) == (1200, 900)


def test_plot_without_matplotlib_explains_how_to_install_it(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    path = write_jsonl(tmp_path / "t.jsonl", synthetic_trace(10))
    result = invoke("trace", "plot", str(path), "-o", str(tmp_path / "x.png"))
    assert result.exit_code == 1
    assert "trace plot needs matplotlib, which is not installed" in result.stderr
    assert "pip install 'carbonforge-runtime[plot]'" in result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "x.png").exists()


def test_sessions_without_a_chat_template_many_distinct_prompt_endings(tmp_path: Path) -> None:
    # Raw completions: each turn appends the previous output and new text; prompt endings all differ,
    # which takes the length-based search for cut points instead of the search by ending.
    rng = random.Random(11)
    records: list[dict[str, Any]] = []
    expected: list[list[str]] = []
    for k in range(50):
        prompt = f"Document {k}: " + "".join(rng.choice("abcdefgh ") for _ in range(40))
        ids = []
        for turn in range(3):
            output = "".join(rng.choice("xyz ") for _ in range(20)).strip() + "."
            i = len(records)
            records.append(record(i, T0 + k + 100 * turn, 0.5, 0.0, prompt_text=prompt, output_text=output))
            ids.append(f"chatcmpl-{i:016x}")
            prompt = prompt + output + f" continue {rng.randint(0, 10**6)}"
        expected.append(ids)
    path = write_jsonl(tmp_path / "raw.jsonl", records)
    result = reconstruct(path)
    assert sorted(s.request_ids for s in result.sessions) == sorted(expected)


def test_plot_leaves_idle_periods_blank_and_refuses_too_many_windows(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = phase(0, T0 + 1, 30, 1.0, e2e=1.0, queue=0.0, output=10) + phase(50, T0 + 600, 30, 1.0, e2e=1.0,
                                                                                 queue=0.8, output=10)
    path = write_jsonl(tmp_path / "gap.jsonl", records)
    out = tmp_path / "gap.png"
    result = invoke("trace", "plot", str(path), "-o", str(out), "--window", "30s")
    assert result.exit_code == 0, result.output
    assert png_size(out) == (1200, 900)
    sparse = write_jsonl(tmp_path / "sparse.jsonl", [record(0, T0, 1.0, 0.0), record(1, T0 + 86_400, 1.0, 0.0)])
    refused = invoke("trace", "plot", str(sparse), "-o", str(tmp_path / "no.png"), "--window", "1s")
    assert refused.exit_code == 1
    assert "spans 86,401 windows of 1s, too many to draw" in refused.stderr
    assert "--window" in refused.stderr and "Traceback" not in refused.output


@pytest.mark.parametrize("t_arrival", [1e18, -1e15])
def test_timestamps_no_calendar_can_show_do_not_crash_the_report(tmp_path: Path, t_arrival: float) -> None:
    path = write_jsonl(tmp_path / "far.jsonl", [record(i, t_arrival + i, 1.0, 0.1) for i in range(5)])
    for command in (["trace", "summarize", str(path)], ["trace", "summarize", "--json", str(path)]):
        result = invoke(*command)
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert result.exit_code == 0, result.output
    assert "out of range" in invoke("trace", "summarize", "--json", str(path)).output


def test_a_line_longer_than_the_limit_is_refused_with_bounded_memory(tmp_path: Path) -> None:
    import gzip
    import resource

    from carbonforge_runtime.offline import trace_reader

    good = json.dumps(record(0, 1_700_000_000.0, 1.0, 0.1))
    path = tmp_path / "long.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=1) as handle:  # a few hundred KB on disk, 100 MB inflated
        handle.write((good + "\n").encode())
        handle.write(b"x" * (100 << 20))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = invoke("trace", "summarize", str(path))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert "longer than 16 MiB" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert grown_mib < 3 * (trace_reader.MAX_LINE_BYTES >> 20) + 64, grown_mib
    with pytest.raises(trace_reader.TraceInputError, match="longer than 16 MiB"):
        list(trace_reader.numbered_records(path))
