"""The runtime's numbers, as plain data: what the feed brings, what NVML reads, what the controller
does. Thread-safe (one lock); no Prometheus import. :mod:`.exposition` renders a snapshot.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from carbonforge_runtime.core.energy_policy import Signals
from carbonforge_runtime.core.feed_protocol import EngineState, RequestSample
from carbonforge_runtime.core.quantiles import quantile
from carbonforge_runtime.core.tenant_labels import MAX_TENANT_LABELS, RESERVED_TENANT_NAMES, tenant_label
from carbonforge_runtime.gpu.types import GpuReading
from carbonforge_runtime.runtime.energy.controller import ControllerStatus
from carbonforge_runtime.runtime.metrics.receiver import ReceiverStats

QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: How long completed requests are kept for the latency guard's p90 (the longest guard window allowed).
MAX_GUARD_WINDOW_S = 300.0
#: Counter messages kept for the tokens-per-step estimate.
TOKEN_HISTORY = 64


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative), last one is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip((*[repr(float(b)) for b in self.buckets], "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass
class FamilyStats:
    queue_wait: Histogram = field(default_factory=lambda: Histogram(QUEUE_WAIT_BUCKETS_S))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))
    prompt_tokens: int = 0
    output_tokens: int = 0
    energy_j: float = 0.0
    #: (finish reason, data-parallel rank) -> count
    requests: dict[tuple[str, int], int] = field(default_factory=dict)


@dataclass
class TenantStats:
    """Usage of one tenant label (a tenant, ``default`` or ``other``), summed over data-parallel ranks."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    energy_j: float = 0.0
    #: finish reason -> count
    requests: dict[str, int] = field(default_factory=dict)

    def copy(self) -> TenantStats:
        return TenantStats(_copy(self.ttft), _copy(self.e2e), self.prompt_tokens, self.cached_prompt_tokens,
                           self.output_tokens, self.energy_j, dict(self.requests))


def _copy(hist: Histogram) -> Histogram:
    return Histogram(hist.buckets, list(hist.counts), hist.total, hist.count)


@dataclass(frozen=True)
class Info:
    runtime_version: str
    vllm_version: str
    context_key: str
    recipe: str
    licence_plan: str
    licence_expires_at: float | None
    #: vLLM's --max-num-seqs on the planned command line (None: vLLM's own default applies).
    max_num_seqs: int | None = None
    #: The recipe's p90 queue-wait target (its controller's latency guard), None when it sets none.
    queue_wait_target_s: float | None = None


@dataclass(frozen=True)
class RankState:
    """What one engine core (one data-parallel rank) last reported, and how long ago."""

    engine: EngineState
    age_s: float


@dataclass
class Snapshot:
    families: dict[str, FamilyStats]
    #: Data-parallel rank -> its engine core's last report (rank 0 alone without data parallel).
    ranks: dict[int, RankState]
    feed: ReceiverStats
    gpus: list[GpuReading]
    controller: ControllerStatus | None
    info: Info | None
    joules_per_output_token: float | None
    #: Hosts of a multi-host group this host has found lost (None when it serves alone).
    group_hosts_lost: int | None = None
    #: Tenant label -> its usage (labels bounded by :func:`~carbonforge_runtime.core.tenant_labels.tenant_label`).
    tenants: dict[str, TenantStats] = field(default_factory=dict)


class RuntimeState:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_tenants: int = MAX_TENANT_LABELS) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._families: dict[str, FamilyStats] = {}
        self._tenants: dict[str, TenantStats] = {}
        self._labelled_tenants: set[str] = set()  # tenants with a label of their own
        self.max_tenants = max_tenants
        self._recent: deque[tuple[float, float, float | None]] = deque()  # (t, queue wait, ttft)
        self._engines: dict[int, tuple[EngineState, float]] = {}  # rank -> (last state, when)
        # per rank: (t, steps, tokens)
        self._token_history: dict[int, deque[tuple[float, int, int]]] = {}
        self._gpus: list[GpuReading] = []
        self.feed = ReceiverStats()
        self.controller: Callable[[], ControllerStatus] | None = None
        self.info: Info | None = None
        self.output_tokens_total = 0
        self.joules_per_output_token: float | None = None
        #: A multi-host group's count of lost hosts (:meth:`GroupHooks.hosts_lost`), None when alone.
        self.group_hosts_lost: Callable[[], int] | None = None

    # -- inputs --

    def on_records(self, samples: list[RequestSample], dp_rank: int = 0) -> None:
        now = self.clock()
        with self._lock:
            for s in samples:
                stats = self._families.get(s.family)
                if stats is None:
                    stats = self._families[s.family] = FamilyStats()
                stats.queue_wait.observe(s.queue_wait_s)
                if s.ttft_s is not None:
                    stats.ttft.observe(s.ttft_s)
                stats.e2e.observe(s.e2e_latency_s)
                stats.prompt_tokens += s.prompt_tokens
                stats.output_tokens += s.output_tokens
                if s.energy_j is not None:
                    stats.energy_j += s.energy_j
                key = (s.finish_reason, dp_rank)
                stats.requests[key] = stats.requests.get(key, 0) + 1
                self._count_tenant(s)
                self.output_tokens_total += s.output_tokens
                self._recent.append((now, s.queue_wait_s, s.ttft_s))
            while self._recent and now - self._recent[0][0] > MAX_GUARD_WINDOW_S:
                self._recent.popleft()

    def _count_tenant(self, s: RequestSample) -> None:
        """Add ``s`` to its tenant's usage (under the lock)."""
        label = tenant_label(s.tenant, self._labelled_tenants, self.max_tenants)
        usage = self._tenants.get(label)
        if usage is None:
            if label not in RESERVED_TENANT_NAMES:
                self._labelled_tenants.add(label)
            usage = self._tenants[label] = TenantStats()
        if s.ttft_s is not None:
            usage.ttft.observe(s.ttft_s)
        usage.e2e.observe(s.e2e_latency_s)
        usage.prompt_tokens += s.prompt_tokens
        usage.cached_prompt_tokens += s.cached_prompt_tokens
        usage.output_tokens += s.output_tokens
        if s.energy_j is not None:
            usage.energy_j += s.energy_j
        usage.requests[s.finish_reason] = usage.requests.get(s.finish_reason, 0) + 1

    def on_engine_state(self, state: EngineState, dp_rank: int = 0) -> None:
        now = self.clock()
        with self._lock:
            self._engines[dp_rank] = (state, now)
            history = self._token_history.setdefault(dp_rank, deque(maxlen=TOKEN_HISTORY))
            history.append((now, state.counters.steps, state.counters.tokens_scheduled_total))

    def set_gpus(self, readings: list[GpuReading]) -> None:
        with self._lock:
            self._gpus = list(readings)

    # -- outputs --

    def signals(self, now: float, window_s: float, token_window_s: float = 10.0) -> Signals:
        """What the controller sees at ``now`` (monotonic). With data parallel: the waiting and
        running requests of all ranks, the mean tokens per step of the ranks that stepped, and the
        age of the stalest report."""
        with self._lock:
            engines = list(self._engines.values())
            recent = [(w, t) for (at, w, t) in self._recent if now - at <= window_s]
            histories = [[h for h in history if now - h[0] <= token_window_s]
                         for history in self._token_history.values()]
        per_rank = []
        for history in histories:
            if len(history) >= 2:
                steps = history[-1][1] - history[0][1]
                per_rank.append((history[-1][2] - history[0][2]) / steps if steps > 0 else 0.0)
        tokens_per_step = sum(per_rank) / len(per_rank) if per_rank else None
        return Signals(
            now_s=now,
            age_s=max((max(now - t, 0.0) for _, t in engines), default=None),
            waiting=sum(e.counters.waiting for e, _ in engines),
            running=sum(e.counters.running for e, _ in engines),
            tokens_per_step=tokens_per_step,
            queue_wait_p90_s=quantile([w for w, _ in recent], 0.90),
            ttft_p90_s=quantile([t for _, t in recent if t is not None], 0.90),
        )

    def snapshot(self) -> Snapshot:
        controller = self.controller() if self.controller is not None else None
        hosts_lost = self.group_hosts_lost() if self.group_hosts_lost is not None else None
        now = self.clock()
        with self._lock:
            families = {
                name: FamilyStats(
                    queue_wait=Histogram(s.queue_wait.buckets, list(s.queue_wait.counts), s.queue_wait.total,
                                         s.queue_wait.count),
                    ttft=Histogram(s.ttft.buckets, list(s.ttft.counts), s.ttft.total, s.ttft.count),
                    e2e=Histogram(s.e2e.buckets, list(s.e2e.counts), s.e2e.total, s.e2e.count),
                    prompt_tokens=s.prompt_tokens, output_tokens=s.output_tokens, energy_j=s.energy_j,
                    requests=dict(s.requests),
                )
                for name, s in self._families.items()
            }
            return Snapshot(
                families=families,
                ranks={rank: RankState(engine, now - t) for rank, (engine, t) in sorted(self._engines.items())},
                feed=ReceiverStats(self.feed.messages, self.feed.lost, self.feed.malformed),
                gpus=list(self._gpus),
                controller=controller,
                info=self.info,
                joules_per_output_token=self.joules_per_output_token,
                group_hosts_lost=hosts_lost,
                tenants={label: usage.copy() for label, usage in self._tenants.items()},
            )
