"""End to end: two boots of the tiny recipe on one compile cache directory; the second finds what the
first compiled. Exactly two engine starts.

What vLLM 0.32 logs (vllm/compilation/decorators.py): the first boot compiles and logs "saved AOT
compiled function to <cache>/vllm/torch_compile_cache/torch_aot_compile/<hash>/rank_0_0/model". A
later boot opens that same file: "Directly load AOT compilation from path <it>" where the artifact
loads (the GPU build). On the CPU build the load of the artifact fails ("'function' object has no
attribute 'finalize_loading'") and vLLM logs "Compiling model again due to a load failure from <it>";
it then traces the model again, and torch Inductor takes every compiled kernel from the kernel cache
beside the artifact, so the second boot compiles no kernel.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import openai

from carbonforge_runtime.runtime.engine_env.compile_cache import CACHE_VARIABLES
from tests.support import TINY_KEY, TINY_SERVED_NAME, RuntimeProcess

SAVED = re.compile(r"saved AOT compiled function to (\S+)")
#: A later boot reading the cache entry: loaded as it is, or traced again over the cached kernels.
FOUND = re.compile(r"(?:Directly load AOT compilation from path|Compiling model again due to a load failure from) "
                   r"(\S+?),?(?:\s|$)", re.MULTILINE)


def boot(cache: Path, log_dir: Path) -> RuntimeProcess:
    runtime = RuntimeProcess(["--context-key", TINY_KEY], log_dir, env={"CF_COMPILE_CACHE_DIR": str(cache)})
    # An operator's value wins over the runtime's; the test process may hold some (importing torch
    # sets TORCHINDUCTOR_CACHE_DIR in its own environment), so the engine must not inherit them.
    for variable in CACHE_VARIABLES:
        runtime.env.pop(variable.name, None)
    return runtime.start()


def engine_environment(runtime: RuntimeProcess) -> dict[str, str]:
    raw = Path(f"/proc/{runtime.engine_pid()}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def kernels(cache: Path) -> set[Path]:
    """The compiled CPU kernels (shared objects torch Inductor built) in the cache."""
    return {path.relative_to(cache) for path in cache.rglob("*.so")}


def test_the_second_boot_finds_what_the_first_compiled(tmp_path: Path) -> None:
    cache = tmp_path / "compile-cache"
    first = boot(cache, tmp_path / "first")
    try:
        first.wait_ready()
        env = engine_environment(first)
        assert env["VLLM_CACHE_ROOT"] == str(cache / "vllm")
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "torchinductor")
        assert env["TRITON_CACHE_DIR"] == str(cache / "triton")
        log = first.engine_log()
        saved = SAVED.findall(log)
        assert saved, log[-3000:]
        assert all(path.startswith(str(cache / "vllm" / "torch_compile_cache") + "/") for path in saved)
        assert not FOUND.search(log)  # an empty cache: the first boot compiles
        assert first.stop(signal.SIGTERM, timeout_s=90) == 0
    finally:
        first.kill()
    compiled = kernels(cache)
    assert compiled, "the first boot left no compiled kernel in the cache"

    second = boot(cache, tmp_path / "second")
    try:
        second.wait_ready()
        log = second.engine_log()
        found = FOUND.findall(log)
        assert found and set(found) <= set(saved), log[-3000:]  # the entry the first boot saved
        # The loaded (or re-traced) model serves.
        client = openai.OpenAI(base_url=second.base_url, api_key="unused", timeout=120, max_retries=0)
        response = client.chat.completions.create(model=TINY_SERVED_NAME, max_tokens=8,
                                                  messages=[{"role": "user", "content": "Hello"}],
                                                  extra_body={"ignore_eos": True})
        assert response.usage is not None and response.usage.completion_tokens == 8
        assert second.stop(signal.SIGTERM, timeout_s=90) == 0
    finally:
        second.kill()
    assert kernels(cache) == compiled  # every kernel came from the cache: none was compiled again
