"""Two "hosts" on one machine: a leader and a headless worker, each its own runtime process, serving
the tiny model with pipeline parallel 2 across them on vLLM's own multiprocessing launcher. Streamed
chat completions go through the leader's API with the OpenAI SDK, the scheduler plug-in runs in the
leader's engine (the plain variant: vLLM turns async scheduling off under pipeline parallel) and
writes the trace. On the same group, once those checks have read what they need, a killed worker
turns the leader's /health to 503 and stops the leader, naming the rank; on a group of its own, a
SIGTERM to the leader stops both cleanly. A worker that never starts
stops the leader after the join timeout, naming the rank; a killed leader stops its worker.

Data parallel on one host (two engine cores): each rank writes its own trace file, the directory
summarizes as one trace, and /metrics keeps the ranks apart under dp_rank with sums that add up."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.support import REPO, RuntimeProcess, descendants, free_port, tiny_model_dir, wait_until


def read_records(path: Path, count: int, timeout_s: float = 20.0) -> list[dict[str, object]]:
    """The trace's records once there are ``count`` of them (the sink writes shortly after completion)."""
    def records() -> list[dict[str, object]]:
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    wait_until(lambda: len(records()) >= count, timeout_s, every_s=0.5)
    return records()


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return None


VLLM_ARGS = ["--", str(tiny_model_dir()), "--served-model-name", "tiny", "--dtype", "bfloat16",
             "--max-model-len", "2048", "--max-num-seqs", "4", "--pipeline-parallel-size", "2"]


def group_members(tmp_path: Path, join_timeout_s: int = 240) -> tuple[RuntimeProcess, RuntimeProcess]:
    """A leader (tracing to ``leader/trace.jsonl``) and a worker, not yet started, sharing the group
    secret through a file."""
    secret = tmp_path / "group-secret"
    secret.write_text(os.urandom(24).hex() + "\n")
    secret.chmod(0o600)
    group = {"CF_NNODES": "2", "CF_MASTER_ADDR": "127.0.0.1", "CF_MASTER_PORT": str(free_port()),
             "CF_GROUP_PORT": str(free_port()), "CF_JOIN_TIMEOUT_S": str(join_timeout_s),
             "CF_GROUP_SECRET_FILE": str(secret),
             # two "hosts" on one machine: both reach each other on loopback, each binds its own core
             "VLLM_HOST_IP": "127.0.0.1"}
    trace = tmp_path / "leader" / "trace.jsonl"
    leader = RuntimeProcess(["--request-trace", "standard", "--trace-file", str(trace), *VLLM_ARGS],
                            tmp_path / "leader", env={**group, "CF_NODE_RANK": "0", "VLLM_CPU_OMP_THREADS_BIND": "0"})
    worker = RuntimeProcess(VLLM_ARGS, tmp_path / "worker",
                            env={**group, "CF_NODE_RANK": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"})
    return leader, worker


def forge_the_group_port(port: int) -> None:
    """What anyone who reaches the leader's watch port may try without the group secret."""
    attempts = [b"join 1 2\n", b"bye\n", b"join 1 2 " + b"00" * 16 + b" " + b"11" * 32 + b"\n", b"x" * 100_000]
    for attempt in attempts:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            assert raw.recv(128).startswith(b"hello ")  # the leader's challenge
            try:
                raw.sendall(attempt)
                raw.recv(128)  # "refused ...", or the leader hangs up
            except OSError:
                pass


def start_group(tmp_path: Path) -> tuple[RuntimeProcess, RuntimeProcess]:
    leader, worker = group_members(tmp_path)
    leader.start()
    worker.start()
    return leader, worker


def test_a_leader_and_a_headless_worker_serve_one_model_across_two_hosts_until_the_worker_is_killed(
    tmp_path: Path,
) -> None:
    """One group for the serve and for the loss of a worker: what the serve checks only reads, and
    the worker is killed last."""
    leader, worker = start_group(tmp_path)
    trace = tmp_path / "leader" / "trace.jsonl"
    try:
        leader.wait_ready(timeout_s=420)
        assert "group: worker, rank 1 of 2 hosts" in worker.output()
        assert "vLLM started headless" in worker.output()
        assert "-m carbonforge_runtime.engine.headless" in worker.engine_log()
        assert "Worker_PP1" in worker.engine_log()  # the second pipeline stage runs on the worker

        client = openai.OpenAI(base_url=leader.base_url, api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "two hosts"}], max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content is not None) >= 1
        usage = next(c.usage for c in chunks if c.usage is not None)
        assert usage.completion_tokens == 12
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "again"}],
                                                max_tokens=6, extra_body={"ignore_eos": True})
        records = read_records(trace, 2)
        assert len(records) == 2 and {r["output_tokens"] for r in records} == {12, 6}
        assert any(r["request_id"] == answer.id for r in records)
        engine_log = leader.engine_log()
        assert "Using custom scheduler class carbonforge_runtime.engine.scheduler.make_scheduler" in engine_log
        assert "Async scheduling is disabled" in engine_log  # so the plain (not async) variant serves
        assert "CarbonForge scheduler on vLLM Scheduler:" in engine_log  # the plug-in's own word: plain variant
        assert "CarbonForge scheduler on vLLM AsyncScheduler" not in engine_log

        # A killed worker turns the leader's /health to 503 and stops the leader, naming the rank.
        # Both sides have logged the join (the worker's runtime joins as it starts, before the leader's
        # API is ready): killing the worker now is a loss the leader's watch sees, not a missing rank.
        assert wait_until(lambda: worker.says("group: joined the leader 127.0.0.1"), 60), worker.output()
        assert wait_until(lambda: leader.says("group: worker rank 1 joined (1 of 1 worker(s))"), 10), leader.output()
        assert health(leader.port) == 200

        # Without the group secret, the watch port changes nothing: a forged join of rank 1 (the old
        # way to take its place and, by hanging up, stop the group), a bye, and a line too long.
        forge_the_group_port(int(leader.env["CF_GROUP_PORT"]))
        time.sleep(2)  # beats keep flowing; the leader would have noticed a loss by now
        assert health(leader.port) == 200
        assert leader.proc.poll() is None and worker.proc.poll() is None  # type: ignore[union-attr]
        assert "joined again" not in leader.output() and "is gone" not in leader.output()
        assert leader.says("group: refused a connection from 127.0.0.1"), leader.output()[-3000:]

        os.kill(worker.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]  # its engine dies with it
        killed_at = time.monotonic()
        statuses: set[int | None] = set()

        def leader_stopped() -> bool:  # noting every /health answer until then
            statuses.add(health(leader.port))
            return leader.proc.poll() is not None  # type: ignore[union-attr]

        wait_until(leader_stopped, 30)
        code = leader.wait(timeout_s=5)
        assert code == 1, leader.output()
        assert time.monotonic() - killed_at < 30
        assert 503 in statuses, statuses
        assert "worker rank 1 of the group is gone" in leader.output()
        assert not leader.leftover_children()
    finally:
        leader.kill()
        worker.kill()


def test_a_sigterm_to_the_leader_stops_the_whole_group(tmp_path: Path) -> None:
    """The orderly end of a group: the leader drains, then tells the worker, which stops too."""
    leader, worker = start_group(tmp_path)
    try:
        leader.wait_ready(timeout_s=420)
        assert wait_until(lambda: worker.says("group: joined the leader 127.0.0.1"), 60), worker.output()
        worker.known_children = descendants(worker.proc.pid)  # type: ignore[union-attr]
        assert leader.stop(timeout_s=90) == 0
        assert "vLLM stopped" in leader.output()
        assert worker.wait(timeout_s=30) == 0
        assert "stopped the group" in worker.output()
        assert not leader.leftover_children() and not worker.leftover_children()
    finally:
        leader.kill()
        worker.kill()


#: The join timeout of the group whose worker never starts: long enough for the leader's vLLM to be up
#: and waiting for rank 1 when it runs out.
JOIN_S = 12


def test_a_worker_that_never_starts_stops_the_leader_naming_the_rank(tmp_path: Path) -> None:
    leader, _ = group_members(tmp_path, join_timeout_s=JOIN_S)
    leader.start()
    try:
        assert wait_until(lambda: leader.says("group: watching 1 worker(s)"), 60), leader.output()
        watching_at = time.monotonic()
        time.sleep(5)  # vLLM's processes are up, waiting for rank 1
        leader.known_children = descendants(leader.proc.pid)  # type: ignore[union-attr]
        assert leader.known_children
        code = leader.wait(timeout_s=JOIN_S + 25)  # the join timeout, then the engine's stop grace
        assert code == 1, leader.output()
        assert time.monotonic() - watching_at < JOIN_S + 25
        out = leader.output()
        assert f"worker rank 1 of the group did not join within {JOIN_S} s" in out, out[-3000:]
        assert not leader.leftover_children()
    finally:
        leader.kill()


def test_a_killed_leader_stops_its_worker(tmp_path: Path) -> None:
    leader, worker = start_group(tmp_path)
    try:
        # once the worker has joined (before that, a missing leader is waited for up to the join timeout)
        assert wait_until(lambda: worker.says("group: joined the leader"), 120), worker.output()
        assert wait_until(lambda: leader.says("group: worker rank 1 joined (1 of 1 worker(s))"), 10), leader.output()
        worker.known_children = descendants(worker.proc.pid)  # type: ignore[union-attr]
        # the leader's host goes away: the runtime and its engine die at once, nothing says goodbye
        os.killpg(leader.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        killed_at = time.monotonic()
        code = worker.wait(timeout_s=30)
        assert time.monotonic() - killed_at < 30
        assert code != 0, worker.output()
        assert "leader 127.0.0.1" in worker.output() and "is gone" in worker.output(), worker.output()[-3000:]
        assert not worker.leftover_children()
    finally:
        leader.kill()
        worker.kill()


# ---- data parallel on one host ------------------------------------------------------------------------


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def test_data_parallel_ranks_write_their_own_trace_files_and_metrics_add_up(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    metrics_port = free_port()
    runtime = RuntimeProcess(
        ["--metrics", "--request-trace", "standard", "--trace-file", str(traces / "requests.jsonl"), "--",
         str(tiny_model_dir()), "--served-model-name", "tiny", "--dtype", "bfloat16", "--max-model-len", "2048",
         "--max-num-seqs", "4", "--data-parallel-size", "2"],
        tmp_path / "logs", env={"CF_METRICS_PORT": str(metrics_port), "VLLM_HOST_IP": "127.0.0.1"},
    ).start()
    try:
        runtime.wait_ready(timeout_s=420)
        assert "each rank writes its own file" in runtime.output()
        client = openai.OpenAI(base_url=runtime.base_url, api_key="unused", max_retries=0, timeout=120)

        def ask(i: int) -> str:
            answer = client.completions.create(model="tiny", prompt=f"rank test {i}", max_tokens=8,
                                               extra_body={"ignore_eos": True})
            return answer.id

        with ThreadPoolExecutor(8) as pool:  # concurrent, so vLLM's balancer uses both engine cores
            sent = list(pool.map(ask, range(24)))
        files = {rank: traces / f"requests.dp{rank}.jsonl" for rank in (0, 1)}

        def lines_written() -> int:
            return sum(len(f.read_text().splitlines()) for f in files.values() if f.exists())

        assert wait_until(lambda: lines_written() >= 24, 20, every_s=0.5), list(traces.iterdir())
        per_rank = {rank: [json.loads(line) for line in f.read_text().splitlines()] for rank, f in files.items()}
        assert sorted(p.name for p in traces.iterdir()) == ["requests.dp0.jsonl", "requests.dp1.jsonl"]
        assert all(per_rank.values()), {rank: len(r) for rank, r in per_rank.items()}  # both ranks served
        ids = [r["request_id"] for records in per_rank.values() for r in records]
        assert sorted(ids) == sorted(sent)  # each request in exactly one rank's file

        summary = subprocess.run([sys.executable, "-m", "carbonforge_runtime", "trace", "summarize", str(traces),
                                  "--json"], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert summary.returncode == 0, summary.stderr
        assert json.loads(summary.stdout)["records"] == 24

        def counted() -> bool:  # requests, and the records the file sink wrote, as two separate reports
            page = scrape(metrics_port)
            sums = [sum(value for labels, value in page.get(name, []) if labels.get("sink", "file") == "file")
                    for name in ("carbonforge_requests_total", "carbonforge_trace_records_written_total")]
            return sums == [24, 24]

        wait_until(counted, 10, every_s=0.5)  # the feed reports every half second
        page = scrape(metrics_port)
        requests = {labels["dp_rank"]: value for labels, value in page.get("carbonforge_requests_total", [])}
        assert requests == {str(rank): float(len(per_rank[rank])) for rank in (0, 1)}
        written = {labels["dp_rank"]: value for labels, value in page["carbonforge_trace_records_written_total"]
                   if labels["sink"] == "file"}
        assert written == requests
        arrived = {labels["dp_rank"]: value for labels, value in page["carbonforge_engine_requests_arrived_total"]}
        assert sum(arrived.values()) == 24 and set(arrived) == {"0", "1"}
        assert runtime.stop(signal.SIGTERM, timeout_s=90) == 0
        assert runtime.engine_log().count("request trace: flushed at shutdown") == 2
    finally:
        runtime.kill()
