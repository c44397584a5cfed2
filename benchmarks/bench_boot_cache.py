"""First and second boot to ready with one compile cache directory: empty, then warm.

Starts the runtime (the real vLLM CPU engine) twice in a row on the same recipe, with
CF_COMPILE_CACHE_DIR at a fresh directory: the first boot compiles and fills it, the second finds
what the first compiled. Prints both times to ready (process start to the `ready:` line and an
answering /health), the engine log's lines about compiling, how many compiled kernels each boot
added to the cache, and the ratio.

The shipped CPU recipes set VLLM_USE_AOT_COMPILE=0 (the CPU build of vLLM 0.32 cannot load its
AOT artifact: with it on, the second boot logs "Compiling model again due to a load failure"), so
the second boot traces the model again and takes every graph and kernel from Inductor's cache,
adding none; where an AOT artifact loads (a GPU), the log says "Directly load AOT compilation from
path <it>".

    .venv/bin/python benchmarks/bench_boot_cache.py [--key cf-tiny:bf16:chat:cpu] [--keep]
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import TINY_KEY, runtime

#: A boot reading the cache entry an earlier one saved (vllm/compilation/decorators.py, backends.py).
FOUND = re.compile(r"Directly load|Compiling model again due to a load failure from")
#: The engine log lines about compiling and its cache, printed for each boot.
COMPILE_LINES = re.compile(r"compil|torch_compile_cache|Directly load", re.IGNORECASE)
#: Compiled kernels: C++ shared objects (CPU), Triton and CUDA binaries (GPU).
KERNEL_SUFFIXES = (".so", ".cubin", ".hsaco")


def kernels(cache: Path) -> set[Path]:
    return {path for path in cache.rglob("*") if path.suffix in KERNEL_SUFFIXES} if cache.exists() else set()


def boot(key: str, cache: Path, log_dir: Path, timeout_s: float, extra_env: dict[str, str]) -> tuple[float, bool, int]:
    """(seconds to ready, whether the engine found a cache entry, kernels it added to the cache)."""
    before = kernels(cache)
    engine = runtime(["--context-key", key], log_dir, env={"CF_COMPILE_CACHE_DIR": str(cache), **extra_env})
    started = time.monotonic()
    engine.start()
    try:
        engine.wait_ready(timeout_s=timeout_s)
        elapsed = time.monotonic() - started
        log = engine.engine_log()
        print(f"--- {log_dir.name}: compile lines of vllm.log ---")
        for line in log.splitlines():
            if COMPILE_LINES.search(line):
                print("  " + line[:240])
        code = engine.stop(signal.SIGTERM, timeout_s=120)
        if code != 0:
            raise SystemExit(f"the runtime exited with {code} on SIGTERM:\n{engine.output()[-2000:]}")
    finally:
        engine.kill()
    return elapsed, bool(FOUND.search(log)), len(kernels(cache) - before)


def size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--key", default=TINY_KEY)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each boot may take to be ready")
    parser.add_argument("--keep", action="store_true", help="keep the cache and log directories")
    parser.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a variable for both boots (repeatable), e.g. VLLM_USE_AOT_COMPILE=0")
    args = parser.parse_args()
    extra_env = dict(item.split("=", 1) for item in args.engine_env)
    work = Path(tempfile.mkdtemp(prefix="cf-bench-boot-"))
    cache = work / "compile-cache"
    try:
        first_s, first_found, first_kernels = boot(args.key, cache, work / "logs-1", args.timeout, extra_env)
        cached_mib = size_mib(cache)
        second_s, second_found, second_kernels = boot(args.key, cache, work / "logs-2", args.timeout, extra_env)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"key: {args.key}; CF_COMPILE_CACHE_DIR: {cache}{' (kept)' if args.keep else ''}; "
          f"engine variables: {' '.join(args.engine_env) or 'none'}")
    print(f"{'':28}{'to ready s':>11}{'cache entry found':>19}{'kernels compiled':>18}")
    for name, seconds, found, added in (("first boot (empty cache)", first_s, first_found, first_kernels),
                                        ("second boot (warm cache)", second_s, second_found, second_kernels)):
        print(f"{name:28}{seconds:11.1f}{'yes' if found else 'no':>19}{added:>18}")
    print(f"cache after the first boot: {cached_mib:.1f} MiB")
    print(f"ratio second / first: {second_s / first_s:.2f} (the first boot took {first_s - second_s:.1f} s longer)")
    if first_found or not second_found or second_kernels:
        raise SystemExit("unexpected: the first boot must compile, the second find the entry and compile no kernel")


if __name__ == "__main__":
    main()
