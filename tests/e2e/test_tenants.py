"""End to end on the real vLLM CPU engine: named keys and usage per tenant, one runtime for the module.

Two named keys of a keys file send requests through the OpenAI SDK; every trace record carries its key's
name, the runtime's /metrics counts each tenant's requests and tokens under its name, a client that sends
its own tenant in ``vllm_xargs`` is recorded as its key's tenant, and ``trace summarize --by tenant`` bills
each tenant its own requests. Then the platform's key contract, through the SDK: every status and code
(401 ``missing_api_key`` / ``invalid_api_key`` with ``WWW-Authenticate``, 403 ``insufficient_scope``, 429
``rate_limit_exceeded`` / ``concurrency_limit_exceeded`` with ``Retry-After``, 413 ``request_too_large``),
the rate-limit headers of counted answers, the SDK's own retry carrying a request through after a 429,
``whoami``, and keys added, revoked and broken in the file while serving, without a restart. The tenant
tests run first: they count every request the runtime has served."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from carbonforge_runtime.offline.trace_tools.chargeback import summarize_by_tenant
from tests.support import TINY_KEY, TINY_SERVED_NAME, RuntimeProcess, free_port, wait_until

TENANTS = ("team-a", "team-b")
SCOPES = "[models:read, inference:invoke]"
#: The keys the contract's checks use, beside the tenants: name -> the rest of its entry.
CONTRACT_KEYS = {
    "reader": "scopes: [models:read]",
    "invoker": "scopes: [inference:invoke]\n    priority: 1\n    share: 2.5",
    "paced": f"scopes: {SCOPES}\n    requests_per_minute: 60",
    "solo": "scopes: [inference:invoke]\n    max_in_flight: 1",
    "lapsed": "scopes: [models:read]\n    expires: 2020-01-01",
}
#: CF_API_KEY beside the file: every scope, no limit, no tenant.
SHORTCUT = "cf-shortcut-" + secrets.token_urlsafe(24)
MAX_REQUEST_BYTES = 65536


def keys_yaml(keys: dict[str, str], extra: dict[str, str] | None = None) -> str:
    """The keys file for ``keys`` (name -> secret): the tenants with both scopes, the others as
    :data:`CONTRACT_KEYS` (or ``extra``) has them."""
    rest = {**CONTRACT_KEYS, **(extra or {})}
    return "keys:\n" + "".join(
        f"  - name: {name}\n    sha256: {hashlib.sha256(secret.encode()).hexdigest()}\n    "
        + (f"scopes: {SCOPES}" if name in TENANTS else rest[name]) + "\n"
        for name, secret in keys.items())


@dataclass
class Session:
    runtime: RuntimeProcess
    metrics_port: int
    trace: Path
    secrets: dict[str, str]
    keys_file: Path


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    tmp = tmp_path_factory.mktemp("tenants-e2e")
    keys = {name: secrets.token_urlsafe(32) for name in (*TENANTS, *CONTRACT_KEYS)}
    keys_file = tmp / "keys.yaml"
    keys_file.write_text(keys_yaml(keys))
    trace = tmp / "trace.jsonl"
    metrics_port = free_port()
    runtime = RuntimeProcess(
        ["--context-key", TINY_KEY, "--metrics", "--request-trace", "standard", "--trace-file", str(trace)],
        tmp / "run", env={"CF_API_KEYS_FILE": str(keys_file), "CF_METRICS_PORT": str(metrics_port),
                          "CF_API_KEY": SHORTCUT, "CF_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES)},
    ).start()
    try:
        runtime.wait_ready()
        yield Session(runtime, metrics_port, trace, keys, keys_file)
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


# ---- the platform's key contract ---------------------------------------------------------------------

ASK: Any = [{"role": "user", "content": "hi"}]
#: OpenAI's duration format (Go's): 250ms, 6s, 1.5s, 1m0s.
DURATION = re.compile(r"(\d+ms|\d+(\.\d+)?s|\d+m\d+(\.\d+)?s)\Z")


def sdk(session: Session, key: str | None, max_retries: int = 0, statuses: list[int] | None = None) -> openai.OpenAI:
    """The OpenAI SDK with ``key`` (a name of ``session.secrets``, or the secret itself); ``statuses``
    collects the status of every answer it gets, retries included."""
    secret = session.secrets.get(key or "", key) or "unused"
    hooks: Any = {"response": [lambda response: statuses.append(response.status_code)]} if statuses is not None else {}
    return openai.OpenAI(base_url=session.runtime.base_url, api_key=secret, timeout=120, max_retries=max_retries,
                         http_client=openai.DefaultHttpxClient(event_hooks=hooks))


def refusal(call: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value


def test_every_refusal_has_the_platforms_status_code_and_header(session: Session) -> None:
    missing = refusal(lambda: sdk(session, "reader").models.list(extra_headers={"Authorization": openai.Omit()}))
    assert isinstance(missing, openai.AuthenticationError) and missing.code == "missing_api_key"
    assert missing.response.headers["www-authenticate"] == "Bearer"
    for key in ("cf-" + secrets.token_urlsafe(32), "lapsed"):
        invalid = refusal(lambda key=key: sdk(session, key).models.list())
        assert isinstance(invalid, openai.AuthenticationError) and invalid.code == "invalid_api_key", key
        assert invalid.response.headers["www-authenticate"] == 'Bearer error="invalid_token"'
    assert "expired" in invalid.message
    scope = refusal(lambda: sdk(session, "reader").chat.completions.create(model=TINY_SERVED_NAME, messages=ASK))
    assert isinstance(scope, openai.PermissionDeniedError) and scope.code == "insufficient_scope"
    assert scope.response.headers["www-authenticate"] == 'Bearer error="insufficient_scope", scope="inference:invoke"'
    models = refusal(lambda: sdk(session, "invoker").models.list())
    assert models.status_code == 403 and models.code == "insufficient_scope"
    assert [m.id for m in sdk(session, "reader").models.list()] == [TINY_SERVED_NAME]
    large = refusal(lambda: sdk(session, "invoker").chat.completions.create(
        model=TINY_SERVED_NAME, messages=[{"role": "user", "content": "x" * MAX_REQUEST_BYTES}]))
    assert large.status_code == 413 and large.code == "request_too_large"
    for error in (missing, invalid, scope, large):
        assert set(error.response.json()["error"]) == {"message", "type", "param", "code"}


def test_counted_answers_carry_the_rate_limit_headers_and_429_has_retry_after(session: Session) -> None:
    paced = sdk(session, "paced")
    answers: list[Any] = [paced.chat.completions.with_raw_response.create(model=TINY_SERVED_NAME, messages=ASK,
                                                                          max_tokens=2)]
    with paced.chat.completions.with_streaming_response.create(model=TINY_SERVED_NAME, messages=ASK, max_tokens=2,
                                                               stream=True) as streamed:
        answers.append(streamed)
        assert list(streamed.iter_lines())
    remaining = []
    while True:  # every counted answer has the headers, until the minute's 60 are spent
        try:
            answers.append(paced.models.with_raw_response.list())
        except openai.RateLimitError as exc:
            spent = exc
            break
        assert len(answers) <= 80, "the limit of 60 a minute never refused a request"
    for answer in answers:
        headers = answer.headers
        assert headers["x-ratelimit-limit-requests"] == "60"
        remaining.append(int(headers["x-ratelimit-remaining-requests"]))
        assert DURATION.match(headers["x-ratelimit-reset-requests"]), headers["x-ratelimit-reset-requests"]
    assert remaining[0] == 59 and remaining == sorted(remaining, reverse=True) and remaining[-1] == 0
    assert spent.code == "rate_limit_exceeded" and spent.response.headers["retry-after"] == "1"
    assert spent.response.headers["x-ratelimit-remaining-requests"] == "0"
    # the SDK's own retry waits what Retry-After says and carries the request through
    statuses: list[int] = []
    started = time.monotonic()
    listed = sdk(session, "paced", max_retries=3, statuses=statuses).models.list()
    assert [m.id for m in listed] == [TINY_SERVED_NAME]
    assert statuses[0] == 429 and statuses[-1] == 200 and time.monotonic() - started < 10, statuses


def test_the_in_flight_limit_and_the_sdk_retry_after_a_slot_frees(session: Session) -> None:
    """A request of ``solo`` (one in flight) is held open by a body that has not finished arriving; a
    second is refused at once, and the SDK's retry gets through once the first ends."""
    go_on, sent = threading.Event(), threading.Event()
    held: dict[str, int] = {}

    def body() -> Any:
        yield b'{"model": "' + TINY_SERVED_NAME.encode() + b'", "max_tokens": 2, '
        sent.set()  # the headers and the first chunk are out: the server has admitted the request
        go_on.wait(60)
        yield b'"messages": [{"role": "user", "content": "hi"}]}'

    def hold() -> None:
        with httpx.Client(timeout=120) as client:
            held["status"] = client.post(f"{session.runtime.base_url}/chat/completions", content=body(), headers={
                "authorization": f"Bearer {session.secrets['solo']}", "content-type": "application/json"}).status_code

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert sent.wait(30)
    time.sleep(0.5)  # no probe may take the one slot before the held request does
    try:
        def refused() -> openai.APIStatusError | None:
            try:
                sdk(session, "solo").chat.completions.create(model=TINY_SERVED_NAME, messages=ASK, max_tokens=2)
            except openai.RateLimitError as exc:
                return exc
            return None

        busy = wait_until(refused, 30, every_s=0.1)
        if busy is None:
            go_on.set()
            holder.join(60)
            raise AssertionError(f"the held request was not in flight; it was answered {held}")
        assert busy is not None and busy.code == "concurrency_limit_exceeded"
        assert busy.response.headers["retry-after"] == "1"
        statuses: list[int] = []
        answer: dict[str, Any] = {}
        retrying = threading.Thread(target=lambda: answer.setdefault("reply", sdk(
            session, "solo", max_retries=5, statuses=statuses).chat.completions.create(
            model=TINY_SERVED_NAME, messages=ASK, max_tokens=2)), daemon=True)
        retrying.start()
        wait_until(lambda: 429 in statuses, 30, every_s=0.05, what="the SDK's first attempt to be refused")
    finally:
        go_on.set()
    holder.join(120)
    retrying.join(120)
    assert held["status"] == 200
    assert statuses[0] == 429 and statuses[-1] == 200 and answer["reply"].choices, statuses


def test_whoami_names_the_key_and_never_the_secret(session: Session) -> None:
    response = sdk(session, "invoker").get("/auth/whoami", cast_to=httpx.Response)
    assert response.json() == {"object": "api_key", "name": "invoker", "scopes": ["inference:invoke"],
                               "limits": {"requests_per_minute": None, "max_in_flight": None}, "priority": 1,
                               "share": 2.5, "expires_at": None}
    assert session.secrets["invoker"] not in response.text
    assert hashlib.sha256(session.secrets["invoker"].encode()).hexdigest() not in response.text
    paced = sdk(session, "paced").get("/auth/whoami", cast_to=dict)
    assert paced["limits"] == {"requests_per_minute": 60, "max_in_flight": None}
    shortcut = sdk(session, SHORTCUT).get("/auth/whoami", cast_to=dict)
    assert shortcut["name"] is None and {"models:read", "inference:invoke"} <= set(shortcut["scopes"])
    assert refusal(lambda: sdk(session, "lapsed").get("/auth/whoami", cast_to=dict)).status_code == 401


def test_the_shortcut_key_has_no_tenant_whatever_the_client_sends(session: Session) -> None:
    answer = sdk(session, SHORTCUT).chat.completions.create(
        model=TINY_SERVED_NAME, messages=ASK, max_tokens=2, extra_body={"vllm_xargs": {"cf_tenant": "team-b"}})
    named = sdk(session, "invoker").chat.completions.create(
        model=TINY_SERVED_NAME, messages=ASK, max_tokens=2, extra_body={"vllm_xargs": {"cf_tenant": "team-b"}})

    def both() -> dict[str, dict[str, Any]]:
        found = {r["request_id"]: r for r in _records(session.trace) if r["request_id"] in (answer.id, named.id)}
        return found if len(found) == 2 else {}

    records = wait_until(both, 30, what="the two requests' trace records")
    assert records[answer.id]["tenant"] is None and records[named.id]["tenant"] == "invoker"


def _api_metric(session: Session, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{session.runtime.port}/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


def test_keys_added_revoked_and_broken_in_the_file_while_serving(session: Session) -> None:
    late = "cf-" + secrets.token_urlsafe(32)
    keys = {**session.secrets, "late": late}
    assert refusal(lambda: sdk(session, late).models.list()).code == "invalid_api_key"

    def rewrite(text: str) -> None:  # as an operator's tool or a Secret update: a new file over the old
        fresh = session.keys_file.with_suffix(".new")
        fresh.write_text(text)
        os.replace(fresh, session.keys_file)

    def works(secret: str) -> bool:
        try:
            sdk(session, secret).models.list()
        except openai.AuthenticationError:
            return False
        return True

    rewrite(keys_yaml(keys, {"late": "scopes: [models:read]"}))
    added = time.monotonic()
    wait_until(lambda: works(late), 5, every_s=0.1, what="the added key to work")
    took_add = time.monotonic() - added
    assert _api_metric(session, "carbonforge_api_keys_loaded") == len(keys)

    rewrite(keys_yaml(session.secrets))
    revoked = time.monotonic()
    wait_until(lambda: not works(late), 5, every_s=0.1, what="the revoked key to be refused")
    took_revoke = time.monotonic() - revoked

    errors = _api_metric(session, "carbonforge_api_keys_file_errors_total") or 0.0
    rewrite("keys: [\n")  # broken: the last good keys stay
    wait_until(lambda: _api_metric(session, "carbonforge_api_keys_file_valid") == 0, 5, every_s=0.2,
               what="the broken file to be noticed")
    assert works(session.secrets["reader"]) and not works(late)
    assert _api_metric(session, "carbonforge_api_keys_file_errors_total") == errors + 1
    assert wait_until(lambda: session.runtime.engine_log_search(r"keys\.yaml: is not valid YAML at line \d+ .*; the "
                                                                r"last good keys stay in force"), 10)
    rewrite(keys_yaml(session.secrets))
    wait_until(lambda: _api_metric(session, "carbonforge_api_keys_file_valid") == 1, 5, every_s=0.2,
               what="the mended file to be read")
    print(f"keys file: an added key worked after {took_add:.2f} s, a revoked one was refused after "
          f"{took_revoke:.2f} s")
    log = session.runtime.engine_log() + session.runtime.output()
    for secret in (*session.secrets.values(), late, SHORTCUT):
        assert secret not in log
