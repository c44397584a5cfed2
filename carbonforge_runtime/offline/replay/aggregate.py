"""Reducing a replay's per-request outcomes to the aggregate table. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from carbonforge_runtime.core.quantiles import quantile


@dataclass
class RequestOutcome:
    index: int
    scheduled_s: float  # when the plan wanted it sent, after the replay start
    sent_s: float | None = None  # when it was actually sent (None: never sent)
    done_s: float | None = None
    request_id: str | None = None
    prompt_tokens: int | None = None  # as the server reported (usage)
    output_tokens: int | None = None
    expected_prompt_tokens: int = 0
    expected_output_tokens: int = 0
    template: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None and self.sent_s is not None

    @property
    def latency_s(self) -> float | None:
        if not self.ok:
            return None
        assert self.done_s is not None and self.sent_s is not None
        return self.done_s - self.sent_s

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["latency_s"] = self.latency_s
        return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (``q`` in 0..100) by the project's nearest-rank convention
    (:mod:`carbonforge_runtime.core.quantiles`); NaN for no values."""
    found = quantile(values, q / 100.0)
    return float("nan") if found is None else found


def latency_stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        nan = float("nan")
        return {"mean": nan, "p50": nan, "p90": nan, "p99": nan, "max": nan}
    return {
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
    }


def summarize(outcomes: Sequence[RequestOutcome], duration_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    latencies = [o.latency_s for o in ok if o.latency_s is not None]
    per_token = [o.latency_s / o.output_tokens for o in ok
                 if o.latency_s is not None and o.output_tokens]
    lags = [o.sent_s - o.scheduled_s for o in outcomes if o.sent_s is not None]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error is not None:
            kind = o.error.split(":", 1)[0]
            errors[kind] = errors.get(kind, 0) + 1
    output_tokens = sum(o.output_tokens or 0 for o in ok)
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "failed": len(outcomes) - len(ok),
        "errors": errors,
        "duration_s": duration_s,
        "request_rate": len(ok) / duration_s if duration_s > 0 else float("nan"),
        "output_token_rate": output_tokens / duration_s if duration_s > 0 else float("nan"),
        "prompt_tokens": sum(o.prompt_tokens or 0 for o in ok),
        "output_tokens": output_tokens,
        "e2e_latency_s": latency_stats(latencies),
        "latency_per_output_token_s": sum(per_token) / len(per_token) if per_token else float("nan"),
        "send_lag_s": {"mean": sum(lags) / len(lags) if lags else float("nan"), "max": max(lags, default=0.0)},
    }


def format_table(summary: Mapping[str, Any]) -> str:
    """The aggregate as a small aligned table for the terminal."""
    lat = summary["e2e_latency_s"]
    rows = [
        ("requests", f"{summary['ok']} ok / {summary['requests']}"
                     + (f"  ({', '.join(f'{k}: {v}' for k, v in summary['errors'].items())})"
                        if summary["errors"] else "")),
        ("duration", f"{summary['duration_s']:.1f} s"),
        ("throughput", f"{summary['request_rate']:.2f} req/s, {summary['output_token_rate']:.0f} output tok/s"),
        ("e2e latency", "mean {mean:.3f} s  p50 {p50:.3f}  p90 {p90:.3f}  p99 {p99:.3f}  max {max:.3f}".format(**lat)),
        ("per output token", f"{summary['latency_per_output_token_s'] * 1000:.2f} ms"),
        ("send lag", "mean {:.1f} ms  max {:.1f} ms".format(summary["send_lag_s"]["mean"] * 1000,
                                                          summary["send_lag_s"]["max"] * 1000)),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)
