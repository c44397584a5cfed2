#!/usr/bin/env python3
"""Benchmark ``trace list``: time and peak memory of a page over a large trace, beside DuckDB.

Writes a synthetic standard-level trace (default 1,000,000 records, about 450 MB, with a model,
a tenant and a task tag on every record) and its gzip copy, then times, each in its own child
process so that peak RSS (``ru_maxrss``) is that run's alone:

* ``import``      : the interpreter plus the listing module, no work (memory floor);
* ``parse only``  : the trace reader and orjson over every line, nothing else (speed floor);
* ``first page``  : ``--filter output_tokens>5 --task sql --sort e2e_latency_s --order desc --limit 50``,
  a sort on a field in random order, so the bounded heap is exercised on every record;
* ``deep cursor`` : the same query with ``--limit 100000`` (the memory of a large page), whose
  cursor then serves the ``later page``: rows 100,001-100,050 through ``--cursor``;
* ``arrival order``: the default sort (``t_arrival`` ascending) with no filter, first page;
* ``gzip``        : the first-page query on the gzip copy;
* ``cli``         : ``carbonforge-runtime trace list ... --json`` for the first page, start-up included.

With ``--duckdb`` (and the ``duckdb`` package installed; it is not a dependency of the runtime) the
same first and later pages are read by DuckDB's ``read_json`` on the plain and the gzip file, with its
default threads and with one thread, and the rows are checked equal to ours.

Rates are per wall-clock second and per CPU second (CPU is less disturbed by other load on the host).
The figures go to stdout, and with ``--out FILE`` to a Markdown file naming the commit and command.

    .venv/bin/python benchmarks/bench_trace_list.py [--records 1000000] [--duckdb] [--out FILE] [--dir DIR]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import REPO, command, commit

FILTERS = ["--filter", "output_tokens>5", "--task", "sql"]
SORT = ["--sort", "e2e_latency_s", "--order", "desc"]
DEEP = int(os.environ.get("CF_BENCH_DEEP", "100000"))

CHILD_LIST = """
import json, sys, time
from pathlib import Path
from carbonforge_runtime.offline.trace_tools import catalog
path, limit, cursor, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None, sys.argv[4]
if mode == "arrival":
    query = catalog.build_query()
else:
    query = catalog.build_query(["output_tokens>5"], task="sql", sort="e2e_latency_s", order="desc")
wall, cpu = time.perf_counter(), time.process_time()
page = catalog.list_requests([Path(path)], query, limit, cursor)
print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "records": page.records, "matched": page.matched, "rows": len(page.rows),
                  "next_cursor": page.next_cursor, "ids": [row.request_id for row in page.rows[-50:]]}))
"""

CHILD_PARSE_ONLY = """
import json, sys, time
from pathlib import Path
from carbonforge_runtime.offline.trace_reader import byte_line_batches, orjson
wall, cpu = time.perf_counter(), time.process_time()
loads = orjson.loads
n = 0
for batch in byte_line_batches(Path(sys.argv[1])):
    for line in batch:
        if line:
            loads(line)
            n += 1
print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "records": n}))
"""

CHILD_IMPORT = """
import json
import carbonforge_runtime.offline.trace_tools.catalog
print(json.dumps({"wall_s": 0.0, "cpu_s": 0.0}))
"""

CHILD_DUCKDB = """
import json, sys, time
import duckdb
path, offset, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
wall, cpu = time.perf_counter(), time.process_time()
con = duckdb.connect()
if threads:
    con.execute(f"SET threads = {threads}")
rows = con.execute(
    "SELECT request_id FROM read_json(?, format = 'newline_delimited') "
    "WHERE output_tokens > 5 AND tags.task = 'sql' "
    "ORDER BY e2e_latency_s DESC NULLS LAST, request_id LIMIT 50 OFFSET ?",
    [path, offset]).fetchall()
print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "ids": [row[0] for row in rows]}))
"""


CASES_CHILD = """
import json, sys
import duckdb
path, where = sys.argv[1], sys.argv[2]
try:
    query = f"SELECT request_id FROM read_json('{path}', format = 'newline_delimited') WHERE {where}"
    rows = duckdb.sql(query).fetchall()
    print(json.dumps({"outcome": f"{len(rows):,} row{'s' if len(rows) != 1 else ''}"}))
except duckdb.Error as exc:
    print(json.dumps({"outcome": "fails: " + str(exc).splitlines()[0].replace(path, "FILE")[:90]}))
"""


def robustness_cases(workdir: Path) -> list[tuple[str, Path, str, list[str], str]]:
    """Small traces that are ordinary for the runtime and hard for a reader that infers a schema from
    a sample: (what, file, DuckDB condition, trace list options, what the right answer is)."""
    def rows(count: int, **extra: object) -> list[str]:
        return [json.dumps({"request_id": f"r{i}", "t_arrival": 1_796_455_800.0 + i, "output_tokens": i % 9,
                            "ttft_s": None, **extra}) for i in range(count)]
    cases = []
    damaged = rows(1000)
    damaged[500] = damaged[500][:40]  # a line cut by a crash mid-write
    path = workdir / "case-damaged.jsonl"
    path.write_text("\n".join(damaged) + "\n")
    cases.append(("one damaged line among 1,000", path, "output_tokens > 5", ["--filter", "output_tokens>5"],
                  "333 rows, the bad line reported"))
    late = [*rows(30_000), json.dumps({"request_id": "tagged", "t_arrival": 1_796_500_000.0, "output_tokens": 1,
                                       "tags": {"task": "sql"}})]
    path = workdir / "case-late-field.jsonl"
    path.write_text("\n".join(late) + "\n")
    cases.append(("tags first seen after 30,000 records", path, "tags.task = 'sql'", ["--task", "sql"], "1 row"))
    typed = [*rows(30_000), json.dumps({"request_id": "fast", "t_arrival": 1_796_500_000.0, "output_tokens": 1,
                                        "ttft_s": 0.5})]
    path = workdir / "case-late-number.jsonl"
    path.write_text("\n".join(typed) + "\n")
    cases.append(("ttft_s null for 30,000 records, then a number", path, "ttft_s > 0.1", ["--filter", "ttft>0.1"],
                  "1 row"))
    path = workdir / "case-cut.jsonl.gz"
    path.write_bytes(gzip.compress(("\n".join(rows(50_000)) + "\n").encode())[:-3000])
    cases.append(("gzip cut short (copied while written)", path, "output_tokens > 5", ["--filter", "output_tokens>5"],
                  "the rows before the cut, the damage reported"))
    return cases


def ours_outcome(path: Path, options: list[str]) -> str:
    done = subprocess.run([sys.executable, "-m", "carbonforge_runtime", "trace", "list", str(path), *options,
                           "--json", "--limit", "0"], capture_output=True, text=True, cwd=REPO, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        return "fails: " + done.stderr.strip().splitlines()[0].replace(str(path), "FILE")[:90]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    noted = f", {len(warnings)} warning{'s' if len(warnings) != 1 else ''}" if warnings else ""
    count = len(json.loads(done.stdout)["rows"])
    return f"{count:,} row{'s' if count != 1 else ''}{noted}"


def write_trace(path: Path, records: int, seed: int = 3) -> None:
    """Standard-level records at about 1,000 requests/s, tagged with a model, tenant and task."""
    rng = random.Random(seed)
    t = 1_796_455_800.0
    tasks = ("sql", "chat", "summarize", "code")
    with path.open("w", encoding="utf-8") as out:
        lines = []
        for i in range(records):
            t += rng.expovariate(1000.0)
            queue = rng.expovariate(20.0) if rng.random() < 0.5 else 0.0
            e2e = queue + rng.lognormvariate(-1.0, 0.5)
            ttft = f"{queue + 0.02:.6f}" if i % 2 else "null"
            rid = f"chatcmpl-{i:016x}"
            lines.append(
                f'{{"request_id": "{rid}", "t_arrival": {t:.6f}, "t_completion": {t + e2e:.6f}, '
                f'"prompt_tokens": {rng.randint(10, 2000)}, "output_tokens": {rng.randint(1, 512)}, '
                f'"e2e_latency_s": {e2e:.6f}, "ttft_s": {ttft}, "queue_wait_s": {queue:.6f}, '
                f'"scheduler_family": "ltr-promptlen", "priority_score": -318.0, "finish_reason": "length", '
                f'"cached_prompt_tokens": 0, "preemptions": 0, "engine_request_id": "{rid}-1a2b3c4d", '
                f'"energy_j": null, "model": "qwen3-8b", "tenant": "team-{i % 7}", '
                f'"tags": {{"task": "{tasks[i % 4]}"}}}}\n'
            )
            if len(lines) >= 10_000:
                out.write("".join(lines))
                lines.clear()
        out.write("".join(lines))


def run_child(argv: list[str]) -> dict:
    """Run a child; return its printed JSON plus its own peak RSS (MiB), wall and CPU time."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child failed: {' '.join(argv)}")
    try:
        data = json.loads(output)
    except ValueError:
        raise SystemExit(f"child printed no figures: {' '.join(argv[:2])} ...: {output[-500:]!r}") from None
    data["peak_rss_mib"] = usage.ru_maxrss / 1024.0
    data["child_wall_s"] = time.perf_counter() - start
    data["child_cpu_s"] = usage.ru_utime + usage.ru_stime
    return data


def have_duckdb() -> bool:
    done = subprocess.run([sys.executable, "-c", "import duckdb"], capture_output=True, check=False)
    return done.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--duckdb", action="store_true", help="also time DuckDB's read_json (needs duckdb)")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures to this Markdown file")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the traces (default: a temp dir)")
    args = parser.parse_args()
    if args.duckdb and not have_duckdb():
        raise SystemExit("--duckdb needs the duckdb package: .venv/bin/pip install duckdb")

    workdir = args.dir or Path(tempfile.mkdtemp(prefix="cf-trace-list-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    plain = workdir / f"trace-list-{args.records}.jsonl"
    packed = workdir / (plain.name + ".gz")
    py = sys.executable
    n = args.records
    try:
        if not plain.exists():
            started = time.perf_counter()
            write_trace(plain, n)
            print(f"wrote {plain} ({plain.stat().st_size / 2**20:,.0f} MiB) in {time.perf_counter() - started:.1f} s")
        if not packed.exists():
            with plain.open("rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        sizes = f"{plain.stat().st_size / 2**20:,.0f} MiB plain, {packed.stat().st_size / 2**20:,.0f} MiB gzip"

        def ours(path: Path, limit: int, cursor: str = "", mode: str = "filtered") -> dict:
            return run_child([py, "-c", CHILD_LIST, str(path), str(limit), cursor, mode])

        runs: list[tuple[str, dict]] = [("import only", run_child([py, "-c", CHILD_IMPORT])),
                                        ("parse only (reader + orjson)", run_child([py, "-c", CHILD_PARSE_ONLY,
                                                                                    str(plain)]))]
        first = ours(plain, 50)
        runs.append(("first page (filter, sort e2e desc)", first))
        deep = ours(plain, DEEP)
        runs.append((f"one page of {DEEP:,} rows (same query)", deep))
        later = ours(plain, 50, deep["next_cursor"])
        runs.append((f"later page via cursor (rows {DEEP + 1:,}-{DEEP + 50:,})", later))
        runs.append(("first page, arrival order, no filter", ours(plain, 50, mode="arrival")))
        runs.append(("first page, gzip", ours(packed, 50)))
        cli = run_child([py, "-m", "carbonforge_runtime", "trace", "list", str(plain), *FILTERS, *SORT, "--json"])
        runs.append(("cli first page (start-up incl.)", cli))
        checks = []
        if args.duckdb:
            for threads in (0, 1):
                label = "default threads" if threads == 0 else "1 thread"
                for name, path, offset, ours_run in (("first page", plain, 0, first),
                                                     (f"later page (OFFSET {DEEP:,})", plain, DEEP, later),
                                                     ("first page, gzip", packed, 0, first)):
                    data = run_child([py, "-c", CHILD_DUCKDB, str(path), str(offset), str(threads)])
                    runs.append((f"duckdb {name}, {label}", data))
                    checks.append(data["ids"] == ours_run["ids"])

        lines = [f"trace: {n:,} standard-level records ({sizes}); query: {' '.join(FILTERS + SORT)} "
                 f"({first['matched']:,} match)", "",
                 "| run | wall s | CPU s | records/s (wall) | records/s (CPU) | peak RSS MiB |",
                 "|---|---|---|---|---|---|"]
        for name, data in runs:
            if name.startswith("import"):
                lines.append(f"| {name} | - | - | - | - | {data['peak_rss_mib']:.0f} |")
                continue
            if name.startswith("cli"):
                wall, cpu = data["child_wall_s"], data["child_cpu_s"]
            else:
                wall, cpu = data["wall_s"], data["cpu_s"]
            lines.append(f"| {name} | {wall:.2f} | {cpu:.2f} | {n / wall:,.0f} | {n / cpu:,.0f} | "
                         f"{data['peak_rss_mib']:.0f} |")
        lines.append("")
        lines.append(f"peak RSS of the first page above the bare import: "
                     f"{first['peak_rss_mib'] - runs[0][1]['peak_rss_mib']:.1f} MiB; "
                     f"of a {DEEP:,}-row page: {deep['peak_rss_mib'] - runs[0][1]['peak_rss_mib']:.1f} MiB")
        if checks:
            lines.append(f"DuckDB's pages equal ours: {'yes' if all(checks) else 'NO'} ({sum(checks)}/{len(checks)})")
        if args.duckdb:
            lines += ["", "| input | right answer | trace list | DuckDB read_json |", "|---|---|---|---|"]
            for what, path, where, options, right in robustness_cases(workdir):
                theirs = run_child([py, "-c", CASES_CHILD, str(path), where])["outcome"]
                lines.append(f"| {what} | {right} | {ours_outcome(path, options)} | {theirs} |")
        text = "\n".join(lines)
        print()
        print(text)
        if args.out is not None:
            header = (f"# trace list on {n:,} records\n\nCommand: `{command()}`\n\nCommit: `{commit()}`\n\n"
                      f"Host: {os.cpu_count()} CPUs, other jobs running; each run in a child process of its own.\n\n")
            args.out.write_text(header + text + "\n", encoding="utf-8")
            print(f"\nwrote {args.out}")
    finally:
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
