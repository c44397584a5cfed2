"""Sending a planned replay over HTTP (httpx, async) to an OpenAI-compatible ``/v1/completions``.

Each request is sent at its planned time with ``max_tokens`` set to the recorded output size and
``ignore_eos`` so the server generates exactly that many tokens. At most ``concurrency`` requests
are in flight (a request that finds no free slot is sent late, and the lateness is recorded as
send lag). Everything stops at the overall deadline: requests still in flight are cancelled and
reported as such.

httpx rather than the openai SDK: the SDK spends tens of milliseconds of CPU per request on a
busy two-core machine, which would shift the very arrival times a replay must keep.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from carbonforge_runtime.offline.replay.aggregate import RequestOutcome, summarize
from carbonforge_runtime.offline.replay.plan import PlannedRequest
from carbonforge_runtime.offline.replay.trace import ReplayError

#: The request field (vLLM ``vllm_xargs``, which reaches the engine as ``sampling_params.extra_args``)
#: that carries a request's true output length to the benchmark-only ``oracle`` family.
TRUE_OUTPUT_TOKENS_ARG = "cf_true_output_tokens"


@dataclass(frozen=True)
class RunOptions:
    base_url: str
    model: str | None = None  # None: the first model the server lists
    api_key: str = "unused"
    concurrency: int = 256
    deadline_s: float = 3600.0
    request_timeout_s: float = 600.0
    progress_every_s: float = 5.0
    send_true_length: bool = False  # only for benchmarks of the oracle family
    extra_body: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.concurrency < 1:
            raise ReplayError(f"concurrency {self.concurrency} must be at least 1", "pass --concurrency N with N >= 1")
        if not self.deadline_s > 0:
            raise ReplayError(f"deadline {self.deadline_s} s must be positive", "pass --deadline-s with seconds > 0")
        if not self.request_timeout_s > 0:
            raise ReplayError(f"request timeout {self.request_timeout_s} s must be positive",
                              "pass --request-timeout-s with seconds > 0")
        if not self.base_url.startswith(("http://", "https://")):
            raise ReplayError(f"base URL {self.base_url!r} is not an http(s) URL",
                              "pass --base-url like http://127.0.0.1:8000/v1")


@dataclass
class ReplayResult:
    model: str
    started_at: float  # Unix seconds when the first request was due
    duration_s: float
    outcomes: list[RequestOutcome]

    def summary(self) -> dict[str, Any]:
        return summarize(self.outcomes, self.duration_s)


async def _discover_model(client: Any, base_url: str, model: str | None) -> str:
    """The model to request (the first listed unless given); also proves the server answers."""
    import httpx

    try:
        response = await client.get("/models")
    except (httpx.TransportError, httpx.TimeoutException) as exc:
        raise ReplayError(f"cannot reach {base_url} ({exc.__class__.__name__})",
                          "start the server first, or fix --base-url (it ends in /v1)") from None
    if response.status_code != 200:
        raise ReplayError(f"{base_url}/models answered HTTP {response.status_code}",
                          "check --base-url (it ends in /v1) and --api-key")
    if model:
        return model
    try:
        names = [str(m["id"]) for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ReplayError(f"{base_url}/models is not an OpenAI model list", "pass --model NAME") from None
    if not names:
        raise ReplayError(f"{base_url} serves no model", "pass --model NAME")
    return names[0]


def _describe_error(exc: BaseException) -> str:
    import httpx

    if isinstance(exc, httpx.TimeoutException):
        return "timeout: no answer within the request timeout"
    if isinstance(exc, httpx.TransportError):
        return f"connection: {exc.__class__.__name__}"
    return f"{exc.__class__.__name__}: {str(exc)[:300]}"


async def run_replay(plan: Sequence[PlannedRequest], options: RunOptions,
                     progress: Callable[[str], None] | None = None) -> ReplayResult:
    import httpx

    options.validate()
    client = httpx.AsyncClient(
        base_url=options.base_url, timeout=options.request_timeout_s,
        headers={"Authorization": f"Bearer {options.api_key}"},
        # Idle connections are dropped after 2 s, before a server's keep-alive timeout (5 s in
        # uvicorn, which vLLM uses) can close one just as a request is sent on it.
        limits=httpx.Limits(max_connections=options.concurrency, max_keepalive_connections=options.concurrency,
                            keepalive_expiry=2.0),
    )
    frozen_here = False
    try:
        # Also the first request through this client, so its one-time costs fall before the clock.
        model = await _discover_model(client, options.base_url, options.model)
        # What the process holds before the clock starts (the plan, the caller's own data) is kept
        # out of the garbage collector's sweeps until the run ends: a full sweep walks every live
        # object with the event loop held, so its length grows with the caller's heap, and requests
        # due meanwhile would go out late together.
        frozen_here = gc.get_freeze_count() == 0
        gc.collect()
        gc.freeze()
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(options.concurrency)
        outcomes = [RequestOutcome(p.index, p.send_at_s, expected_prompt_tokens=p.prompt_tokens,
                                   expected_output_tokens=p.output_tokens, template=p.template) for p in plan]
        in_flight = 0
        start = loop.time()
        started_at = time.time()

        async def send(item: PlannedRequest, outcome: RequestOutcome) -> None:
            nonlocal in_flight
            delay = start + item.send_at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            async with slots:
                body: dict[str, Any] = {"model": model, "prompt": item.prompt, "max_tokens": item.output_tokens,
                                        "ignore_eos": True, **options.extra_body}
                if options.send_true_length:
                    body["vllm_xargs"] = {TRUE_OUTPUT_TOKENS_ARG: item.output_tokens}
                outcome.sent_s = loop.time() - start
                in_flight += 1
                try:
                    response = await client.post("/completions", json=body)
                    done = loop.time() - start
                    if response.status_code != 200:
                        outcome.error = f"http {response.status_code}: {response.text[:300]}"
                        return
                    data = response.json()
                    outcome.done_s = done
                    outcome.request_id = str(data.get("id")) if data.get("id") is not None else None
                    usage = data.get("usage") or {}
                    outcome.prompt_tokens = usage.get("prompt_tokens")
                    outcome.output_tokens = usage.get("completion_tokens")
                except asyncio.CancelledError:
                    outcome.error = "deadline: cancelled in flight at the overall deadline"
                    raise
                except Exception as exc:  # any failure of one request is recorded, not fatal
                    outcome.error = _describe_error(exc)
                finally:
                    in_flight -= 1

        tasks = [asyncio.create_task(send(p, o)) for p, o in zip(plan, outcomes, strict=True)]

        async def report() -> None:
            while True:
                await asyncio.sleep(options.progress_every_s)
                done = sum(t.done() for t in tasks)
                failed = sum(1 for o in outcomes if o.error is not None)
                if progress is not None:
                    progress(f"replay: {done}/{len(tasks)} done, {in_flight} in flight, {failed} failed, "
                             f"{loop.time() - start:.0f} s")

        reporter = asyncio.create_task(report())
        try:
            _, pending = await asyncio.wait(tasks, timeout=options.deadline_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)
        duration = loop.time() - start
        for outcome in outcomes:
            if outcome.sent_s is None and outcome.error is None:
                outcome.error = "deadline: not sent before the overall deadline"
        if progress is not None:
            failed = sum(1 for o in outcomes if o.error is not None)
            progress(f"replay: finished {len(outcomes) - failed}/{len(outcomes)} in {duration:.1f} s")
        return ReplayResult(model, started_at, duration, outcomes)
    finally:
        if frozen_here:
            gc.unfreeze()
        await client.aclose()
