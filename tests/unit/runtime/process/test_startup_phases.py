"""The start-up phase reader: a real vllm.log of the pinned vLLM's CPU engine, GPU-only phases built from
the pinned release's own format strings, and downloads seen in a Hugging Face cache folder."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from carbonforge_runtime.runtime.process import startup_phases as sp

HERE = Path(__file__).parent
#: The start of a real vllm.log (vLLM 0.32.0, CPU build, the built-in tiny model), up to the API
#: server's "Application startup complete." Paths were replaced by neutral ones.
CPU_LOG = HERE / "vllm-0.32-cpu-start.log"
#: A whole real vllm.log of the same engine failing to start: the weights file of the tiny model lost its
#: second half (tests/e2e/test_serve.py makes it so), and vLLM exits while it loads the weights.
TRUNCATED_LOG = HERE / "vllm-0.32-cpu-truncated-weights.log"
_STAMP = re.compile(r"\b(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) \[")


def stamp_seconds(line: str, previous: float) -> float:
    """The time vLLM printed on a line, in seconds (lines without one keep the previous time)."""
    found = _STAMP.search(line)
    if found is None:
        return previous
    _month, day, hour, minute, second = (int(part) for part in found.groups())
    return float(((day * 24 + hour) * 60 + minute) * 60 + second)


def replay(lines: list[str]) -> tuple[sp.StartupPhases, list[str], float]:
    """Feed lines on the log's own clock; returns the reader, the phase after each line, the last time."""
    now = next(stamp_seconds(line, -1.0) for line in lines if _STAMP.search(line))  # the first stamp
    phases = sp.StartupPhases(now)
    seen = [phases.phase]
    for line in lines:
        now = stamp_seconds(line, now)
        phases.feed(line, now)
        if seen[-1] != phases.phase:
            seen.append(phases.phase)
    return phases, seen, now


def cpu_lines(tmp_path: Path, chunk: int) -> list[str]:
    """The CPU log as the supervisor reads it: appended to a file in pieces of ``chunk`` bytes (which
    cut lines, multi-byte characters and carriage-return line ends), read after each piece."""
    data = CPU_LOG.read_bytes()
    target = tmp_path / "vllm.log"
    target.write_bytes(b"older run\n")
    follower = sp.LogFollower(target, offset=target.stat().st_size)
    lines: list[str] = []
    for start in range(0, len(data), chunk):
        with target.open("ab") as handle:
            handle.write(data[start:start + chunk])
        lines.extend(follower.read_lines())
    return lines


@pytest.mark.parametrize("chunk", [7, 1000, 1 << 20])
def test_the_cpu_engine_log_reads_as_its_phases_in_order(tmp_path: Path, chunk: int) -> None:
    lines = cpu_lines(tmp_path, chunk)
    assert "older run" not in lines
    assert any("█" in line for line in lines)  # the banner's multi-byte characters survive any cut
    phases, seen, end = replay(lines)
    assert seen == [sp.STARTING, sp.LOADING, sp.COMPILING, sp.PROFILING, sp.API_SERVER]
    assert phases.kv == sp.KvCapacity("CPU", 2_097_152, 2048, 1024.0)
    assert phases.weights_load_s == pytest.approx(0.01)
    assert phases.compile_cache_hit is False  # this run found no usable compiled model in the cache
    took = dict(phases.durations(end))
    # On the log's own clock: the warm-up compilation ran from 05:21:43 to 05:21:54.
    assert took[sp.COMPILING] == pytest.approx(11.0)
    assert took[sp.STARTING] == pytest.approx(21.0)  # 05:21:21 (the first vLLM line) to 05:21:42 (loading)
    assert sum(took.values()) == pytest.approx(end - phases.started)


def test_an_engine_that_dies_reading_its_weights_is_in_the_loading_phase(tmp_path: Path) -> None:
    lines = sp.LogFollower(TRUNCATED_LOG).read_lines()
    assert any("SafetensorError" in line for line in lines)  # the engine's traceback is in the log
    phases, seen, _end = replay(lines)
    assert seen == [sp.STARTING, sp.LOADING]
    assert phases.phase == sp.LOADING
    assert phases.kv is None and phases.weights_load_s is None


def test_the_ready_summary_names_each_phase_with_its_time_and_the_kv_capacity(tmp_path: Path) -> None:
    phases, _seen, end = replay(cpu_lines(tmp_path, 1 << 20))
    first, kv = phases.ready_summary(end + 2.0)
    assert first == ("engine ready after 37 s: launching processes 21 s, loading weights 1.0 s, compiling 11 s, "
                     "measuring memory for the KV cache 1.0 s, starting the API server 3.0 s")
    assert kv == "KV cache: 2,097,152 tokens (CPU); maximum concurrency at 2,048 tokens per request: 1024.00x"


# The GPU-only messages, written with the pinned vLLM's format strings: (source file, format, arguments).
# Each format is checked against the installed source below, so a vLLM upgrade that rewords one fails here.
GPU_MESSAGES: list[tuple[str, str, tuple[object, ...]]] = [
    # v1/worker/gpu_model_runner.py:5040
    ("v1/worker/gpu_model_runner.py", "Starting to load model %s...", ("Qwen/Qwen3-8B",)),
    # model_executor/model_loader/default_loader.py:502
    ("model_executor/model_loader/default_loader.py", "Loading weights took %.2f seconds", (3.21,)),
    # v1/worker/gpu_model_runner.py:5150
    ("v1/worker/gpu_model_runner.py", "Model loading took %s GiB memory and %.6f seconds", ("15.27", 4.1)),
    # compilation/monitor.py:40
    ("compilation/monitor.py", "%sStarting torch.compile", ("",)),
    # compilation/backends.py:1167
    ("compilation/backends.py", "%sDynamo bytecode transform time: %.2f s", ("", 5.12)),
    # compilation/backends.py:399
    ("compilation/backends.py", "%sCompiling a graph for compile range %s takes %.2f s", ("", "(1, 8192)", 20.15)),
    # compilation/monitor.py:20
    ("compilation/monitor.py", "%storch.compile took %.2f s in total", ("", 27.31)),
    # v1/worker/gpu_worker.py:760
    ("v1/worker/gpu_worker.py", "Available KV cache memory: %s GiB", ("100.2",)),
    # v1/core/kv_cache_utils.py:2328
    ("v1/core/kv_cache_utils.py", "%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx",
     ("GPU", "729,856", "32,768", 22.27)),
    # v1/worker/gpu_model_runner.py:6657 (a progress bar's description)
    ("v1/worker/gpu_model_runner.py", "Capturing CUDA graphs ({}, {})", ("mixed prefill-decode", "PIECEWISE")),
    # v1/worker/gpu_model_runner.py:6582
    ("v1/worker/gpu_model_runner.py", "Graph capturing finished in %.0f secs, took %.2f GiB", (12.4, 0.83)),
    # v1/engine/core.py:396
    ("v1/engine/core.py", "init engine (profile, create kv cache, warmup model) took %.2f s (compilation: %.2f s)",
     (75.12, 27.31)),
    # entrypoints/launchers/api_server/entry.py:140
    ("entrypoints/launchers/api_server/entry.py", "Starting vLLM server on %s", ("http://0.0.0.0:8000",)),
]


def _vllm_source(relative: str) -> str:
    spec = importlib.util.find_spec("vllm")  # finds the installed package without importing it
    assert spec is not None and spec.origin is not None
    return (Path(spec.origin).parent / relative).read_text(encoding="utf-8")


def _source_text(source: str) -> str:
    """The source with adjacent string literals joined, as Python joins them."""
    return re.sub(r'"\s*\n\s*"', "", source)


@pytest.mark.parametrize(("relative", "fmt"), [(rel, fmt) for rel, fmt, _ in GPU_MESSAGES])
def test_each_gpu_message_is_the_pinned_release_s_own(relative: str, fmt: str) -> None:
    assert fmt in _source_text(_vllm_source(relative)), f"{fmt!r} is no longer in vllm/{relative}"


def gpu_log() -> list[tuple[str, float]]:
    lines: list[tuple[str, float]] = []
    for second, (relative, fmt, args) in enumerate(GPU_MESSAGES):
        message = fmt.format(*args) if "{}" in fmt else fmt % args
        process = "Worker_TP0 pid=41" if "worker" in relative or "model_loader" in relative else "EngineCore pid=40"
        if message.startswith("Capturing CUDA graphs"):  # tqdm redraws its bar with carriage returns
            lines.append((f"\r{message}:   0%|          | 0/51 [00:00<?, ?it/s]", second * 10.0))
            continue
        lines.append((f"({process}) INFO 12-02 09:00:{second:02d} [{Path(relative).name}:1] {message}", second * 10.0))
    lines.append(("INFO:     Application startup complete.", len(GPU_MESSAGES) * 10.0))
    return lines


def test_gpu_phases_include_profiling_around_compilation_and_graph_capture() -> None:
    phases = sp.StartupPhases(-5.0)
    seen = [sp.STARTING]
    for line, now in gpu_log():
        phases.feed(line, now)
        if seen[-1] != phases.phase:
            seen.append(phases.phase)
    # On a GPU the compilation runs inside the memory profiling, so that phase comes back after it.
    assert seen == [sp.STARTING, sp.LOADING, sp.PROFILING, sp.COMPILING, sp.PROFILING, sp.CAPTURING, sp.API_SERVER]
    assert phases.kv == sp.KvCapacity("GPU", 729_856, 32_768, 22.27)
    assert phases.model_memory_gib == pytest.approx(15.27)
    assert phases.graphs_s == pytest.approx(12.0)
    took = dict(phases.durations(130.0))
    assert list(took) == [sp.STARTING, sp.LOADING, sp.PROFILING, sp.COMPILING, sp.CAPTURING, sp.API_SERVER]
    assert took[sp.LOADING] == pytest.approx(20.0)
    assert took[sp.COMPILING] == pytest.approx(30.0)
    assert took[sp.PROFILING] == pytest.approx(40.0)  # 10 s before compiling and 30 s after it
    assert took[sp.CAPTURING] == pytest.approx(20.0)
    assert took[sp.API_SERVER] == pytest.approx(20.0)


def test_a_compile_cache_hit_is_recognised() -> None:
    phases = sp.StartupPhases(0.0)
    # compilation/decorators.py:319, "%sDirectly load AOT compilation from path %s"
    phases.feed("(Worker pid=7) INFO 12-02 09:00:00 [decorators.py:319] [backbone] Directly load AOT compilation "
                "from path /root/.cache/vllm/torch_compile_cache/x/rank_0_0/model", 1.0)
    assert phases.compile_cache_hit is True and phases.phase == sp.COMPILING
    assert "%sDirectly load AOT compilation from path %s" in _source_text(_vllm_source("compilation/decorators.py"))


GIB = 1 << 30


def test_a_growing_download_is_its_own_phase_with_rate_and_time_left() -> None:
    phases = sp.StartupPhases(0.0)
    phases.feed("(Worker pid=7) INFO 12-02 09:00:00 [cpu_model_runner.py:68] Starting to load model org/big...", 1.0)
    phases.note_download(1 * GIB, 1, 4 * GIB, 2.0)
    assert phases.phase == sp.LOADING  # one look shows no growth yet
    phases.note_download(1 * GIB + 100 * (1 << 20), 1, None, 12.0)
    assert phases.phase == sp.DOWNLOADING
    state = phases.download(12.0)
    assert state is not None
    assert state.describe() == "1.1 GiB of 4.0 GiB (27%), 10.0 MiB/s, about 5 min left"
    assert phases.progress(12.0).startswith("downloading weights: 1.1 GiB of 4.0 GiB (27%)")
    # No growth for a while: the operator sees a stall rather than a rate.
    phases.note_download(1 * GIB + 100 * (1 << 20), 1, None, 50.0)
    assert phases.download(50.0) is not None
    assert phases.download(50.0).describe() == "1.1 GiB of 4.0 GiB (27%), no progress for 38 s"  # type: ignore[union-attr]
    # model_executor/model_loader/weight_utils.py:533
    phases.feed("(Worker pid=7) INFO 12-02 09:01:00 [weight_utils.py:533] Time spent downloading weights for "
                "org/big: 58.000000 seconds", 60.0)
    assert phases.phase == sp.LOADING and phases.download(60.0) is None
    took = dict(phases.durations(61.0))
    assert took[sp.DOWNLOADING] == pytest.approx(48.0)
    assert took[sp.LOADING] == pytest.approx(12.0)  # 1 s to 12 s, then 60 s to 61 s


def test_a_progress_line_names_each_phase_once_and_its_time_only_when_it_adds_something() -> None:
    phases = sp.StartupPhases(0.0)
    # The first phase has run for the whole time so far: its time would only repeat it.
    assert phases.progress(10.0) == "launching processes"
    phases.feed("(Worker pid=7) INFO 12-02 09:00:00 [cpu_model_runner.py:87] Warming up model for the compilation",
                33.0)
    assert phases.progress(41.0) == "compiling for 8 s"


def test_left_over_partial_files_that_do_not_grow_are_no_download() -> None:
    phases = sp.StartupPhases(0.0)
    for now in (1.0, 2.0, 3.0):
        phases.note_download(5 * GIB, 2, None, now)
    assert phases.phase == sp.STARTING


def test_a_download_of_unknown_size_shows_bytes_and_rate() -> None:
    state = sp.DownloadState(300 * (1 << 20), None, 2.5 * (1 << 20), 0.0)
    assert state.describe() == "300.0 MiB, 2.5 MiB/s"


def test_the_cache_folder_scan_counts_partial_files_and_reads_the_index_total(tmp_path: Path) -> None:
    folder = tmp_path / "models--org--big"
    assert sp.scan_download(folder) == (0, 0, None)
    (folder / "blobs").mkdir(parents=True)
    (folder / "blobs" / "aaa").write_bytes(b"x" * 100)
    (folder / "blobs" / "bbb.1234abcd.incomplete").write_bytes(b"x" * 50)
    assert sp.scan_download(folder) == (150, 1, None)
    snapshot = folder / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 4000},
                                                                        "weight_map": {}}))
    assert sp.scan_download(folder) == (150, 1, 4000)


def test_the_repo_folder_is_the_hub_layout_and_none_for_a_local_model(tmp_path: Path) -> None:
    assert sp.repo_cache_folder("Qwen/Qwen3-8B", "/cache/hub") == Path("/cache/hub/models--Qwen--Qwen3-8B")
    assert sp.repo_cache_folder(str(tmp_path), "/cache/hub") is None
    assert sp.repo_cache_folder("./models/x", "/cache/hub") is None
