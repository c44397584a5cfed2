"""The runtime's own start-up cost: process start to the point where vLLM would be spawned.

A dry run of a GPU recipe walks the whole serving path (settings, recipes, licence gate, NVML
hardware check, pre-flight, command line) and exits where the engine would be started, so its
wall time is that cost. Measured side by side with a bare interpreter start for scale.

    .venv/bin/python benchmarks/bench_startup.py [--runs 15] [--key qwen3-32b:fp8:chat:a100-80x1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

TARGET_S = 0.5


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{argv} failed: {done.stderr.decode()[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--key", default="qwen3-32b:fp8:chat:a100-80x1")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CF_")}
    env["CF_LOG_DIR"] = "/tmp"
    runtime = [sys.executable, "-m", "carbonforge_runtime", "--context-key", args.key, "--dry-run"]
    bare = [sys.executable, "-c", "pass"]
    timed(runtime, env)  # warm the page cache
    runtime_s, bare_s = [], []
    for _ in range(args.runs):  # alternate so both see the same machine state
        runtime_s.append(timed(runtime, env))
        bare_s.append(timed(bare, env))
    med_runtime, med_bare = statistics.median(runtime_s), statistics.median(bare_s)
    print(f"runs: {args.runs}, key: {args.key}")
    print(f"{'':28}{'median s':>10}{'p90 s':>10}")
    print(f"{'bare python -c pass':28}{med_bare:10.3f}{sorted(bare_s)[int(0.9 * len(bare_s))]:10.3f}")
    print(f"{'runtime dry run (to spawn)':28}{med_runtime:10.3f}{sorted(runtime_s)[int(0.9 * len(runtime_s))]:10.3f}")
    print(f"ratio runtime / bare interpreter: {med_runtime / med_bare:.1f}x")
    verdict = "meets" if med_runtime < TARGET_S else "MISSES"
    print(f"target < {TARGET_S} s: {verdict} ({med_runtime:.3f} s)")


if __name__ == "__main__":
    main()
