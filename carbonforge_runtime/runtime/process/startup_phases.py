"""Which start-up phase the engine is in, read from what it writes while it starts.

vLLM says little about its progress on its own terms, but each phase of its start-up leaves a
recognisable line in ``vllm.log``. :class:`StartupPhases` is a small state machine over those lines
(pure: the caller hands it lines and the time it read them). Downloads are the exception: vLLM turns
the Hugging Face progress bars off, so the bytes come from the cache folder of the served
repository instead (:func:`scan_download`), where the hub library writes ``*.incomplete`` files that
grow until each one is renamed to its blob.

The messages matched here are those of the pinned vLLM release (0.32); each pattern names the file
that logs it. A message vLLM drops or rewords only makes a phase go unnamed: the supervisor then
shows the phase before it for longer, and nothing else changes.
"""

from __future__ import annotations

import codecs
import json
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

STARTING = "launching processes"
DOWNLOADING = "downloading weights"
LOADING = "loading weights"
COMPILING = "compiling"
PROFILING = "measuring memory for the KV cache"
CAPTURING = "capturing CUDA graphs"
API_SERVER = "starting the API server"

#: A download counts as stalled when its bytes have not grown for this long.
STALLED_AFTER_S = 30.0
#: The download rate is averaged over this window.
RATE_WINDOW_S = 30.0

_NUMBER = r"[0-9][0-9,]*"

#: (pattern, phase it starts). Searched anywhere in the line, so the process prefix vLLM adds
#: (``(EngineCore pid=N) INFO 12-02 05:21:55 [file.py:N]``) does not matter.
_PHASE_LINES: tuple[tuple[re.Pattern[str], str], ...] = (
    # v1/worker/cpu_model_runner.py:68 and v1/worker/gpu_model_runner.py:5040
    (re.compile(r"Starting to load model "), LOADING),
    # v1/worker/gpu/model_runner.py:392 (the V2 model runner)
    (re.compile(r"Loading model from scratch"), LOADING),
    # model_executor/model_loader/weight_utils.py:533, logged once the download is over
    (re.compile(r"Time spent downloading weights for "), LOADING),
    # the loader's own progress bar (model_executor/model_loader/weight_utils.py)
    (re.compile(r"Loading (safetensors|pt) checkpoint shards"), LOADING),
    # v1/worker/gpu_model_runner.py:5150: the GPU worker profiles memory right after loading
    (re.compile(r"Model loading took \S+ GiB memory and "), PROFILING),
    # v1/worker/cpu_model_runner.py:87: the CPU worker compiles in a warm-up run
    (re.compile(r"Warming up model for the compilation"), COMPILING),
    # compilation/monitor.py:40
    (re.compile(r"Starting torch\.compile"), COMPILING),
    # compilation/backends.py:1167
    (re.compile(r"Dynamo bytecode transform time: "), COMPILING),
    # compilation/backends.py:399 (a compilation) and :296 (a graph taken from the compile cache)
    (re.compile(r"Compiling a graph for compile range "), COMPILING),
    (re.compile(r"Directly load the compiled graph\(s\) for compile range "), COMPILING),
    # compilation/decorators.py:319 (the whole model from the AOT compile cache)
    (re.compile(r"Directly load AOT compilation from path "), COMPILING),
    # compilation/monitor.py:20 and :92, v1/worker/cpu_model_runner.py:91: compilation is over
    (re.compile(r"torch\.compile took \S+ s in total"), PROFILING),
    (re.compile(r"Initial profiling/warmup run took "), PROFILING),
    (re.compile(r"Warming up done\."), PROFILING),
    # v1/worker/gpu_worker.py:760, v1/worker/cpu_worker.py:260 (Auto set / Explicitly set ... GiB for KV cache)
    (re.compile(r"Available KV cache memory: "), PROFILING),
    (re.compile(r"set \(\S+/\S+\) GiB for KV cache on node"), PROFILING),
    # v1/worker/gpu_model_runner.py:6657 and v1/worker/gpu/cudagraph_utils.py:422 (progress bars)
    (re.compile(r"Capturing CUDA graphs"), CAPTURING),
    # v1/engine/core.py:386-403: the engine core is up; the API server starts next
    (re.compile(r"init engine \(profile, create kv cache, warmup model\) took "), API_SERVER),
    # entrypoints/launchers/api_server/entry.py:140 (0.32), and the older API server's wording
    (re.compile(r"Starting vLLM (server on|API server)"), API_SERVER),
    (re.compile(r"Application startup complete"), API_SERVER),
)

#: v1/core/kv_cache_utils.py:2328: "%s KV cache size: %s tokens, Maximum concurrency for %s tokens
#: per request: %.2fx" (the device is "GPU", "CPU", ..., with " + host" for a host-memory pool).
_KV_CAPACITY = re.compile(
    rf"(?P<device>\w+(?: \+ host)?) KV cache size: (?P<tokens>{_NUMBER}) tokens, "
    rf"Maximum concurrency for (?P<length>{_NUMBER}) tokens per request: (?P<concurrency>[0-9.]+)x")
#: model_executor/model_loader/default_loader.py:502
_WEIGHTS_TOOK = re.compile(r"Loading weights took (?P<s>[0-9.]+) seconds")
#: v1/worker/gpu_model_runner.py:5150
_MODEL_MEMORY = re.compile(r"Model loading took (?P<gib>[0-9.]+) GiB memory")
#: v1/worker/gpu_model_runner.py:6582
_GRAPHS_TOOK = re.compile(r"Graph capturing finished in (?P<s>[0-9.]+) secs, took (?P<gib>[0-9.]+) GiB")
#: compilation/backends.py:296, compilation/decorators.py:319 (cache hits) and decorators.py:333 (a miss)
_COMPILE_CACHE_HIT = re.compile(r"Directly load (the compiled graph|AOT compilation)")
_COMPILE_CACHE_MISS = re.compile(r"Compiling model again due to a load failure")


@dataclass(frozen=True)
class KvCapacity:
    """What vLLM computed when it sized the KV cache."""

    device: str
    tokens: int
    max_model_len: int
    max_concurrency: float

    def describe(self) -> str:
        return (f"KV cache: {self.tokens:,} tokens ({self.device}); maximum concurrency at "
                f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x")


@dataclass(frozen=True)
class DownloadState:
    """How far the weights download is: bytes in the repository's cache folder over time."""

    done_bytes: int
    total_bytes: int | None
    rate_bytes_s: float | None
    stalled_s: float

    def describe(self) -> str:
        parts = [_size(self.done_bytes)]
        if self.total_bytes:
            share = min(self.done_bytes / self.total_bytes, 0.99)
            parts = [f"{_size(self.done_bytes)} of {_size(self.total_bytes)} ({share:.0%})"]
        if self.stalled_s >= STALLED_AFTER_S:
            parts.append(f"no progress for {self.stalled_s:.0f} s")
        elif self.rate_bytes_s:
            parts.append(f"{_size(self.rate_bytes_s)}/s")
            if self.total_bytes and self.total_bytes > self.done_bytes:
                parts.append(f"about {_duration((self.total_bytes - self.done_bytes) / self.rate_bytes_s)} left")
        return ", ".join(parts)


def _size(count: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:.0f} B"


def _duration(seconds: float) -> str:
    if seconds >= 90:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


class StartupPhases:
    """The phase the engine is in, and the facts its start-up log gave on the way.

    ``now`` is the caller's clock (any monotonic seconds); each phase's time runs from the line
    that started it to the line that started the next one."""

    def __init__(self, now: float) -> None:
        self.started = now
        #: (phase, when it started), in the order they happened; a phase may come back (on a GPU the
        #: compilation runs inside the memory profiling).
        self.spans: list[tuple[str, float]] = [(STARTING, now)]
        self.kv: KvCapacity | None = None
        self.weights_load_s: float | None = None
        self.model_memory_gib: float | None = None
        self.graphs_s: float | None = None
        #: True: vLLM took its compiled model from the compile cache; False: it compiled it.
        self.compile_cache_hit: bool | None = None
        self._download: deque[tuple[float, int]] = deque()
        self._download_total: int | None = None
        self._last_growth: float | None = None

    @property
    def phase(self) -> str:
        return self.spans[-1][0]

    def phase_started(self) -> float:
        return self.spans[-1][1]

    def _enter(self, phase: str, now: float) -> None:
        if phase != self.phase:
            self.spans.append((phase, now))

    def feed(self, line: str, now: float) -> None:
        """One line of the engine's log."""
        for pattern, phase in _PHASE_LINES:
            if pattern.search(line):
                self._enter(phase, now)
                break
        if (kv := _KV_CAPACITY.search(line)) is not None:
            self.kv = KvCapacity(kv["device"], int(kv["tokens"].replace(",", "")),
                                 int(kv["length"].replace(",", "")), float(kv["concurrency"]))
            self._enter(PROFILING, now)
        elif (took := _WEIGHTS_TOOK.search(line)) is not None:
            self.weights_load_s = float(took["s"])
            if self.phase == DOWNLOADING:
                self._enter(LOADING, now)
        if (memory := _MODEL_MEMORY.search(line)) is not None:
            self.model_memory_gib = float(memory["gib"])
        if (graphs := _GRAPHS_TOOK.search(line)) is not None:
            self.graphs_s = float(graphs["s"])
        if _COMPILE_CACHE_HIT.search(line):
            self.compile_cache_hit = True
        elif _COMPILE_CACHE_MISS.search(line) and self.compile_cache_hit is None:
            self.compile_cache_hit = False

    def note_download(self, done_bytes: int, incomplete: int, total_bytes: int | None, now: float) -> None:
        """One look at the served repository's cache folder: the bytes of its blobs (partial ones
        included), how many partial files there are, and the weights' total size where known.

        Growing partial files before the weights are loaded mean a download: the phase becomes
        :data:`DOWNLOADING` and stays so until the log says the weights are being loaded."""
        if total_bytes:
            self._download_total = total_bytes
        previous = self._download[-1][1] if self._download else None
        self._download.append((now, done_bytes))
        while len(self._download) > 2 and now - self._download[1][0] >= RATE_WINDOW_S:
            self._download.popleft()
        grew = previous is not None and done_bytes > previous
        if grew:
            self._last_growth = now
        if grew and incomplete > 0 and self.phase in (STARTING, LOADING):
            self._enter(DOWNLOADING, now)

    def download(self, now: float) -> DownloadState | None:
        """The download's progress, while the engine is downloading."""
        if self.phase != DOWNLOADING or not self._download:
            return None
        (first_t, first_b), (last_t, last_b) = self._download[0], self._download[-1]
        rate = (last_b - first_b) / (last_t - first_t) if last_t > first_t and last_b > first_b else None
        stalled = now - (self._last_growth if self._last_growth is not None else self.phase_started())
        return DownloadState(last_b, self._download_total, rate, max(stalled, 0.0))

    def durations(self, now: float) -> list[tuple[str, float]]:
        """Each phase and the time it took (summed where it came back), in the order each first began;
        the current phase runs until ``now``."""
        total: dict[str, float] = {}
        for index, (phase, began) in enumerate(self.spans):
            ended = self.spans[index + 1][1] if index + 1 < len(self.spans) else now
            total[phase] = total.get(phase, 0.0) + max(ended - began, 0.0)
        return list(total.items())

    def describe_durations(self, now: float) -> str:
        return ", ".join(f"{phase} {_seconds(took)}" for phase, took in self.durations(now))

    def progress(self, now: float) -> str:
        """The phase, for a progress line: ``loading weights for 12 s`` (the first phase without its
        time, which is the whole time so far), with the download's progress while downloading."""
        text = self.phase
        if len(self.spans) > 1:
            text += f" for {max(now - self.phase_started(), 0.0):.0f} s"
        state = self.download(now)
        if state is not None:
            text = f"{self.phase}: {state.describe()}"
        return text

    def ready_summary(self, now: float) -> list[str]:
        """The lines for the moment the engine is ready: the time of each phase, then the KV capacity."""
        lines = [f"engine ready after {_seconds(now - self.started)}: {self.describe_durations(now)}"]
        if self.kv is not None:
            lines.append(self.kv.describe())
        return lines


class LogFollower:
    """Reads what a log file gained since the last call, as whole lines (``\\n`` or ``\\r`` ends one:
    progress bars rewrite their line with carriage returns)."""

    def __init__(self, path: Path, offset: int = 0, max_bytes: int = 1 << 20) -> None:
        self.path = path
        self.offset = offset
        self.max_bytes = max_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""

    def read_lines(self) -> list[str]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read(self.max_bytes)
        except OSError:
            return []
        self.offset += len(chunk)
        text = self._partial + self._decoder.decode(chunk)
        pieces = re.split(r"\r\n|\r|\n", text)
        self._partial = pieces.pop()
        return [piece for piece in pieces if piece.strip()]


def repo_cache_folder(model: str, hub_cache: str | Path) -> Path | None:
    """The cache folder vLLM downloads ``model`` into (``models--org--name``), or None for a local path."""
    if not model or model.startswith(("/", "./", "../", "~")) or Path(model).expanduser().exists():
        return None
    return Path(hub_cache) / ("models--" + model.replace("/", "--"))


def scan_download(folder: Path) -> tuple[int, int, int | None]:
    """The bytes of the blobs in a repository's cache folder (partial downloads included), how many
    partial (``*.incomplete``) files there are, and the weights' total size from a safetensors index
    when one is in a snapshot already (vLLM fetches the index before the weights)."""
    done = incomplete = 0
    try:
        for entry in (folder / "blobs").iterdir():
            try:
                done += entry.stat().st_size
            except OSError:
                continue
            incomplete += entry.name.endswith(".incomplete")
    except OSError:
        return 0, 0, None
    total: int | None = None
    try:
        for index in (folder / "snapshots").glob("*/*.safetensors.index.json"):
            size = json.loads(index.read_text(encoding="utf-8")).get("metadata", {}).get("total_size")
            if isinstance(size, int) and size > 0:
                total = size
                break
    except (OSError, ValueError, AttributeError):
        total = None
    return done, incomplete, total
