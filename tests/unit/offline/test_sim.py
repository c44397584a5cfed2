"""``sim``'s inputs and results (issue 16, acceptance 3): every input format, Mooncake hash ids and
full-level prompt text giving the expected prefix-cache hits, the result JSON in replay's shape, and
per-request records that ``trace summarize`` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from carbonforge_runtime.core.twin_data import SimError, SimRequest, StepCostModel, TwinSettings
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.offline.sim.inputs import WindowOptions, load_trace, text_blocks, window
from carbonforge_runtime.offline.trace_reader import TraceInputError

MOONCAKE = Path("/work/shared/data/mooncake/synthetic_trace.jsonl")
FLAT = StepCostModel(name="flat", version=1, gpu="test", tensor_parallel_size=1, floor_ms=10.0,
                     per_batched_token_ms=0.0, per_kv_token_read_ms=0.0, attention_ms=0.0, overhead_ms=0.0,
                     kv_capacity_tokens=100_000, provenance="test")


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def lines(rows: list[dict[str, object]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def twin(requests: list[SimRequest]) -> list[int | None]:
    pytest.importorskip("vllm")
    from carbonforge_runtime.engine.twin import run_twin

    settings = TwinSettings(family="fcfs", params={}, max_num_seqs=8, max_num_batched_tokens=4096,
                            max_model_len=8192, kv_tokens=100_000, async_scheduling=False)
    return [o.cached_prompt_tokens for o in run_twin(requests, settings, FLAT).outcomes]


def test_azure_csv(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path / "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                                 "2023-11-16 18:15:46.5,374,44\n2023-11-16 18:15:48.0,396,0\n"))
    assert trace.kind == "azure-csv"
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.blocks) for r in trace.requests] == [
        (0.0, 374, 44, None), (1.5, 396, 1, None)]


def test_our_standard_and_full_traces(tmp_path: Path) -> None:
    std = load_trace(write(tmp_path / "s.jsonl", lines([
        {"t_arrival": 10.0, "prompt_tokens": 30, "output_tokens": 5},
        {"t_arrival": 12.5, "prompt_tokens": 20, "output_tokens": 3}])))
    assert std.kind == "jsonl-standard"
    assert [(r.arrival_s, r.prompt_tokens, r.blocks) for r in std.requests] == [(0.0, 30, None), (2.5, 20, None)]
    system = "You are a helpful assistant. " * 10  # 300 characters shared
    full = load_trace(write(tmp_path / "f.jsonl", lines([
        {"t_arrival": 1.0, "prompt_tokens": 100, "output_tokens": 4, "prompt_text": system + "first question?"},
        {"t_arrival": 2.0, "prompt_tokens": 100, "output_tokens": 4, "prompt_text": system + "another one!!"}])))
    assert full.kind == "jsonl-full"
    a, b = full.requests
    assert a.blocks is not None and b.blocks is not None and a.block_tokens == 16
    # 300 shared characters: four whole blocks of 64 characters are the same, the fifth differs.
    assert a.blocks[:4] == b.blocks[:4] and a.blocks[4] != b.blocks[4]
    assert text_blocks("x" * 64 + "y") != text_blocks("z" * 64 + "y")
    # Through the twin: four shared blocks of 16 tokens are a prefix-cache hit of 64 tokens.
    assert twin(list(full.requests)) == [0, 64]


def test_mooncake_hash_ids_give_the_expected_cached_tokens(tmp_path: Path) -> None:
    path = write(tmp_path / "m.jsonl", lines([
        {"timestamp": 0, "input_length": 1100, "output_length": 2, "hash_ids": [0, 1, 2]},
        {"timestamp": 5000, "input_length": 1100, "output_length": 2, "hash_ids": [0, 1, 3]},
        {"timestamp": 10000, "input_length": 600, "output_length": 2, "hash_ids": [0, 4]},
        {"timestamp": 15000, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]},
        {"timestamp": 20000, "input_length": 700, "output_length": 2, "hash_ids": [5, 6]},
    ]))
    trace = load_trace(path)
    assert trace.kind == "mooncake-jsonl"
    assert [r.arrival_s for r in trace.requests] == [0.0, 5.0, 10.0, 15.0, 20.0]
    assert trace.requests[0].blocks == (0, 1, 2) and trace.requests[0].block_tokens == 512
    # Two shared 512-token blocks: 1024 cached; one: 512; a prompt that is exactly two cached blocks:
    # all but the last (recomputed) token, rounded down to vLLM's 16-token blocks: 1008; none: 0.
    assert twin(list(trace.requests)) == [0, 1024, 512, 1008, 0]


@pytest.mark.skipif(not MOONCAKE.is_file(), reason="the shared Mooncake trace is not on this machine")
def test_the_shared_mooncake_trace_loads() -> None:
    trace = load_trace(MOONCAKE)
    assert len(trace.requests) == 3993 and trace.requests[0].blocks is not None
    assert 1000 < trace.requests[-1].arrival_s < 1100


def test_window_options_match_replay(tmp_path: Path) -> None:
    path = write(tmp_path / "m.jsonl", lines([
        {"timestamp": t * 1000, "input_length": 1024, "output_length": 10, "hash_ids": [t, t + 100]}
        for t in range(5)]))
    chosen = window(load_trace(path), WindowOptions(start=1, limit=3, rate=2.0, token_scale=0.5))
    assert [r.index for r in chosen] == [1, 2, 3]
    assert [r.arrival_s for r in chosen] == [0.0, 0.5, 1.0]
    assert {(r.prompt_tokens, r.output_tokens, r.block_tokens) for r in chosen} == {(512, 5, 256)}
    with pytest.raises(SimError, match="no request left"):
        window(load_trace(path), WindowOptions(start=9))


@pytest.mark.parametrize(("name", "text", "message"), [
    ("m.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1}\n', "lacks the Mooncake field"),
    ("m.jsonl", '{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": []}\n', "timestamp"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}\n', "input_length"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "x"}\n', "not a list"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}\n', "hash ids for"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]}\n', "hash id"),
    ("s.jsonl", '{"t_arrival": 0, "prompt_tokens": "many", "output_tokens": 1}\n', "prompt_tokens"),
])
def test_bad_traces_are_refused_with_their_line(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message) as caught:
        load_trace(write(tmp_path / name, text))
    assert ":1:" in caught.value.message


@pytest.mark.parametrize("name", ["missing.csv", "missing.jsonl"])
def test_a_missing_trace_is_told_what_sim_reads_not_the_runtimes_flag(tmp_path: Path, name: str) -> None:
    with pytest.raises(TraceInputError) as caught:
        load_trace(tmp_path / name)
    assert caught.value.message == f"trace file {tmp_path / name} does not exist"
    assert caught.value.remedy == ("check the path (the trace is an Azure-format CSV, a Mooncake JSONL trace or a "
                                   "trace written by serve's --trace-file)")
    assert "of the runtime" not in caught.value.render()


def test_unreadable_input_goes_through_the_shared_reader(tmp_path: Path) -> None:
    with pytest.raises(TraceInputError, match="does not exist"):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceInputError, match="not JSON"):
        load_trace(write(tmp_path / "bad.jsonl", "{nope\n"))
    with pytest.raises(TraceInputError, match="directory"):
        load_trace(tmp_path)
