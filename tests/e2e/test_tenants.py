"""End to end on the real vLLM CPU engine: usage per tenant. Two named keys of a keys file send requests
through the OpenAI SDK; every trace record carries its key's name, the runtime's /metrics counts each
tenant's requests and tokens under its name, a client that sends its own tenant in ``vllm_xargs`` is
recorded as its key's tenant, and ``trace summarize --by tenant`` bills each tenant its own requests."""

from __future__ import annotations

import hashlib
import json
import secrets
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from carbonforge_runtime.offline.trace_tools.chargeback import summarize_by_tenant
from tests.support import TINY_KEY, TINY_SERVED_NAME, RuntimeProcess, free_port, wait_until

TENANTS = ("team-a", "team-b")
SCOPES = "[models:read, inference:invoke]"


@dataclass
class Session:
    runtime: RuntimeProcess
    metrics_port: int
    trace: Path
    secrets: dict[str, str]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    tmp = tmp_path_factory.mktemp("tenants-e2e")
    keys = {name: secrets.token_urlsafe(32) for name in TENANTS}
    keys_file = tmp / "keys.yaml"
    keys_file.write_text("keys:\n" + "".join(
        f"  - name: {name}\n    sha256: {hashlib.sha256(secret.encode()).hexdigest()}\n    scopes: {SCOPES}\n"
        for name, secret in keys.items()))
    trace = tmp / "trace.jsonl"
    metrics_port = free_port()
    runtime = RuntimeProcess(
        ["--context-key", TINY_KEY, "--metrics", "--request-trace", "standard", "--trace-file", str(trace)],
        tmp / "run", env={"CF_API_KEYS_FILE": str(keys_file), "CF_METRICS_PORT": str(metrics_port)},
    ).start()
    try:
        runtime.wait_ready()
        yield Session(runtime, metrics_port, trace, keys)
    finally:
        runtime.kill()


def _records(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def _tenant_series(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith("carbonforge_tenant_")}


def test_two_tenants_are_named_in_the_trace_and_on_metrics_and_a_client_cannot_pose_as_another(
    session: Session,
) -> None:
    clients = {name: openai.OpenAI(base_url=session.runtime.base_url, api_key=secret, timeout=300, max_retries=0)
               for name, secret in session.secrets.items()}
    messages: Any = [{"role": "user", "content": "count to three"}]
    sent: dict[str, str] = {}  # request id -> the tenant of the key that sent it
    tokens = {name: [0, 0] for name in TENANTS}  # prompt, output
    for name, count in (("team-a", 2), ("team-b", 1)):
        for _ in range(count):
            answer = clients[name].chat.completions.create(model=TINY_SERVED_NAME, messages=messages, max_tokens=3)
            sent[answer.id] = name
            assert answer.usage is not None
            tokens[name][0] += answer.usage.prompt_tokens
            tokens[name][1] += answer.usage.completion_tokens
    # team-a claims team-b's name in the reserved channel: the middleware overwrites it with its key's name
    spoof = clients["team-a"].chat.completions.create(
        model=TINY_SERVED_NAME, messages=messages, max_tokens=3,
        extra_body={"vllm_xargs": {"cf_tenant": "team-b", "cf_priority": 9, "cf_share": 100.0}})
    sent[spoof.id] = "team-a"
    assert spoof.usage is not None
    tokens["team-a"][0] += spoof.usage.prompt_tokens
    tokens["team-a"][1] += spoof.usage.completion_tokens
    assert "cf_tenant" not in spoof.model_dump_json()

    wait_until(lambda: len(_records(session.trace)) >= len(sent), 30, every_s=0.2)
    records = _records(session.trace)
    assert sorted(r["request_id"] for r in records) == sorted(sent)
    for record in records:
        assert record["tenant"] == sent[record["request_id"]], record

    def counted() -> bool:
        series = _tenant_series(session.metrics_port)
        return sum(v for (n, _), v in series.items() if n == "carbonforge_tenant_requests_total") >= len(sent)

    wait_until(counted, 30, every_s=0.5, what="the metrics feed to count every request")
    series = _tenant_series(session.metrics_port)

    def value(name: str, **labels: str) -> float:
        return sum(v for (n, lab), v in series.items() if n == name and all(
            dict(lab).get(k) == w for k, w in labels.items()))

    assert value("carbonforge_tenant_requests_total", tenant="team-a") == 3
    assert value("carbonforge_tenant_requests_total", tenant="team-b") == 1
    assert {dict(lab)["tenant"] for (n, lab), _ in series.items() if n == "carbonforge_tenant_requests_total"} \
        == set(TENANTS)  # no default: every request came with a named key
    for name in TENANTS:
        assert value("carbonforge_tenant_prompt_tokens_total", tenant=name) == tokens[name][0]
        assert value("carbonforge_tenant_output_tokens_total", tenant=name) == tokens[name][1]
        assert value("carbonforge_tenant_request_e2e_latency_seconds_count", tenant=name) == (3 if name == "team-a"
                                                                                             else 1)
    bill = {usage.tenant: usage for usage in summarize_by_tenant([session.trace]).tenants}
    assert {name: (u.requests, u.prompt_tokens, u.output_tokens) for name, u in bill.items()} == {
        "team-a": (3, *tokens["team-a"]), "team-b": (1, *tokens["team-b"])}
