"""How long the doctor takes on this machine, and what the pre-flight adds to every serve.

Measured side by side (alternating runs, so both sides see the same machine state):

* the bare launch (``carbonforge-runtime`` with no arguments runs the doctor), as a process, against
  a bare interpreter start and ``carbonforge-runtime --version`` (the CLI's own start-up);
* the doctor in-process (collect facts with the real probes and NVML, check, render);
* a dry run of a GPU recipe with and without ``--skip-preflight`` (the pre-flight's share of start-up).

    .venv/bin/python benchmarks/bench_doctor.py [--runs 11] [--key qwen2.5-0.5b:fp8:chat:l4x1]

Target: the doctor under 2 s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import median, percentile, timed_run

TARGET_S = 2.0


def timed(argv: list[str], env: dict[str, str]) -> float:
    """The doctor exits 1 when a check fails (no GPU here), which still measures it."""
    return timed_run(argv, env, ok_codes=(0, 1))


def median_p90(values: list[float]) -> tuple[float, float]:
    return median(values), percentile(values, 0.9)


def in_process_doctor(runs: int, env: dict[str, str]) -> list[float]:
    from carbonforge_runtime.gpu.select import default_backend
    from carbonforge_runtime.runtime.doctor import DoctorRequest, run_doctor

    times = []
    for _ in range(runs):
        started = time.perf_counter()
        run_doctor(DoctorRequest(), env, default_backend())
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--key", default="qwen2.5-0.5b:fp8:chat:l4x1", help="GPU recipe for the dry-run pair")
    args = parser.parse_args()

    log_dir = tempfile.mkdtemp(prefix="cf-bench-doctor-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CF_", "CARBONFORGE_"))}
    env["CF_LOG_DIR"] = log_dir
    runtime = [sys.executable, "-m", "carbonforge_runtime"]
    sides = {
        "bare python -c pass": [sys.executable, "-c", "pass"],
        "carbonforge-runtime --version": [*runtime, "--version"],
        "bare launch (the doctor)": runtime,
        "dry run, --skip-preflight": [*runtime, "--context-key", args.key, "--dry-run", "--skip-preflight"],
        "dry run with pre-flight": [*runtime, "--context-key", args.key, "--dry-run"],
    }
    for argv in sides.values():  # warm the page cache
        timed(argv, env)
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.runs):
        for name, argv in sides.items():
            samples[name].append(timed(argv, env))
    inproc = in_process_doctor(args.runs, {**env, "HOME": env.get("HOME", "/root")})

    print(f"runs: {args.runs} per row, alternating; dry-run key: {args.key}")
    print(f"{'':34}{'median s':>10}{'p90 s':>10}")
    for name, values in samples.items():
        med, p90 = median_p90(values)
        print(f"{name:34}{med:10.3f}{p90:10.3f}")
    med, p90 = median_p90(inproc)
    print(f"{'doctor in-process (no start-up)':34}{med:10.3f}{p90:10.3f}")

    doctor_s = median(samples["bare launch (the doctor)"])
    bare_s = median(samples["bare python -c pass"])
    cli_s = median(samples["carbonforge-runtime --version"])
    with_pf = median(samples["dry run with pre-flight"])
    without_pf = median(samples["dry run, --skip-preflight"])
    print(f"doctor / bare interpreter: {doctor_s / bare_s:.1f}x; doctor / CLI start-up: {doctor_s / cli_s:.2f}x")
    print(f"pre-flight share of a dry run: {with_pf - without_pf:+.3f} s "
          f"(with / without: {with_pf / without_pf:.2f}x)")
    verdict = "meets" if doctor_s < TARGET_S else "MISSES"
    print(f"doctor run time {doctor_s:.3f} s {verdict} the {TARGET_S:.0f} s target ({doctor_s / TARGET_S:.0%} of it)")


if __name__ == "__main__":
    main()
