"""End to end on the real vLLM CPU engine: a real Prometheus scrapes ``--metrics``; energy_j comes from the
scripted fake NVML (``CF_FAKE_NVML``); the controller acts on it and puts it back on SIGTERM.

One engine session serves a burst of N concurrent requests. (That nothing listens on the metrics port
without ``--metrics`` is checked on the default engine in test_serve.py.) Prometheus (Debian's ``prometheus``
package) runs as its own process with a temporary configuration that scrapes the runtime every second.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import TINY_SERVED_NAME, RuntimeProcess, free_port, listening_ports, wait_until
from tests.support.burst import send_burst_replies

KEY = "cf-tiny-energy:bf16:chat:cpu"
RECIPE = f"""
# Test only: the tiny CPU recipe with an SM-clock controller, acting on the fake NVML.
key: {KEY}
plan: free
description: Test only.
model: {{repo: carbonforge/tiny-chat, served_name: {TINY_SERVED_NAME}, builtin: tiny-chat}}
vllm: {{dtype: bfloat16, max_model_len: 2048, max_num_seqs: 16, enable_prefix_caching: true}}
drain_timeout_s: 15
env: {{VLLM_CPU_KVCACHE_SPACE: "1", HF_HUB_OFFLINE: "1"}}
controller:
  policy: lock-sm-clock
  params: {{period_s: 0.5, down_periods: 1}}
"""
REQUESTS = 12
OUTPUT_TOKENS = 1500  # a burst of several seconds: the arrival-to-first-step gap (tens of ms) stays small
WATTS = 300.0
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


class Prometheus:
    def __init__(self, target_port: int, workdir: Path) -> None:
        assert PROMETHEUS is not None
        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: carbonforge\n    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n"
        )
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )

        def ready() -> bool:
            assert self.proc.poll() is None, (workdir / "prometheus.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        wait_until(ready, 60, what="prometheus to become ready")

    def query(self, expr: str) -> float | None:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        result = body["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


@dataclass
class Session:
    runtime: RuntimeProcess
    metrics_port: int
    trace: Path
    calls: Path
    prometheus: Prometheus


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    if PROMETHEUS is None or PROMTOOL is None:
        pytest.skip("prometheus/promtool are not installed (Debian: apt-get install prometheus)")
    tmp = tmp_path_factory.mktemp("metrics-e2e")
    recipes = tmp / "recipes"
    recipes.mkdir()
    (recipes / "cf-tiny-energy--bf16--chat--cpu.yaml").write_text(RECIPE)
    calls = tmp / "nvml-calls.jsonl"
    script = tmp / "nvml.json"
    script.write_text(json.dumps({"kind": "h100", "power_w": WATTS, "call_log": str(calls)}))
    trace = tmp / "trace.jsonl"
    metrics_port = free_port()
    runtime = RuntimeProcess(
        ["--context-key", KEY, "--metrics", "--request-trace", "standard", "--trace-file", str(trace)], tmp / "run",
        env={"CF_RECIPES_DIR": str(recipes), "CF_METRICS_PORT": str(metrics_port), "CF_FAKE_NVML": str(script)},
    ).start()
    prometheus = None
    try:
        runtime.wait_ready()
        prometheus = Prometheus(metrics_port, tmp)
        yield Session(runtime, metrics_port, trace, calls, prometheus)
    finally:
        if prometheus is not None:
            prometheus.stop()
        runtime.kill()


def calls_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def read_trace(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_prometheus_counts_every_request_energy_adds_up_and_the_gpu_is_restored(session: Session) -> None:
    runtime = session.runtime
    assert session.metrics_port in listening_ports(runtime.proc.pid)  # type: ignore[union-attr]
    # idle after start-up: the controller saves (locks the SM clock below its maximum)
    wait_until(lambda: any(c["call"] == "set_locked_clocks" for c in calls_of(session.calls)), 30)
    assert [c["call"] for c in calls_of(session.calls)] == ["set_locked_clocks"], runtime.output()

    # From a child process, so the whole burst reaches the engine at once and the load rises sharply.
    replies = send_burst_replies(runtime.base_url, TINY_SERVED_NAME,
                                 [f"Request {i}: count to ten." for i in range(REQUESTS)], OUTPUT_TOKENS, timeout_s=300)
    assert all(tokens == OUTPUT_TOKENS for _, tokens in replies), replies

    # 1. the real Prometheus saw every request
    prom = session.prometheus
    total = "sum(carbonforge_requests_total)"
    assert wait_until(lambda: prom.query(total) == REQUESTS, 30, every_s=0.5), prom.query(total)
    assert prom.query("sum(carbonforge_request_e2e_latency_seconds_count)") == REQUESTS
    assert prom.query("sum(carbonforge_request_queue_wait_seconds_count)") == REQUESTS
    assert prom.query("sum(carbonforge_request_time_to_first_token_seconds_count)") == REQUESTS
    assert prom.query("sum(carbonforge_request_output_tokens_total)") == REQUESTS * OUTPUT_TOKENS
    assert prom.query('carbonforge_requests_total{finish_reason="length",scheduler_family="fcfs"}') == REQUESTS
    assert prom.query('carbonforge_gpu_power_watts{gpu="0"}') == WATTS
    # engine state arrives twice a second and is scraped every second: wait for the settled values
    written = "carbonforge_trace_records_written_total"
    assert wait_until(lambda: prom.query(written) == REQUESTS, 30, every_s=0.5), prom.query(written)
    running = "carbonforge_requests_running"
    assert wait_until(lambda: prom.query(running) == 0, 30, every_s=0.5), prom.query(running)
    with urllib.request.urlopen(f"http://127.0.0.1:{session.metrics_port}/metrics", timeout=5) as response:
        page = response.read()
    checked = subprocess.run([PROMTOOL, "check", "metrics"], input=page, capture_output=True,  # type: ignore[list-item]
                             timeout=60)
    assert checked.returncode == 0 and not checked.stdout and not checked.stderr, checked

    # 2. energy_j on every record, adding up to the scripted counter's increase over the burst
    wait_until(lambda: len(read_trace(session.trace)) >= REQUESTS, 20)
    records = read_trace(session.trace)
    assert len(records) == REQUESTS
    energies = [r["energy_j"] for r in records]
    assert all(isinstance(e, float) and e > 0 for e in energies), energies
    span_s = max(r["t_completion"] for r in records) - min(r["t_arrival"] for r in records)
    assert sum(energies) == pytest.approx(WATTS * span_s, rel=0.02), (sum(energies), WATTS * span_s)
    assert prom.query("sum(carbonforge_request_energy_joules_total)") == pytest.approx(sum(energies), abs=1e-3)

    # 3. the rising load took the GPU back to full clocks; the idle after it saves again
    wait_until(lambda: [c["call"] for c in calls_of(session.calls)][-1:] == ["set_locked_clocks"], 10)
    kinds = [c["call"] for c in calls_of(session.calls)]
    assert kinds[:3] == ["set_locked_clocks", "reset_locked_clocks", "set_locked_clocks"], kinds

    # top's snapshot of this runtime, while it still serves
    top_once_shows_the_live_runtime(session)

    # 4. SIGTERM: the runtime stops and the GPU is as it was found
    code = runtime.stop(signal.SIGTERM, timeout_s=60)
    assert code == 0, runtime.output()
    kinds = [c["call"] for c in calls_of(session.calls)]
    # The controller may move a lock to another level (set, set) while serving; what matters is that
    # the last call restores the clocks, so nothing stays locked after the stop.
    assert kinds[-1] == "reset_locked_clocks", kinds
    # put back as soon as the stop is asked for, before the engine has drained
    out = runtime.output()
    assert "received SIGTERM" in out
    assert out.index("unlock the SM clock of GPU 0 (stopping)") < out.index("vLLM stopped")
    assert "Traceback" not in runtime.output()


# ---- top against the live runtime ----------------------------------------------------------------------


def top_once_shows_the_live_runtime(session: Session) -> None:
    """``carbonforge-runtime top --once`` with the runtime's own environment and no --url (so the local
    metrics endpoint and, through serve.json, vLLM's /metrics are found as in a container), after the burst."""
    runtime = session.runtime
    done = subprocess.run([*runtime.python, "top", "--once", "--interval-s", "0.5"], env=runtime.env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    out = done.stdout
    print("\n== top --once:\n" + out)
    assert f"http://127.0.0.1:{session.metrics_port}/metrics  +  http://127.0.0.1:{runtime.port}/metrics" in out
    assert KEY in out and "running 0/16" in out  # the recipe's max_num_seqs is the ceiling
    assert f"power {WATTS:.0f} W (1 GPU)" in out
    ttft = next(line for line in out.splitlines() if "time to first token" in line)
    assert int(ttft.split()[4]) == REQUESTS  # since start: every request of the burst
    rank = next(line for line in out.splitlines() if line.startswith("0 ")).split()
    assert rank[1] == "0/16" and rank[4].endswith("%")  # KV use read from vLLM's own metrics
    assert all(len(line) <= 80 for line in out.splitlines())
