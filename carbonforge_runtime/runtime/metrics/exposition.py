"""Prometheus metric families from a :class:`~carbonforge_runtime.runtime.metrics.state.Snapshot`.

Names: prefix ``carbonforge_``, base units (seconds, joules, watts, hertz, bytes, celsius),
``_total`` on counters. Served from a dedicated registry (never the global one). Importing this
module imports prometheus-client: only the runtime with ``--metrics`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from carbonforge_runtime.gpu.types import GpuReading
from carbonforge_runtime.runtime.metrics.state import Histogram, RankState, Snapshot, TenantStats

PREFIX = "carbonforge_"
MHZ = 1_000_000.0


@dataclass(frozen=True)
class MetricSpec:
    """One metric family: ``name`` without the prefix (and without a counter's ``_total``)."""

    name: str
    kind: str  # counter, gauge, histogram or info
    help: str
    #: Label names; for an info metric, the keys of its one sample.
    labels: tuple[str, ...] = ()

    @property
    def exposed_name(self) -> str:
        """The name as scraped: counters end in ``_total``, info metrics in ``_info``."""
        return PREFIX + self.name + {"counter": "_total", "info": "_info"}.get(self.kind, "")


_FAMILY = ("scheduler_family",)
_GPU = ("gpu", "uuid")
#: The data-parallel rank of the engine core a value comes from ("0" without data parallel): sum
#: over it for the deployment's total.
_RANK = ("dp_rank",)
#: The tenant: the name of the request's API key for the first 64 distinct tenants seen, "other" past
#: them, "default" for requests without a named key (core/tenant_labels.py).
_TENANT = ("tenant",)
_TENANT_REASON = ("tenant", "finish_reason")
#: Every metric family, in exposition order. The code below takes each family's type, help and labels
#: from here, and docs/metrics-and-energy.md is generated from it (scripts/gen_docs.py).
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("runtime", "info", "The runtime, its engine and what it serves",
               ("version", "vllm_version", "context_key", "recipe")),
    MetricSpec("licence", "info", "The plan this deployment is served under", ("plan",)),
    MetricSpec("licence_expiry_timestamp_seconds", "gauge", "When the licence expires (Unix time)"),
    MetricSpec("engine_max_num_seqs", "gauge", "Most requests the engine runs at once (vLLM's --max-num-seqs "
               "as planned; absent when the recipe leaves it to vLLM's default)"),
    MetricSpec("queue_wait_target_seconds", "gauge", "The recipe's target for the p90 queue wait (its controller's "
               "latency guard, queue_wait_p90_s; absent when the recipe sets none)"),
    MetricSpec("group_hosts_lost", "gauge", "Hosts of the multi-host group found gone or never joined (the "
               "runtime stops its engine soon after; absent when serving alone)"),
    MetricSpec("request_queue_wait_seconds", "histogram", "Arrival to first scheduling of each completed request",
               _FAMILY),
    MetricSpec("request_time_to_first_token_seconds", "histogram", "Arrival to first output token of each "
               "completed request (requests that produced no token are not counted)", _FAMILY),
    MetricSpec("request_e2e_latency_seconds", "histogram", "Arrival to completion of each completed request",
               _FAMILY),
    MetricSpec("requests", "counter", "Completed requests by finish reason and data-parallel rank",
               ("scheduler_family", "finish_reason", "dp_rank")),
    MetricSpec("request_prompt_tokens", "counter", "Prompt tokens of completed requests", _FAMILY),
    MetricSpec("request_output_tokens", "counter", "Output tokens of completed requests", _FAMILY),
    MetricSpec("request_energy_joules", "counter", "GPU energy attributed to completed requests", _FAMILY),
    MetricSpec("tenant_requests", "counter", "Completed requests per tenant by the engine's finish reason (error: "
               "failed in the engine; abort: ended by the API server, e.g. the client left); requests the API "
               "server refuses (401, 403, 413, 429) never reach the engine and are not counted", _TENANT_REASON),
    MetricSpec("tenant_prompt_tokens", "counter", "Prompt tokens of completed requests per tenant", _TENANT),
    MetricSpec("tenant_cached_prompt_tokens", "counter", "Prompt tokens served from the prefix cache per tenant",
               _TENANT),
    MetricSpec("tenant_output_tokens", "counter", "Output tokens of completed requests per tenant", _TENANT),
    MetricSpec("tenant_energy_joules", "counter", "GPU energy attributed to completed requests per tenant (0 "
               "without NVML)", _TENANT),
    MetricSpec("tenant_request_time_to_first_token_seconds", "histogram", "Arrival to first output token of each "
               "completed request per tenant (requests that produced no token are not counted)", _TENANT),
    MetricSpec("tenant_request_e2e_latency_seconds", "histogram", "Arrival to completion of each completed request "
               "per tenant", _TENANT),
    MetricSpec("requests_waiting", "gauge", "Requests waiting to be scheduled", _RANK),
    MetricSpec("requests_running", "gauge", "Requests in the running batch", _RANK),
    MetricSpec("engine_steps", "counter", "Engine scheduling steps", _RANK),
    MetricSpec("engine_scheduled_tokens", "counter", "Tokens scheduled by the engine", _RANK),
    MetricSpec("engine_requests_arrived", "counter", "Requests that reached the engine", _RANK),
    MetricSpec("engine_state_age_seconds", "gauge", "Time since the engine last reported", _RANK),
    MetricSpec("engine_emulated_steps", "counter", "Engine steps paced to the step-time model (serve --emulate; "
               "absent otherwise)", _RANK),
    MetricSpec("engine_emulated_late_steps", "counter", "Paced steps whose real work ran past their modelled time "
               "(serve --emulate; over 1% of the steps: the run is not faithful)", _RANK),
    MetricSpec("trace_records_written", "counter", "Trace records a sink stored", ("sink", "dp_rank")),
    MetricSpec("trace_records_dropped", "counter", "Trace records given up on (sink \"queue\": dropped before "
               "reaching any sink)", ("sink", "dp_rank")),
    MetricSpec("metrics_feed_messages", "counter", "Messages received from the engine"),
    MetricSpec("metrics_feed_lost_messages", "counter", "Messages from the engine that never arrived"),
    MetricSpec("gpu_power_watts", "gauge", "Power draw", _GPU),
    MetricSpec("gpu_sm_clock_hertz", "gauge", "SM clock", _GPU),
    MetricSpec("gpu_memory_clock_hertz", "gauge", "Memory clock", _GPU),
    MetricSpec("gpu_temperature_celsius", "gauge", "GPU temperature", _GPU),
    MetricSpec("gpu_memory_used_bytes", "gauge", "GPU memory in use", _GPU),
    MetricSpec("gpu_power_limit_watts", "gauge", "Power limit in force", _GPU),
    MetricSpec("gpu_clocks_locked", "gauge",
               "1 when the driver reports clocks held by a locked or application clocks setting", _GPU),
    MetricSpec("gpu_energy_joules", "counter", "Energy consumed since the driver loaded", _GPU),
    MetricSpec("energy_per_output_token_joules", "gauge", "GPU energy per output token over the last minute"),
    MetricSpec("controller_observe_only", "gauge",
               "1 when the energy controller only observes (dry run or no permission)"),
    MetricSpec("controller_target_sm_clock_hertz", "gauge",
               "Highest SM clock the controller allows (the GPU's maximum when unlocked)", ("gpu", "policy")),
    MetricSpec("controller_target_power_limit_watts", "gauge", "Power limit the controller wants in force",
               ("gpu", "policy")),
    MetricSpec("controller_actions", "counter", "Settings the controller changed (observe-only: would have changed)",
               ("action",)),
    MetricSpec("controller_guard_trips", "counter", "Times the latency guard forced full performance"),
    MetricSpec("controller_failures", "counter", "Controller failures: a GPU setting the driver refused (stage "
               "\"setting\") or a control period that failed (stage \"period\")", ("stage",)),
    MetricSpec("controller_load_ratio", "gauge", "Load the controller last saw (0 to 1)"),
)
_SPECS = {spec.name: spec for spec in METRICS}
_KINDS: dict[str, Any] = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
                          "histogram": HistogramMetricFamily, "info": InfoMetricFamily}


def _family(name: str, **kwargs: Any) -> Any:
    """A new, empty family ``name`` with the type, help and labels :data:`METRICS` declares."""
    spec = _SPECS[name]
    if spec.labels and spec.kind != "info":
        kwargs["labels"] = list(spec.labels)
    return _KINDS[spec.kind](PREFIX + spec.name, spec.help, **kwargs)


def _hertz(mhz: int | None) -> float | None:
    return None if mhz is None else mhz * MHZ


def _histogram(name: str, per_family: dict[str, Histogram]) -> HistogramMetricFamily:
    family = _family(name)
    for label, hist in sorted(per_family.items()):
        family.add_metric([label], hist.cumulative(), hist.total)
    return family


def _tenant_families(tenants: dict[str, TenantStats]) -> Iterator[Metric]:
    requests = _family("tenant_requests")
    counters = [_family(name) for name in ("tenant_prompt_tokens", "tenant_cached_prompt_tokens",
                                           "tenant_output_tokens", "tenant_energy_joules")]
    for label, usage in sorted(tenants.items()):
        for reason, count in sorted(usage.requests.items()):
            requests.add_metric([label, reason], count)
        values = (usage.prompt_tokens, usage.cached_prompt_tokens, usage.output_tokens, usage.energy_j)
        for family, value in zip(counters, values, strict=True):
            family.add_metric([label], value)
    yield requests
    yield from counters
    yield _histogram("tenant_request_time_to_first_token_seconds", {k: v.ttft for k, v in tenants.items()})
    yield _histogram("tenant_request_e2e_latency_seconds", {k: v.e2e for k, v in tenants.items()})


def families(snap: Snapshot) -> Iterator[Metric]:
    """Every metric family, in a stable order."""
    if snap.info is not None:
        info = _family("runtime")
        info.add_metric([], {"version": snap.info.runtime_version, "vllm_version": snap.info.vllm_version,
                             "context_key": snap.info.context_key, "recipe": snap.info.recipe})
        yield info
        licence = _family("licence")
        licence.add_metric([], {"plan": snap.info.licence_plan})
        yield licence
        if snap.info.licence_expires_at is not None:
            yield _family("licence_expiry_timestamp_seconds", value=snap.info.licence_expires_at)
        if snap.info.max_num_seqs is not None:
            yield _family("engine_max_num_seqs", value=float(snap.info.max_num_seqs))
        if snap.info.queue_wait_target_s is not None:
            yield _family("queue_wait_target_seconds", value=snap.info.queue_wait_target_s)
    if snap.group_hosts_lost is not None:
        yield _family("group_hosts_lost", value=float(snap.group_hosts_lost))

    # -- requests (from the engine, per completed request) --
    fams = snap.families
    yield _histogram("request_queue_wait_seconds", {k: v.queue_wait for k, v in fams.items()})
    yield _histogram("request_time_to_first_token_seconds", {k: v.ttft for k, v in fams.items()})
    yield _histogram("request_e2e_latency_seconds", {k: v.e2e for k, v in fams.items()})
    requests = _family("requests")
    prompt = _family("request_prompt_tokens")
    output = _family("request_output_tokens")
    energy = _family("request_energy_joules")
    for name, stats in sorted(fams.items()):
        for (reason, rank), count in sorted(stats.requests.items()):
            requests.add_metric([name, reason, str(rank)], count)
        prompt.add_metric([name], stats.prompt_tokens)
        output.add_metric([name], stats.output_tokens)
        energy.add_metric([name], stats.energy_j)
    yield requests
    yield prompt
    yield output
    yield energy
    yield from _tenant_families(snap.tenants)

    # -- engine state (from each engine core, twice a second) --
    if snap.ranks:
        counted: list[tuple[str, Callable[[RankState], float]]] = [
            ("requests_waiting", lambda r: r.engine.counters.waiting),
            ("requests_running", lambda r: r.engine.counters.running),
            ("engine_steps", lambda r: r.engine.counters.steps),
            ("engine_scheduled_tokens", lambda r: r.engine.counters.tokens_scheduled_total),
            ("engine_requests_arrived", lambda r: r.engine.counters.requests_arrived_total),
            ("engine_state_age_seconds", lambda r: r.age_s),
        ]
        if any(state.engine.counters.emulated_steps_total for state in snap.ranks.values()):
            counted += [("engine_emulated_steps", lambda r: r.engine.counters.emulated_steps_total),
                        ("engine_emulated_late_steps", lambda r: r.engine.counters.emulated_late_steps_total)]
        for name, of_rank in counted:
            family = _family(name)
            for rank, state in snap.ranks.items():
                family.add_metric([str(rank)], of_rank(state))
            yield family
        if any(state.engine.sinks for state in snap.ranks.values()):
            written = _family("trace_records_written")
            dropped = _family("trace_records_dropped")
            for rank, state in snap.ranks.items():
                for kind, (w, d) in sorted(state.engine.sinks.items()):
                    if kind != "queue":
                        written.add_metric([kind, str(rank)], w)
                    dropped.add_metric([kind, str(rank)], d)
            yield written
            yield dropped
    yield _family("metrics_feed_messages", value=snap.feed.messages)
    yield _family("metrics_feed_lost_messages", value=snap.feed.lost + snap.feed.malformed)

    # -- GPUs (NVML, read every second) --
    if snap.gpus:
        gauges: list[tuple[str, Callable[[GpuReading], float | None]]] = [
            ("gpu_power_watts", lambda r: r.power_w),
            ("gpu_sm_clock_hertz", lambda r: _hertz(r.sm_clock_mhz)),
            ("gpu_memory_clock_hertz", lambda r: _hertz(r.memory_clock_mhz)),
            ("gpu_temperature_celsius", lambda r: r.temperature_c),
            ("gpu_memory_used_bytes", lambda r: None if r.memory_used_bytes is None else float(r.memory_used_bytes)),
            ("gpu_power_limit_watts", lambda r: r.power_limit_w),
            ("gpu_clocks_locked", lambda r: None if r.clocks_locked is None else float(r.clocks_locked)),
        ]
        for name, get in gauges:
            family = _family(name)
            for reading in snap.gpus:
                value = get(reading)
                if value is not None:
                    family.add_metric([str(reading.index), reading.uuid], value)
            yield family
        energy_total = _family("gpu_energy_joules")
        for reading in snap.gpus:
            if reading.energy_j is not None:
                energy_total.add_metric([str(reading.index), reading.uuid], reading.energy_j)
        yield energy_total
    if snap.joules_per_output_token is not None:
        yield _family("energy_per_output_token_joules", value=snap.joules_per_output_token)

    # -- the controller --
    status = snap.controller
    if status is not None:
        yield _family("controller_observe_only", value=float(status.observe_only))
        clock = _family("controller_target_sm_clock_hertz")
        power = _family("controller_target_power_limit_watts")
        for index, (mhz, watts) in sorted(status.targets.items()):
            clock.add_metric([str(index), status.policy], mhz * MHZ)
            power.add_metric([str(index), status.policy], watts)
        yield clock
        yield power
        actions = _family("controller_actions")
        for kind in ("lock_sm_clock", "unlock_sm_clock", "set_power_limit", "restore_power_limit"):
            actions.add_metric([kind], status.actions.get(kind, 0))
        yield actions
        yield _family("controller_guard_trips", value=status.guard_trips)
        failures = _family("controller_failures")
        for stage in ("setting", "period"):
            failures.add_metric([stage], status.failures.get(stage, 0))
        yield failures
        if status.load is not None:
            yield _family("controller_load_ratio", value=status.load)


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
