#!/usr/bin/env python3
"""Benchmark ``trace summarize``: records per second and peak memory, side by side.

Writes synthetic standard-level traces (default 100,000 and 1,000,000 records), then runs, each in
its own child process so peak RSS is that run's alone:

* ``import``    : the interpreter plus the summarizer module, no work (memory floor);
* ``json only`` : read the file and ``json.loads`` every line, nothing else (speed floor);
* ``summarize`` : the summarizer on the small and on the large file, and on the large file
  with the standard library's JSON parser instead of orjson;
* ``cli``       : ``carbonforge-runtime trace summarize FILE --json`` on the large file, start-up included.

Constant memory shows as the same peak RSS for the small and the large file. Rates are given per
wall-clock second and per CPU second (the CPU figure is less disturbed by other load on the host).

    .venv/bin/python benchmarks/bench_trace_summarize.py [--records 1000000] [--gzip] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD_SUMMARIZE = """
import json, sys, time
from pathlib import Path
from carbonforge_runtime.offline.trace_tools import summarize as summary
from carbonforge_runtime.offline.trace_tools.summarize import Summarizer
if len(sys.argv) > 2 and sys.argv[2] == "stdlib":
    summary.orjson = None
wall, cpu = time.perf_counter(), time.process_time()
s = Summarizer(60.0)
s.feed_file(Path(sys.argv[1]))
result = s.result()
print(json.dumps({"records": result.records, "wall_s": time.perf_counter() - wall,
                  "cpu_s": time.process_time() - cpu, "windows": len(result.windows)}))
"""

CHILD_JSON_ONLY = """
import json, sys, time
wall, cpu = time.perf_counter(), time.process_time()
n = 0
loads = json.loads
with open(sys.argv[1], encoding="utf-8") as handle:
    for line in handle:
        loads(line)
        n += 1
print(json.dumps({"records": n, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}))
"""

CHILD_IMPORT = """
import json
import carbonforge_runtime.offline.trace_tools.summarize
print(json.dumps({"records": 0, "wall_s": 0.0, "cpu_s": 0.0}))
"""


def write_trace(path: Path, records: int, seed: int = 1) -> None:
    """Standard-level records at about 1,000 requests/s, with queueing in bursts."""
    rng = random.Random(seed)
    t = 1_789_040_000.0
    families = ("ltr-promptlen", "ltr-promptlen", "ltr-promptlen", "fcfs")
    with path.open("w", encoding="utf-8") as out:
        lines = []
        for i in range(records):
            t += rng.expovariate(1000.0)
            queue = rng.expovariate(20.0) if rng.random() < 0.5 else 0.0
            e2e = queue + rng.lognormvariate(-1.0, 0.5)
            ttft = f"{queue + 0.02:.6f}" if i % 2 else "null"
            lines.append(
                f'{{"request_id": "chatcmpl-{i:016x}", "t_arrival": {t:.6f}, "t_completion": {t + e2e:.6f}, '
                f'"prompt_tokens": {rng.randint(10, 2000)}, "output_tokens": {rng.randint(1, 512)}, '
                f'"e2e_latency_s": {e2e:.6f}, "ttft_s": {ttft}, "queue_wait_s": {queue:.6f}, '
                f'"scheduler_family": "{families[i % 4]}", "priority_score": -318.0, "finish_reason": "length"}}\n'
            )
            if len(lines) >= 10_000:
                out.write("".join(lines))
                lines.clear()
        out.write("".join(lines))


def run_child(argv: list[str]) -> dict[str, float]:
    """Run a child; return its printed JSON plus its own peak RSS (MiB) and wall time."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}): {' '.join(argv)}")
    elapsed = time.perf_counter() - start
    try:
        data = json.loads(output)
    except ValueError:
        data = {}
    data["peak_rss_mib"] = usage.ru_maxrss / 1024.0
    data["child_wall_s"] = elapsed
    data["child_cpu_s"] = usage.ru_utime + usage.ru_stime
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=100_000)
    parser.add_argument("--gzip", action="store_true", help="also time the large file gzip-compressed")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the files (default: a temp dir)")
    args = parser.parse_args()

    workdir = args.dir or Path(tempfile.mkdtemp(prefix="cf-trace-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    small, large = workdir / f"trace-{args.small}.jsonl", workdir / f"trace-{args.records}.jsonl"
    try:
        for path, count in ((small, args.small), (large, args.records)):
            if not path.exists():
                started = time.perf_counter()
                write_trace(path, count)
                print(f"wrote {path} ({path.stat().st_size / 2**20:,.0f} MiB) in {time.perf_counter() - started:.1f} s")
        py = sys.executable
        runs: list[tuple[str, int, dict[str, float]]] = [
            ("import only", 0, run_child([py, "-c", CHILD_IMPORT])),
            (f"json only, {args.records:,}", args.records, run_child([py, "-c", CHILD_JSON_ONLY, str(large)])),
            (f"summarize, {args.small:,}", args.small, run_child([py, "-c", CHILD_SUMMARIZE, str(small)])),
            (f"summarize, {args.records:,}", args.records, run_child([py, "-c", CHILD_SUMMARIZE, str(large)])),
            (f"summarize stdlib json, {args.records:,}", args.records,
             run_child([py, "-c", CHILD_SUMMARIZE, str(large), "stdlib"])),
        ]
        if args.gzip:
            packed = workdir / (large.name + ".gz")
            if not packed.exists():
                with large.open("rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            runs.append((f"summarize gzip, {args.records:,}", args.records,
                         run_child([py, "-c", CHILD_SUMMARIZE, str(packed)])))
        cli = run_child([py, "-m", "carbonforge_runtime", "trace", "summarize", str(large), "--json"])
        runs.append((f"cli (start-up incl.), {args.records:,}", args.records, cli))

        print()
        print(f"{'run':<40}{'records/s (wall)':>18}{'records/s (cpu)':>18}{'peak RSS MiB':>14}")
        for name, count, data in runs:
            wall = data.get("wall_s") or data["child_wall_s"]
            cpu = data.get("cpu_s") or data["child_cpu_s"]
            rate_wall = f"{count / wall:,.0f}" if count else "-"
            rate_cpu = f"{count / cpu:,.0f}" if count else "-"
            print(f"{name:<40}{rate_wall:>18}{rate_cpu:>18}{data['peak_rss_mib']:>14.1f}")
        by_name = {name: data for name, _, data in runs}
        big = by_name[f"summarize, {args.records:,}"]
        little = by_name[f"summarize, {args.small:,}"]
        floor = by_name[f"json only, {args.records:,}"]
        base = by_name["import only"]
        print()
        print(f"peak RSS, {args.records:,} vs {args.small:,} records: {big['peak_rss_mib']:.1f} vs "
              f"{little['peak_rss_mib']:.1f} MiB (ratio {big['peak_rss_mib'] / little['peak_rss_mib']:.2f}; "
              f"{big['peak_rss_mib'] - base['peak_rss_mib']:.1f} MiB above the bare import)")
        stdlib = by_name[f"summarize stdlib json, {args.records:,}"]
        print(f"summarize speed vs json.loads alone (same file, CPU time): "
              f"{floor['cpu_s'] / big['cpu_s']:.2f}x; orjson vs standard parser: {stdlib['cpu_s'] / big['cpu_s']:.2f}x")
        print(f"summarize: {args.records / big['wall_s']:,.0f} records/s wall, "
              f"{args.records / big['cpu_s']:,.0f} records/s CPU (target: 200,000)")
    finally:
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
