"""The twin's results: ``replay``'s result JSON (the same keys, plus a ``sim`` section) and a
per-request JSONL in the trace record's shape, which ``trace summarize`` and ``trace plot`` read.
Pure: the files are written by :func:`carbonforge_runtime.files.write_atomic`.

Times are virtual seconds after the first arrival (in the per-request records, Unix seconds from
``origin_s``, 0 by default: the epoch).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from carbonforge_runtime.core.figure_labels import FigureLabel, of_cost_model
from carbonforge_runtime.core.trace_record import LEVEL_STANDARD, Completion, build_record
from carbonforge_runtime.core.twin_data import SimOutcome, StepCostModel, TwinRun
from carbonforge_runtime.offline.replay.aggregate import RequestOutcome, latency_stats, summarize

#: Most points of the KV-use timeline kept in the result (evenly thinned beyond that).
MAX_TIMELINE_POINTS = 2000


def request_id(index: int) -> str:
    return f"sim-{index}"


def replay_outcomes(outcomes: Sequence[SimOutcome], rejected: Mapping[int, str]) -> list[RequestOutcome]:
    """The twin's outcomes as ``replay`` reports them: sent at arrival, done at completion."""
    out = []
    for o in outcomes:
        item = RequestOutcome(o.index, o.arrival_s, expected_prompt_tokens=o.prompt_tokens,
                              expected_output_tokens=o.output_tokens)
        if o.index in rejected:
            item.error = rejected[o.index]
        else:
            item.sent_s = o.arrival_s
            item.done_s = o.completion_s
            item.request_id = request_id(o.index)
            item.prompt_tokens = o.prompt_tokens
            item.output_tokens = o.generated_tokens
            if o.completion_s is None:
                item.error = "unfinished: the simulation ended first"
        out.append(item)
    return out


def _ttft(o: SimOutcome) -> float | None:
    return None if o.first_token_s is None else o.first_token_s - o.arrival_s


def _thin(points: list[Any]) -> list[Any]:
    if len(points) <= MAX_TIMELINE_POINTS:
        return points
    stride = -(-len(points) // MAX_TIMELINE_POINTS)
    return points[::stride]


def _group_stats(outcomes: Sequence[SimOutcome], makespan: float) -> dict[str, Any]:
    """Latency and throughput of one tenant's (or one class's) requests."""
    done = [o for o in outcomes if o.completion_s is not None]
    ttft = [t for o in done if (t := _ttft(o)) is not None]
    e2e = [o.completion_s - o.arrival_s for o in done if o.completion_s is not None]
    output = sum(o.generated_tokens for o in done)
    return {
        "requests": len(outcomes),
        "completed": len(done),
        "ttft_s": latency_stats(ttft),
        "e2e_s": latency_stats(e2e),
        "request_rate": len(done) / makespan if makespan > 0 else float("nan"),
        "output_token_rate": output / makespan if makespan > 0 else float("nan"),
    }


def tenancy_sections(run: TwinRun) -> dict[str, Any]:
    """Per-tenant figures when the trace names more than one tenant (requests without one are the
    ``default`` tenant), and per-class figures when it has more than one priority class."""
    from carbonforge_runtime.core.ordering.tenancy import DEFAULT_TENANT

    tenants: dict[str, list[SimOutcome]] = {}
    classes: dict[int, list[SimOutcome]] = {}
    for o in run.outcomes:
        tenants.setdefault(o.tenant if o.tenant is not None else DEFAULT_TENANT, []).append(o)
        classes.setdefault(o.priority, []).append(o)
    out: dict[str, Any] = {}
    if len(tenants) > 1:
        out["tenants"] = {name: _group_stats(group, run.makespan_s) for name, group in sorted(tenants.items())}
    if len(classes) > 1:
        out["priority_classes"] = {str(p): _group_stats(group, run.makespan_s)
                                   for p, group in sorted(classes.items(), reverse=True)}
    return out


def sim_section(run: TwinRun, cost: StepCostModel, engine: Mapping[str, Any]) -> dict[str, Any]:
    """What the twin adds to the replay's summary."""
    done = [o for o in run.outcomes if o.completion_s is not None]
    ttft = [t for o in done if (t := _ttft(o)) is not None]
    queue = [o.scheduled_s - o.arrival_s for o in done if o.scheduled_s is not None]
    tpot = [(o.completion_s - o.first_token_s) / (o.generated_tokens - 1) for o in done
            if o.first_token_s is not None and o.completion_s is not None and o.generated_tokens > 1]
    prompt = sum(o.prompt_tokens for o in done)
    cached = sum(o.cached_prompt_tokens or 0 for o in done)
    makespan = run.makespan_s
    kv = [s.kv_usage for s in run.samples]
    return {
        "virtual_time": True,
        "cost_model": cost.to_json(),
        "proxy_cost_model": cost.proxy,
        "engine": dict(engine),
        "ttft_s": latency_stats(ttft),
        "queue_wait_s": latency_stats(queue),
        "tpot_s": latency_stats(tpot),
        "throughput": {
            "request_rate": len(done) / makespan if makespan > 0 else float("nan"),
            "output_token_rate": sum(o.generated_tokens for o in done) / makespan if makespan > 0 else float("nan"),
            "total_token_rate": (prompt + sum(o.generated_tokens for o in done)) / makespan if makespan > 0
            else float("nan"),
        },
        "prefix_cache": {"prompt_tokens": prompt, "cached_prompt_tokens": cached,
                         "hit_rate": cached / prompt if prompt else 0.0},
        "preemptions": {"total": sum(o.preemptions for o in done),
                        "requests_preempted": sum(1 for o in done if o.preemptions)},
        "steps": {"count": run.steps, "busy_s": run.busy_s, "makespan_s": makespan,
                  "prefill_tokens": run.prefill_tokens, "decode_tokens": run.decode_tokens},
        "kv_use": {"mean": sum(kv) / len(kv) if kv else 0.0, "max": max(kv, default=0.0),
                   "columns": ["t_s", "kv_usage", "running", "waiting"],
                   "timeline": _thin([[s.t_s, s.kv_usage, s.running, s.waiting] for s in run.samples])},
        **tenancy_sections(run),
    }


def build_document(*, trace: str, trace_kind: str, model: str, options: Mapping[str, Any], run: TwinRun,
                   rejected: Mapping[int, str], cost: StepCostModel, engine: Mapping[str, Any],
                   label: FigureLabel | None = None) -> dict[str, Any]:
    """The result JSON: replay's keys (``base_url`` null, ``started_at`` 0: virtual time), the
    figures' ``label`` (predicted, with the step-time model) and ``sim``."""
    outcomes = replay_outcomes(run.outcomes, rejected)
    summary = summarize(outcomes, run.makespan_s)
    by_index = {o.index: o for o in run.outcomes}
    requests = []
    for item in outcomes:
        entry = item.to_json()
        o = by_index[item.index]
        queue_wait = None if o.scheduled_s is None else o.scheduled_s - o.arrival_s
        entry.update({"ttft_s": _ttft(o), "queue_wait_s": queue_wait,
                      "cached_prompt_tokens": o.cached_prompt_tokens, "preemptions": o.preemptions})
        if o.tenant is not None or o.priority:
            entry.update({"tenant": o.tenant, "priority": o.priority})
        requests.append(entry)
    return {
        "trace": trace,
        "trace_kind": trace_kind,
        "base_url": None,
        "model": model,
        "started_at": 0.0,
        "options": dict(options),
        "summary": summary,
        "sim": sim_section(run, cost, engine),
        "label": (label if label is not None else of_cost_model(cost)).to_json(),
        "requests": requests,
    }


def records(run: TwinRun, rejected: Mapping[int, str], family: str, origin_s: float) -> list[dict[str, Any]]:
    """One standard-level trace record per request the engine saw (rejected ones never reach it)."""
    out = []
    for o in run.outcomes:
        if o.index in rejected or o.completion_s is None:
            continue

        def at(t: float | None) -> float | None:
            return None if t is None else round(origin_s + t, 6)

        t_arrival = at(o.arrival_s)
        t_completion = at(o.completion_s)
        assert t_arrival is not None and t_completion is not None
        out.append(build_record(Completion(
            engine_request_id=request_id(o.index), t_arrival=t_arrival, t_scheduled=at(o.scheduled_s),
            t_first_token=at(o.first_token_s), t_completion=t_completion, prompt_tokens=o.prompt_tokens,
            output_tokens=o.generated_tokens, finish_reason=o.finish_reason,
            cached_prompt_tokens=o.cached_prompt_tokens, preemptions=o.preemptions, priority_score=o.priority_score,
            tenant_arg=o.tenant,
        ), family=family, level=LEVEL_STANDARD))
    return out


def dump_json(document: Mapping[str, Any]) -> Callable[[Any], None]:
    def write(handle: Any) -> None:
        handle.write(json.dumps(document, indent=1) + "\n")

    return write


def dump_jsonl(rows: Sequence[Mapping[str, Any]]) -> Callable[[Any], None]:
    def write(handle: Any) -> None:
        for row in rows:
            handle.write(json.dumps(row, separators=(",", ":")) + "\n")

    return write


def format_sim_table(document: Mapping[str, Any]) -> str:
    """The terminal summary: replay's table plus the twin's figures."""
    from carbonforge_runtime.offline.replay.aggregate import format_table

    sim = document["sim"]
    rows = [
        ("TTFT", "mean {mean:.3f} s  p50 {p50:.3f}  p90 {p90:.3f}  p99 {p99:.3f}".format(**sim["ttft_s"])),
        ("queue wait", "mean {mean:.3f} s  p50 {p50:.3f}  p90 {p90:.3f}  p99 {p99:.3f}".format(**sim["queue_wait_s"])),
        ("TPOT", "mean {:.2f} ms  p99 {:.2f} ms".format(sim["tpot_s"]["mean"] * 1000, sim["tpot_s"]["p99"] * 1000)),
        ("prefix cache", f"{sim['prefix_cache']['hit_rate']:.1%} of prompt tokens"),
        ("preemptions", f"{sim['preemptions']['total']} ({sim['preemptions']['requests_preempted']} requests)"),
        ("KV use", f"mean {sim['kv_use']['mean']:.1%}  max {sim['kv_use']['max']:.1%}"),
        ("steps", f"{sim['steps']['count']}"),
        ("cost model", f"{sim['cost_model']['name']} v{sim['cost_model']['version']}"
                       + ("  (PROXY: figures scaled from another model or GPU)" if sim["proxy_cost_model"] else "")),
    ]
    lines = [f"figures: {document['label']['text']}"] if "label" in document else []
    lines.append(format_table(document["summary"]))
    width = max(len("per output token"), *(len(name) for name, _ in rows))
    lines.extend(f"{name.ljust(width)}  {value}" for name, value in rows)
    for key, title in (("tenants", "tenant"), ("priority_classes", "priority class")):
        if key in sim:
            lines.extend(format_group_table(title, sim[key]))
    return "\n".join(lines)


def format_group_table(title: str, groups: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per tenant (or class): requests, TTFT and e2e p50 / p99, throughput."""
    header = (title, "requests", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99", "req/s", "out tok/s")
    rows = [header]
    for name, g in groups.items():
        rows.append((name, f"{g['completed']}/{g['requests']}", f"{g['ttft_s']['p50']:.3f}",
                     f"{g['ttft_s']['p99']:.3f}", f"{g['e2e_s']['p50']:.3f}", f"{g['e2e_s']['p99']:.3f}",
                     f"{g['request_rate']:.3f}", f"{g['output_token_rate']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    out = [""]
    for r in rows:
        out.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths,
                                                                                                       strict=True))))
    return out
