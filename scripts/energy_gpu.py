"""GPU energy check on a machine with NVIDIA GPUs: telemetry, energy counter, meter and a controller dry run.

1. Lists the GPUs this process may use and what the controller would work with (power limit and its
   bounds, SM clocks, whether clocks are already locked).
2. Reads every GPU for ``--seconds`` (default 30): power, energy counter, clocks, temperature. Reports
   how often the energy counter moves, how its increase compares with the integral of the power
   readings, and what one counter read costs.
3. Runs the per-request energy meter on synthetic engine steps and checks that what it attributes
   adds up to the counter's increase.
4. Runs the controller in dry run (no set call is ever made) for a few periods per policy, on a
   scripted load: idle, busy, idle, then latency at risk. Each period logs what it would do and why.

Everything is written to ``--out`` as well as to the terminal. Nothing on the GPU is changed.

    python scripts/energy_gpu.py [--seconds 30] [--out energy-gpu.log] [--fake-nvml script.json]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from carbonforge_runtime.core.energy_policy import Signals, parse_params
from carbonforge_runtime.engine.energy_meter import EnergyMeter
from carbonforge_runtime.gpu.select import open_session, select_visible
from carbonforge_runtime.gpu.types import GpuError, GpuId, GpuSession
from carbonforge_runtime.runtime.energy.controller import Controller

log = logging.getLogger("energy-gpu")


def describe_gpus(session: GpuSession, gpus: list[GpuId]) -> None:
    for gpu in gpus:
        log.info("GPU %d: %s (%s)", gpu.index, gpu.name, gpu.uuid)
        try:
            lim = session.limits(gpu.index)
        except GpuError as exc:
            log.info("  limits: not readable (%s: %s)", exc.kind, exc)
            continue
        log.info("  power limit %.0f W (default %.0f W, settable %.0f-%.0f W)", lim.power_limit_w,
                 lim.power_limit_default_w, lim.power_limit_min_w, lim.power_limit_max_w)
        clocks = lim.sm_clocks_mhz
        log.info("  SM clock up to %d MHz; %d supported clocks from %d MHz; clocks locked now: %s",
                 lim.sm_clock_max_mhz, len(clocks), clocks[0], lim.clocks_locked)


def sample(session: GpuSession, gpus: list[GpuId], seconds: float, interval_s: float = 0.1) -> None:
    log.info("reading power and the energy counter of %d GPU(s) every %.0f ms for %.0f s",
             len(gpus), interval_s * 1000, seconds)
    series: dict[int, list[tuple[float, float | None, float | None]]] = {g.index: [] for g in gpus}
    end = time.monotonic() + seconds
    next_print = time.monotonic()
    while time.monotonic() < end:
        t = time.monotonic()
        for gpu in gpus:
            reading = session.read(gpu.index)
            series[gpu.index].append((t, reading.power_w, reading.energy_j))
            if t >= next_print:
                log.info("  GPU %d: %s W, counter %s J, SM %s MHz, memory %s MHz, %s C, limit %s W, locked %s",
                         gpu.index, reading.power_w, reading.energy_j, reading.sm_clock_mhz,
                         reading.memory_clock_mhz, reading.temperature_c, reading.power_limit_w,
                         reading.clocks_locked)
        if t >= next_print:
            next_print = t + 5.0
        time.sleep(max(interval_s - (time.monotonic() - t), 0.0))
    for index, points in series.items():
        energy = [(t, e) for t, _, e in points if e is not None]
        power = [(t, p) for t, p, _ in points if p is not None]
        if len(energy) < 2 or len(power) < 2:
            log.info("GPU %d: not enough readings (energy %d, power %d)", index, len(energy), len(power))
            continue
        counter_j = energy[-1][1] - energy[0][1]
        integral_j = sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in itertools.pairwise(power))
        moves = [t for (t, e), (_, before) in zip(energy[1:], energy, strict=False) if e != before]
        gaps = [b - a for a, b in itertools.pairwise(moves)]
        log.info("GPU %d: counter +%.1f J, power integral %.1f J (ratio %.3f), mean %.1f W; counter moved %d times, "
                 "median every %.0f ms", index, counter_j, integral_j, counter_j / integral_j if integral_j else 0.0,
                 integral_j / (power[-1][0] - power[0][0]), len(moves),
                 statistics.median(gaps) * 1000 if gaps else float("nan"))
    gpu = gpus[0]
    calls = 2000
    started = time.perf_counter()
    for _ in range(calls):
        session.energy_j(gpu.index)
    log.info("one energy counter read: %.1f us", (time.perf_counter() - started) / calls * 1e6)


def meter_check(session: GpuSession, gpus: list[GpuId], seconds: float = 5.0) -> None:
    log.info("energy meter on synthetic engine steps for %.0f s (requests a:b:c share the work 1:2:5)", seconds)
    meter = EnergyMeter(session, [g.index for g in gpus], log).start()
    t0 = time.monotonic()
    start_j = sum(session.energy_j(g.index) for g in gpus)
    end = t0 + seconds
    while time.monotonic() < end:
        key = object()
        meter.step_started(key, time.monotonic())
        time.sleep(0.01)
        meter.step_ended(key, time.monotonic(), {"a": 1, "b": 2, "c": 5})
    time.sleep(0.3)
    stop_j = sum(session.energy_j(g.index) for g in gpus)
    got = {rid: meter.energy_for(rid, time.time()) for rid in "abc"}
    totals = meter.attributor.totals
    meter.close()
    attributed = sum(v or 0.0 for v in got.values())
    log.info("meter: a %.2f J, b %.2f J, c %.2f J; attributed %.1f J + unattributed %.1f J; counter +%.1f J over "
             "the check (includes the 0.3 s after it)", got["a"] or 0, got["b"] or 0, got["c"] or 0, attributed,
             totals.unattributed_j, stop_j - start_j)


def controller_dry_run(session: GpuSession, gpus: list[GpuId], periods: int, period_s: float) -> None:
    for policy in ("lock-sm-clock", "cap-power"):
        params = parse_params(policy, {"period_s": max(period_s, 0.5), "guard": {"queue_wait_p90_s": 0.5}},
                              "energy_gpu.py", capacity_seqs=64)
        idle = max(periods, params.down_periods + 1)  # long enough for a saving to be taken
        script = ["idle"] * idle + ["busy"] * 2 + ["idle"] * idle + ["latency at risk"] * 2
        phase = {"now": "idle"}

        def signals(now: float, phase: dict[str, str] = phase) -> Signals:
            if phase["now"] == "busy":
                return Signals(now, 0.2, waiting=3, running=64)
            if phase["now"] == "latency at risk":
                return Signals(now, 0.2, running=2, queue_wait_p90_s=0.9)
            return Signals(now, 0.2, running=1)

        controller = Controller(params, session, gpus, signals, log, dry_run=True)
        if not controller.start():
            return
        log.info("controller dry run, policy %s: %s", policy, ", ".join(script))
        for name in script:
            phase["now"] = name
            controller.tick()
            time.sleep(period_s)
        controller.stop()
        actuator = controller.actuator
        log.info("policy %s: %d set calls made (a dry run makes none)", policy, actuator.set_calls if actuator else 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--periods", type=int, default=4, help="idle controller periods per phase")
    parser.add_argument("--period-s", type=float, default=1.0, help="seconds between controller periods")
    parser.add_argument("--out", default="energy-gpu.log")
    parser.add_argument("--fake-nvml", default=os.environ.get("CF_FAKE_NVML"),
                        help="a scripted fake GPU instead of the driver (to try the script without a GPU)")
    args = parser.parse_args()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout), logging.FileHandler(args.out, mode="w")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", handlers=handlers)
    opened = open_session(args.fake_nvml, log)
    if opened is None:
        log.error("no NVIDIA GPU is usable through NVML here (driver missing, or no GPU given to this container)")
        return 2
    session, found = opened
    gpus, warning = select_visible(found, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if warning:
        log.warning(warning)
    if not gpus:
        log.error("no GPU selected")
        return 2
    try:
        describe_gpus(session, gpus)
        sample(session, gpus, args.seconds)
        meter_check(session, gpus, min(5.0, max(args.seconds / 6, 1.0)))
        controller_dry_run(session, gpus, args.periods, args.period_s)
    finally:
        session.close()
    log.info("log saved to %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
