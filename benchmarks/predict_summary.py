#!/usr/bin/env python
"""Several runs of the prediction check side by side: one line per check and per kind of prediction.

``benchmarks/predict_cpu.py`` judges one check; on a machine whose speed drifts, one check says
little. This reads the ``figures.json`` of each check named and prints, per check, the machine's
drift (FCFS served twice, and the step times on each run's engine against the first calibration)
and, for each kind of prediction, the worst error over the check's runs of mean e2e,
p99 e2e and throughput and whether all of them met the targets::

    .venv/bin/python benchmarks/predict_summary.py /work/bench-out/predict-*/figures.json

Kinds: ``blind`` (the model calibrated once, before the trace is served), ``blind, each engine``
(calibrated again on each run's engine just before it, also before the trace is served; checks
recorded before that step have ``probe`` instead: the first model scaled to a short burst's speed),
``run speed`` (the first model scaled to the run's own steps, after the fact) and ``engine
arrivals`` (that, fed the arrival times the scheduler saw).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.predict_cpu import TARGETS

#: The targeted figures, in the order of each cell.
JUDGED = ("mean_e2e", "p99_e2e", "throughput")

KINDS = (("blind", "offered"), ("blind, each engine", "local"), ("probe", "probe"), ("run speed", "run_speed"),
         ("engine arrivals", "engine_side"))


def worst(errors: dict[str, dict[str, float]], metric: str) -> float:
    return max(abs(run[metric]) for run in errors.values())


def speeds(figures: dict[str, Any]) -> str:
    """Step times against the first calibration, lowest to highest: trace A on each run's engine (or
    the probe), and trace B in the runs."""
    local = [r["speed"] for r in figures.get("local", {}).get("runs", {}).values() if r.get("speed")]
    probe = [r["speed"] for r in figures.get("probe", {}).get("runs", {}).values() if r.get("speed")]
    runs = [1.0 / r["step_model"]["sum_ratio"] for r in figures.get("engine_side", {}).get("runs", {}).values()
            if r.get("step_model")]
    parts = [f"{name} {min(values):.2f}x-{max(values):.2f}x"
             for name, values in (("A", local), ("probe", probe), ("runs", runs)) if values]
    return ", ".join(parts) or "-"


def cell(errors: dict[str, dict[str, float]]) -> str:
    """Worst mean e2e / p99 e2e / throughput error over the runs, and whether all met the targets."""
    worsts = {metric: worst(errors, metric) for metric in JUDGED}
    met = all(worsts[m] <= TARGETS[m] for m in JUDGED)
    return "/".join(f"{100 * worsts[m]:.0f}" for m in JUDGED) + (" met" if met else " missed")


def ranking(figures: dict[str, Any]) -> str:
    """How often the twin ranked the families as the engine did, where the real difference counted."""
    judged = figures.get("ranking", [])
    if not judged:
        return "nothing judged"
    cells = [f"{sum(1 for r in judged if r['agrees'])}/{len(judged)}"]
    for name in ("agrees_local", "agrees_at_run_speed"):
        other = [r[name] for r in judged if name in r]
        cells.append(f"{sum(other)}/{len(other)}" if other else "-")
    return ", ".join(cells)


def summary(paths: list[Path]) -> str:
    lines = ["| check | FCFS vs itself, mean e2e | step times against the calibration | "
             + " | ".join(label for label, _ in KINDS) + " | ranking agrees: blind, each engine, at run speed |",
             "|---" * (4 + len(KINDS)) + "|"]
    for path in paths:
        figures = json.loads(path.read_text())
        floor = figures.get("noise_floor", {}).get("mean_e2e")
        cells = [cell(figures[key]["errors"]) if figures.get(key, {}).get("errors") else "-" for _, key in KINDS]
        name = path.parent.name if path.name == "figures.json" else path.stem
        lines.append(f"| {name} | {f'{floor:.0%}' if floor is not None else '-'} | {speeds(figures)} | "
                     + " | ".join(cells) + f" | {ranking(figures)} |")
    lines.append("")
    lines.append("Each prediction: the worst error in % over the check's runs of mean e2e / p99 e2e / throughput, "
                 "and whether every run met the targets ("
                 + " / ".join(f"{TARGETS[m]:.0%}" for m in JUDGED) + "). Ranking: of the comparisons of two families "
                 "whose real difference exceeded FCFS against itself, how many the twin got the same way round.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("figures", nargs="+", type=Path, help="figures.json of each check (predict_cpu.py --json)")
    args = parser.parse_args()
    missing = [str(p) for p in args.figures if not p.is_file()]
    if missing:
        print(f"predict_summary: no such file: {', '.join(missing)} (pass the --json file of each check)",
              file=sys.stderr)
        return 2
    print(summary(args.figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
