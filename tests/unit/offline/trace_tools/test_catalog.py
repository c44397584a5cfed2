"""trace list / trace show on synthetic trace files (no engine)."""

from __future__ import annotations

import base64
import gzip
import json
import tempfile
import tracemalloc
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.offline.trace_tools import catalog
from carbonforge_runtime.offline.trace_tools.catalog import (
    Condition,
    Query,
    build_query,
    find_request,
    list_requests,
    parse_condition,
    parse_time,
    split_reasoning,
)

runner = CliRunner()
T0 = 1_796_455_800.0  # 2026-12-05 07:30:00 UTC


def invoke(*args: str) -> Any:
    return runner.invoke(cli.app, list(args))


def rec(i: int, *, t: float | None = None, prompt: int = 100, output: int = 10, e2e: float = 1.0,
        ttft: float | None = 0.1, queue: float = 0.01, finish: str = "stop", rid: str | None = None,
        **extra: Any) -> dict[str, Any]:
    request_id = rid if rid is not None else f"chatcmpl-{i:08x}"
    return {
        "request_id": request_id, "t_arrival": T0 + i if t is None else t,
        "t_completion": (T0 + i if t is None else t) + e2e, "prompt_tokens": prompt, "output_tokens": output,
        "e2e_latency_s": e2e, "ttft_s": ttft, "queue_wait_s": queue, "scheduler_family": "fcfs",
        "priority_score": None, "finish_reason": finish, "cached_prompt_tokens": 0, "preemptions": 0,
        "engine_request_id": f"{request_id}-{i:08x}", "energy_j": None, **extra,
    }


def write(path: Path, records: Iterable[dict[str, Any] | str], *, compress: bool = False) -> Path:
    text = "".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in records)
    path.write_bytes(gzip.compress(text.encode()) if compress else text.encode())
    return path


def ids(page: catalog.Page) -> list[str]:
    return [row.request_id for row in page.rows]


def every_page(paths: Sequence[Path], query: Query, limit: int) -> list[catalog.Row]:
    """Every row, page by page through the cursors (each page a fresh pass)."""
    rows: list[catalog.Row] = []
    cursor = None
    for _ in range(10_000):
        page = list_requests(paths, query, limit, cursor)
        assert page.before == len(rows)
        rows.extend(page.rows)
        if page.next_cursor is None:
            return rows
        assert len(page.rows) == limit
        cursor = page.next_cursor
    raise AssertionError("paging did not end")


# ---------------------------------------------------------------------------------------------
# Parsing the options


@pytest.mark.parametrize(("text", "expected"), [
    ("output_tokens>5", Condition("output_tokens", ">", 5)),
    ("output_tokens >= 5", Condition("output_tokens", ">=", 5)),
    ("input_tokens<100", Condition("prompt_tokens", "<", 100)),
    ("latency<=2s", Condition("e2e_latency_s", "<=", 2)),
    ("ttft>250ms", Condition("ttft_s", ">", 0.25)),
    ("queue_wait=1m", Condition("queue_wait_s", "=", 60)),
    ("preemptions==0", Condition("preemptions", "=", 0)),
    ("energy!=1.5", Condition("energy_j", "!=", 1.5)),
    ("CACHED_TOKENS>0", Condition("cached_prompt_tokens", ">", 0)),
])
def test_conditions_parse_with_aliases_and_units(text: str, expected: Condition) -> None:
    assert parse_condition(text) == expected


@pytest.mark.parametrize(("text", "said", "fix"), [
    ("output_tokens", "is not FIELD OPERATOR NUMBER", "> >= < <= = !="),
    ("output_tokens~5", "is not FIELD OPERATOR NUMBER", "fields: t_arrival"),
    ("bogus>5", "unknown field 'bogus'", "e2e_latency_s"),
    ("output_tokens>five", "'five' is not a number", "> >= < <= = !="),
    ("output_tokens>5s", "'5s' is not a number", "compare output_tokens with a number"),
    ("latency>nan", "'nan' is not a number", "500ms"),
    ("finish_reason=stop", "finish_reason is text", "--finish-reason"),
    ("task=x", "task is text", "--task"),
])
def test_bad_filter_expressions_name_the_fields_and_operators(text: str, said: str, fix: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_condition(text)
    assert said in caught.value.message
    assert fix in caught.value.remedy


def test_times_parse_from_iso_and_unix_seconds() -> None:
    assert parse_time("2026-12-05T07:30:00Z", "--since") == T0
    assert parse_time("2026-12-05 07:30", "--since") == T0
    assert parse_time("2026-12-05T09:30:00+02:00", "--since") == T0
    assert parse_time("2026-12-05", "--since") == T0 - 7.5 * 3600
    assert parse_time(str(T0), "--since") == T0
    with pytest.raises(UsageError, match="is not a time"):
        parse_time("yesterday", "--since")
    with pytest.raises(UsageError, match="is not a time"):
        parse_time("inf", "--until")


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"order": "up"}, "--order 'up' is not asc or desc"),
    ({"sort": "request_id"}, "unknown field 'request_id'"),
    ({"sort": "model"}, "model is text"),
    ({"since": "2026-12-05T08:00:00Z", "until": "2026-12-05T07:00:00Z"}, "is not before --until"),
])
def test_bad_options_are_usage_errors(kwargs: dict[str, str], said: str) -> None:
    with pytest.raises(UsageError) as caught:
        build_query(**kwargs)  # type: ignore[arg-type]
    assert said in caught.value.message


# ---------------------------------------------------------------------------------------------
# Filters


def test_every_operator_filters_on_its_field(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [rec(i, output=i) for i in range(10)])
    expected = {">": [6, 7, 8, 9], ">=": [5, 6, 7, 8, 9], "<": [0, 1, 2, 3, 4], "<=": [0, 1, 2, 3, 4, 5],
                "=": [5], "==": [5], "!=": [0, 1, 2, 3, 4, 6, 7, 8, 9]}
    for op, wanted in expected.items():
        page = list_requests([path], build_query([f"output_tokens{op}5"]), limit=0)
        assert [row.output_tokens for row in page.rows] == wanted, op
        assert page.matched == len(wanted)


def test_filters_combine_and_a_missing_or_null_field_never_matches(tmp_path: Path) -> None:
    records = [rec(0, ttft=None), rec(1, ttft=0.5), rec(2, ttft=0.05), rec(3, output=1)]
    del records[3]["ttft_s"]
    path = write(tmp_path / "t.jsonl", records)
    assert ids(list_requests([path], build_query(["ttft<1"]))) == ["chatcmpl-00000001", "chatcmpl-00000002"]
    assert ids(list_requests([path], build_query(["ttft!=0.5"]))) == ["chatcmpl-00000002"]
    both = build_query(["ttft<1", "ttft>100ms"])
    assert ids(list_requests([path], both)) == ["chatcmpl-00000001"]


def test_text_filters_need_the_field_and_match_exactly(tmp_path: Path) -> None:
    records = [
        rec(0, model="qwen", tenant="acme", tags={"task": "sql"}),
        rec(1, model="qwen", tenant="other", tags={"task": "SQL"}, finish="length"),
        rec(2, tags={"team": "x"}),  # no model, no tenant, no task
        rec(3, model="llama", tags="task=sql"),  # tags of the wrong shape: no task
        rec(4, model="qwen", tenant="acme", tags={"task": "sql"}, finish="abort"),
    ]
    path = write(tmp_path / "t.jsonl", records)

    def listed(**kwargs: str) -> list[str]:
        return [r[-1] for r in ids(list_requests([path], build_query(**kwargs)))]  # type: ignore[arg-type]

    assert listed(model="qwen") == ["0", "1", "4"]
    assert listed(tenant="acme") == ["0", "4"]
    assert listed(task="sql") == ["0", "4"]
    assert listed(task="sql", finish_reason="stop") == ["0"]
    assert listed(finish_reason="length") == ["1"]
    assert listed(model="QWEN") == []


def test_time_range_is_since_inclusive_until_exclusive(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [rec(i) for i in range(10)])
    query = build_query(since="2026-12-05T07:30:03Z", until=str(T0 + 6))
    page = list_requests([path], query)
    assert [row.t_arrival for row in page.rows] == [T0 + 3, T0 + 4, T0 + 5]
    assert page.records == 10


# ---------------------------------------------------------------------------------------------
# Sort, order and pages


def test_sort_and_order_put_records_without_the_field_last(tmp_path: Path) -> None:
    records = [rec(0, ttft=0.3), rec(1, ttft=None), rec(2, ttft=0.1), rec(3, ttft=0.3), rec(4, ttft=0.2)]
    path = write(tmp_path / "t.jsonl", records)
    ascending = list_requests([path], build_query(sort="ttft"))
    descending = list_requests([path], build_query(sort="ttft_s", order="desc"))
    assert [row.ttft_s for row in ascending.rows] == [0.1, 0.2, 0.3, 0.3, None]
    assert [r[-1] for r in ids(ascending)] == ["2", "4", "0", "3", "1"]
    # Ties keep file order in both directions.
    assert [r[-1] for r in ids(descending)] == ["0", "3", "4", "2", "1"]


def test_pages_cover_every_row_once_with_ties_across_files(tmp_path: Path) -> None:
    a = write(tmp_path / "a.jsonl", [rec(i, output=i % 3) for i in range(0, 20, 2)])
    b = write(tmp_path / "b.jsonl", [rec(i, output=i % 3) for i in range(1, 20, 2)])
    query = build_query(sort="output_tokens", order="desc")
    whole = list_requests([tmp_path], query, limit=0)
    assert whole.next_cursor is None and len(whole.rows) == 20
    for limit in (1, 3, 7, 19, 20, 21):
        rows = every_page([a, b], query, limit)
        assert [(row.file, row.line) for row in rows] == [(row.file, row.line) for row in whole.rows]
    assert [row.output_tokens for row in whole.rows] == sorted([i % 3 for i in range(20)], reverse=True)
    # Within a tie: file a's rows (by line) before file b's.
    twos = [(Path(row.file).name, row.line) for row in whole.rows if row.output_tokens == 2]
    assert twos == sorted(twos)


def test_a_cursor_survives_appended_records_and_shows_only_the_new_ones_after_the_end(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [rec(i) for i in range(5)])
    query = build_query()
    first = list_requests([path], query, limit=3)
    assert first.next_cursor is not None
    with path.open("a") as handle:
        handle.write(json.dumps(rec(5)) + "\n")
    second = list_requests([path], query, limit=3, cursor=first.next_cursor)
    assert [r[-1] for r in ids(second)] == ["3", "4", "5"]
    assert second.before == 3


def test_a_cursor_from_other_filters_or_a_broken_one_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [rec(i) for i in range(5)])
    cursor = list_requests([path], build_query(["output_tokens>1"]), limit=2).next_cursor
    assert cursor is not None
    # Only the page size may change.
    assert len(list_requests([path], build_query(["output_tokens>1"]), limit=4, cursor=cursor).rows) == 3
    with pytest.raises(UsageError, match="other filters or another sort"):
        list_requests([path], build_query(["output_tokens>2"]), limit=2, cursor=cursor)
    with pytest.raises(UsageError, match="other filters or another sort"):
        list_requests([path], build_query(["output_tokens>1"], order="desc"), limit=2, cursor=cursor)
    fingerprint = build_query(["output_tokens>1"]).fingerprint()
    huge = base64.urlsafe_b64encode(json.dumps([fingerprint, 0, 10**400, str(path), 1]).encode()).decode()
    for broken in ("abc", cursor[:-4], "c1.!!!", "c1." + "e30", "c1." + huge):
        with pytest.raises(UsageError, match="is not a cursor of trace list"):
            list_requests([path], build_query(["output_tokens>1"]), limit=2, cursor=broken)


def test_the_heap_holds_rows_not_texts_so_memory_stays_small_on_full_level_files(tmp_path: Path) -> None:
    big = "x" * 100_000
    path = write(tmp_path / "full.jsonl", [rec(i, prompt_text=big, output_text=big) for i in range(200)])
    assert path.stat().st_size > 40_000_000
    tracemalloc.start()
    try:
        page = list_requests([path], build_query(sort="t_arrival", order="desc"), limit=100)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(page.rows) == 100 and page.rows[0].t_arrival == T0 + 199
    assert peak < 8_000_000, peak  # a read block and a record or two, not the 200 texts kept


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.one_of(st.none(), st.integers(0, 3)),
                       st.one_of(st.none(), st.sampled_from([0.1, 0.2, 0.3]))), max_size=40),
    st.integers(1, 45),
    st.sampled_from(["t_arrival", "output_tokens", "ttft_s"]),
    st.booleans(),
    st.one_of(st.none(), st.integers(0, 3)),
    st.integers(1, 3),
)
def test_paging_returns_exactly_the_filtered_sorted_records(
        rows: list[tuple[int, int | None, float | None]], limit: int, sort: str, descending: bool,
        at_least: int | None, file_count: int) -> None:
    records = []
    for i, (t, output, ttft) in enumerate(rows):
        item = rec(i, t=T0 + t, ttft=ttft)
        if output is None:
            del item["output_tokens"]
        else:
            item["output_tokens"] = output
        records.append(item)
    filters = [] if at_least is None else [f"output_tokens>={at_least}"]
    query = build_query(filters, sort=sort, order="desc" if descending else "asc")
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write(Path(tmp) / f"f{k}.jsonl", records[k::file_count]) for k in range(file_count)]
        got = [row.request_id for row in every_page(paths, query, limit)]
    # Reference, written independently: file order (by name), then a stable sort on the value, missing last.
    in_order = [r for k in range(file_count) for r in records[k::file_count]]
    kept = [r for r in in_order if at_least is None or (r.get("output_tokens") is not None
                                                         and r["output_tokens"] >= at_least)]
    present = [r for r in kept if r.get(sort) is not None]
    absent = [r for r in kept if r.get(sort) is None]
    present.sort(key=lambda r: -r[sort] if descending else r[sort])
    assert got == [r["request_id"] for r in present + absent]


# ---------------------------------------------------------------------------------------------
# Files: damage, gzip, directories


def test_damaged_lines_are_reported_and_skipped(tmp_path: Path) -> None:
    no_id = rec(4)
    del no_id["request_id"]
    late = rec(8)
    late["t_arrival"] = "soon"
    lines: list[dict[str, Any] | str] = [
        rec(0), "{broken", "[1, 2]", json.dumps(rec(3)) + " extra", no_id,
        rec(5, output="many"),  # type: ignore[arg-type]
        json.dumps(rec(6)).replace('"output_tokens": 10', '"output_tokens": NaN'),
        "", late, rec(9, output=True), rec(10),  # type: ignore[arg-type]
    ]
    path = write(tmp_path / "t.jsonl", lines)
    page = list_requests([path], build_query(["output_tokens>1"]), limit=0)
    assert [r[-2:] for r in ids(page)] == ["00", "0a"]
    reasons = {bad.line: bad.reason for bad in page.bad_line_examples}
    assert sorted(reasons) == [2, 3, 4, 5, 6, 7, 9, 10]
    assert "not valid JSON" in reasons[2]
    assert "not a trace record" in reasons[3]
    assert reasons[4] == "unexpected text after the JSON object"
    assert reasons[5] == "missing field 'request_id'"
    assert reasons[6] == 'output_tokens is "many", not a number'
    assert reasons[7] == "output_tokens is NaN, not a number"
    assert reasons[9].startswith("t_arrival is")
    assert reasons[10] == "output_tokens is true, not a number"
    assert page.records == 2 and page.bad_lines == 8

    result = invoke("trace", "list", str(path), "--filter", "output_tokens>1")
    assert result.exit_code == 0
    assert f"warning: {path}:2: not valid JSON" in result.stderr
    assert "Traceback" not in result.output


def test_gzip_and_directories_read_like_plain_files(tmp_path: Path) -> None:
    records = [rec(i, output=i) for i in range(30)]
    plain = write(tmp_path / "t.jsonl", records)
    (tmp_path / "ranks").mkdir()
    write(tmp_path / "ranks" / "requests.dp0.jsonl.gz", records[::2], compress=True)
    write(tmp_path / "ranks" / "requests.dp1.jsonl", records[1::2])
    (tmp_path / "ranks" / "notes.txt").write_text("not a trace")
    query = build_query(["output_tokens>=10"], sort="output_tokens", order="desc")
    one = list_requests([plain], query, limit=0)
    split = list_requests([tmp_path / "ranks"], query, limit=0)
    assert [row.output_tokens for row in one.rows] == list(range(29, 9, -1))
    assert ids(split) == ids(one)
    assert len(split.files) == 2


def test_truncated_gzip_lists_what_came_before_the_damage(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl.gz", [rec(i) for i in range(3000)], compress=True)
    path.write_bytes(path.read_bytes()[:-2000])
    result = invoke("trace", "list", str(path), "--limit", "5", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert 0 < data["records"] < 3000 and data["next_cursor"] is not None
    assert "gzip data is truncated" in result.stderr


# ---------------------------------------------------------------------------------------------
# The command line


def test_cli_list_prints_a_table_and_pages_through_json_cursors(tmp_path: Path) -> None:
    records = [rec(i, output=i, model="qwen", tags={"task": "sql" if i % 2 else "chat"}) for i in range(12)]
    path = write(tmp_path / "t.jsonl", records)
    text = invoke("trace", "list", str(path), "--filter", "output_tokens>5", "--task", "sql", "--limit", "2")
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    assert lines[0] == ("requests 1-2 of 3 matching output_tokens>5, task = sql (12 records read), "
                        "by t_arrival ascending")
    assert lines[2].split() == ["arrival", "(UTC)", "request", "id", "model", "task", "prompt", "output", "ttft", "s",
                                "e2e", "s", "queue", "s", "finish"]
    assert lines[3].split()[:6] == ["2026-12-05", "07:30:07.000", "chatcmpl-00000007", "qwen", "sql", "100"]
    assert lines[-1].startswith("next page: --cursor c1.")

    seen: list[str] = []
    cursor: list[str] = []
    while True:
        result = invoke("trace", "list", str(path), "--sort", "latency", "--order", "desc", "--limit", "5", "--json",
                        *cursor)
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        seen += [row["request_id"] for row in data["rows"]]
        assert all(row["file"] == str(path.resolve()) for row in data["rows"])
        if data["next_cursor"] is None:
            break
        cursor = ["--cursor", data["next_cursor"]]
    assert seen == [r["request_id"] for r in records]  # equal latencies: file order


def test_cli_list_shows_a_sort_field_that_is_not_a_column(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [rec(0, energy_j=5.0), rec(1, energy_j=9.5)])
    result = invoke("trace", "list", str(path), "--sort", "energy", "--order", "desc", "--json")
    assert [row["energy_j"] for row in json.loads(result.stdout)["rows"]] == [9.5, 5.0]
    text = invoke("trace", "list", str(path), "--sort", "energy")
    assert text.stdout.splitlines()[2].endswith("energy_j")


@pytest.mark.parametrize(("args", "said"), [
    (["--filter", "bogus>1"], "unknown field 'bogus'"),
    (["--filter", "output_tokens"], "operators: > >= < <= = !="),
    (["--order", "sideways"], "is not asc or desc"),
    (["--since", "last tuesday"], "is not a time"),
    (["--cursor", "nonsense"], "is not a cursor of trace list"),
    (["--limit", "-1"], "--limit -1 is negative"),
])
def test_cli_list_mistakes_exit_2_with_the_fix(tmp_path: Path, args: list[str], said: str) -> None:
    path = write(tmp_path / "t.jsonl", [rec(0)])
    result = invoke("trace", "list", str(path), *args)
    assert result.exit_code == 2
    assert said in result.stderr and "fix:" in result.stderr
    assert "Traceback" not in result.output


def test_cli_list_of_a_missing_file_says_so(tmp_path: Path) -> None:
    result = invoke("trace", "list", str(tmp_path / "missing.jsonl"))
    assert result.exit_code == 1
    assert "does not exist" in result.stderr


def test_cli_list_with_nothing_matching_says_so(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [rec(0), rec(1)])
    result = invoke("trace", "list", str(path), "--model", "absent")
    assert result.exit_code == 0
    assert result.stdout.strip() == "no requests (0 matching model = absent; 2 records read)"


# ---------------------------------------------------------------------------------------------
# trace show


def test_reasoning_is_split_from_the_content() -> None:
    assert split_reasoning("<think>\nplan it\n</think>\n\nThe answer.") == ("plan it", "The answer.")
    # The template opened the block in the prompt: the output starts inside it.
    assert split_reasoning("plan it</think>The answer.") == ("plan it", "The answer.")
    # Cut short while reasoning.
    assert split_reasoning("<think>still going") == ("still going", "")
    assert split_reasoning("Plain answer <b>") == (None, "Plain answer <b>")
    assert split_reasoning("<think></think>Hi") == ("", "Hi")


def full_conversation() -> list[dict[str, Any]]:
    prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    return [
        rec(0, rid="chatcmpl-aa", model="qwen", tenant="acme", tags={"task": "math", "team": "x"},
            prompt_text=prompt, output_text="<think>two and two</think>\n\n4", energy_j=1.25, preemptions=1,
            cached_prompt_tokens=64, priority_score=-3.5),
        rec(1, rid="chatcmpl-bb"),
        rec(2, rid="chatcmpl-aa", prompt_text=prompt, output_text="Four."),
    ]


def test_show_finds_every_record_of_an_id_and_by_engine_id(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [*full_conversation(), "{damaged chatcmpl-aa"])
    request = find_request([path], "chatcmpl-aa")
    assert [item.line for item in request.found] == [1, 3]
    assert request.bad_lines == 1  # a damaged line that could have been the record is reported
    engine_id = full_conversation()[1]["engine_request_id"]
    by_engine = find_request([path], engine_id)
    assert [(item.line, item.matched_by) for item in by_engine.found] == [(2, "engine_request_id")]
    assert find_request([path], "chatcmpl-a").found == []
    # An id with characters JSON may escape is still found (every line is parsed then).
    odd = write(tmp_path / "odd.jsonl", [rec(0, rid='chatcmpl-"quoted"/é')])
    assert len(find_request([odd], 'chatcmpl-"quoted"/é').found) == 1


def test_cli_show_prints_the_request_in_full(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl.gz", full_conversation(), compress=True)
    result = invoke("trace", "show", "chatcmpl-aa", str(path))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith("2 records have the id chatcmpl-aa (with n > 1")
    assert f"record 1 of 2: chatcmpl-aa   ({path}:1)" in out
    for fact in ("model                qwen", "tenant               acme", "tags                 task=math, team=x",
                 "arrival              2026-12-05 07:30:00.000 UTC", "time to first token  0.100 s",
                 "prompt tokens        100 (64 from the prefix cache)", "priority score       -3.500",
                 "preemptions          1", "energy               1.250 J", "scheduler family     fcfs"):
        assert fact in out, fact
    first, second = out.split("record 2 of 2")
    assert "  reasoning:\n    two and two\n\n  answer:\n    4" in first
    assert "    What is 2+2?<|im_end|>" in first
    assert "reasoning" not in second and "  answer:\n    Four." in second


def test_cli_show_json_and_standard_level(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", full_conversation())
    data = json.loads(invoke("trace", "show", "chatcmpl-aa", str(path), "--json").stdout)
    assert [item["record"] == expected for item, expected in
            zip(data["records"], [full_conversation()[0], full_conversation()[2]], strict=True)] == [True, True]
    assert (data["records"][0]["reasoning"], data["records"][0]["content"]) == ("two and two", "4")
    standard = invoke("trace", "show", "chatcmpl-bb", str(path))
    assert standard.stdout.startswith("request: chatcmpl-bb")
    assert "prompt and answer: not recorded (a standard-level trace" in standard.stdout


def test_cli_show_of_an_unknown_id_names_trace_list(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", full_conversation())
    result = invoke("trace", "show", "chatcmpl-zz", str(path))
    assert result.exit_code == 1
    assert "error: no request with the id 'chatcmpl-zz'" in result.stderr
    assert f"trace list {path}" in result.stderr
    assert "Traceback" not in result.output


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
SENT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "user", "content": "And Rome?"},
]
ANSWER = ('Paris was sunny; now Rome.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
          "\n</tool_call>")


def tiny_record(**extra: Any) -> dict[str, Any]:
    """A full-level record as the tiny model's recipe writes it: the prompt its chat template renders."""
    from carbonforge_runtime.offline.trace_tools import chat_parse
    from carbonforge_runtime.recipes import chat_templates

    prompt = chat_parse.render(chat_templates.TEMPLATES["tiny"], chat_parse.template_messages(SENT), TOOLS)
    return rec(0, rid="chatcmpl-tiny", prompt_text=prompt, output_text=ANSWER, **extra)


def test_show_reads_the_messages_back_with_the_models_chat_template(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [tiny_record(model="carbonforge/tiny-chat")])
    result = invoke("trace", "show", "chatcmpl-tiny", str(path))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert ("  messages (read back from the prompt with the tiny chat template):\n"
            "    [system]\n      Be brief.\n    [user]\n      Weather in Paris?\n"
            "    [assistant]\n      tool call call_1: get_weather({\"city\": \"Paris\"})\n"
            "    [tool call_1]\n      sunny\n    [user]\n      And Rome?\n\n  tools offered: get_weather") in out
    assert ("  reasoning:\n    Paris was sunny; now Rome.\n\n  answer:\n"
            "    tool call call_2: get_weather({\"city\": \"Rome\"})") in out
    assert "<|im_start|>" not in out
    data = json.loads(invoke("trace", "show", "chatcmpl-tiny", str(path), "--json").stdout)["records"][0]
    assert data["template"] == "tiny"
    assert data["messages"] == SENT and data["tools"] == TOOLS
    assert data["answer"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert (data["reasoning"], data["content"]) == ("Paris was sunny; now Rome.", "")


def test_show_falls_back_to_the_prompt_and_says_why(tmp_path: Path) -> None:
    unnamed = tiny_record()  # no model field: the template is not known
    other = {**tiny_record(model="Qwen/Qwen3-Coder-Next-FP8"), "request_id": "chatcmpl-other"}
    broken = {**tiny_record(model="carbonforge/tiny-chat"), "request_id": "chatcmpl-broken",
              "prompt_text": "plain text, no template"}
    path = write(tmp_path / "t.jsonl", [unnamed, other, broken])

    shown = invoke("trace", "show", "chatcmpl-tiny", str(path)).stdout
    assert "  prompt (as the engine served it, chat template included):\n    <|im_start|>system" in shown
    assert "(messages not rebuilt: the record does not name its model" in shown
    assert "  reasoning:\n    Paris was sunny; now Rome.\n\n  answer:\n    <tool_call>" in shown
    with_template = invoke("trace", "show", "chatcmpl-tiny", str(path), "--template", "tiny").stdout
    assert "    [tool call_1]\n      sunny" in with_template

    assert "no vendored chat template for Qwen/Qwen3-Coder-Next-FP8" in invoke(
        "trace", "show", "chatcmpl-other", str(path)).stdout
    data = json.loads(invoke("trace", "show", "chatcmpl-broken", str(path), "--json").stdout)["records"][0]
    assert data["messages"] is None
    assert data["messages_not_rebuilt"].startswith("the prompt does not read back with the tiny template")

    refused = invoke("trace", "show", "chatcmpl-tiny", str(path), "--template", "llama")
    assert refused.exit_code == 2
    assert "--template 'llama' is not a vendored chat template" in refused.stderr
    assert "qwen3_coder, qwen3_coder_vllm, qwen3_next_instruct, tiny" in refused.stderr


# ---------------------------------------------------------------------------------------------
# Any input (the strategies of the offline tools' hostile-input tests)


def _hostile_files() -> Any:
    from tests.unit.offline.test_hostile_input import TRACE_FIELDS, lines_file, record_line

    names = st.sampled_from(["qwen", "sql", "x"])
    fields = {**TRACE_FIELDS, "model": names, "tenant": names, "tags": st.fixed_dictionaries({"task": names}),
              "engine_request_id": st.text(max_size=8), "energy_j": st.none() | st.floats(0, 100),
              "preemptions": st.integers(0, 3), "cached_prompt_tokens": st.none() | st.integers(0, 100)}
    return lines_file(record_line(fields))


@settings(max_examples=80, deadline=None)
@given(data=_hostile_files(), sort=st.sampled_from(["t_arrival", "ttft", "energy_j", "preemptions"]),
       order=st.sampled_from(["asc", "desc"]), limit=st.integers(0, 3), as_json=st.booleans(),
       narrow=st.sampled_from([[], ["--filter", "output_tokens>=1"], ["--task", "sql"], ["--model", "qwen"],
                               ["--since", "1750000000", "--filter", "latency<5000"]]))
def test_list_and_show_survive_any_input(data: bytes, sort: str, order: str, limit: int, as_json: bool,
                                         narrow: list[str]) -> None:
    from tests.unit.offline.test_hostile_input import assert_own_error

    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "t.jsonl"
        trace.write_bytes(data)
        options = ["--sort", sort, "--order", order, "--limit", str(limit), *narrow]
        result = invoke("trace", "list", str(trace), *options, "--json")
        assert_own_error(result, {1})
        if result.exit_code == 0:
            page = json.loads(result.stdout)
            assert len(page["rows"]) <= (limit or len(page["rows"]))
            if page["next_cursor"] is not None:
                assert_own_error(invoke("trace", "list", str(trace), *options, "--cursor", page["next_cursor"]), {1})
            if page["rows"]:
                wanted = page["rows"][0]["request_id"]
                shown = invoke("trace", "show", wanted, str(trace), *(["--json"] if as_json else []))
                assert_own_error(shown, {1})
                assert shown.exit_code == 0
        assert_own_error(invoke("trace", "list", str(trace), *options), {1})
        assert_own_error(invoke("trace", "show", "chatcmpl-x", str(trace)), {1})
