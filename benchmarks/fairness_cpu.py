#!/usr/bin/env python3
"""The flood case of ``bench_fairness.py`` on the real CPU engine: does it agree in direction?

One engine start, set up as ``predict_cpu.py`` sets it up so that requests reach the engine as they
are sent (the engine's worker on the first CPU, everything else on the others, the engine core's
spinning main thread at nice 19; without that, the API server starved and handed requests to the
engine seconds late and in bunches, and the queue formed in front of the scheduler): the built-in
tiny model in a copy of the ``cf-tiny`` recipe that runs two sequences at a time (so that a queue
forms in the engine), ``fcfs`` with
the default ``fairness: vtc``, and a keys file (``CF_API_KEYS_FILE``) with three keys: ``steady``,
``flood`` and ``shared``. Every request goes through the API server's middleware, which writes the
key's tenant into the request, as in production. Three phases on the same engine:

1. **capacity**: 20 requests at once; their completion rate (completed over first send to last
   answer) is the capacity ``C``;
2. **alone**: the steady traffic (Poisson, 0.2 x C) alone, key ``steady``;
3. **FCFS**: the steady traffic and a flood (Poisson, 3 x C) both sent with the key ``shared``:
   one tenant, so the queue is in arrival order, as with ``fairness: off``;
4. **VTC**: the same two streams with the keys ``steady`` and ``flood``.

Each phase lasts ``--seconds`` of arrivals and waits for every answer. Requests are completions
of a short token prompt with ``ignore_eos`` and a drawn ``max_tokens`` of 200 to 400 (the same
draws in phases 2-4). Latency is taken twice: the client's (send to the answer's last byte) and
the engine's (arrival at the scheduler to completion, from the runtime's request trace, which also
names each record's tenant). Reported: the steady stream's p50 / p99 e2e both ways, its p99 wait
in the engine's queue, and the flood's completion rate (completed / first send to last completion)
in phases 3 and 4. About five minutes on two cores (a minute to start, then each phase's arrivals
and the flood's drain)::

    PYTHONPATH=. .venv/bin/python benchmarks/fairness_cpu.py [--seconds 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness import (  # noqa: E402
    log,
    lower_engine_core,
    percentile,
    pin_processes,
    runtime,
    tiny_served_name,
)

KEY = "fair-tiny:bf16:chat:cpu"
KEYS = ("steady", "flood", "shared")
#: Output tokens per request: long enough that the engine, not the HTTP front end (which shares the two
#: cores), is the bottleneck; with 20-120 tokens the front end saturated first (about 16 requests a
#: second) and the queue formed there, before the scheduler saw the requests.
OUTPUT_MIN, OUTPUT_MAX = 200, 400
BURST = 20


def write_setup(directory: Path, worker_cpus: str | None = None) -> dict[str, str]:
    """The recipe (its worker bound to ``worker_cpus``) and the keys file; the secrets by key name."""
    served = tiny_served_name()
    bind = f', VLLM_CPU_OMP_THREADS_BIND: "{worker_cpus}"' if worker_cpus else ""
    recipes = directory / "recipes"
    recipes.mkdir(parents=True)
    (recipes / "fair-tiny.yaml").write_text(f"""key: {KEY}
plan: free
description: fairness check; the tiny model with two running sequences so that a queue forms in the engine
model: {{repo: carbonforge/tiny-chat, served_name: {served}, builtin: tiny-chat}}
vllm:
  dtype: bfloat16
  max_model_len: 2048
  max_num_seqs: 2
  enable_prefix_caching: true
drain_timeout_s: 5
env: {{VLLM_CPU_KVCACHE_SPACE: "1", HF_HUB_OFFLINE: "1", VLLM_USE_AOT_COMPILE: "0"{bind}}}
scheduler: {{family: fcfs, params: {{}}}}
""")
    secret = {name: "cf-" + secrets.token_hex(32) for name in KEYS}
    entries = "".join(f"  - name: {name}\n    sha256: {hashlib.sha256(secret[name].encode()).hexdigest()}\n"
                      "    scopes: [models:read, inference:invoke]\n" for name in KEYS)
    (directory / "keys.yaml").write_text("keys:\n" + entries)
    return secret


STATUS: dict[str, int] = {}


async def one(client: Any, secret: str, output: int, delay: float, started: float
              ) -> tuple[float, float, bool, str | None]:
    """Send at ``started + delay``; (send time, e2e seconds, ok, the answer's id)."""
    await asyncio.sleep(max(0.0, started + delay - time.monotonic()))
    sent = time.monotonic()
    try:
        response = await client.post("/completions", headers={"Authorization": f"Bearer {secret}"}, json={
            "model": tiny_served_name(), "prompt": [100, 200, 300, 400], "max_tokens": output, "ignore_eos": True})
        status = str(response.status_code)
        body = response.json() if response.status_code == 200 else {}
        ok = body.get("usage", {}).get("completion_tokens") == output
        rid = body.get("id")
    except Exception as exc:
        status, ok, rid = type(exc).__name__, False, None
    STATUS[status] = STATUS.get(status, 0) + 1
    return sent, time.monotonic() - sent, ok, rid


async def phase(base_url: str, streams: list[tuple[str, list[tuple[float, int]]]]) -> dict[str, list[tuple]]:
    """Send every stream (key secret, [(offset s, max_tokens)]) at once; results per stream index."""
    import httpx

    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        started = time.monotonic()
        tasks = [[asyncio.create_task(one(client, secret, out, t, started)) for t, out in items]
                 for secret, items in streams]
        return {str(i): [await task for task in group] for i, group in enumerate(tasks)}


def stream(rng: random.Random, rate: float, seconds: float) -> list[tuple[float, int]]:
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append((t, rng.randint(OUTPUT_MIN, OUTPUT_MAX)))


def latency(results: list[tuple], records: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The client's e2e (send to answer) and the engine's (arrival at the scheduler to completion, from
    the runtime's request trace), with the engine's queue wait."""
    e2e = [r[1] for r in results if r[2]]
    mine = [records[r[3]] for r in results if r[2] and r[3] in records]
    engine = [float(m["e2e_latency_s"]) for m in mine]
    wait = [float(m["queue_wait_s"]) for m in mine if m.get("queue_wait_s") is not None]
    return {"requests": len(results), "ok": len(e2e), "e2e_p50_s": percentile(e2e, 0.5),
            "e2e_p99_s": percentile(e2e, 0.99), "engine_records": len(mine),
            "engine_e2e_p50_s": percentile(engine, 0.5), "engine_e2e_p99_s": percentile(engine, 0.99),
            "engine_wait_p99_s": percentile(wait, 0.99)}


def rate(results: list[tuple]) -> float:
    ok = [r for r in results if r[2]]
    if not ok:
        return math.nan
    span = max(r[0] + r[1] for r in ok) - min(r[0] for r in results)
    return len(ok) / span


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=None, help="keep the recipe, keys file and logs here")
    args = parser.parse_args()
    t0 = time.monotonic()
    out: dict[str, Any] = {"seconds": args.seconds, "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="cf-fair-cpu-") as tmp:
        work = args.work or Path(tmp)
        secret = write_setup(work, pin_processes())
        env = {"CF_RECIPES_DIR": str(work / "recipes"), "CF_API_KEYS_FILE": str(work / "keys.yaml")}
        trace = work / "trace.jsonl"
        args_rt = ["--context-key", KEY, "--request-trace", "standard", "--trace-file", str(trace)]
        with runtime(args_rt, work / "logs", env=env) as engine:
            log(f"engine ready in {time.monotonic() - t0:.0f} s")
            if not lower_engine_core(engine.pid):
                log("  warning: no engine core process found to lower in priority")
            rng = random.Random(args.seed)
            burst = [(0.0, rng.randint(OUTPUT_MIN, OUTPUT_MAX)) for _ in range(BURST)]
            done = asyncio.run(phase(engine.base_url, [(secret["steady"], burst)]))["0"]
            ends = sorted(s + e for s, e, ok, _ in done if ok)
            if len(ends) < BURST * 3 // 4:
                raise SystemExit(f"the capacity burst failed: answers by status {STATUS}; logs in {work / 'logs'}")
            first = min(r[0] for r in done)
            cap = len(ends) / (ends[-1] - first)
            out["capacity_rps"] = cap
            log(f"capacity {cap:.2f} req/s (burst of {BURST} done in {ends[-1] - first:.1f} s)")
            steady = stream(random.Random(args.seed + 1), 0.2 * cap, args.seconds)
            flood = stream(random.Random(args.seed + 2), 3.0 * cap, args.seconds)
            alone = asyncio.run(phase(engine.base_url, [(secret["steady"], steady)]))
            fcfs = asyncio.run(phase(engine.base_url, [(secret["shared"], steady), (secret["shared"], flood)]))
            vtc = asyncio.run(phase(engine.base_url, [(secret["steady"], steady), (secret["flood"], flood)]))
            time.sleep(3)  # the last records reach the trace file
            records = {str(r["request_id"]): r for r in map(json.loads, trace.read_text().splitlines())}
            out["alone"] = {"steady": latency(alone["0"], records)}
            out["fcfs"] = {"steady": latency(fcfs["0"], records), "flood_rps": rate(fcfs["1"]),
                           "flood": latency(fcfs["1"], records)}
            out["vtc"] = {"steady": latency(vtc["0"], records), "flood_rps": rate(vtc["1"]),
                          "flood": latency(vtc["1"], records)}
            out["tenants_in_trace"] = sorted({str(r.get("tenant")) for r in records.values()})
            for label in ("alone", "fcfs", "vtc"):
                log(f"{label}: {out[label]}")
            engine_log = engine.engine_log()
            out["fair_queue_engaged"] = "the waiting queue now orders by priority class" in engine_log
            out["answers_by_status"] = dict(STATUS)
    out["wall_s"] = time.monotonic() - t0
    lines = [
        f"Real CPU engine (tiny model, 2 running sequences), capacity {out['capacity_rps']:.2f} req/s, "
        f"{len(steady)} steady and {len(flood)} flood requests over {args.seconds:g} s per phase:",
        "",
        "| run | steady p50 / p99 e2e s (client) | steady p50 / p99 e2e s (engine) | steady p99 wait in the engine s "
        "| steady engine p99 vs alone | flood req/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    alone_p99 = out["alone"]["steady"]["engine_e2e_p99_s"]
    for label, name in (("alone", "steady alone"), ("fcfs", "FCFS with the flood (one key)"),
                        ("vtc", "VTC with the flood (two keys)")):
        s = out[label]["steady"]
        flood_rps = out[label].get("flood_rps")
        lines.append(f"| {name} | {s['e2e_p50_s']:.2f} / {s['e2e_p99_s']:.2f} | {s['engine_e2e_p50_s']:.2f} / "
                     f"{s['engine_e2e_p99_s']:.2f} | {s['engine_wait_p99_s']:.2f} | "
                     f"{s['engine_e2e_p99_s'] / alone_p99:.2f}x | "
                     + (f"{flood_rps:.2f} |" if flood_rps is not None else "- |"))
    agrees = out["vtc"]["steady"]["engine_e2e_p99_s"] < out["fcfs"]["steady"]["engine_e2e_p99_s"]
    lines += ["", f"Answers by HTTP status: {out['answers_by_status']}.",
              f"Direction: steady engine-side p99 lower under VTC than under FCFS: {'yes' if agrees else 'NO'}; "
              f"fair queue engaged (engine log): {'yes' if out['fair_queue_engaged'] else 'NO'}; "
              f"{out['wall_s']:.0f} s in all."]
    out["agrees"] = agrees
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
