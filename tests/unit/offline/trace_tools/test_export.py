"""trace export on synthetic full-level traces whose prompts are rendered by the vendored templates."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.offline.trace_tools import catalog, scrub
from carbonforge_runtime.offline.trace_tools import chat_parse as cp
from carbonforge_runtime.offline.trace_tools import export as export_mod
from carbonforge_runtime.recipes.chat_templates import TEMPLATES

runner = CliRunner()
T0 = 1_796_455_800.0

#: OpenAI's chat fine-tuning row, as its documentation describes it (roles, tool calls, tool messages).
_CALL = {"type": "object", "required": ["id", "type", "function"], "additionalProperties": False,
         "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                        "function": {"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                                     "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
FINE_TUNING_ROW = {
    "type": "object", "required": ["messages"], "additionalProperties": False,
    "properties": {
        "messages": {"type": "array", "minItems": 1, "items": {"oneOf": [
            {"type": "object", "required": ["role", "content"], "additionalProperties": False,
             "properties": {"role": {"enum": ["system", "user"]}, "content": {"type": "string"}}},
            {"type": "object", "required": ["role"], "additionalProperties": False,
             "anyOf": [{"required": ["content"], "properties": {"content": {"type": "string"}}},
                       {"required": ["tool_calls"]}],
             "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                            "tool_calls": {"type": "array", "minItems": 1, "items": _CALL},
                            "weight": {"enum": [0, 1]}}},
            {"type": "object", "required": ["role", "content", "tool_call_id"], "additionalProperties": False,
             "properties": {"role": {"const": "tool"}, "content": {"type": "string"},
                            "tool_call_id": {"type": "string"}}},
        ]}},
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "function"],
                                             "properties": {"type": {"const": "function"}}}},
        "parallel_tool_calls": {"type": "boolean"},
    },
}

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                           "parameters": {"type": "object",
                                                          "properties": {"word": {"type": "string"}}}}}]


def conversation(i: int, secret: str = "") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": f"What does word {i} mean? {secret}".strip()},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "lookup", "arguments": json.dumps({"word": str(i)})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": f"definition {i}"},
    ]


def record(i: int, *, template: str = "tiny", model: str | None = "carbonforge/tiny-chat", finish: str = "stop",
           secret: str = "", answer: str = "", task: str = "glossary", **extra: Any) -> dict[str, Any]:
    messages = conversation(i, secret)
    prompt = cp.render(TEMPLATES[template], cp.template_messages(messages), TOOLS)
    out = {"request_id": f"chatcmpl-{i}", "t_arrival": T0 + i, "t_completion": T0 + i + 1, "prompt_tokens": 90,
           "output_tokens": 12, "e2e_latency_s": 1.0, "ttft_s": 0.1, "queue_wait_s": 0.0, "scheduler_family": "fcfs",
           "priority_score": None, "finish_reason": finish, "tags": {"task": task},
           "prompt_text": prompt, "output_text": answer or f"hmm\n</think>\n\nWord {i} means {i}."}
    if model is not None:
        out["model"] = model
    out.update(extra)
    return out


def write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def invoke(*args: str) -> Any:
    return runner.invoke(cli.app, ["trace", "export", *args])


def test_chat_rows_are_the_client_messages_plus_the_answer_and_fit_the_fine_tuning_schema(tmp_path: Path) -> None:
    trace = write(tmp_path / "t.jsonl", [record(i) for i in range(3)])
    out = tmp_path / "out.jsonl"
    result = invoke(str(trace), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "wrote 3 rows" in result.output
    got = rows(out)
    for i, row in enumerate(got):
        jsonschema.validate(row, FINE_TUNING_ROW)
        assert row["messages"][:-1] == conversation(i)
        assert row["messages"][-1] == {"role": "assistant", "content": f"Word {i} means {i}."}
        assert row["tools"] == TOOLS


def test_eval_rows_hold_the_reference_answer_and_metadata(tmp_path: Path) -> None:
    trace = write(tmp_path / "t.jsonl", [record(0, template="qwen3", model="Qwen/Qwen3-32B-FP8",
                                                answer="<think>\nweigh\n</think>\n\nIt means zero.")])
    out = tmp_path / "eval.jsonl"
    result = invoke(str(trace), "-o", str(out), "--format", "eval", "--keep-reasoning")
    assert result.exit_code == 0, result.output
    (row,) = rows(out)
    assert row["messages"] == conversation(0)
    assert row["reference"] == {"role": "assistant", "content": "It means zero.", "reasoning_content": "weigh"}
    assert row["metadata"] == {"request_id": "chatcmpl-0", "model": "Qwen/Qwen3-32B-FP8", "task": "glossary",
                               "finish_reason": "stop"}


def test_qwen3_coder_answers_with_tool_calls_are_parsed(tmp_path: Path) -> None:
    answer = ("Let me check.\n<tool_call>\n<function=lookup>\n<parameter=word>\n42\n</parameter>\n</function>\n"
              "</tool_call>")
    trace = write(tmp_path / "t.jsonl", [record(0, template="qwen3_coder",
                                                model="Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8", answer=answer)])
    out = tmp_path / "out.jsonl"
    assert invoke(str(trace), "-o", str(out)).exit_code == 0
    (row,) = rows(out)
    jsonschema.validate(row, FINE_TUNING_ROW)
    assert row["messages"][-1] == {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "42"}'}}]}


def test_failed_duplicate_and_unparsable_requests_are_skipped_and_counted(tmp_path: Path) -> None:
    records = [record(0), record(0), record(1, finish="length"), record(2, finish="abort"),
               record(3, prompt_text="<|im_start|>user\nhi<|im_end|>\n"), record(4, model="Qwen/Qwen3-Coder-Next-FP8")]
    trace = write(tmp_path / "t.jsonl", records)
    out = tmp_path / "out.jsonl"
    result = invoke(str(trace), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert len(rows(out)) == 1
    text = result.output
    assert "2 not successful (length 1, abort 1; --include-failed keeps them)" in text
    assert "1 exact duplicates" in text
    assert "ends without the assistant's generation prompt" in text
    assert "served by Qwen/Qwen3-Coder-Next-FP8" in text
    result = invoke(str(trace), "-o", str(out), "--include-failed", "--json")
    summary = json.loads(result.output)
    assert summary["written"] == 3 and summary["duplicates"] == 1 and summary["skipped_failed"] == {}
    result = invoke(str(trace), "-o", str(out), "--finish-reason", "length")
    assert result.exit_code == 0 and "wrote 1 rows" in result.output


def test_the_same_filters_as_trace_list(tmp_path: Path) -> None:
    records = [record(0, task="a"), record(1, task="b", output_tokens=3), record(2, task="b"), record(3, task="b")]
    trace = write(tmp_path / "t.jsonl", records)
    out = tmp_path / "out.jsonl"
    result = invoke(str(trace), "-o", str(out), "--task", "b", "--filter", "output_tokens>5", "--since", str(T0 + 2.5),
                    "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["matched"] == 1
    assert rows(out)[0]["messages"][1]["content"] == "What does word 3 mean?"


def test_split_is_deterministic_and_max_rows_caps(tmp_path: Path) -> None:
    trace = write(tmp_path / "t.jsonl", [record(i) for i in range(20)])
    first, second = tmp_path / "a" / "d.jsonl", tmp_path / "b" / "d.jsonl"
    for out in (first, second):
        assert invoke(str(trace), "-o", str(out), "--split", "0.8", "--seed", "7").exit_code == 0
    train, held = export_mod.split_paths(first)
    assert (train.name, held.name) == ("d.train.jsonl", "d.eval.jsonl")
    assert export_mod.split_paths(Path("x/day.1.jsonl"))[1] == Path("x/day.1.eval.jsonl")
    assert len(rows(train)) == 16 and len(rows(held)) == 4
    assert train.read_text() == export_mod.split_paths(second)[0].read_text()
    other = tmp_path / "c" / "d.jsonl"
    assert invoke(str(trace), "-o", str(other), "--split", "0.8", "--seed", "8").exit_code == 0
    assert export_mod.split_paths(other)[1].read_text() != held.read_text()
    capped = tmp_path / "cap.jsonl"
    result = invoke(str(trace), "-o", str(capped), "--max-rows", "5")
    assert len(rows(capped)) == 5 and "stopped at --max-rows 5" in result.output


def test_planted_secrets_are_absent_from_the_export(tmp_path: Path) -> None:
    planted = ["sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z", "AKIAIOSFODNN7EXAMPLE",
               "ghp_A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8", "xoxb-123456789012-1234567890123-AbCdEfGhIjKl",
               "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"]
    answer = "ok\n</think>\n\nUse Authorization: Bearer 9f8e7d6c5b4a39281706f5e4d3c2b1a0 and password=hunter2hunter2"
    trace = write(tmp_path / "t.jsonl", [record(i, secret=secret, answer=answer) for i, secret in enumerate(planted)])
    out = tmp_path / "out.jsonl"
    result = invoke(str(trace), "-o", str(out))
    assert result.exit_code == 0, result.output
    text = out.read_text()
    for secret in [*planted, "9f8e7d6c5b4a39281706f5e4d3c2b1a0", "hunter2hunter2"]:
        assert secret not in text
    assert "scrubbing: 15 values redacted" in result.output
    result = invoke(str(trace), "-o", str(out), "--no-scrub")
    assert planted[0] in out.read_text() and "scrubbing: off" in result.output


def test_secrets_in_tool_call_arguments_are_scrubbed_and_the_arguments_stay_json() -> None:
    row = {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "login", "arguments": json.dumps({"password": "hunter2hunter2", "n": 1})}}]}]}
    cleaned = export_mod._scrub_row(row, scrub.scrubber())
    arguments = json.loads(cleaned["messages"][0]["tool_calls"][0]["function"]["arguments"])
    assert arguments == {"password": "[REDACTED:password]", "n": 1}


def test_standard_level_traces_are_refused_naming_the_full_level(tmp_path: Path) -> None:
    standard = record(0)
    del standard["prompt_text"], standard["output_text"]
    trace = write(tmp_path / "t.jsonl", [standard])
    out = tmp_path / "out.jsonl"
    out.write_text("earlier\n")
    result = invoke(str(trace), "-o", str(out))
    assert result.exit_code == 1
    assert "standard-level" in result.output and "--request-trace full" in result.output
    assert "Traceback" not in result.output
    assert out.read_text() == "earlier\n"  # nothing written over the earlier file


def test_records_without_a_model_need_a_template(tmp_path: Path) -> None:
    trace = write(tmp_path / "t.jsonl", [record(0, model=None)])
    out = tmp_path / "out.jsonl"
    result = invoke(str(trace), "-o", str(out))
    assert result.exit_code == 2
    assert "--template NAME, one of qwen2_5, qwen3, qwen3_6, qwen3_coder" in result.output
    assert invoke(str(trace), "-o", str(out), "--template", "tiny").exit_code == 0
    result = invoke(str(trace), "-o", str(out), "--template", "llama")
    assert result.exit_code == 2 and "is not a vendored chat template" in result.output


@pytest.mark.parametrize("args, message", [
    (["--split", "1.5"], "not between 0 and 1"),
    (["--max-rows", "0"], "not a positive number"),
    (["--format", "csv"], "is not one of chat, eval"),
])
def test_bad_options_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    trace = write(tmp_path / "t.jsonl", [record(0)])
    result = invoke(str(trace), "-o", str(tmp_path / "o.jsonl"), *args)
    assert result.exit_code == 2 and message in result.output


def test_an_unwritable_output_is_an_error_with_a_fix(tmp_path: Path) -> None:
    trace = write(tmp_path / "t.jsonl", [record(0)])
    (tmp_path / "dir.jsonl").mkdir()
    result = invoke(str(trace), "-o", str(tmp_path / "dir.jsonl"))
    assert result.exit_code == 1 and "cannot write" in result.output and "Traceback" not in result.output


_FILTERS = st.lists(st.sampled_from(["output_tokens>5", "output_tokens<=12", "latency>=2s", "ttft<100ms",
                                     "queue_wait!=0", "prompt_tokens=90"]), max_size=2)


@settings(max_examples=30, deadline=None)
@given(data=st.lists(st.tuples(st.integers(0, 20), st.sampled_from([0.5, 1.0, 3.0]), st.sampled_from(["a", "b"]),
                               st.sampled_from(["stop", "length"]), st.sampled_from([None, 0.05, 0.2])),
                     min_size=1, max_size=12),
       filters=_FILTERS, task=st.sampled_from([None, "a"]), reason=st.sampled_from([None, "stop"]),
       since=st.sampled_from([None, 3]))
def test_the_export_filter_matches_trace_lists(data: list[tuple[int, float, str, str, float | None]],
                                               filters: list[str], task: str | None, reason: str | None,
                                               since: int | None) -> None:
    """The export's predicate selects exactly the records trace list counts as matching."""
    records = [{"request_id": f"r{i}", "t_arrival": T0 + i, "output_tokens": tokens, "e2e_latency_s": e2e,
                "prompt_tokens": 90, "queue_wait_s": 0.0, "ttft_s": ttft, "finish_reason": finish,
                "tags": {"task": tag}} for i, (tokens, e2e, tag, finish, ttft) in enumerate(data)]
    with tempfile.TemporaryDirectory() as folder:
        trace = write(Path(folder) / "t.jsonl", records)
        query = catalog.build_query(filters, None if since is None else str(T0 + since), None, reason, None, None,
                                    task)
        listed = catalog.list_requests([trace], query, 0).matched
    accepts = export_mod.query_predicate(query)
    assert sum(1 for r in records if accepts(r)) == listed
