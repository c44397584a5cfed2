"""Prometheus metric families from a :class:`~carbonforge_runtime.metrics.state.Snapshot`.

Names: prefix ``carbonforge_``, base units (seconds, joules, watts, hertz, bytes, celsius),
``_total`` on counters. Served from a dedicated registry (never the global one). Importing this
module imports prometheus-client: only the runtime with ``--metrics`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from carbonforge_runtime.gpu.control import GpuReading
from carbonforge_runtime.metrics.state import Histogram, Snapshot

PREFIX = "carbonforge_"
MHZ = 1_000_000.0


def _hertz(mhz: int | None) -> float | None:
    return None if mhz is None else mhz * MHZ


def _histogram(name: str, doc: str, per_family: dict[str, Histogram]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(PREFIX + name, doc, labels=["scheduler_family"])
    for label, hist in sorted(per_family.items()):
        family.add_metric([label], hist.cumulative(), hist.total)
    return family


def families(snap: Snapshot) -> Iterator[Metric]:
    """Every metric family, in a stable order."""
    if snap.info is not None:
        info = InfoMetricFamily(PREFIX + "runtime", "The runtime, its engine and what it serves")
        info.add_metric([], {"version": snap.info.runtime_version, "vllm_version": snap.info.vllm_version,
                             "context_key": snap.info.context_key, "recipe": snap.info.recipe})
        yield info
        licence = InfoMetricFamily(PREFIX + "licence", "The plan this deployment is served under")
        licence.add_metric([], {"plan": snap.info.licence_plan})
        yield licence
        if snap.info.licence_expires_at is not None:
            yield GaugeMetricFamily(PREFIX + "licence_expiry_timestamp_seconds",
                                    "When the licence expires (Unix time)", value=snap.info.licence_expires_at)

    # -- requests (from the engine, per completed request) --
    fams = snap.families
    yield _histogram("request_queue_wait_seconds", "Arrival to first scheduling of each completed request",
                     {k: v.queue_wait for k, v in fams.items()})
    yield _histogram("request_time_to_first_token_seconds", "Arrival to first output token of each completed "
                     "request (requests that produced no token are not counted)", {k: v.ttft for k, v in fams.items()})
    yield _histogram("request_e2e_latency_seconds", "Arrival to completion of each completed request",
                     {k: v.e2e for k, v in fams.items()})
    requests = CounterMetricFamily(PREFIX + "requests", "Completed requests by finish reason",
                                   labels=["scheduler_family", "finish_reason"])
    prompt = CounterMetricFamily(PREFIX + "request_prompt_tokens", "Prompt tokens of completed requests",
                                 labels=["scheduler_family"])
    output = CounterMetricFamily(PREFIX + "request_output_tokens", "Output tokens of completed requests",
                                 labels=["scheduler_family"])
    energy = CounterMetricFamily(PREFIX + "request_energy_joules", "GPU energy attributed to completed requests",
                                 labels=["scheduler_family"])
    for name, stats in sorted(fams.items()):
        for reason, count in sorted(stats.requests.items()):
            requests.add_metric([name, reason], count)
        prompt.add_metric([name], stats.prompt_tokens)
        output.add_metric([name], stats.output_tokens)
        energy.add_metric([name], stats.energy_j)
    yield requests
    yield prompt
    yield output
    yield energy

    # -- engine state (from the engine, twice a second) --
    engine = snap.engine
    if engine is not None:
        yield GaugeMetricFamily(PREFIX + "requests_waiting", "Requests waiting to be scheduled", value=engine.waiting)
        yield GaugeMetricFamily(PREFIX + "requests_running", "Requests in the running batch", value=engine.running)
        yield CounterMetricFamily(PREFIX + "engine_steps", "Engine scheduling steps", value=engine.steps)
        yield CounterMetricFamily(PREFIX + "engine_scheduled_tokens", "Tokens scheduled by the engine",
                                  value=engine.tokens_scheduled_total)
        yield CounterMetricFamily(PREFIX + "engine_requests_arrived", "Requests that reached the engine",
                                  value=engine.requests_arrived_total)
        if snap.engine_age_s is not None:
            yield GaugeMetricFamily(PREFIX + "engine_state_age_seconds", "Time since the engine last reported",
                                    value=snap.engine_age_s)
        if engine.sinks:
            written = CounterMetricFamily(PREFIX + "trace_records_written", "Trace records a sink stored",
                                          labels=["sink"])
            dropped = CounterMetricFamily(PREFIX + "trace_records_dropped", "Trace records given up on (sink "
                                          "\"queue\": dropped before reaching any sink)", labels=["sink"])
            for kind, (w, d) in sorted(engine.sinks.items()):
                if kind != "queue":
                    written.add_metric([kind], w)
                dropped.add_metric([kind], d)
            yield written
            yield dropped
    yield CounterMetricFamily(PREFIX + "metrics_feed_messages", "Messages received from the engine",
                              value=snap.feed.messages)
    yield CounterMetricFamily(PREFIX + "metrics_feed_lost_messages", "Messages from the engine that never arrived",
                              value=snap.feed.lost + snap.feed.malformed)

    # -- GPUs (NVML, read every second) --
    if snap.gpus:
        gauges: list[tuple[str, str, Callable[[GpuReading], float | None]]] = [
            ("gpu_power_watts", "Power draw", lambda r: r.power_w),
            ("gpu_sm_clock_hertz", "SM clock", lambda r: _hertz(r.sm_clock_mhz)),
            ("gpu_memory_clock_hertz", "Memory clock", lambda r: _hertz(r.memory_clock_mhz)),
            ("gpu_temperature_celsius", "GPU temperature", lambda r: r.temperature_c),
            ("gpu_memory_used_bytes", "GPU memory in use",
             lambda r: None if r.memory_used_bytes is None else float(r.memory_used_bytes)),
            ("gpu_power_limit_watts", "Power limit in force", lambda r: r.power_limit_w),
            ("gpu_clocks_locked", "1 when the driver reports clocks held by a locked or application clocks setting",
             lambda r: None if r.clocks_locked is None else float(r.clocks_locked)),
        ]
        for name, doc, get in gauges:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["gpu", "uuid"])
            for reading in snap.gpus:
                value = get(reading)
                if value is not None:
                    family.add_metric([str(reading.index), reading.uuid], value)
            yield family
        energy_total = CounterMetricFamily(PREFIX + "gpu_energy_joules", "Energy consumed since the driver loaded",
                                           labels=["gpu", "uuid"])
        for reading in snap.gpus:
            if reading.energy_j is not None:
                energy_total.add_metric([str(reading.index), reading.uuid], reading.energy_j)
        yield energy_total
    if snap.joules_per_output_token is not None:
        yield GaugeMetricFamily(PREFIX + "energy_per_output_token_joules",
                                "GPU energy per output token over the last minute",
                                value=snap.joules_per_output_token)

    # -- the controller --
    status = snap.controller
    if status is not None:
        yield GaugeMetricFamily(PREFIX + "controller_observe_only",
                                "1 when the energy controller only observes (dry run or no permission)",
                                value=float(status.observe_only))
        clock = GaugeMetricFamily(PREFIX + "controller_target_sm_clock_hertz",
                                  "Highest SM clock the controller allows (the GPU's maximum when unlocked)",
                                  labels=["gpu", "policy"])
        power = GaugeMetricFamily(PREFIX + "controller_target_power_limit_watts",
                                  "Power limit the controller wants in force", labels=["gpu", "policy"])
        for index, (mhz, watts) in sorted(status.targets.items()):
            clock.add_metric([str(index), status.policy], mhz * MHZ)
            power.add_metric([str(index), status.policy], watts)
        yield clock
        yield power
        actions = CounterMetricFamily(PREFIX + "controller_actions", "Settings the controller changed (observe-only: "
                                      "would have changed)", labels=["action"])
        for kind in ("lock_sm_clock", "unlock_sm_clock", "set_power_limit", "restore_power_limit"):
            actions.add_metric([kind], status.actions.get(kind, 0))
        yield actions
        yield CounterMetricFamily(PREFIX + "controller_guard_trips", "Times the latency guard forced full performance",
                                  value=status.guard_trips)
        if status.load is not None:
            yield GaugeMetricFamily(PREFIX + "controller_load_ratio", "Load the controller last saw (0 to 1)",
                                    value=status.load)


class SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        yield from families(self.snapshot())


def make_registry(snapshot: Callable[[], Snapshot]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    from prometheus_client import generate_latest

    return generate_latest(registry)
