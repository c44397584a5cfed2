"""Metrics: the engine-to-runtime feed, the exposition (checked by promtool), and the endpoint's lifecycle."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from carbonforge_runtime.core.contract import EngineContract
from carbonforge_runtime.core.energy_policy import Signals, parse_params
from carbonforge_runtime.core.feed_protocol import (
    EngineCounters,
    EngineState,
    RequestSample,
    encode_counters,
    encode_records,
)
from carbonforge_runtime.engine.metrics_feed import FeedSink
from carbonforge_runtime.errors import CarbonForgeError
from carbonforge_runtime.gpu.fake import FakeGpuBackend, FakeGpuSession, host
from carbonforge_runtime.runtime.energy.controller import Controller
from carbonforge_runtime.runtime.metrics.exposition import exposition, make_registry
from carbonforge_runtime.runtime.metrics.receiver import FeedReceiver
from carbonforge_runtime.runtime.metrics.state import Info, RuntimeState
from carbonforge_runtime.runtime.serve import observability as metrics_runtime
from carbonforge_runtime.runtime.serve.launch import ServeOptions, prepare
from carbonforge_runtime.runtime.serve.observability import Needs, start_observability
from carbonforge_runtime.settings import load_settings
from tests.support import TINY_KEY, free_port, wait_until

LOG = logging.getLogger("test.metrics")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: prometheus)")


def promtool_check(text: bytes) -> subprocess.CompletedProcess[bytes]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=60)


def values(text: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def total(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lab, v in found.get(name, []) if all(lab.get(k) == w for k, w in labels.items()))


def sample(family: str = "fcfs", reason: str = "stop", ttft: float | None = 0.05, e2e: float = 0.8,
           energy: float | None = 4.0) -> RequestSample:
    return RequestSample(family, reason, 0.02, ttft, e2e, 100, 20, energy)


# ---- the exposition ---------------------------------------------------------------------------------------


def populated_state() -> RuntimeState:
    state = RuntimeState()
    state.info = Info("0.2.0", "0.32.0", "qwen3-32b:fp8:chat:a100-80x1", "qwen3-32b--fp8--chat--a100-80x1",
                      "premium", 1_900_000_000.0, max_num_seqs=16)
    state.on_records([sample() for _ in range(5)] + [sample("ltr-promptlen", "length", ttft=None, e2e=12.0)] * 2
                     + [sample(reason="abort", ttft=None, energy=None)])
    state.on_engine_state(EngineState(EngineCounters(steps=40, waiting=2, running=3, tokens_scheduled_total=900,
                                                     requests_arrived_total=13, requests_completed_total=8),
                                      sinks={"file": (8, 0), "otlp": (5, 3), "queue": (0, 1)}))
    fake = FakeGpuSession("h100", count=2, power_w=310.0)
    gpus = fake.open()
    params = parse_params("lock-sm-clock", {"down_periods": 1}, "r.yaml", capacity_seqs=16)
    ctl = Controller(params, fake, gpus, lambda now: Signals(now, 0.1, running=1), LOG, dry_run=False,
                     privileged=lambda: True)
    assert ctl.start()
    ctl.tick()
    state.set_gpus([fake.read(g.index) for g in gpus])
    state.controller = ctl.status
    state.joules_per_output_token = 0.21
    return state


@needs_promtool
def test_exposition_passes_promtool_and_carries_every_family() -> None:
    text = exposition(make_registry(populated_state().snapshot))
    checked = promtool_check(text)
    assert checked.returncode == 0 and checked.stdout == b"" and checked.stderr == b"", checked
    found = values(text)
    assert total(found, "carbonforge_requests_total") == 8
    assert total(found, "carbonforge_requests_total", scheduler_family="fcfs", finish_reason="abort") == 1
    assert total(found, "carbonforge_request_e2e_latency_seconds_count") == 8
    assert total(found, "carbonforge_request_queue_wait_seconds_count") == 8
    assert total(found, "carbonforge_request_time_to_first_token_seconds_count") == 5  # no token, no TTFT
    assert total(found, "carbonforge_request_e2e_latency_seconds_bucket", scheduler_family="ltr-promptlen",
                 le="10.0") == 0
    assert total(found, "carbonforge_request_e2e_latency_seconds_bucket", scheduler_family="ltr-promptlen",
                 le="20.0") == 2
    assert total(found, "carbonforge_request_output_tokens_total") == 160
    assert total(found, "carbonforge_request_energy_joules_total") == pytest.approx(4.0 * 7)
    assert total(found, "carbonforge_requests_waiting") == 2 and total(found, "carbonforge_requests_running") == 3
    assert total(found, "carbonforge_trace_records_dropped_total", sink="otlp") == 3
    assert total(found, "carbonforge_trace_records_dropped_total", sink="queue") == 1
    assert total(found, "carbonforge_gpu_power_watts", gpu="1", uuid="GPU-fake-h100-1") == 310.0
    assert total(found, "carbonforge_gpu_energy_joules_total", gpu="0") > 1_000_000
    assert total(found, "carbonforge_gpu_sm_clock_hertz", gpu="0") == 1260e6  # locked by the controller
    assert total(found, "carbonforge_gpu_clocks_locked", gpu="0") == 1.0
    assert total(found, "carbonforge_controller_target_sm_clock_hertz", gpu="0", policy="lock-sm-clock") == 1260e6
    assert total(found, "carbonforge_controller_actions_total", action="lock_sm_clock") == 2
    assert total(found, "carbonforge_controller_observe_only") == 0.0
    assert total(found, "carbonforge_licence_expiry_timestamp_seconds") == 1_900_000_000.0
    info = found["carbonforge_runtime_info"][0][0]
    assert info == {"version": "0.2.0", "vllm_version": "0.32.0", "context_key": "qwen3-32b:fp8:chat:a100-80x1",
                    "recipe": "qwen3-32b--fp8--chat--a100-80x1"}
    assert found["carbonforge_licence_info"][0][0] == {"plan": "premium"}
    assert total(found, "carbonforge_engine_max_num_seqs") == 16  # the ceiling of the running batch
    for name in found:  # the conventions promtool does not check: one prefix, counters end in _total
        assert name.startswith("carbonforge_")


@needs_promtool
def test_an_empty_runtime_exposes_a_clean_page() -> None:
    text = exposition(make_registry(RuntimeState().snapshot))
    assert promtool_check(text).returncode == 0
    assert total(values(text), "carbonforge_requests_total") == 0
    assert "carbonforge_engine_max_num_seqs" not in values(text)


def test_the_max_num_seqs_gauge_follows_the_planned_command_line() -> None:
    from carbonforge_runtime.recipes import load_recipes, recipe_dirs
    from carbonforge_runtime.runtime.planning.plan import ServeOptions, build_plan
    from carbonforge_runtime.runtime.serve.observability import _max_num_seqs
    from carbonforge_runtime.settings import load_settings
    from tests.support import TINY_KEY

    shipped = load_recipes(recipe_dirs(None))
    settings = load_settings({})
    recipe_value = shipped[TINY_KEY].vllm.get("max_num_seqs")
    plan = build_plan(ServeOptions(context_key=TINY_KEY), settings, shipped, {}).launch
    assert _max_num_seqs(plan.argv) == recipe_value
    # a flag after -- comes last on vLLM's command line and wins, so the gauge shows it
    plan = build_plan(ServeOptions(context_key=TINY_KEY, vllm_args=["--max-num-seqs", "7"]), settings, shipped,
                      {}).launch
    assert _max_num_seqs(plan.argv) == 7
    assert _max_num_seqs(["vllm", "serve", "m"]) is None


# ---- the feed ------------------------------------------------------------------------------------------


def test_lost_and_malformed_messages_are_counted() -> None:
    got: list[tuple[RequestSample, int]] = []
    states: list[tuple[EngineState, int]] = []
    receiver = FeedReceiver.__new__(FeedReceiver)  # handle() decodes; no socket is needed to test it
    receiver.log = LOG
    receiver.on_records = lambda samples, rank: got.extend((s, rank) for s in samples)
    receiver.on_state = lambda state, rank: states.append((state, rank))
    from carbonforge_runtime.runtime.metrics.receiver import ReceiverStats

    receiver.stats, receiver._last_seq = ReceiverStats(), {}
    record = {"scheduler_family": "fcfs", "finish_reason": "stop", "queue_wait_s": 0.1, "ttft_s": None,
              "e2e_latency_s": 1.0, "prompt_tokens": 3, "output_tokens": 0, "energy_j": None, "prompt_text": "x"}
    receiver.handle(encode_records("a", 1, [record]))
    receiver.handle(encode_records("a", 2, [record, record]))
    receiver.handle(encode_counters("a", 5, EngineCounters(waiting=4), {}))  # 3 and 4 never arrived
    receiver.handle(encode_records("b", 1, [record], dp_rank=1))  # another sender starts its own count
    receiver.handle(b"not json")
    receiver.handle(encode_records("c", 1, [record]).replace(b'"dp":0', b'"dp":-1'))  # no such rank
    assert [rank for _, rank in got] == [0, 0, 0, 1] and states[0][0].counters.waiting == 4
    assert receiver.stats.lost == 2 and receiver.stats.malformed == 2 and receiver.stats.messages == 4


def test_data_parallel_ranks_are_labelled_and_add_up() -> None:
    """Each engine core (rank) reports on its own; the page keeps them apart under dp_rank, and the
    sums over dp_rank are the deployment's totals."""
    now = [100.0]
    state = RuntimeState(clock=lambda: now[0])
    state.on_records([sample() for _ in range(3)], 0)
    state.on_records([sample() for _ in range(5)] + [sample(reason="length")], 1)
    state.on_engine_state(EngineState(EngineCounters(steps=10, waiting=1, running=2, tokens_scheduled_total=100,
                                                     requests_arrived_total=3), {"file": (3, 0)}), 0)
    state.on_engine_state(EngineState(EngineCounters(steps=30, waiting=4, running=2, tokens_scheduled_total=900,
                                                     requests_arrived_total=6), {"file": (5, 1)}), 1)
    text = exposition(make_registry(state.snapshot))
    if PROMTOOL is not None:  # the page's format is also checked by the promtool tests above, which skip without it
        assert promtool_check(text).returncode == 0
    page = values(text)
    assert total(page, "carbonforge_requests_total", dp_rank="0", finish_reason="stop") == 3
    assert total(page, "carbonforge_requests_total", dp_rank="1", finish_reason="stop") == 5
    assert total(page, "carbonforge_requests_total") == 9
    assert total(page, "carbonforge_requests_waiting", dp_rank="1") == 4
    assert total(page, "carbonforge_requests_waiting") == 5
    assert total(page, "carbonforge_engine_requests_arrived_total") == 9
    assert total(page, "carbonforge_trace_records_written_total", dp_rank="1", sink="file") == 5
    assert total(page, "carbonforge_trace_records_dropped_total") == 1
    # the controller sees the whole deployment: both ranks' queues, the stalest report
    now[0] = 103.0
    state.on_engine_state(EngineState(EngineCounters(steps=20, waiting=0, running=1, tokens_scheduled_total=300)), 0)
    signals = state.signals(now=104.0, window_s=60.0)
    assert (signals.waiting, signals.running) == (4, 3)
    assert signals.age_s == 4.0
    assert signals.tokens_per_step == 20.0  # rank 0: 200 tokens over 10 steps; rank 1 has one report only


def test_the_engine_side_never_blocks_when_the_runtime_does_not_read(tmp_path: Path) -> None:
    path = str(tmp_path / "slow.sock")
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    silent.bind(path)  # bound, never read: its buffer fills up
    try:
        sink = FeedSink(path)
        record = {"scheduler_family": "fcfs", "finish_reason": "stop", "queue_wait_s": 0.1, "ttft_s": 0.2,
                  "e2e_latency_s": 1.0, "prompt_tokens": 3, "output_tokens": 9, "energy_j": 1.5}
        started = time.monotonic()
        for _ in range(200):
            sink.write([record] * 500)
        elapsed = time.monotonic() - started
        assert sink.sender.failed > 0 and sink.sender.sent > 0
        assert elapsed < 5.0
        sink.close()
    finally:
        silent.close()
    gone = FeedSink(str(tmp_path / "nobody.sock"))
    gone.write([record])
    assert gone.sender.failed == 1
    gone.close()


def test_records_sent_are_records_received(tmp_path: Path) -> None:
    got: list[RequestSample] = []
    ranks: set[int] = set()

    def on_records(samples: list[RequestSample], rank: int) -> None:
        got.extend(samples)
        ranks.add(rank)

    receiver = FeedReceiver(str(tmp_path / "f.sock"), on_records, lambda s, r: None, LOG).start()
    sink = FeedSink(str(tmp_path / "f.sock"), dp_rank=3)
    record = {"scheduler_family": "trace", "finish_reason": "length", "queue_wait_s": 0.5, "ttft_s": 0.7,
              "e2e_latency_s": 2.0, "prompt_tokens": 30, "output_tokens": 40, "energy_j": 2.25,
              "prompt_text": "never sent", "output_text": "never sent"}
    sink.write([record] * 1000)  # several datagrams
    wait_until(lambda: len(got) >= 1000, 5, every_s=0.01)
    sink.close()
    receiver.close()
    assert len(got) == 1000 and receiver.stats.lost == 0 and ranks == {3}
    assert got[0] == RequestSample("trace", "length", 0.5, 0.7, 2.0, 30, 40, 2.25)


# ---- the runtime wiring ---------------------------------------------------------------------------------


def test_what_a_run_needs() -> None:
    assert Needs.of(metrics=False, policy="none", tracing=False, gpu_recipe=False, fake_nvml=False) is None
    assert Needs.of(metrics=True, policy="none", tracing=False, gpu_recipe=False, fake_nvml=False) == Needs(True, True)
    assert Needs.of(metrics=False, policy="none", tracing=False, gpu_recipe=True, fake_nvml=False) == Needs(True, False)
    assert Needs.of(metrics=False, policy="lock-sm-clock", tracing=False, gpu_recipe=False,
                    fake_nvml=False) == Needs(True, False)


def prepared_for(options: ServeOptions, env: dict[str, str]) -> tuple[Any, Any]:
    settings = load_settings(env)
    return prepare(options, settings, env, FakeGpuBackend(host(None))), settings


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_metrics_endpoint_lives_between_start_and_close(tmp_path: Path) -> None:
    port = free_port()
    env = {"CF_METRICS_PORT": str(port), "CF_HOST": "127.0.0.1", "CF_LOG_DIR": str(tmp_path)}
    options = ServeOptions(context_key=TINY_KEY, metrics=True)
    prepared, settings = prepared_for(options, env)
    obs = start_observability(prepared, options, settings, env, LOG)
    assert obs is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read()
        found = values(text)
        assert found["carbonforge_runtime_info"][0][0]["context_key"] == TINY_KEY
        assert found["carbonforge_licence_info"][0][0] == {"plan": "free"}
        assert "carbonforge_gpu_power_watts" not in found  # no NVML here
        contract = EngineContract.from_environ(prepared.plan.engine_env(obs.engine_contract(prepared.plan.contract)))
        # metrics without tracing: the contract names the feed, and no trace part
        assert contract.tracing is None and contract.metrics_feed is not None
        feed_path = contract.metrics_feed.socket
        assert os.path.exists(feed_path) and contract.energy_meter is None
        assert oct(os.stat(os.path.dirname(feed_path)).st_mode & 0o777) == "0o700"
    finally:
        obs.close()
    assert not listening(port) and not os.path.exists(feed_path)
    obs.close()  # twice is harmless


def test_a_busy_metrics_port_stops_the_launch_with_a_remedy(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"CF_METRICS_PORT": str(port), "CF_HOST": "127.0.0.1"}
        options = ServeOptions(context_key=TINY_KEY, metrics=True)
        prepared, settings = prepared_for(options, env)
        with pytest.raises(CarbonForgeError) as caught:
            start_observability(prepared, options, settings, env, LOG)
    assert f"port {port}" in caught.value.remedy and "CF_METRICS_PORT" in caught.value.remedy


def test_without_metrics_a_cpu_run_starts_nothing() -> None:
    env: dict[str, str] = {}
    options = ServeOptions(context_key=TINY_KEY)
    prepared, settings = prepared_for(options, env)
    assert start_observability(prepared, options, settings, env, LOG) is None


def test_gpu_monitor_logs_joules_per_output_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(metrics_runtime, "GPU_POLL_S", 0.05)
    monkeypatch.setattr(metrics_runtime, "ENERGY_LOG_INTERVAL_S", 0.5)
    script = tmp_path / "nvml.json"
    script.write_text('{"kind": "l4", "count": 2, "power_w": 60, "energy_update_s": 0}')
    env = {"CF_FAKE_NVML": str(script)}
    options = ServeOptions(context_key=TINY_KEY)
    prepared, settings = prepared_for(options, env)
    caplog.set_level(logging.INFO, logger=LOG.name)
    obs = start_observability(prepared, options, settings, env, LOG)
    assert obs is not None and obs.session is not None and obs.receiver is not None
    try:
        obs.engine_ready()
        def reported() -> bool:  # feeding records until the summary line reports them
            if "J per output token" in caplog.text:
                return True
            obs.state.on_records([RequestSample("fcfs", "stop", 0.0, 0.1, 0.2, 5, 10, None)])
            return False

        wait_until(reported, 10, every_s=0.05)
    finally:
        obs.close()
    line = next(r.getMessage() for r in caplog.records if "J per output token" in r.getMessage())
    per_token = float(line.split()[1])
    # 2 x 60 W, about 10 tokens every 0.05 s: around 0.6 J per token, but sleeps stretch under load,
    # so check the figure against the line's own joules and tokens and keep the range loose.
    joules, tokens = float(line.split("(")[1].split()[0]), int(line.split(" for ")[1].split()[0])
    assert per_token == pytest.approx(joules / tokens, rel=0.01), line
    assert 0.1 < per_token < 5.0, line
    assert "120 W on average" in line and obs.state.joules_per_output_token == pytest.approx(per_token, rel=1e-3)
    assert "CF_FAKE_NVML is set" in caplog.text


@pytest.mark.parametrize(("env", "bound"), [
    ({"CF_HOST": "0.0.0.0", "CF_METRICS_HOST": "127.0.0.1"}, "127.0.0.1"),  # its own address
    ({"CF_HOST": "127.0.0.1"}, "127.0.0.1"),  # unset: the API's
    ({}, "0.0.0.0"),  # neither: the API's default, as the published docs' port table has it
])
def test_the_metrics_endpoint_binds_to_cf_metrics_host(tmp_path: Path, env: dict[str, str], bound: str) -> None:
    env = {**env, "CF_METRICS_PORT": str(free_port()), "CF_LOG_DIR": str(tmp_path)}
    options = ServeOptions(context_key=TINY_KEY, metrics=True)
    prepared, settings = prepared_for(options, env)
    obs = start_observability(prepared, options, settings, env, LOG)
    assert obs is not None
    try:
        assert obs.server.server_address[0] == bound
    finally:
        obs.close()
