"""End to end: the runtime launches the real vLLM CPU engine; the real openai client talks to it.

One engine, the plain default, serves every check that only reads (the serve itself, no metrics
port, where it compiles to); the SIGTERM stop comes after them, then a second boot on the compile
cache the first one filled. The two engines that cannot start are their own runs. Override mode is
checked on the OTLP HTTP engine in test_tracing.py; the context-key flag with extra vLLM flags and
the engine's death on the command-line engine in test_command_line.py.

The compile cache: the shipped CPU recipes turn vLLM's AOT compilation off (``VLLM_USE_AOT_COMPILE=0``:
the CPU build of vLLM 0.32 cannot load the artifact it saves). vLLM then hands the model to
torch.compile, and Inductor keeps its graphs (``fxgraph/``, ``aotautograd/``) and the kernels it built
(``*.so``) under ``TORCHINDUCTOR_CACHE_DIR``, which the runtime points into the compile cache
directory. The first boot fills it; the second traces the model again, finds every graph and kernel
there, and writes nothing."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from carbonforge_runtime.runtime.engine_env.compile_cache import CACHE_VARIABLES
from tests.support import (
    REPO,
    TINY_KEY,
    TINY_SERVED_NAME,
    RuntimeProcess,
    free_port,
    listening_ports,
)
from tests.support.serving import chat_both_ways, stop_cleanly

#: Holds with a second engine beside it (scripts/test.sh runs these modules two at a time).
pytestmark = pytest.mark.parallel_safe

#: The start-up phases of the CPU engine, in the order the runtime must report them.
CPU_PHASES = ["launching processes", "loading weights", "compiling", "measuring memory for the KV cache",
              "starting the API server"]
_PHASE_NAMES = "|".join([*CPU_PHASES, "downloading weights", "capturing CUDA graphs"])
#: vLLM's CPU model runner, as it hands the model to torch.compile (v1/worker/cpu_model_runner.py).
COMPILING = "Warming up model for the compilation"


def assert_startup_phases(out: str) -> None:
    """The runtime's output names the phases while the engine starts, then gives each one's time and the
    KV capacity just before the ready line."""
    lines = out.splitlines()
    ready_at = next(i for i, line in enumerate(lines) if "ready: OpenAI API" in line)
    summary, kv = lines[ready_at - 2], lines[ready_at - 1]
    assert " engine ready after " in summary, out
    times = re.findall(r"(?:: |, )([a-zA-Z ]+?) ([0-9.]+) s", summary.split(" engine ready after ", 1)[1])
    assert [name for name, _ in times] == CPU_PHASES, summary
    total = float(re.search(r"engine ready after ([0-9.]+) s", summary)[1])  # type: ignore[index]
    assert abs(sum(float(took) for _, took in times) - total) <= 2.0, summary
    assert re.search(r"KV cache: [0-9,]+ tokens \(CPU\); maximum concurrency at 2,048 tokens per request: "
                     r"[0-9.]+x$", kv), kv
    progress = [line for line in lines[:ready_at] if "engine starting" in line]
    assert progress, out  # the tiny engine takes well over the 10 s between progress lines here
    for line in progress:
        assert re.search(rf"engine starting, [0-9]+ s so far: ({CPU_PHASES[0]}|({_PHASE_NAMES}) for [0-9]+ s) "
                         r"\(details in ", line), line


@dataclass
class DefaultEngine:
    runtime: RuntimeProcess
    metrics_port: int
    compile_cache: Path


def tiny_serve(log_dir: Path, cache: Path, env: dict[str, str]) -> RuntimeProcess:
    """A runtime with the tiny recipe compiling into ``cache``, as the recipe alone configures it."""
    runtime = RuntimeProcess([], log_dir, env={"CF_CONTEXT_KEY": TINY_KEY, "CF_COMPILE_CACHE_DIR": str(cache), **env})
    # An operator's value wins over the runtime's; the test process may hold some (importing torch
    # sets TORCHINDUCTOR_CACHE_DIR in its own environment), so the engine must not inherit them.
    for variable in CACHE_VARIABLES:
        runtime.env.pop(variable.name, None)
    runtime.env.pop("VLLM_USE_AOT_COMPILE")  # the shipped recipe's own setting is the one under test
    return runtime.start()


@pytest.fixture(scope="module")
def default_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DefaultEngine]:
    """The embedded default from CF_CONTEXT_KEY and no argument, as plain as a serve gets, on a compile
    cache of its own; the metrics port is named, so that nothing listening there can be seen. The tests
    below read it; the SIGTERM test stops it."""
    metrics_port = free_port()
    base = tmp_path_factory.mktemp("default-engine")
    cache = base / "compile-cache"
    runtime = tiny_serve(base / "first", cache, {"CF_METRICS_PORT": str(metrics_port)})
    try:
        runtime.wait_ready()
        yield DefaultEngine(runtime, metrics_port, cache)
    finally:
        runtime.kill()


def test_serves_cf_context_key(default_engine: DefaultEngine) -> None:
    runtime = default_engine.runtime
    out = runtime.output()
    assert f"ready: OpenAI API on http://127.0.0.1:{runtime.port}/v1 serving model '{TINY_SERVED_NAME}'" in out
    assert "Traceback" not in out
    assert_startup_phases(out)
    # The runtime's own log stays short; the engine's goes to vllm.log (progress lines aside, whose
    # number grows with the start-up time).
    assert len([line for line in out.splitlines() if "engine starting, " not in line]) < 30
    assert "vllm.entrypoints.openai.api_server" in runtime.engine_log()
    chat_both_ways(runtime.base_url, TINY_SERVED_NAME)
    assert container_healthcheck(runtime) == 0


def test_without_metrics_nothing_listens_on_the_metrics_port(default_engine: DefaultEngine) -> None:
    runtime = default_engine.runtime
    assert runtime.proc is not None
    assert "starting vLLM" in runtime.output()  # past the point where --metrics would have bound its port
    ports = listening_ports(runtime.proc.pid)
    assert 9105 not in ports and default_engine.metrics_port not in ports
    assert "metrics:" not in runtime.output()


def test_the_engine_compiles_into_the_compile_cache(default_engine: DefaultEngine) -> None:
    runtime, cache = default_engine.runtime, default_engine.compile_cache
    env = engine_environment(runtime)
    assert env["VLLM_CACHE_ROOT"] == str(cache / "vllm")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "torchinductor")
    assert env["TRITON_CACHE_DIR"] == str(cache / "triton")
    assert env["VLLM_USE_AOT_COMPILE"] == "0"  # from the recipe
    assert COMPILING in runtime.engine_log()


def test_sigterm_stops_the_default_engine_cleanly(default_engine: DefaultEngine) -> None:
    """After the reads: the stop every read above shared."""
    runtime = default_engine.runtime
    stop_cleanly(runtime, drain_s=15)
    assert container_healthcheck(runtime) == 1


def test_the_second_boot_finds_what_the_first_compiled(default_engine: DefaultEngine, tmp_path: Path) -> None:
    """After the stop: a second boot on the compile cache the default engine filled."""
    cache = default_engine.compile_cache
    assert default_engine.runtime.proc is not None and default_engine.runtime.proc.poll() is not None
    compiled = kernels(cache)
    assert compiled, "the first boot left no compiled kernel in the cache"
    inductor = cache / "torchinductor"
    assert any((inductor / "fxgraph").rglob("*")), "the first boot left no compiled graph in the cache"
    before = contents(cache)

    second = tiny_serve(tmp_path / "second", cache, {})
    try:
        second.wait_ready()
        assert COMPILING in second.engine_log()  # it compiles again, from the cache
        # The model compiled from the cache serves.
        client = openai.OpenAI(base_url=second.base_url, api_key="unused", timeout=120, max_retries=0)
        response = client.chat.completions.create(model=TINY_SERVED_NAME, max_tokens=8,
                                                  messages=[{"role": "user", "content": "Hello"}],
                                                  extra_body={"ignore_eos": True})
        assert response.usage is not None and response.usage.completion_tokens == 8
        assert second.stop(signal.SIGTERM, timeout_s=90) == 0
    finally:
        second.kill()
    assert kernels(cache) == compiled  # every kernel came from the cache: none was compiled again
    # Nothing was added or rewritten: every graph came from the cache too.
    assert contents(cache) == before


def engine_environment(runtime: RuntimeProcess) -> dict[str, str]:
    raw = Path(f"/proc/{runtime.engine_pid()}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def kernels(cache: Path) -> set[Path]:
    """The compiled CPU kernels (shared objects torch Inductor built) in the cache."""
    return {path.relative_to(cache) for path in cache.rglob("*.so")}


def contents(cache: Path) -> dict[Path, tuple[int, int]]:
    """Every file in the cache with its size and modification time."""
    return {path.relative_to(cache): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in cache.rglob("*") if path.is_file() and "locks" not in path.relative_to(cache).parts}


def container_healthcheck(runtime: RuntimeProcess) -> int:
    """The image's HEALTHCHECK command, run outside the image, with the runtime's log directory
    (where the runtime records the address it serves)."""
    env = {**os.environ, "CF_PORT": str(runtime.port), "CF_LOG_DIR": str(runtime.log_dir)}
    return subprocess.run([sys.executable, str(REPO / "docker" / "healthcheck.py")], env=env, timeout=30).returncode


def test_engine_failing_while_loading_weights_is_reported_in_that_phase(tmp_path: Path, tiny_model: str) -> None:
    # A copy of the tiny model whose weights file lost its second half (as an interrupted copy leaves it):
    # the header still reads, so only loading the tensors fails.
    model = tmp_path / "tiny-truncated"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    weights.write_bytes(data[:header_end + (len(data) - header_end) // 2])
    args = ["--", str(model), "--served-model-name", "tiny-truncated", "--dtype", "bfloat16",
            "--max-model-len", "1024"]
    runtime = RuntimeProcess(args, tmp_path / "logs").start()
    try:
        code = runtime.wait(300)
        out = runtime.output()
        assert code != 0
        assert "vLLM exited (code 1) before becoming ready, while loading weights" in out
        phases = [line for line in out.splitlines() if "start-up phases until then: " in line]
        assert len(phases) == 1, out
        assert re.search(r"launching processes [0-9.]+ s, loading weights [0-9.]+ s$", phases[0]), phases[0]
        assert "ready: OpenAI API" not in out
    finally:
        runtime.kill()
