"""Offline tools on hostile input: any bytes, any JSON values, huge numbers and huge lines.

Each tool is run through its command line in-process. Whatever the input, it ends with exit code
0 (the input happened to be usable) or its own documented error code, one ``error:`` line on
stderr, and never a traceback. A single 100 MB line is refused in bounded memory, measured in a
subprocess.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli

runner = CliRunner()
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])
#: Nothing listens on port 9 (discard) here: a replay that gets as far as sending fails to connect.
DEAD_URL = "http://127.0.0.1:9/v1"


# --------------------------------------------------------------------------------------------
# Strategies


@dataclass(frozen=True)
class Raw:
    """A JSON token written as is (numbers no encoder produces, nesting no parser survives)."""

    text: str


RAW_TOKENS = st.sampled_from([
    "1e999", "-1e999", "NaN", "-Infinity", "Infinity", "1e-999", "-0", "1" + "0" * 5000, "-" + "9" * 400,
    "123456789012345678901234567890", "18446744073709551616", "1.7976931348623157e308",
    "[" * 3000 + "]" * 3000, '{"a":' * 3000 + "1" + "}" * 3000,
]).map(Raw)

HUGE_INTS = st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30, 10**400, -(10**400)])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=1e300),
    st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def hostile(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value: a valid one, any JSON value, or a raw token."""
    return st.one_of(valid, valid, JSON_VALUES, RAW_TOKENS)


def encode(value: Any) -> str:
    """JSON text of ``value``, with any :class:`Raw` inside written as is."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{encode(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(encode(v) for v in value) + "]"
    return json.dumps(value)


def record_line(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[bytes]:
    """One JSON object line; each field present or not, valid or hostile."""
    optional = {name: hostile(valid) for name, valid in fields.items()}
    records = st.fixed_dictionaries({}, optional=optional)
    return records.map(lambda record: encode(record).encode("utf-8", "surrogatepass"))


def json_line() -> st.SearchStrategy[bytes]:
    return st.one_of(JSON_VALUES.map(lambda v: json.dumps(v).encode()), RAW_TOKENS.map(lambda r: r.text.encode()))


def lines_file(records: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """A file of lines: mostly records, some any JSON, some any bytes; plain or gzip, maybe damaged."""
    line = st.one_of(records, records, records, json_line(), st.binary(max_size=40), st.just(b""))
    body = st.lists(line, max_size=8).map(b"\n".join)
    return st.one_of(
        body, body, body, st.binary(max_size=200),
        body.map(gzip.compress),
        st.tuples(body.map(gzip.compress), st.floats(0.0, 1.0)).map(lambda pair: pair[0][:int(len(pair[0]) * pair[1])]),
    )


NUMBER = st.one_of(st.floats(0, 1e4), st.integers(0, 10**6))
TIME = st.floats(1.7e9, 1.8e9)
TRACE_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "request_id": st.text(max_size=8).map(lambda s: f"chatcmpl-{s}"),
    "t_arrival": TIME,
    "t_completion": TIME,
    "e2e_latency_s": NUMBER,
    "queue_wait_s": NUMBER,
    "ttft_s": st.none() | NUMBER,
    "prompt_tokens": st.integers(1, 10**6),
    "output_tokens": st.integers(0, 10**5),
    "scheduler_family": st.sampled_from(["fcfs", "ltr", "hybrid"]),
    "prompt_text": st.text(max_size=30),
    "output_text": st.text(max_size=30),
    "prefix_hash": st.integers(-(2**63), 2**63 - 1),
    "finish_reason": st.sampled_from(["stop", "length", "abort", "error"]),
    "template": st.text(max_size=8),
}
TRACE_FILES = lines_file(record_line(TRACE_FIELDS))


def azure_csv() -> st.SearchStrategy[bytes]:
    cell = st.one_of(st.integers(-5, 10**6).map(str), st.sampled_from(
        ["1e999", "nan", "inf", "-inf", "1" + "0" * 400, "2023-11-16 18:15:46.6805900", "9999-12-31 23:59:59",
         "0001-01-01 00:00:00", "2023-11-16 18:15:46.x", "", '"', "\x00", "10000000000000000000000"]),
        st.text(max_size=10), st.floats(allow_nan=True, allow_infinity=True).map(repr))
    row = st.lists(cell, min_size=2, max_size=4).map(lambda cells: ",".join(cells).encode("utf-8", "surrogatepass"))
    header = st.sampled_from([b"TIMESTAMP,ContextTokens,GeneratedTokens", b"ContextTokens,TIMESTAMP,GeneratedTokens",
                              b"TIMESTAMP,ContextTokens", b"", b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens"])
    line = st.one_of(row, row, row, st.binary(max_size=30))
    body = st.tuples(header, st.lists(line, max_size=6)).map(lambda pair: b"\n".join([pair[0], *pair[1]]))
    return st.one_of(body, body, body.map(gzip.compress), st.binary(max_size=100))


# --------------------------------------------------------------------------------------------
# Checks


def run_cli(*args: str, env: dict[str, str] | None = None) -> Any:
    return runner.invoke(cli.app, list(args), env=env)


def assert_own_error(result: Any, codes: set[int]) -> None:
    """Exit code 0 or the tool's documented one; a one-line error on failure; no traceback."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        trace = "".join(traceback.format_exception(result.exception))
        raise AssertionError(f"the tool raised instead of reporting an error:\n{trace}")
    assert result.exit_code in codes | {0}, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    if result.exit_code != 0:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, result.output


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# --------------------------------------------------------------------------------------------
# Any input, each tool


@FUZZ
@given(data=TRACE_FILES, as_json=st.booleans())
def test_trace_summarize_survives_any_input(tmp_path: Path, data: bytes, as_json: bool) -> None:
    trace = write(tmp_path / "t.jsonl", data)
    result = run_cli("trace", "summarize", str(trace), *(["--json"] if as_json else []))
    assert_own_error(result, {1})


@FUZZ
@given(data=TRACE_FILES, window=st.one_of(st.just("60s"), st.text(max_size=8),
                                          st.sampled_from(["1e-300", "1e300s", "nan", "5e-324ms", "-1m"])))
def test_trace_summarize_survives_any_window(tmp_path: Path, data: bytes, window: str) -> None:
    trace = write(tmp_path / "t.jsonl", data)
    result = run_cli("trace", "summarize", str(trace), "--window", window)
    assert_own_error(result, {1, 2})


@FUZZ
@given(data=TRACE_FILES, as_json=st.booleans())
def test_trace_sessions_survives_any_input(tmp_path: Path, data: bytes, as_json: bool) -> None:
    trace = write(tmp_path / "t.jsonl", data)
    result = run_cli("trace", "sessions", str(trace), "-o", str(tmp_path / "groups.jsonl"),
                     *(["--json"] if as_json else []))
    assert_own_error(result, {1})


@settings(FUZZ, max_examples=25)
@given(data=TRACE_FILES, window=st.sampled_from(["60s", "1s", "1h", "1ms"]))
def test_trace_plot_survives_any_input(tmp_path: Path, data: bytes, window: str) -> None:
    trace = write(tmp_path / "t.jsonl", data)
    result = run_cli("trace", "plot", str(trace), "-o", str(tmp_path / "p.png"), "--window", window)
    assert_own_error(result, {1})


REPLAY_OPTIONS = st.lists(st.sampled_from([
    ["--token-scale", "1e300"], ["--token-scale", "1e-300"], ["--rate", "1e-300"], ["--rate", "1e300"],
    ["--limit", "2"], ["--start", "3"], ["--prompt-format", "text"], ["--prompt-format", "ids"],
    ["--max-prompt-tokens", "5"], ["--token-ids", "0:1"],
]), max_size=2)


def _replay(tmp_path: Path, trace: Path, options: list[list[str]]) -> Any:
    flat = [arg for pair in options for arg in pair]
    return run_cli("replay", str(trace), "--base-url", DEAD_URL, "-o", str(tmp_path / "r.json"), "--quiet",
                   "--request-timeout-s", "2", "--deadline-s", "5", *flat)


@FUZZ
@given(data=TRACE_FILES, options=REPLAY_OPTIONS)
def test_replay_survives_any_jsonl_recording(tmp_path: Path, data: bytes, options: list[list[str]]) -> None:
    # Nothing listens at DEAD_URL: a usable recording ends in "cannot reach" (2), so every outcome is an error.
    result = _replay(tmp_path, write(tmp_path / "t.jsonl", data), options)
    assert_own_error(result, {1, 2})
    assert result.exit_code != 0


@FUZZ
@given(data=azure_csv(), options=REPLAY_OPTIONS)
def test_replay_survives_any_azure_csv(tmp_path: Path, data: bytes, options: list[list[str]]) -> None:
    result = _replay(tmp_path, write(tmp_path / "t.csv", data), options)
    assert_own_error(result, {1, 2})
    assert result.exit_code != 0


def test_replay_refuses_a_huge_token_count_before_planning(tmp_path: Path) -> None:
    """A recorded size no model has is refused with its line, not turned into a prompt."""
    lines = [json.dumps({"t_arrival": 1.0, "prompt_tokens": 3, "output_tokens": 2}),
             json.dumps({"t_arrival": 2.0, "prompt_tokens": 10**12, "output_tokens": 2})]
    trace = write(tmp_path / "t.jsonl", ("\n".join(lines) + "\n").encode())
    started = time.monotonic()
    result = _replay(tmp_path, trace, [])
    assert_own_error(result, {2})
    assert result.exit_code == 2 and f"{trace}:2: prompt_tokens=1000000000000 is above" in result.stderr
    assert time.monotonic() - started < 5
    csv = write(tmp_path / "t.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n0,3,4\n1,5,99999999999\n")
    result = _replay(tmp_path, csv, [])
    assert result.exit_code == 2 and f"{csv}:3: GeneratedTokens=99999999999 is above" in result.stderr


def test_replay_plan_makes_prompts_only_when_sent() -> None:
    """The plan of a large recording holds sizes, not prompts: memory does not grow with the token counts."""
    from carbonforge_runtime.offline.replay.plan import PlanOptions, build_plan
    from carbonforge_runtime.offline.replay.trace import MAX_REQUEST_TOKENS, RecordedRequest, Recording

    requests = tuple(RecordedRequest(i, float(i), MAX_REQUEST_TOKENS, 1) for i in range(1000))
    started = time.monotonic()
    plan = build_plan(Recording("big", "jsonl-standard", requests), PlanOptions())
    assert time.monotonic() - started < 2  # a billion token ids would take minutes and gigabytes
    assert len(plan) == 1000 and plan[-1].prompt_tokens == MAX_REQUEST_TOKENS
    small = build_plan(Recording("small", "jsonl-standard", requests[:2]), PlanOptions(max_prompt_tokens=7))
    assert small[0].prompt == small[0].prompt and len(small[0].prompt) == 7
    assert small[0].prompt != small[1].prompt


LTR_FIELDS = {name: TRACE_FIELDS[name] for name in
              ("t_arrival", "prompt_tokens", "output_tokens", "prefix_hash", "finish_reason", "prompt_text")}
LTR_TRACES = lines_file(record_line(LTR_FIELDS))


@FUZZ
@given(data=LTR_TRACES, holdout=st.sampled_from(["0.2", "0", "0.99"]))
def test_ltr_fit_survives_any_trace(tmp_path: Path, data: bytes, holdout: str) -> None:
    trace = write(tmp_path / "t.jsonl", data)
    result = run_cli("ltr", "fit", str(trace), "-o", str(tmp_path / "m.json"), "--holdout", holdout)
    assert_own_error(result, {1, 2})


def _valid_model() -> dict[str, Any]:
    return {"format": "carbonforge-ltr", "version": 1, "observations": 3,
            "params": {"prior_weight": 4.0, "ridge": 2.0, "max_weight": 2000.0, "max_keys": 4096},
            "global": [3.0, 12.0, 9.0, 50.0, 40.0], "keys": {"7": [2.0, 8.0, 6.0, 33.0, 25.0]}}


def _model_files() -> st.SearchStrategy[bytes]:
    def stats() -> st.SearchStrategy[Any]:
        return hostile(st.lists(st.floats(0, 100), min_size=5, max_size=5))

    structured = st.fixed_dictionaries({}, optional={
        "format": hostile(st.just("carbonforge-ltr")), "version": hostile(st.just(1)),
        "observations": hostile(st.integers(0, 100)),
        "params": hostile(st.fixed_dictionaries({}, optional={
            "prior_weight": hostile(st.floats(0, 10)), "ridge": hostile(st.floats(0, 10)),
            "max_weight": hostile(st.floats(1, 1e4)), "max_keys": hostile(st.integers(1, 10))})),
        "global": stats(),
        "keys": hostile(st.dictionaries(st.one_of(st.integers().map(str), st.text(max_size=4)), stats(),
                                        max_size=3)),
    }).map(lambda doc: encode(doc).encode("utf-8", "surrogatepass"))
    return st.one_of(structured, structured, st.binary(max_size=100), json_line(),
                     st.just(json.dumps(_valid_model()).encode()),
                     st.just(json.dumps(_valid_model()).encode()).map(gzip.compress))


@FUZZ
@given(model=_model_files(), data=st.one_of(st.just(None), LTR_TRACES), online=st.booleans())
def test_ltr_eval_survives_any_model_and_trace(tmp_path: Path, model: bytes, data: bytes | None,
                                              online: bool) -> None:
    if data is None:  # a usable trace, so the model's contents are what is tested
        lines = [json.dumps({"t_arrival": i, "prompt_tokens": 10 + i, "output_tokens": 5 * i + 1, "prefix_hash": 7})
                 for i in range(4)]
        data = "\n".join(lines).encode()
    trace = write(tmp_path / "t.jsonl", data)
    result = run_cli("ltr", "eval", str(write(tmp_path / "m.json", model)), str(trace),
                     *(["--online"] if online else []))
    assert_own_error(result, {1, 2})


# --------------------------------------------------------------------------------------------
# sim and sim-calibrate (fewer examples: sim runs vLLM's scheduler in virtual time)

SIM_FUZZ = settings(FUZZ, max_examples=30)
#: Mooncake's fields beside ours: sim reads that format too.
SIM_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **{name: TRACE_FIELDS[name] for name in ("t_arrival", "prompt_tokens", "output_tokens", "prompt_text",
                                              "prefix_hash", "request_id")},
    "timestamp": st.integers(0, 10**6), "input_length": st.integers(1, 4000), "output_length": st.integers(1, 50),
    "hash_ids": st.lists(st.integers(0, 50), max_size=4),
}


@SIM_FUZZ
@given(data=st.one_of(lines_file(record_line(SIM_FIELDS)), azure_csv()), csv=st.booleans(),
       options=st.lists(st.sampled_from([["--token-scale", "1e300"], ["--rate", "1e-300"], ["--load", "1e300"],
                                         ["--start", "2"], ["--kv-tokens", "16"], ["--max-model-len", "64"]]),
                        max_size=2))
def test_sim_survives_any_input(tmp_path: Path, data: bytes, csv: bool, options: list[list[str]]) -> None:
    trace = write(tmp_path / ("t.csv" if csv else "t.jsonl"), data)
    flat = [arg for pair in options for arg in pair]
    result = run_cli("sim", str(trace), "--context-key", "cf-tiny:bf16:chat:cpu", "--cost-model", "l4-tp1",
                     "--limit", "8", "-o", str(tmp_path / "s.json"), "--quiet", *flat)
    assert_own_error(result, {1, 2})


def _steps(count: int) -> list[bytes]:
    steps = []
    for number in range(1, count + 1):
        steps.append(json.dumps({"kind": "step", "engine": 0, "step": number, "t": 1.78e9 + number,
                                 "wall_s": 0.01 + number * 1e-4, "batched_tokens": 10 * number,
                                 "kv_read_tokens": 100 * number, "attention_units": float(number * number)}).encode())
    return steps


STEP_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "kind": st.sampled_from(["step", "engine", "other"]), "engine": st.integers(0, 3), "step": st.integers(0, 10**6),
    "t": TIME, "wall_s": st.floats(1e-4, 10.0), "batched_tokens": st.integers(0, 10**5),
    "kv_read_tokens": st.integers(0, 10**7), "attention_units": st.floats(0, 1e12),
    "tensor_parallel_size": st.integers(1, 8), "kv_cache_tokens": st.integers(0, 10**7),
}


@st.composite
def step_logs(draw: st.DrawFn) -> bytes:
    """Any lines, or enough valid steps to reach the fit with hostile records among them."""
    hostile_lines = st.lists(st.one_of(record_line(STEP_FIELDS), json_line(), st.binary(max_size=40)), max_size=6)
    if draw(st.booleans()):
        return draw(lines_file(record_line(STEP_FIELDS)))
    lines = _steps(draw(st.integers(0, 40)))
    for line in draw(hostile_lines):
        lines.insert(draw(st.integers(0, len(lines))), line)
    body = b"\n".join(lines)
    return gzip.compress(body) if draw(st.booleans()) else body


@SIM_FUZZ
@given(data=step_logs(), gpu=st.sampled_from(["h100", "", "x" * 300, "a: b"]))
def test_sim_calibrate_survives_any_step_log(tmp_path: Path, data: bytes, gpu: str) -> None:
    log = write(tmp_path / "steps.jsonl", data)
    result = run_cli("sim-calibrate", str(log), "-o", str(tmp_path / "model.yaml"), "--gpu", gpu)
    assert_own_error(result, {1, 2})


# --------------------------------------------------------------------------------------------
# One 100 MB line, in bounded memory

HUNDRED_MB = 100 * 1000 * 1000
_MEASURE = textwrap.dedent("""
    import sys, time
    from carbonforge_runtime.cli.main import main
    started = time.monotonic()
    try:
        main(sys.argv[1:])
        code = 0
    except SystemExit as exc:
        code = exc.code
    # VmHWM is this program's own peak; ru_maxrss would also count the forking test process's memory
    with open("/proc/self/status") as status:
        peak_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    rss_mib = peak_kib / 1024
    print(f"MEASURE code={code} rss_mib={rss_mib:.0f} seconds={time.monotonic() - started:.2f}", file=sys.stderr)
""")


def one_huge_line_gzip(path: Path, size: int = HUNDRED_MB) -> Path:
    """A gzip file whose content is one line of ``size`` bytes (a JSON string that never ends), about 100 KB."""
    chunk = b"a" * (1 << 20)
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    with path.open("wb") as handle:
        handle.write(compressor.compress(b'{"t_arrival": 1, "prompt_text": "'))
        written = 0
        while written < size:
            piece = chunk[: size - written]
            handle.write(compressor.compress(piece))
            written += len(piece)
        handle.write(compressor.compress(b'"}\n'))
        handle.write(compressor.flush())
    return path


def one_huge_line_sparse(path: Path, size: int = HUNDRED_MB) -> Path:
    """A plain file of ``size`` zero bytes and no newline; sparse, so it takes no disk."""
    with path.open("wb") as handle:
        handle.truncate(size)
    return path


def measure(*args: str) -> tuple[int, float, float, str]:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CF_LOG_LEVEL": "warning"})
    line = next(line for line in proc.stderr.splitlines() if line.startswith("MEASURE "))
    fields = dict(part.split("=", 1) for part in line.split()[1:])
    return int(fields["code"]), float(fields["rss_mib"]), float(fields["seconds"]), proc.stderr


@pytest.fixture(scope="module")
def huge_lines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("huge")
    gz = one_huge_line_gzip(folder / "one-line.jsonl.gz")
    csv_gz = folder / "one-line-gz.csv"
    csv_gz.write_bytes(gz.read_bytes())
    return {"gzip.jsonl": gz, "plain.jsonl": one_huge_line_sparse(folder / "one-line.jsonl"),
            "gzip.csv": csv_gz, "plain.csv": one_huge_line_sparse(folder / "one-line.csv")}


#: Peak RSS allowed for a tool refusing one 100 MB line (the interpreter and imports take about 60-100 MiB).
MAX_RSS_MIB = 200

TOOLS = {
    "trace summarize": (["trace", "summarize"], [], "jsonl"),
    "trace sessions": (["trace", "sessions"], [], "jsonl"),
    "trace plot": (["trace", "plot"], ["-o", "{out}/p.png"], "jsonl"),
    "replay": (["replay"], ["--base-url", DEAD_URL, "-o", "{out}/r.json", "--quiet"], "jsonl"),
    "replay (Azure CSV)": (["replay"], ["--base-url", DEAD_URL, "-o", "{out}/r.json", "--quiet"], "csv"),
    "ltr fit": (["ltr", "fit"], ["-o", "{out}/m.json"], "jsonl"),
    "ltr eval": (["ltr", "eval", "{model}"], [], "jsonl"),
}


@pytest.mark.parametrize("kind", ["gzip", "plain"])
@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_100_mb_line_is_refused_in_bounded_memory(tool: str, kind: str, huge_lines: dict[str, Path],
                                                    tmp_path: Path) -> None:
    head, tail, suffix = TOOLS[tool]
    model = write(tmp_path / "model.json", json.dumps(_valid_model()).encode())
    fill = {"out": str(tmp_path), "model": str(model)}
    trace = str(huge_lines[f"{kind}.{suffix}"])
    args = [part.format(**fill) for part in head] + [trace] + [part.format(**fill) for part in tail]
    exit_code, rss_mib, seconds, stderr = measure(*args)
    print(f"{tool} ({kind}): exit {exit_code}, peak RSS {rss_mib:.0f} MiB, {seconds:.2f} s")
    assert exit_code == 1, stderr  # the trace reader's error: the file cannot be read as a trace
    assert "Traceback" not in stderr
    assert "line 1 is longer than 16 MiB" in stderr, stderr
    assert rss_mib < MAX_RSS_MIB, stderr


# --------------------------------------------------------------------------------------------
# Every field read, every hostile number: always checked, not only when the search finds it

HOSTILE_TOKENS = ["1e999", "-1e999", "NaN", "Infinity", "1" + "0" * 400, "-" + "9" * 400, "18446744073709551616",
                  "1e308", "-1e308", "true", '"12"', "null", "[1]", "{}", "[" * 3000 + "]" * 3000]
_BASE = {"request_id": "chatcmpl-1", "t_arrival": 1.7e9, "t_completion": 1.7e9 + 2, "e2e_latency_s": 2.0,
         "queue_wait_s": 0.5, "ttft_s": 0.1, "prompt_tokens": 12, "output_tokens": 5, "scheduler_family": "fcfs",
         "prompt_text": "<|im_start|>user\nhi<|im_end|>\n", "output_text": "hello", "prefix_hash": 7,
         "finish_reason": "stop"}
MATRIX_TOOLS = {
    "trace summarize": (["trace", "summarize", "{trace}"], {1}),
    "trace sessions": (["trace", "sessions", "{trace}"], {1}),
    "replay": (["replay", "{trace}", "--base-url", DEAD_URL, "-o", "{out}/r.json", "--quiet"], {1, 2}),
    "ltr fit": (["ltr", "fit", "{trace}", "-o", "{out}/m.json", "--holdout", "0.5"], {1, 2}),
    "ltr eval": (["ltr", "eval", "{model}", "{trace}"], {1, 2}),
}


@pytest.mark.parametrize("tool", list(MATRIX_TOOLS))
@pytest.mark.parametrize("name", [name for name in _BASE if name != "request_id"] + ["request_id"])
def test_every_field_with_every_hostile_number(tool: str, name: str, tmp_path: Path) -> None:
    args, codes = MATRIX_TOOLS[tool]
    model = write(tmp_path / "model.json", json.dumps(_valid_model()).encode())
    for number, token in enumerate(HOSTILE_TOKENS):
        good = encode({**_BASE, "t_arrival": 1.7e9 + number})
        bad = encode({**_BASE, name: Raw(token)})
        trace = write(tmp_path / f"t{number}.jsonl", f"{good}\n{bad}\n{good}\n".encode())
        fill = {"trace": str(trace), "out": str(tmp_path), "model": str(model)}
        result = run_cli(*[part.format(**fill) for part in args])
        assert_own_error(result, codes)
