"""Two "hosts" on one machine: a leader and a headless worker, each its own runtime process, serving
the tiny model with pipeline parallel 2 across them on vLLM's own multiprocessing launcher. Streamed
chat completions go through the leader's API with the OpenAI SDK, the scheduler plug-in runs in the
leader's engine (the plain variant: vLLM turns async scheduling off under pipeline parallel) and
writes the trace; a SIGTERM to the leader stops both cleanly. A killed worker turns the leader's
/health to 503 and stops the leader, naming the rank."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

from tests.support import RuntimeProcess, descendants, free_port, tiny_model_dir


def read_records(path: Path, count: int, timeout_s: float = 20.0) -> list[dict[str, object]]:
    """The trace's records once there are ``count`` of them (the sink writes shortly after completion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return None


def start_group(tmp_path: Path) -> tuple[RuntimeProcess, RuntimeProcess]:
    """A leader (tracing to ``leader/trace.jsonl``) and a worker, started together."""
    group = {"CF_NNODES": "2", "CF_MASTER_ADDR": "127.0.0.1", "CF_MASTER_PORT": str(free_port()),
             "CF_GROUP_PORT": str(free_port()), "CF_JOIN_TIMEOUT_S": "240",
             # two "hosts" on one machine: both reach each other on loopback, each binds its own core
             "VLLM_HOST_IP": "127.0.0.1"}
    vllm = ["--", str(tiny_model_dir()), "--served-model-name", "tiny", "--dtype", "bfloat16",
            "--max-model-len", "2048", "--max-num-seqs", "4", "--pipeline-parallel-size", "2"]
    trace = tmp_path / "leader" / "trace.jsonl"
    leader = RuntimeProcess(["--request-trace", "standard", "--trace-file", str(trace), *vllm], tmp_path / "leader",
                            env={**group, "CF_NODE_RANK": "0", "VLLM_CPU_OMP_THREADS_BIND": "0"})
    worker = RuntimeProcess(vllm, tmp_path / "worker",
                            env={**group, "CF_NODE_RANK": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"})
    leader.start()
    worker.start()
    return leader, worker


def test_a_leader_and_a_headless_worker_serve_one_model_across_two_hosts(tmp_path: Path) -> None:
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

        # SIGTERM to the leader: it drains, then tells the worker, which stops too; nothing is left
        worker.known_children = descendants(worker.proc.pid)  # type: ignore[union-attr]
        assert leader.stop(timeout_s=90) == 0
        assert "vLLM stopped" in leader.output()
        assert worker.wait(timeout_s=30) == 0
        assert "stopped the group" in worker.output()
        assert not leader.leftover_children() and not worker.leftover_children()
    finally:
        leader.kill()
        worker.kill()


def test_a_killed_worker_turns_the_leaders_health_to_503_and_stops_the_leader(tmp_path: Path) -> None:
    leader, worker = start_group(tmp_path)
    try:
        leader.wait_ready(timeout_s=420)
        until_joined = time.monotonic() + 60
        while "group: watching" not in worker.output() and time.monotonic() < until_joined:
            time.sleep(0.5)
        os.kill(worker.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]  # its engine dies with it
        killed_at = time.monotonic()
        statuses = set()
        while leader.proc.poll() is None and time.monotonic() - killed_at < 30:  # type: ignore[union-attr]
            statuses.add(health(leader.port))
            time.sleep(0.2)
        code = leader.wait(timeout_s=5)
        assert code == 1, leader.output()
        assert time.monotonic() - killed_at < 30
        assert 503 in statuses, statuses
        assert "worker rank 1 of the group is gone" in leader.output()
        assert not leader.leftover_children()
    finally:
        leader.kill()
        worker.kill()
