#!/usr/bin/env python3
"""Write the Grafana dashboards in deploy/observability/dashboards/ from the panel table below, or check
that the committed ones are current.

    python scripts/gen_dashboards.py            # rewrite every dashboard
    python scripts/gen_dashboards.py --check    # exit 1, naming each dashboard that differs; writes nothing

Every panel is one row of :data:`OVERVIEW`: a title, the queries (PromQL, with Grafana's ``$model``,
``$__rate_interval`` and ``$datasource`` variables), a unit and a description that says what a bad value
means and what to do about it. The queries use the names the runtime exports on its metrics port
(``carbonforge_*``, see docs/metrics-and-energy.md) and the names vLLM exports on the API port's
/metrics (``vllm:*``, labelled with the served model as ``model_name``). The end-to-end test
tests/e2e/test_metrics.py runs every query of every dashboard against a real Prometheus scraping a real
serve. The output is deterministic: no timestamps, no machine-specific paths.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DASHBOARDS_DIR = REPO / "deploy" / "observability" / "dashboards"
#: Grafana's dashboard JSON model version the files are written in (Grafana 10.4 and later read it and
#: migrate it forward).
SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
#: The served model: vLLM's ``model_name`` label (the runtime's own series carry no model label; one
#: runtime serves one model).
MODEL = 'model_name="$model"'
WINDOW = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    description: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # or "stat"


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Dashboard:
    file: str
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]


def _q(expr: str, legend: str = "") -> Query:
    return Query(expr, legend)


def _quantiles(metric: str, selector: str = "") -> tuple[Query, ...]:
    """p50, p95 and p99 of a histogram over the dashboard's rate window."""
    inner = f"sum by (le) (rate({metric}_bucket{{{selector}}}[{WINDOW}]))"
    return tuple(_q(f"histogram_quantile({q}, {inner})", f"p{round(q * 100)}") for q in (0.5, 0.95, 0.99))


OVERVIEW = Dashboard(
    file="carbonforge-overview.json",
    uid="carbonforge-overview",
    title="CarbonForge runtime: overview",
    description="One CarbonForge deployment: traffic, latency, usage per tenant, the engine's batch and KV cache, "
                "request traces, data-parallel ranks and energy. Series: the runtime's metrics port (carbonforge_*, "
                "with --metrics) and vLLM's /metrics on the API port (vllm:*).",
    rows=(
        Row("Traffic", (
            Panel("Requests by finish reason", "reqps",
                  "Completed requests per second, by how they ended. A rising 'abort' share means clients give up "
                  "(timeouts, disconnects): look at the latency panels and at queueing; 'length' means replies hit "
                  "max_tokens.",
                  (_q(f"sum by (finished_reason) (rate(vllm:request_success_total{{{MODEL}}}[{WINDOW}]))",
                      "{{finished_reason}}"),
                   _q(f"sum by (finish_reason) (rate(carbonforge_requests_total[{WINDOW}]))",
                      "runtime: {{finish_reason}}"))),
            Panel("HTTP responses by status", "reqps",
                  "API responses per second by status class (vLLM's server). 4xx: clients send bad requests or a "
                  "wrong API key (check the client's configuration); 5xx: the server fails requests (read the "
                  "runtime's log and the engine's exit report).",
                  (_q(f"sum by (status) (rate(http_requests_total[{WINDOW}]))", "{{status}}"),)),
            Panel("Tokens per second", "short",
                  "Prompt and generated tokens per second. Generated tokens falling while requests keep coming means "
                  "the engine is saturated or preempting: compare with the batch and KV cache panels.",
                  (_q(f"sum(rate(vllm:generation_tokens_total{{{MODEL}}}[{WINDOW}]))", "generated"),
                   _q(f"sum(rate(vllm:prompt_tokens_total{{{MODEL}}}[{WINDOW}]))", "prompt"))),
        )),
        Row("Latency", (
            Panel("Time to first token", "s",
                  "Arrival to the first output token (vLLM's histogram). A p95 above your target with a long queue "
                  "means too little capacity: add replicas; with a short queue, long prompts dominate "
                  "(prefill): consider chunked prefill or a larger max_num_batched_tokens.",
                  _quantiles("vllm:time_to_first_token_seconds", MODEL)),
            Panel("End-to-end latency", "s",
                  "Arrival to completion. Grows with output length; a jump at unchanged traffic means preemptions or "
                  "a slower GPU (check clocks and power in the energy row).",
                  _quantiles("vllm:e2e_request_latency_seconds", MODEL)),
            Panel("Queue wait", "s",
                  "Arrival to first scheduling (the runtime's histogram, per completed request), with the recipe's "
                  "p90 target when it sets one. Anything above a few hundred milliseconds, or above the target, "
                  "means requests wait for a place in the batch: scale out, or raise max_num_seqs if the KV cache "
                  "has room.",
                  (*_quantiles("carbonforge_request_queue_wait_seconds"),
                   _q("max(carbonforge_queue_wait_target_seconds)", "target (p90)"))),
        )),
        Row("Tenants", (
            Panel("Requests by tenant", "reqps",
                  "Completed requests per second per tenant (the name of the request's API key; 'default': "
                  "requests without a named key; 'other': tenants past the runtime's first 64). One tenant taking "
                  "most of the traffic while others' latency grows: give it a lower share or priority in the keys "
                  "file, or a requests-per-minute limit.",
                  (_q(f"sum by (tenant) (rate(carbonforge_tenant_requests_total[{WINDOW}]))", "{{tenant}}"),)),
            Panel("Failed requests by tenant", "reqps",
                  "Requests per second per tenant that ended with finish reason 'error' (failed in the engine: read "
                  "the engine's log) or 'abort' (ended by the API server: the client left or timed out, or a stop "
                  "string matched). Refusals before the engine (401, 403, 413, 429) are not in these series.",
                  (_q(f'sum by (tenant) (rate(carbonforge_tenant_requests_total{{finish_reason="error"}}[{WINDOW}])) '
                      f"or 0 * sum by (tenant) (rate(carbonforge_tenant_requests_total[{WINDOW}]))",
                      "error, {{tenant}}"),
                   _q(f'sum by (tenant) (rate(carbonforge_tenant_requests_total{{finish_reason="abort"}}[{WINDOW}])) '
                      f"or 0 * sum by (tenant) (rate(carbonforge_tenant_requests_total[{WINDOW}]))",
                      "abort, {{tenant}}"))),
            Panel("Tokens by tenant", "short",
                  "Prompt, cached prompt and output tokens per second per tenant: the usage a chargeback bills "
                  "(trace summarize --by tenant gives the same from the trace). Cached prompt tokens cost little "
                  "compute; a tenant with few of them and long prompts loads the prefill.",
                  (_q(f"sum by (tenant) (rate(carbonforge_tenant_prompt_tokens_total[{WINDOW}]))",
                      "prompt, {{tenant}}"),
                   _q(f"sum by (tenant) (rate(carbonforge_tenant_cached_prompt_tokens_total[{WINDOW}]))",
                      "cached prompt, {{tenant}}"),
                   _q(f"sum by (tenant) (rate(carbonforge_tenant_output_tokens_total[{WINDOW}]))",
                      "output, {{tenant}}"))),
            Panel("Time to first token p95 by tenant", "s",
                  "Arrival to the first output token, p95 per tenant (the runtime's histogram). One tenant's p95 "
                  "far above the others' under the same load means it waits behind another tenant's burst: check "
                  "the shares and priorities in the keys file.",
                  (_q("histogram_quantile(0.95, sum by (tenant, le) "
                      f"(rate(carbonforge_tenant_request_time_to_first_token_seconds_bucket[{WINDOW}])))",
                      "{{tenant}}"),)),
            Panel("End-to-end latency p95 by tenant", "s",
                  "Arrival to completion, p95 per tenant. Grows with the tenant's output lengths; a rise at unchanged "
                  "traffic for one tenant only points at queueing behind others (compare with its time to first "
                  "token).",
                  (_q("histogram_quantile(0.95, sum by (tenant, le) "
                      f"(rate(carbonforge_tenant_request_e2e_latency_seconds_bucket[{WINDOW}])))", "{{tenant}}"),)),
            Panel("GPU power by tenant", "watt",
                  "GPU energy attributed to each tenant's completed requests per second (average watts over the "
                  "window; 0 without NVML). The energy part of a chargeback: a tenant's share of it above its "
                  "share of tokens means long prompts or small, inefficient batches.",
                  (_q(f"sum by (tenant) (rate(carbonforge_tenant_energy_joules_total[{WINDOW}]))", "{{tenant}}"),)),
        )),
        Row("Engine", (
            Panel("Running and waiting requests", "short",
                  "Requests in the batch and in the queue, against the batch's ceiling (max_num_seqs, from the "
                  "runtime's plan). Running pinned at the ceiling with waiting above zero: the deployment is full, "
                  "add replicas. Waiting with running well below the ceiling: the KV cache is the limit.",
                  (_q(f"sum(vllm:num_requests_running{{{MODEL}}})", "running"),
                   _q(f"sum(vllm:num_requests_waiting{{{MODEL}}})", "waiting"),
                   _q("max(carbonforge_engine_max_num_seqs)", "max_num_seqs"))),
            Panel("KV cache usage", "percentunit",
                  "Share of the KV cache in use. Near 100% the scheduler preempts requests (see Preemptions): lower "
                  "max_num_seqs or max_model_len, or give the cache more memory (gpu_memory_utilization).",
                  (_q(f"max(vllm:kv_cache_usage_perc{{{MODEL}}})", "used"),)),
            Panel("Preemptions", "short",
                  "Requests pushed out of the batch to free KV cache, per second. Any steady value wastes work and "
                  "raises latency: lower max_num_seqs or give the KV cache more memory.",
                  (_q(f"sum(rate(vllm:num_preemptions_total{{{MODEL}}}[{WINDOW}]))", "preemptions"),)),
            Panel("Prefix cache hit rate", "percentunit",
                  "Share of prompt tokens found in the prefix cache. Low with prompts that share a long system "
                  "prompt means the cache is too small or evicted by load; empty when the recipe turns prefix "
                  "caching off.",
                  (_q(f"sum(rate(vllm:prefix_cache_hits_total{{{MODEL}}}[{WINDOW}])) / "
                      f"sum(rate(vllm:prefix_cache_queries_total{{{MODEL}}}[{WINDOW}]))", "hit rate"),)),
        )),
        Row("Data-parallel ranks and hosts", (
            Panel("Running and waiting by rank", "short",
                  "The batch and queue of each engine core (dp_rank). One rank busy while others idle means the "
                  "load is not spread: check the client or the router in front.",
                  (_q("sum by (dp_rank) (carbonforge_requests_running)", "running, rank {{dp_rank}}"),
                   _q("sum by (dp_rank) (carbonforge_requests_waiting)", "waiting, rank {{dp_rank}}"))),
            Panel("Scheduled tokens by rank", "short",
                  "Tokens each engine core schedules per second. A rank at zero under load is stuck or gone: read the "
                  "engine's log.",
                  (_q(f"sum by (dp_rank) (rate(carbonforge_engine_scheduled_tokens_total[{WINDOW}]))",
                      "rank {{dp_rank}}"),)),
            Panel("Engine report age by rank", "s",
                  "Time since each engine core last reported (twice a second when healthy). Above a few seconds the "
                  "engine core is hung or the metrics feed is broken: the runtime's log says which.",
                  (_q("max by (dp_rank) (carbonforge_engine_state_age_seconds)", "rank {{dp_rank}}"),)),
            Panel("Group hosts lost", "short",
                  "Hosts of a multi-host group found gone or never joined, as the leader's group watch sees them "
                  "(no data when serving on one host). Above zero the runtime stops its engine: bring the host "
                  "back (its runtime's log says why it left) and restart the group.",
                  (_q("max(carbonforge_group_hosts_lost)", "hosts lost"),), kind="stat"),
            Panel("Scrape targets up", "short",
                  "1 for every metrics endpoint Prometheus reaches (the runtime's metrics port and vLLM's /metrics, "
                  "on every host of a multi-host group). 0: the process is down or the port is blocked.",
                  (_q("up", "{{job}} {{instance}}"),), kind="stat"),
        )),
        Row("Request traces", (
            Panel("Trace records written", "short",
                  "Trace records each sink stores per second. It should follow the completed requests; a sink at "
                  "zero under load is not writing (full disk, unreachable collector).",
                  (_q(f"sum by (sink) (rate(carbonforge_trace_records_written_total[{WINDOW}]))", "{{sink}}"),)),
            Panel("Trace records dropped", "short",
                  "Trace records given up on over the window. Anything above zero loses data: sink 'queue' means the "
                  "writer cannot keep up (a slower trace mode or a faster disk), another sink means it failed "
                  "(its error is in the runtime's log).",
                  (_q(f"sum by (sink) (increase(carbonforge_trace_records_dropped_total[{WINDOW}]))", "{{sink}}"),)),
            Panel("Metrics feed messages lost", "short",
                  "Messages from the engine that never reached the runtime over the window. Above zero the "
                  "runtime's request metrics undercount: the host is overloaded.",
                  (_q(f"increase(carbonforge_metrics_feed_lost_messages_total[{WINDOW}])", "lost"),)),
        )),
        Row("Energy", (
            Panel("GPU power", "watt",
                  "Power draw of each GPU. High power at low traffic means clocks are not lowered: check the "
                  "controller's actions (observe-only, or no permission to set clocks).",
                  (_q("carbonforge_gpu_power_watts", "GPU {{gpu}}"),)),
            Panel("Energy per request", "joule",
                  "GPU energy attributed to completed requests, per request, over the window. Rising at unchanged "
                  "traffic means longer replies or a less efficient batch (small batches, high clocks).",
                  (_q(f"sum(increase(carbonforge_request_energy_joules_total[{WINDOW}])) / "
                      f"sum(increase(carbonforge_requests_total[{WINDOW}]))", "J per request"),)),
            Panel("Energy per output token", "joule",
                  "GPU energy attributed to completed requests per generated token, over the window. Compare "
                  "recipes and controller policies with it; a rise at unchanged traffic means the GPU works harder "
                  "for the same output (small batches, clocks held high).",
                  (_q(f"sum(increase(carbonforge_request_energy_joules_total[{WINDOW}])) / "
                      f"sum(increase(carbonforge_request_output_tokens_total[{WINDOW}]))", "J per token"),)),
            Panel("Controller actions", "short",
                  "Settings the energy controller changed over the window (observe-only: would have changed), "
                  "latency guard trips and failures. Many lock/unlock pairs a minute mean it oscillates: lengthen "
                  "its period or down_periods in the recipe. Failures: the driver refused a setting or a period "
                  "failed; the runtime's log names it.",
                  (_q(f"sum by (action) (increase(carbonforge_controller_actions_total[{WINDOW}]))", "{{action}}"),
                   _q(f"increase(carbonforge_controller_guard_trips_total[{WINDOW}])", "latency guard trips"),
                   _q(f"sum by (stage) (increase(carbonforge_controller_failures_total[{WINDOW}]))",
                      "failures: {{stage}}"))),
            Panel("SM clock and the controller's target", "hertz",
                  "The SM clock of each GPU and the highest clock the controller allows. A clock below the target "
                  "under load means thermal or power throttling: check temperature and the power limit.",
                  (_q("carbonforge_gpu_sm_clock_hertz", "clock, GPU {{gpu}}"),
                   _q("carbonforge_controller_target_sm_clock_hertz", "target, GPU {{gpu}}"))),
            Panel("Controller load and mode", "short",
                  "The load the controller last saw (0 to 1) and 1 when it only observes. Observe-only on a "
                  "deployment meant to save energy: the runtime lacks the permission to set clocks (see the "
                  "doctor's energy checks).",
                  (_q("carbonforge_controller_load_ratio", "load"),
                   _q("carbonforge_controller_observe_only", "observe only"))),
        )),
    ),
)
DASHBOARDS: tuple[Dashboard, ...] = (OVERVIEW,)

PANEL_WIDTH = 8
PANEL_HEIGHT = 8
GRID_WIDTH = 24


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    targets = [{"datasource": DATASOURCE, "expr": query.expr, "legendFormat": query.legend or "__auto",
                "refId": chr(ord("A") + index)} for index, query in enumerate(panel.queries)]
    options: dict[str, Any] = ({"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
                               if panel.kind == "stat" else
                               {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                                "tooltip": {"mode": "multi", "sort": "none"}})
    return {
        "datasource": DATASOURCE,
        "description": panel.description,
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "gridPos": {"h": PANEL_HEIGHT, "w": PANEL_WIDTH, "x": x, "y": y},
        "id": panel_id,
        "options": options,
        "targets": targets,
        "title": panel.title,
        "type": panel.kind,
    }


def render(dashboard: Dashboard) -> dict[str, Any]:
    """The Grafana dashboard JSON model of ``dashboard``: one row panel per row, three panels a line."""
    panels: list[dict[str, Any]] = []
    next_id, y = 1, 0
    for row in dashboard.rows:
        panels.append({"collapsed": False, "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}, "id": next_id,
                       "panels": [], "title": row.title, "type": "row"})
        next_id, y = next_id + 1, y + 1
        for index, panel in enumerate(row.panels):
            column = index % (GRID_WIDTH // PANEL_WIDTH)
            panels.append(_panel_json(panel, next_id, column * PANEL_WIDTH, y))
            next_id += 1
            if column == GRID_WIDTH // PANEL_WIDTH - 1 or index == len(row.panels) - 1:
                y += PANEL_HEIGHT
    variables = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "hide": 0, "refresh": 1, "skipUrlSync": False, "options": []},
        {"name": "model", "label": "Served model", "type": "query", "datasource": DATASOURCE,
         "description": "vLLM's model_name label: the served model name of the deployment",
         "query": "label_values(vllm:num_requests_running, model_name)",
         "definition": "label_values(vllm:num_requests_running, model_name)",
         "hide": 0, "refresh": 2, "sort": 1, "skipUrlSync": False, "options": []},
    ]
    return {
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": dashboard.description,
        "editable": True,
        "graphTooltip": 1,
        "links": [],
        "panels": panels,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["carbonforge", "vllm"],
        "templating": {"list": variables},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": dashboard.title,
        "uid": dashboard.uid,
        "version": 1,
    }


def text_of(dashboard: Dashboard) -> str:
    return json.dumps(render(dashboard), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a committed dashboard differs from the table; write nothing")
    args = parser.parse_args(argv)
    stale = []
    for dashboard in DASHBOARDS:
        path = DASHBOARDS_DIR / dashboard.file
        text = text_of(dashboard)
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(path.relative_to(REPO))
            continue
        from carbonforge_runtime.files import write_text_atomic

        write_text_atomic(path, text)
        print(f"wrote {path.relative_to(REPO)}")
    if stale:
        for path in stale:
            print(f"{path} is not what scripts/gen_dashboards.py writes: run it and commit the result",
                  file=sys.stderr)
        return 1
    if args.check:
        print(f"dashboards: all {len(DASHBOARDS)} are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
