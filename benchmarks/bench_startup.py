"""The runtime's own start-up cost: process start to the point where vLLM would be spawned.

A dry run of a GPU recipe walks the whole serving path (settings, recipes, licence gate, NVML
hardware check, pre-flight, command line) and exits where the engine would be started, so its
wall time is that cost. Measured side by side with a bare interpreter start for scale.

    .venv/bin/python benchmarks/bench_startup.py [--runs 15] [--key qwen3-32b:fp8:chat:a100-80x1]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import median, percentile, timed_run

TARGET_S = 0.5


def timed(argv: list[str], env: dict[str, str]) -> float:
    return timed_run(argv, env, timeout_s=60)


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
    med_runtime, med_bare = median(runtime_s), median(bare_s)
    print(f"runs: {args.runs}, key: {args.key}")
    print(f"{'':28}{'median s':>10}{'p90 s':>10}")
    print(f"{'bare python -c pass':28}{med_bare:10.3f}{percentile(bare_s, 0.9):10.3f}")
    print(f"{'runtime dry run (to spawn)':28}{med_runtime:10.3f}{percentile(runtime_s, 0.9):10.3f}")
    print(f"ratio runtime / bare interpreter: {med_runtime / med_bare:.1f}x")
    verdict = "meets" if med_runtime < TARGET_S else "MISSES"
    print(f"target < {TARGET_S} s: {verdict} ({med_runtime:.3f} s)")


if __name__ == "__main__":
    main()
