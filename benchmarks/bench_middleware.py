#!/usr/bin/env python3
"""What the request-contract middleware adds to each request in vLLM's API server.

Two ASGI apps shaped like vLLM's, built the same way: a Starlette app with vLLM's CORS and its real
``AuthenticationMiddleware`` (an API key is set and the right one is sent) around a
``POST /v1/chat/completions`` route that reads the JSON body and answers with a chat completion that
carries ``reasoning`` (as JSON, or as 64 server-sent events then ``[DONE]``); one of the two has
``RequestContract`` added the way ``--middleware`` adds it. The contract is a reasoning one with
thinking budgets, so requests have their effort mapped and answers get ``reasoning_content``.

Each request is driven in-process with a hand-written ASGI scope/receive/send (no socket, whose noise
would hide microseconds), on uvloop when it is installed (as vLLM's server runs). The two apps take
turns in interleaved rounds (the order flips every round), so both see the same machine state.
Cases: a small chat request, the same streamed, a long conversation (~20 KB of messages), and a
request refused for its effort (for information: without the middleware the route answers it).

    .venv/bin/python benchmarks/bench_middleware.py [--requests 10000] [--rounds 20] [--breakdown]
    .venv/bin/python benchmarks/bench_middleware.py --keys-file 1000 [--out benchmarks/results/middleware_keys.md]

``--keys-file N`` measures named keys instead: the middleware serving a keys file of N keys (vLLM's own
key check off, as the runtime runs it then), the request made with one of them, which has a
per-minute limit (never reached) and an in-flight limit, so every part runs: the lookup, both limits,
the rate-limit headers and the tenant written into ``vllm_xargs``. It is paired, round by round,
against the middleware without a keys file (``VLLM_API_KEY`` and vLLM's check, as above) and against
the app without the middleware.

Target: under 50 us added at the median to what a client waits on: the whole answer of a plain
request, each event of a streamed one (each token's delivery; the stream's total is printed too, as
the API server's extra CPU per stream). Exit status 1 when a case misses it or an answer is not what
the contract promises.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import command, commit, median, percentile
from carbonforge_runtime.core.api_contract import (
    API_CONTRACT_VARIABLE,
    CHAT_PATH,
    ApiContract,
    alias_reasoning_events,
    alias_reasoning_json,
    check_request,
)

TARGET_US = 50.0
CONTRACT = ApiContract(reasoning=True, tools=True, thinking_budget={"low": 1024, "medium": 4096, "xhigh": None})
MODEL = "carbonforge/tiny-chat"
WORDS = ("invoice", "payment", "overdue", "receipt", "billing", "refund", "statement", "account", "terms",
         "credit", "ledger", "balance")
#: What the route last saw of the effort mapping (checked once per case, outside the timing).
SEEN: dict[str, Any] = {}


def text(words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 5) % len(WORDS)] for i in range(words))


def answer_json(request_id: int) -> dict[str, Any]:
    """A non-streamed chat completion as vLLM 0.32 answers it (with a reasoning parser)."""
    return {
        "id": f"chatcmpl-{request_id:032x}", "object": "chat.completion", "created": 1767225600, "model": MODEL,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text(60, 1), "refusal": None, "annotations": None,
                        "audio": None, "function_call": None, "tool_calls": [], "reasoning": text(120, 2)},
            "logprobs": None, "finish_reason": "stop", "stop_reason": None, "token_ids": None,
        }],
        "service_tier": None, "system_fingerprint": None,
        "usage": {"prompt_tokens": 38, "total_tokens": 218, "completion_tokens": 180, "prompt_tokens_details": None},
        "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None,
    }


def stream_events(chunks: int = 64) -> list[bytes]:
    """``chunks`` ``data: {...}`` events (role, reasoning deltas, content deltas, finish), then [DONE]."""
    head = {"id": "chatcmpl-" + "0" * 32, "object": "chat.completion.chunk", "created": 1767225600, "model": MODEL}
    deltas: list[tuple[dict[str, Any], str | None]] = [({"role": "assistant", "content": ""}, None)]
    thinking = (chunks - 2) // 2
    deltas += [({"reasoning": " " + WORDS[i % len(WORDS)]}, None) for i in range(thinking)]
    deltas += [({"content": " " + WORDS[(i * 5) % len(WORDS)]}, None) for i in range(chunks - 2 - thinking)]
    deltas.append(({}, "stop"))
    events = []
    for delta, finish in deltas:
        chunk = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        events.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


EVENTS = stream_events()


def build_app(key: str, middleware: bool, vllm_auth: bool = True) -> Any:
    """The Starlette app, with the middleware added as vLLM adds it when ``middleware`` is set. Its
    stack is built now, so the middleware reads the environment as it is at this call."""
    from starlette.applications import Starlette
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    from carbonforge_runtime.apiserver.request_contract import RequestContract

    async def events() -> Any:
        for event in EVENTS:
            yield event

    async def chat(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return JSONResponse({"error": {"message": "Invalid JSON", "type": "BadRequestError", "code": 400}},
                                status_code=400)
        SEEN["budget"] = body.get("thinking_token_budget")
        SEEN["xargs"] = body.get("vllm_xargs")
        if body.get("stream"):
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(answer_json(len(body["messages"])))

    app = Starlette(routes=[Route(CHAT_PATH, chat, methods=["POST"])])
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=False, allow_methods=["*"],
                       allow_headers=["*"])
    if vllm_auth:
        app.add_middleware(AuthenticationMiddleware, tokens=[key])
    if middleware:
        app.add_middleware(RequestContract)
    app.middleware_stack = app.build_middleware_stack()
    return app


class Exchange:
    """One request's ``receive`` and ``send``, as a server gives them: the body once, then a
    disconnect only after the answer is complete (uvicorn's ASGI spec 2.3)."""

    __slots__ = ("body", "chunks", "done", "given", "headers", "status")

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.given = False
        self.done = asyncio.Event()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []

    async def receive(self) -> dict[str, Any]:
        if not self.given:
            self.given = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.done.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
        elif message["type"] == "http.response.body":
            self.chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                self.done.set()


@dataclass
class Case:
    name: str
    request: dict[str, Any]
    target: bool  # counts for the verdict (the refused case is for information)
    check: Callable[[Exchange, bool], str | None]  # (answer, with middleware) -> what is wrong, or None
    body: bytes = b""
    samples: dict[bool, list[int]] = field(default_factory=lambda: {False: [], True: []})
    #: Per round, with-median minus without-median (ns): machine drift between rounds cancels out.
    paired: list[float] = field(default_factory=list)

    def scope(self, key: str) -> dict[str, Any]:
        headers = [
            (b"host", b"127.0.0.1:8000"), (b"accept-encoding", b"gzip, deflate"), (b"connection", b"keep-alive"),
            (b"accept", b"application/json"), (b"content-type", b"application/json"),
            (b"user-agent", b"OpenAI/Python 1.109.1"), (b"x-stainless-lang", b"python"),
            (b"x-stainless-package-version", b"1.109.1"), (b"x-stainless-os", b"Linux"),
            (b"x-stainless-arch", b"x64"), (b"x-stainless-runtime", b"CPython"),
            (b"x-stainless-runtime-version", b"3.11.9"), (b"authorization", b"Bearer " + key.encode()),
            (b"x-stainless-async", b"false"), (b"x-stainless-retry-count", b"0"),
            (b"x-stainless-read-timeout", b"600"), (b"content-length", str(len(self.body)).encode()),
        ]
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000), "scheme": "http",
                "method": "POST", "root_path": "", "path": CHAT_PATH, "raw_path": CHAT_PATH.encode(),
                "query_string": b"", "headers": headers, "state": {}}


def joined(answer: Exchange) -> bytes:
    return b"".join(answer.chunks)


def check_json(answer: Exchange, with_mw: bool) -> str | None:
    if answer.status != 200:
        return f"status {answer.status}"
    message = json.loads(joined(answer))["choices"][0]["message"]
    length = dict(answer.headers).get(b"content-length")
    if length != str(len(joined(answer))).encode():
        return f"content-length {length!r} for a {len(joined(answer))}-byte body"
    if with_mw and message.get("reasoning_content") != message["reasoning"]:
        return "no reasoning_content beside reasoning"
    if with_mw and SEEN.get("budget") != CONTRACT.thinking_budget["medium"]:
        return f"the route saw thinking_token_budget={SEEN.get('budget')!r}, not the medium budget"
    if not with_mw and "reasoning_content" in message:
        return "reasoning_content without the middleware"
    return None


def check_stream(answer: Exchange, with_mw: bool) -> str | None:
    if answer.status != 200:
        return f"status {answer.status}"
    events = [e for e in joined(answer).split(b"\n\n") if e]
    if len(events) != len(EVENTS) or events[-1] != b"data: [DONE]":
        return f"{len(events)} events, last {events[-1][:40]!r}"
    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in events[:-1]]
    thinking = [d for d in deltas if "reasoning" in d]
    if not thinking:
        return "no reasoning deltas"
    aliased = sum(d.get("reasoning_content") == d["reasoning"] for d in thinking)
    if with_mw and aliased != len(thinking):
        return f"reasoning_content in {aliased} of {len(thinking)} reasoning deltas"
    if not with_mw and aliased:
        return "reasoning_content without the middleware"
    return None


def check_refused(answer: Exchange, with_mw: bool) -> str | None:
    if not with_mw:  # the route takes it as it comes (vLLM would hand the kwargs to the chat template)
        return None if answer.status == 200 else f"status {answer.status}"
    if answer.status != 400:
        return f"status {answer.status}, not 400"
    error = json.loads(joined(answer))["error"]
    return None if error.get("code") == "invalid_reasoning_effort" else f"error {error}"


def conversation(target_bytes: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You are the billing assistant of an accounting product."}]
    turn = 0
    while len(json.dumps(messages)) < target_bytes:
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": text(70, turn)})
        turn += 1
    messages.append({"role": "user", "content": "Which of these invoices are still overdue?"})
    return messages


def cases() -> list[Case]:
    small = {"model": MODEL, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Summarize the payment terms of invoice 4417 in two sentences."}],
        "max_tokens": 256, "temperature": 0.7, "reasoning_effort": "medium"}
    made = [
        Case("small chat, JSON answer", small, True, check_json),
        Case("small chat, streamed (64 events)", {**small, "stream": True,
                                                  "stream_options": {"include_usage": False}}, True, check_stream),
        Case("long conversation (~20 KB)", {**small, "messages": conversation(20_000)}, True, check_json),
        Case("refused: bad effort (info)", {**small, "reasoning_effort": None,
                                            "chat_template_kwargs": {"reasoning_effort": "extreme"}},
             False, check_refused),
    ]
    for case in made:
        case.body = json.dumps(case.request).encode()
    return made


async def one(app: Any, case: Case, key: str) -> tuple[int, Exchange]:
    answer = Exchange(case.body)
    scope = case.scope(key)
    started = time.perf_counter_ns()
    await app(scope, answer.receive, answer.send)
    return time.perf_counter_ns() - started, answer


async def check_answers(apps: dict[bool, Any], all_cases: list[Case], key: str, warmup: int) -> list[str]:
    """Warm both apps up on every case, then check one answer of each (none of it timed)."""
    problems = []
    for case in all_cases:
        for with_mw, app in apps.items():
            for _ in range(warmup):
                await one(app, case, key)
            _, answer = await one(app, case, key)
            wrong = case.check(answer, with_mw)
            if wrong:
                problems.append(f"{case.name} {'with' if with_mw else 'without'} the middleware: {wrong}")
    return problems


async def interleaved(variants: dict[Any, Any], case: Case, key: str, rounds: int, per_round: int,
                      before: Callable[[Any], None] = lambda name: None) -> dict[Any, list[list[int]]]:
    """Nanoseconds per request of each variant (name -> app), one list per round: ``per_round``
    requests of each in turn, the order rotating every round. ``before(name)`` runs ahead of each
    variant's turn."""
    samples: dict[Any, list[list[int]]] = {name: [] for name in variants}
    names = list(variants)
    for round_no in range(rounds):
        shift = round_no % len(names)
        for name in names[shift:] + names[:shift]:
            before(name)
            app = variants[name]
            out: list[int] = []
            samples[name].append(out)
            for _ in range(per_round):
                elapsed, _ = await one(app, case, key)
                out.append(elapsed)
    before(None)
    return samples


async def measure(apps: dict[bool, Any], all_cases: list[Case], key: str, rounds: int, per_round: int,
                  warmup: int) -> list[str]:
    problems = await check_answers(apps, all_cases, key, warmup)
    for round_no in range(rounds):  # every case in every round, the order of the sides flipping
        order = {True: apps[True], False: apps[False]} if round_no % 2 else apps
        for case in all_cases:
            got = await interleaved(order, case, key, 1, per_round)
            for with_mw, [values] in got.items():
                case.samples[with_mw] += values
            case.paired.append(median(got[True][0]) - median(got[False][0]))
    return problems


def median_p90_us(values: list[int]) -> tuple[float, float]:
    return median(values) / 1000, percentile(values, 0.9) / 1000


def pure_parts(all_cases: list[Case], repeats: int) -> None:
    """The middleware's pure parts, timed alone: judging the body and aliasing the answer."""
    answer = json.dumps(answer_json(3)).encode()
    stream = b"".join(EVENTS)

    def per_call_us(fn: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter_ns()
            for _ in range(repeats):
                fn()
            best = min(best, (time.perf_counter_ns() - started) / repeats / 1000)
        return best

    rows: list[tuple[str, Callable[[], object]]] = [
        (f"check_request, {case.name}", functools.partial(check_request, CHAT_PATH, case.body, CONTRACT))
        for case in all_cases]
    rows += [
        (f"alias_reasoning_json, one {len(answer)}-byte answer", lambda: alias_reasoning_json(answer)),
        (f"alias_reasoning_events, {len(EVENTS)} events one by one",
         lambda: [alias_reasoning_events(event) for event in EVENTS]),
        (f"alias_reasoning_events, {len(EVENTS)} events at once", lambda: alias_reasoning_events(stream)),
    ]
    print("\nthe pure parts alone (best of 5), us per call:")
    for name, fn in rows:
        print(f"  {name:<60}{per_call_us(fn):8.1f}")


async def parts(all_cases: list[Case], key: str, rounds: int, per_round: int) -> None:
    """The middleware with one part at a time taken away, against the app without it."""
    from carbonforge_runtime.apiserver import request_contract

    def built(contract: ApiContract, keys: bool) -> Any:
        os.environ[API_CONTRACT_VARIABLE] = contract.to_json()
        if keys:
            os.environ["VLLM_API_KEY"] = key
        else:
            os.environ.pop("VLLM_API_KEY", None)
        return build_app(key, middleware=True)

    full = build_app(key, middleware=True)
    variants = {
        "without the middleware": build_app(key, middleware=False),
        "the middleware": full,
        "  no key check (VLLM_API_KEY unset)": built(CONTRACT, keys=False),
        "  answers passed through the alias wrapper unchanged": full,
        "  no reasoning contract (no alias wrapper)": built(ApiContract(tools=True), keys=True),
        "  neither key check nor reasoning contract": built(ApiContract(tools=True), keys=False),
    }
    os.environ[API_CONTRACT_VARIABLE] = CONTRACT.to_json()
    os.environ["VLLM_API_KEY"] = key
    originals = (request_contract.alias_reasoning_json, request_contract.alias_reasoning_events)

    def unchanged(body: bytes) -> bytes:
        return body

    def before(name: str | None) -> None:
        patched = name is not None and "unchanged" in name
        replaced = (unchanged, unchanged) if patched else originals
        request_contract.alias_reasoning_json, request_contract.alias_reasoning_events = replaced  # type: ignore[assignment]

    print("\nwhere the added time goes (interleaved the same way; us per request: the median, and the median\n"
          "over rounds of the difference to the app without the middleware in the same round):")
    for case in all_cases[:3]:
        for name, app in variants.items():  # warm-up
            before(name)
            for _ in range(20):
                await one(app, case, key)
        samples = await interleaved(variants, case, key, rounds, per_round, before)
        base = [median(values) for values in samples["without the middleware"]]
        print(f"  {case.name}")
        for name, per_round_values in samples.items():
            medians = [median(values) for values in per_round_values]
            added = median(mine - theirs for mine, theirs in zip(medians, base, strict=True))
            print(f"    {name:<56}{median(medians) / 1000:8.1f}{added / 1000:+9.1f}")


def keys_file_text(count: int) -> tuple[str, dict[str, str]]:
    """A keys file of ``count`` keys (every one with limits, a priority and a share) and the secrets by name."""
    import hashlib

    secrets_by_name = {f"tenant-{i:05d}": "cf-" + secrets.token_urlsafe(32) for i in range(count)}
    lines = ["keys:"]
    for i, (name, secret) in enumerate(secrets_by_name.items()):
        lines += [f"  - name: {name}", f"    sha256: {hashlib.sha256(secret.encode()).hexdigest()}",
                  "    scopes: [models:read, inference:invoke]", "    requests_per_minute: 100000000",
                  "    max_in_flight: 64", f"    priority: {i % 3}", f"    share: {1 + i % 4}.0"]
    return "\n".join(lines) + "\n", secrets_by_name


async def measure_keys(count: int, rounds: int, per_round: int, warmup: int) -> tuple[list[str], list[str]]:
    """(table lines, problems): the middleware with ``count`` named keys against it without a keys file
    and against no middleware, on the three timed cases, paired round by round."""
    import tempfile

    from carbonforge_runtime.core.api_keys import KEYS_FILE_VARIABLE

    key = secrets.token_urlsafe(24)
    text, by_name = keys_file_text(count)
    with tempfile.TemporaryDirectory() as tmp:  # kept while measuring: the middleware looks at it every second
        path = Path(tmp) / "keys.yaml"
        path.write_text(text)
        os.environ[API_CONTRACT_VARIABLE] = CONTRACT.to_json()
        os.environ["VLLM_API_KEY"] = key
        os.environ.pop(KEYS_FILE_VARIABLE, None)
        plain = build_app(key, middleware=False)
        no_file = build_app(key, middleware=True)
        os.environ.pop("VLLM_API_KEY")
        os.environ[KEYS_FILE_VARIABLE] = str(path)
        loading = time.perf_counter()
        keyed = build_app(key, middleware=True, vllm_auth=False)
        load_ms = (time.perf_counter() - loading) * 1000
        os.environ.pop(KEYS_FILE_VARIABLE)
        return await _measure_keys(count, rounds, per_round, warmup, key, plain, no_file, keyed, by_name, load_ms)


async def _measure_keys(count: int, rounds: int, per_round: int, warmup: int, key: str, plain: Any, no_file: Any,
                        keyed: Any, by_name: dict[str, str], load_ms: float) -> tuple[list[str], list[str]]:
    from carbonforge_runtime.core.request_tags import TENANT_ARG

    named = f"tenant-{count // 2:05d}"
    variants = {"none": (plain, key), "no_file": (no_file, key), "keys": (keyed, by_name[named])}
    problems: list[str] = []
    table = [f"keys file: {count} keys, read and checked in {load_ms:.0f} ms when the server starts; the request "
             f"uses {named!r}", "",
             "| case | without middleware p50 | middleware, no keys file: added | with the keys file: added | "
             "keys file vs no keys file (the target) | verdict |",
             "|---|---|---|---|---|---|"]
    for case in cases()[:3]:
        for name, (app, secret) in variants.items():
            for _ in range(warmup):
                await one(app, case, secret)
            _, answer = await one(app, case, secret)
            wrong = case.check(answer, name != "none")
            headers = dict(answer.headers)
            if name == "keys" and not wrong:
                if (SEEN.get("xargs") or {}).get(TENANT_ARG) != named:
                    wrong = f"the route saw vllm_xargs {SEEN.get('xargs')!r}, not the tenant"
                elif b"x-ratelimit-remaining-requests" not in headers:
                    wrong = "no x-ratelimit headers"
            if wrong:
                problems.append(f"{case.name}, {name}: {wrong}")
        medians: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for round_no in range(rounds):
            shift = round_no % len(names)
            for name in names[shift:] + names[:shift]:
                app, secret = variants[name]
                times = [(await one(app, case, secret))[0] for _ in range(per_round)]
                medians[name].append(median(times))
        stream = len(EVENTS) if case.request.get("stream") else 1

        def paired(a: str, b: str, per: int = stream, medians: dict[str, list[float]] = medians) -> float:
            return median(x - y for x, y in zip(medians[a], medians[b], strict=True)) / 1000 / per

        judged = paired("keys", "no_file")  # the keys file's part, judged per event for the stream
        verdict = "meets" if judged < TARGET_US else "MISSES"
        if judged >= TARGET_US:
            problems.append(f"{case.name}: {judged:.1f} us added by the keys file")
        unit = " per event" if stream > 1 else ""
        table.append(f"| {case.name} | {median(medians['none']) / 1000:.1f} us | {paired('no_file', 'none'):+.1f} us"
                     f"{unit} | {paired('keys', 'none'):+.1f} us{unit} | {paired('keys', 'no_file', 1):+.1f} us | "
                     f"{verdict}{unit} |")
    return table, problems


def keys_main(args: argparse.Namespace) -> int:
    try:
        import uvloop

        runner: Callable[[Any], Any] = uvloop.run
        loop_name = "uvloop"
    except ImportError:
        runner, loop_name = asyncio.run, "asyncio"
    per_round = args.requests // args.rounds
    table, problems = runner(measure_keys(args.keys_file, args.rounds, per_round, args.warmup))
    text = "\n".join([
        f"# The middleware with {args.keys_file} named keys", "",
        f"Command: `{command()}`", "", f"Commit: `{commit()}`", "",
        f"Host: {os.cpu_count()} CPUs (shared with other work); {per_round * args.rounds} requests per case and "
        f"variant in {args.rounds} interleaved rounds, in-process ASGI on {loop_name}, Python "
        f"{sys.version.split()[0]}.", "",
        *table, "",
        "Added: the median over rounds of that round's median minus the app without the middleware's (per "
        "server-sent event for the stream). Keys file vs no keys file: the same, against the middleware "
        "checking one `VLLM_API_KEY` (the whole request, also for the stream). Target: what the keys file adds, "
        f"paired against no keys file, under {TARGET_US:.0f} us at the median (per event for the stream).",
        *[f"WRONG: {problem}" for problem in problems], ""])
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if not problems else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=10000,
                        help="timed requests per case and side (default 10000)")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds they are split into (default 20)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed requests per case and side first")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time its parts: the pure functions alone, the middleware with one taken away")
    parser.add_argument("--keys-file", type=int, default=0, metavar="N",
                        help="measure named keys: the middleware with a keys file of N keys (see above)")
    parser.add_argument("--out", help="with --keys-file: also write the result (markdown) to this file")
    args = parser.parse_args()
    if args.rounds < 2 or args.requests < args.rounds:
        parser.error("--rounds must be at least 2 and --requests at least --rounds")
    if args.keys_file:
        return keys_main(args)

    key = secrets.token_urlsafe(24)
    # The middleware reads both when it is constructed (build_app builds the stack at once).
    os.environ[API_CONTRACT_VARIABLE] = CONTRACT.to_json()
    os.environ["VLLM_API_KEY"] = key
    apps = {False: build_app(key, middleware=False), True: build_app(key, middleware=True)}
    all_cases = cases()
    per_round = args.requests // args.rounds

    try:
        import uvloop

        runner: Callable[[Any], Any] = uvloop.run
        loop_name = "uvloop"
    except ImportError:
        runner, loop_name = asyncio.run, "asyncio"
    problems = runner(measure(apps, all_cases, key, args.rounds, per_round, args.warmup))

    print(f"{per_round * args.rounds} requests per case and side in {args.rounds} interleaved rounds, "
          f"in-process ASGI on {loop_name}, Python {sys.version.split()[0]}")
    print(f"{'case':<36}{'without p50':>12}{'p90':>8}{'with p50':>10}{'p90':>8}{'added p50':>11}{'p90':>8}"
          f"{'paired':>8}{'with/without':>14}  target")
    ok = not problems
    streamed = 0.0
    for case in all_cases:
        base_p50, base_p90 = median_p90_us(case.samples[False])
        mine_p50, mine_p90 = median_p90_us(case.samples[True])
        added = mine_p50 - base_p50
        paired = median(case.paired) / 1000
        judged = paired / len(EVENTS) if case.request.get("stream") else paired
        if case.target:
            meets = judged < TARGET_US
            ok = ok and meets
            verdict = ("meets" if meets else "MISSES") + (" (per event)" if case.request.get("stream") else "")
        else:
            verdict = "(info)"
        print(f"{case.name:<36}{base_p50:12.1f}{base_p90:8.1f}{mine_p50:10.1f}{mine_p90:8.1f}{added:+11.1f}"
              f"{mine_p90 - base_p90:+8.1f}{paired:+8.1f}{mine_p50 / base_p50:13.2f}x  {verdict}")
        if case.request.get("stream"):
            streamed = paired / len(EVENTS)
    print("times in us per request; added = with - without; paired = the median over rounds of that round's "
          "with-median minus its without-median")
    print(f"target: under {TARGET_US:.0f} us added at the median (judged on paired, which drift between rounds "
          "does not move; per event for a stream)")
    print(f"streamed: {streamed:.1f} us added per server-sent event ({len(EVENTS)} per answer)")
    for problem in problems:
        print(f"WRONG ANSWER: {problem}")
    if args.breakdown:
        pure_parts(all_cases, 2000)
        runner(parts(all_cases, key, args.rounds, max(1, per_round // 2)))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
