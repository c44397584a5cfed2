#!/usr/bin/env python
"""A prediction check recorded before the step log counted a busy engine's time between steps,
predicted again as if it had.

Reads a ``benchmarks/predict_cpu.py`` work directory: its calibration step log (``steps.jsonl``)
and the calibration run's request trace (``calibrate/trace.jsonl``). Each step that began while
requests were in the engine (arrived and not completed, by the request trace) gets the time since
the previous step's end added to its wall time, as the step log now measures it; the result is
fitted with ``sim-calibrate`` and trace B predicted for every family again. Prints predicted
against real (the saved real runs) for the same four figures as the check::

    PYTHONPATH=. .venv/bin/python benchmarks/busy_gaps_refit.py /work/bench-out/predict
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.harness import request_figures  # noqa: E402
from benchmarks.predict_cpu import AGAIN, METRICS, cli, error, read_jsonl, sim_args  # noqa: E402
from carbonforge_runtime.offline.replay.trace import write_jsonl  # noqa: E402

#: A longer gap than this between two steps is not the engine core's own work.
MAX_GAP_S = 0.5


def with_busy_gaps(steps: list[dict], requests: list[dict]) -> tuple[list[dict], float]:
    """The step lines with each busy step's preceding gap added to its wall time, and the total added."""
    events = sorted([(r["t_arrival"], 1) for r in requests] + [(r["t_completion"], -1) for r in requests])
    times = [t for t, _ in events]
    in_engine = list(itertools.accumulate(step for _, step in events))
    out, added, previous_end = [], 0.0, None
    for line in steps:
        if line.get("kind") == "step":
            start = line["t"] - line["wall_s"]
            index = bisect.bisect_right(times, previous_end) - 1 if previous_end is not None else -1
            busy = index >= 0 and in_engine[index] > 0  # requests in the engine when the previous step ended
            if previous_end is not None and busy and 0 < start - previous_end < MAX_GAP_S:
                added += start - previous_end
                line = {**line, "wall_s": round(line["t"] - previous_end, 7)}
            previous_end = line["t"]
        out.append(line)
    return out, added


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("work", nargs="?", type=Path, default=Path("/work/bench-out/predict"),
                        help="a predict_cpu.py work directory (--work)")
    work: Path = parser.parse_args().work.resolve()
    refit = work / "busy-gaps"
    refit.mkdir(exist_ok=True)
    steps, added = with_busy_gaps(read_jsonl(work / "steps.jsonl"), read_jsonl(work / "calibrate" / "trace.jsonl"))
    write_jsonl(refit / "steps.jsonl", steps)
    busy = sum(s["wall_s"] for s in steps if s.get("kind") == "step")
    print(f"{added:.2f} s of gaps added to the calibration's steps ({added / busy:.1%} of the busy time)")
    fitted = cli(["sim-calibrate", str(refit / "steps.jsonl"), "-o", str(refit / "model.yaml"), "--gpu", "cpu"], work)
    print("\n".join(line for line in fitted.stdout.splitlines() if line.startswith(("R2", "mean relative"))))
    kv = int(json.loads((work / "calibrate.json").read_text())["kv_tokens"])
    real = json.loads((work / "real.json").read_text())
    predicted = {}
    for run in real:
        family = "fcfs" if run == AGAIN else run
        if family not in predicted:
            records = refit / f"sim-{family}.requests.jsonl"
            cli(["sim", str(work / "trace-b.jsonl"), *sim_args(work, family, kv, refit / "model.yaml"),
                 "-o", str(refit / f"sim-{family}.json"), "--records", str(records)], work)
            predicted[family] = request_figures(read_jsonl(records))
        pred = predicted[family]
        print(f"{run}: " + ", ".join(f"{label} {pred[m]:.3f} / {real[run][m]:.3f} ({error(pred[m], real[run][m]):+.0%})"
                                     for m, label in METRICS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
