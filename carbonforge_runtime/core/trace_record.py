"""The trace record: what the engine hands over for a completed request, and the record built from it.

Pure functions over plain data, no vLLM import. The scheduler shim fills a :class:`Completion`
on the engine loop (plain attribute copies, nothing else); the writer thread turns it into a
record with :func:`build_record`, decoding text there when the level asks for it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from carbonforge_runtime.core.request_tags import model_from_arg, tags_from_arg, tenant_from_arg

LEVEL_OFF = "off"
LEVEL_STANDARD = "standard"
LEVEL_FULL = "full"
LEVELS = (LEVEL_OFF, LEVEL_STANDARD, LEVEL_FULL)

#: The documented standard fields, in the order they are written.
STANDARD_FIELDS = (
    "request_id",
    "t_arrival",
    "t_completion",
    "prompt_tokens",
    "output_tokens",
    "e2e_latency_s",
    "ttft_s",
    "queue_wait_s",
    "scheduler_family",
    "priority_score",
)
#: Fields this runtime adds at every level.
EXTRA_FIELDS = ("finish_reason", "cached_prompt_tokens", "preemptions", "engine_request_id", "energy_j", "model",
                "tags", "tenant")
#: Fields only the full level writes.
FULL_FIELDS = ("prompt_text", "output_text")

#: What each field holds: docs/tracing.md is generated from this (scripts/gen_docs.py), and a unit test
#: checks it names exactly the fields :func:`build_record` writes. Timestamps are Unix seconds.
FIELD_MEANINGS: dict[str, str] = {
    "request_id": "The `id` the client received (`chatcmpl-…`, `cmpl-…`, `resp_…`, or built from an "
    "`X-Request-Id` header), without the engine's internal suffix. With `n > 1` every sample has its own record "
    "with the same `request_id`; `/v1/completions` with several prompts writes one record per prompt, and a "
    "Responses API request one per engine turn.",
    "t_arrival": "When the API server received the request (vLLM's arrival stamp, taken as the request is "
    "rendered).",
    "t_completion": "When the engine finished the request (last token, or the abort).",
    "prompt_tokens": "Prompt length in the engine's tokens, chat template included.",
    "output_tokens": "Tokens generated, reasoning included.",
    "e2e_latency_s": "`t_completion - t_arrival`, in seconds.",
    "ttft_s": "Measured time from arrival to the first output token leaving the model step, for streaming and "
    "non-streaming requests alike; `null` only when no token was produced (e.g. aborted while queued).",
    "queue_wait_s": "Arrival to first admission into the running batch (includes the few milliseconds between "
    "the API server and the engine); a request aborted before admission waited its whole life.",
    "scheduler_family": "The recipe's scheduler family (`fcfs` in the full override mode).",
    "priority_score": "The family's score for the request when it was first admitted (higher is served "
    "sooner); `null` for families that keep vLLM's order (`fcfs`, `trace`).",
    "finish_reason": "`length` (max_tokens or context), `stop` (end-of-sequence or a stop token), `abort` (the "
    "API server ended it: client gone, or a stop string matched, since stop strings are applied in the API "
    "server), `error` or `repetition`.",
    "cached_prompt_tokens": "Prompt tokens served from the prefix cache at admission (`null` if never admitted).",
    "preemptions": "How often the engine preempted the request.",
    "engine_request_id": "The engine's own id for the request (`<request_id>-<8 hex>`, prefixed `<i>_` for "
    "sample `i` of `n > 1`), as vLLM's log shows it.",
    "energy_j": "GPU energy attributed to the request, in joules: `null` without NVML (CPU hosts, no "
    "`--gpus`), `0.0` for a request that never ran.",
    "model": "The model name the client asked for (the request body's `model` as sent: a served model name or a "
    "LoRA adapter's); `null` when the request named none (vLLM then serves its first served model name).",
    "tags": "The request's tags, an object of string names to string values: the OpenAI `metadata` field as sent "
    "(at most 16 pairs, names up to 64 characters, values up to 512; a request past that is refused with a 400), "
    "and the `X-CF-Task` header as `task`, which wins over a `task` in `metadata`. `{}` when the request has none. "
    "Every record of one request (each sample of `n > 1`, each prompt of `/v1/completions`) has the same tags.",
    "tenant": "The tenant the request was served for: the name of its API key in the keys file (`CF_API_KEYS_FILE`), "
    "never the key itself (printable, at most 64 characters); `null` for a request that came without a named key. "
    "`trace summarize --by tenant` and the `/metrics` series count `null`, and an absent field (records written "
    "before the field existed), as the default tenant `default`. Every record of one request has the same tenant.",
    "prompt_text": "The prompt exactly as the engine served it, chat template and special tokens included.",
    "output_text": "The generated text, decoded as the API decodes it (special tokens skipped unless the "
    "request asked otherwise).",
}

#: Finish reasons as written in the record.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


@dataclass(slots=True)
class Completion:
    """One completed request as the engine saw it. Timestamps are Unix seconds."""

    engine_request_id: str
    t_arrival: float
    t_scheduled: float | None  # first admission into the running batch; None if never admitted
    t_first_token: float | None  # first output token produced; None if none was
    t_completion: float
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    cached_prompt_tokens: int | None = None
    preemptions: int = 0
    priority_score: float | None = None
    # Full level only: the token ids to decode off the engine loop.
    prompt_token_ids: Sequence[int] | None = None
    output_token_ids: Sequence[int] | None = None
    skip_special_tokens: bool = True
    #: GPU joules attributed to the request (filled off the engine loop; None without NVML).
    energy_j: float | None = None
    #: What the request carried in ``SamplingParams.extra_args`` under the reserved keys, as it was
    #: (checked and parsed off the engine loop, by :func:`build_record`).
    tags_arg: Any = None
    model_arg: Any = None
    tenant_arg: Any = None


class Decoder(Protocol):
    def __call__(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str: ...


_ENGINE_SUFFIX = re.compile(r"-[0-9a-f]{8}\Z")
_SAMPLE_INDEX = re.compile(r"\A\d+_(?=(?:chatcmpl|cmpl)-)")
_PROMPT_INDEX = re.compile(r"\A(cmpl-.*)-\d+\Z", re.S)
_RESPONSES_TURN = re.compile(r"\A(resp_.*)_\d+\Z", re.S)


def client_request_id(engine_request_id: str) -> str:
    """The ``id`` the client received, from the id the engine uses for the same request.

    The API server turns the client's id into ``<id>-<8 hex>``; with ``n > 1`` each sample is
    ``<index>_<id>-<8 hex>``; ``/v1/completions`` adds ``-<prompt index>`` before the suffix; the
    Responses API adds ``_<turn>`` (one engine request per turn of its built-in tool loop).
    """
    rid = _ENGINE_SUFFIX.sub("", engine_request_id, count=1)
    rid = _SAMPLE_INDEX.sub("", rid, count=1)
    match = _PROMPT_INDEX.match(rid) or _RESPONSES_TURN.match(rid)
    return match.group(1) if match else rid


def _seconds(value: float) -> float:
    return round(value, 6)


def build_record(
    done: Completion, family: str, level: str, decode: Decoder | None = None
) -> dict[str, Any]:
    """The JSON-ready record for ``done`` at ``level`` (``standard`` or ``full``).

    ``e2e_latency_s`` is ``t_completion - t_arrival``; ``queue_wait_s`` runs from arrival to
    first admission (to completion for a request never admitted); ``ttft_s`` from arrival to the
    first output token (``None`` when no token was produced). Durations are clamped at zero
    against clock steps between the API server and the engine.
    """
    t_arrival = done.t_arrival
    t_completion = max(done.t_completion, t_arrival)
    e2e = t_completion - t_arrival
    scheduled = done.t_scheduled if done.t_scheduled is not None else t_completion
    queue_wait = min(max(scheduled - t_arrival, 0.0), e2e)
    ttft: float | None = None
    if done.t_first_token is not None:
        ttft = min(max(done.t_first_token - t_arrival, queue_wait), e2e)
    record: dict[str, Any] = {
        "request_id": client_request_id(done.engine_request_id),
        "t_arrival": t_arrival,
        "t_completion": t_completion,
        "prompt_tokens": done.prompt_tokens,
        "output_tokens": done.output_tokens,
        "e2e_latency_s": _seconds(e2e),
        "ttft_s": None if ttft is None else _seconds(ttft),
        "queue_wait_s": _seconds(queue_wait),
        "scheduler_family": family,
        "priority_score": done.priority_score,
        "finish_reason": done.finish_reason,
        "cached_prompt_tokens": done.cached_prompt_tokens,
        "preemptions": done.preemptions,
        "engine_request_id": done.engine_request_id,
        "energy_j": done.energy_j,
        "model": model_from_arg(done.model_arg),
        "tags": tags_from_arg(done.tags_arg),
        "tenant": tenant_from_arg(done.tenant_arg),
    }
    if level == LEVEL_FULL:
        prompt_text: str | None = None
        output_text: str | None = None
        if decode is not None:
            if done.prompt_token_ids is not None:
                prompt_text = decode(list(done.prompt_token_ids), False)
            if done.output_token_ids is not None:
                # The API's incremental detokenizer holds back an incomplete UTF-8 sequence at the
                # end of a generation; drop its replacement characters so the text matches the API.
                output_text = decode(list(done.output_token_ids), done.skip_special_tokens).rstrip("\ufffd")
        record["prompt_text"] = prompt_text
        record["output_text"] = output_text
    return record
