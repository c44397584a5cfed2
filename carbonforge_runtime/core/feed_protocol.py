"""The metrics feed's wire format, shared by its two ends.

The engine side (:mod:`carbonforge_runtime.engine.metrics_feed`) sends JSON datagrams on a Unix
socket; the runtime side (:mod:`carbonforge_runtime.runtime.metrics.receiver`) decodes them. This
module is what both agree on: the message shapes, the compact record, and the engine's counters.
Pure: no sockets, no threads, no vLLM.

Messages (one JSON object per datagram, ``v`` = :data:`VERSION`):

* ``{"k": "r", "sid", "seq", "dp", "r": [compact record, ...]}``: completed requests;
* ``{"k": "c", "sid", "seq", "dp", "c": {counters}, "s": {sink: [written, dropped]}}``: engine state.

``sid`` names one sender (one engine process) and ``seq`` numbers its messages, so the receiver can
count what it never got. ``dp`` is the sender's data-parallel rank (0 without data parallel; absent
means 0).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from carbonforge_runtime.core.request_tags import tenant_from_arg

VERSION = 1
#: Records per datagram (a compact record is about 150 bytes, 250 with a long tenant name; datagrams stay far
#: below the socket limit).
RECORDS_PER_DATAGRAM = 150
MAX_DATAGRAM_BYTES = 256 * 1024

KIND_RECORDS = "r"
KIND_COUNTERS = "c"


@dataclass
class EngineCounters:
    """The engine's running counters. The scheduler updates one instance in place on the engine loop
    (plain attribute writes; another thread reading it sees a recent, possibly slightly torn, view);
    the runtime receives copies of it in the feed's counter messages."""

    steps: int = 0
    waiting: int = 0
    running: int = 0
    tokens_scheduled_total: int = 0
    requests_arrived_total: int = 0
    requests_completed_total: int = 0
    #: The paced engine (``serve --emulate``): steps paced, and those whose real work ran past their
    #: modelled time.
    emulated_steps_total: int = 0
    emulated_late_steps_total: int = 0

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> EngineCounters:
        return cls(**{f.name: int(data.get(f.name, 0) or 0) for f in fields(cls)})


@dataclass(frozen=True)
class EngineState:
    """What the runtime last heard from the engine: its counters, and its trace sinks' record counts
    (sink kind ``"file"``, ``"otlp"`` or ``"queue"`` -> (records written, records dropped))."""

    counters: EngineCounters = field(default_factory=EngineCounters)
    sinks: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def from_message(cls, counters: Mapping[str, Any], sinks: Mapping[str, Any]) -> EngineState:
        table = {str(k): (int(v[0]), int(v[1])) for k, v in sinks.items()
                 if isinstance(v, (list, tuple)) and len(v) == 2}
        return cls(EngineCounters.from_mapping(counters), table)


def compact(record: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a trace record the metrics need (never any text)."""
    return {
        "f": record.get("scheduler_family"),
        "fr": record.get("finish_reason"),
        "qw": record.get("queue_wait_s"),
        "tt": record.get("ttft_s"),
        "e2e": record.get("e2e_latency_s"),
        "pt": record.get("prompt_tokens"),
        "ot": record.get("output_tokens"),
        "ej": record.get("energy_j"),
        "cp": record.get("cached_prompt_tokens"),
        "tn": record.get("tenant"),
    }


@dataclass(frozen=True)
class RequestSample:
    """One completed request as the runtime receives it."""

    family: str
    finish_reason: str
    queue_wait_s: float
    ttft_s: float | None
    e2e_latency_s: float
    prompt_tokens: int
    output_tokens: int
    energy_j: float | None
    cached_prompt_tokens: int = 0
    #: The record's tenant (None: the default tenant); the runtime bounds it before it becomes a label.
    tenant: str | None = None

    @classmethod
    def from_compact(cls, data: Mapping[str, Any]) -> RequestSample:
        def number(key: str) -> float | None:
            value = data.get(key)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        return cls(
            family=str(data.get("f") or "unknown"),
            finish_reason=str(data.get("fr") or "unknown"),
            queue_wait_s=number("qw") or 0.0,
            ttft_s=number("tt"),
            e2e_latency_s=number("e2e") or 0.0,
            prompt_tokens=int(number("pt") or 0),
            output_tokens=int(number("ot") or 0),
            energy_j=number("ej"),
            cached_prompt_tokens=int(number("cp") or 0),
            tenant=tenant_from_arg(data.get("tn")),
        )


def encode_records(sid: str, seq: int, records: Sequence[Mapping[str, Any]], dp_rank: int = 0) -> bytes:
    return json.dumps({"v": VERSION, "k": KIND_RECORDS, "sid": sid, "seq": seq, "dp": dp_rank,
                       "r": [compact(r) for r in records]}, separators=(",", ":")).encode()


def encode_counters(sid: str, seq: int, counters: EngineCounters, sinks: Mapping[str, tuple[int, int]],
                    dp_rank: int = 0) -> bytes:
    return json.dumps({"v": VERSION, "k": KIND_COUNTERS, "sid": sid, "seq": seq, "dp": dp_rank,
                       "c": asdict(counters), "s": {k: list(v) for k, v in sinks.items()}},
                      separators=(",", ":")).encode()


def dp_rank_of(message: Mapping[str, Any]) -> int:
    """A message's data-parallel rank; raises ValueError when it is not a small non-negative integer."""
    rank = message.get("dp", 0)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 65536:
        raise ValueError(f"bad data-parallel rank {rank!r}")
    return rank


def sink_kind(name: str) -> str:
    """``'file /var/log/t.jsonl'`` -> ``'file'``, ``'OTLP grpc http://...'`` -> ``'otlp'``."""
    return (name.split(" ", 1)[0] or "sink").lower()
