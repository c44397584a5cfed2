"""``carbonforge-runtime top``: a live view of one runtime from its metrics. Imports nothing heavy until it runs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlsplit

import typer

from carbonforge_runtime.cli.errors import run_guarded
from carbonforge_runtime.log import RUNTIME_LOG_NAME
from carbonforge_runtime.runtime.serve import address
from carbonforge_runtime.settings import Settings, load_settings

TOP_EPILOG = (
    "Without --url it reads the local runtime: http://CF_METRICS_HOST:CF_METRICS_PORT/metrics (the runtime must "
    "serve with --metrics). KV use and preemptions come from vLLM's own /metrics on the API port (the port in "
    "serve.json in CF_LOG_DIR, else CF_PORT), warnings from runtime.log in CF_LOG_DIR. A URL that does not "
    "answer, or is not the runtime's metrics, exits with status 5."
)


def default_url(settings: Settings) -> str:
    """The local runtime's metrics endpoint, as a client on this host reaches it."""
    host = settings.metrics_host if settings.metrics_host is not None else settings.host
    return f"http://{_url_host(address.probe_host(host))}:{settings.metrics_port}/metrics"


def default_engine_url(metrics_url: str, settings: Settings) -> str | None:
    """vLLM's /metrics beside the runtime at ``metrics_url``: that host, on the API port serve.json names
    (CF_PORT without it); None when ``metrics_url`` names no host."""
    host = urlsplit(metrics_url).hostname
    if not host:
        return None
    port = settings.port
    try:
        recorded = json.loads((Path(settings.log_dir) / address.FILE_NAME).read_text())
        port = int(recorded["port"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    scheme = urlsplit(metrics_url).scheme or "http"
    return f"{scheme}://{_url_host(host)}:{port}/metrics"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def top_command(
    url: str | None = typer.Option(None, "--url",
                                   help="The runtime's metrics endpoint (default: the local one, from CF_METRICS_HOST "
                                        "and CF_METRICS_PORT)."),
    engine_url: str | None = typer.Option(None, "--engine-url",
                                          help="vLLM's own /metrics, for KV use and preemptions (default: the API port "
                                               "on --url's host; 'off' reads none)."),
    interval_s: float = typer.Option(1.0, "--interval-s", min=0.2, max=60.0,
                                     help="Seconds between refreshes (and between --once's two scrapes)."),
    run_once: bool = typer.Option(False, "--once",
                                  help="Print one snapshot as plain lines and exit (two scrapes, --interval-s apart, "
                                       "for the rates; latency percentiles since the runtime started)."),
) -> None:
    """Watch one runtime live: requests against the ceiling, tokens/s, latency percentiles, KV use, power."""
    from carbonforge_runtime.offline.top import draw

    settings = load_settings(os.environ)
    metrics_url = url or default_url(settings)
    if engine_url is None:
        engine = default_engine_url(metrics_url, settings)
    else:
        engine = None if engine_url.strip().lower() in ("", "off") else engine_url
    target = draw.Target(metrics_url, engine, Path(settings.log_dir) / RUNTIME_LOG_NAME)
    raise typer.Exit(run_guarded(lambda: draw.main(target, interval_s, run_once)))
