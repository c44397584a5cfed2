"""End to end: two boots of the tiny recipe on one compile cache directory; the second finds what the
first compiled. Exactly two engine starts.

The shipped CPU recipes turn vLLM's AOT compilation off (``VLLM_USE_AOT_COMPILE=0``: the CPU build of
vLLM 0.32 cannot load the artifact it saves). vLLM then hands the model to torch.compile, and
Inductor keeps its graphs (``fxgraph/``, ``aotautograd/``) and the kernels it built (``*.so``) under
``TORCHINDUCTOR_CACHE_DIR``, which the runtime points into the compile cache directory. The first
boot fills it; the second traces the model again, finds every graph and kernel there, and writes
nothing.
"""

from __future__ import annotations

import signal
from pathlib import Path

import openai

from carbonforge_runtime.runtime.engine_env.compile_cache import CACHE_VARIABLES
from tests.support import TINY_KEY, TINY_SERVED_NAME, RuntimeProcess

#: vLLM's CPU model runner, as it hands the model to torch.compile (v1/worker/cpu_model_runner.py).
COMPILING = "Warming up model for the compilation"


def boot(cache: Path, log_dir: Path) -> RuntimeProcess:
    runtime = RuntimeProcess(["--context-key", TINY_KEY], log_dir, env={"CF_COMPILE_CACHE_DIR": str(cache)})
    # An operator's value wins over the runtime's; the test process may hold some (importing torch
    # sets TORCHINDUCTOR_CACHE_DIR in its own environment), so the engine must not inherit them.
    for variable in CACHE_VARIABLES:
        runtime.env.pop(variable.name, None)
    runtime.env.pop("VLLM_USE_AOT_COMPILE")  # the shipped recipe's own setting is the one under test
    return runtime.start()


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


def test_the_second_boot_finds_what_the_first_compiled(tmp_path: Path) -> None:
    cache = tmp_path / "compile-cache"
    first = boot(cache, tmp_path / "first")
    try:
        first.wait_ready()
        env = engine_environment(first)
        assert env["VLLM_CACHE_ROOT"] == str(cache / "vllm")
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "torchinductor")
        assert env["TRITON_CACHE_DIR"] == str(cache / "triton")
        assert env["VLLM_USE_AOT_COMPILE"] == "0"  # from the recipe
        assert COMPILING in first.engine_log()
        assert first.stop(signal.SIGTERM, timeout_s=90) == 0
    finally:
        first.kill()
    compiled = kernels(cache)
    assert compiled, "the first boot left no compiled kernel in the cache"
    inductor = cache / "torchinductor"
    assert any((inductor / "fxgraph").rglob("*")), "the first boot left no compiled graph in the cache"
    before = contents(cache)

    second = boot(cache, tmp_path / "second")
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
