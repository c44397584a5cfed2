"""From a recording to a send schedule: which prompt, how many output tokens, when. Pure.

* Inter-arrival times are the recorded ones divided by ``rate`` (2.0 sends twice as fast).
* ``token_scale`` multiplies every prompt and output size (at least 1 token each), so traces
  recorded on large models fit a small test model; ``max_*_tokens`` then cap them.
* Prompts: a full-level trace replays its recorded prompt text (cut to the same fraction of
  its characters when scaled down); otherwise a prompt of the recorded size is generated, as
  token ids (exact size; vLLM accepts them on /v1/completions) or as plain words (for servers
  that take text only; the size is then approximate).

A plan holds sizes, never generated prompts: a prompt is made when its request is sent
(:attr:`PlannedRequest.prompt`), so memory does not grow with the recorded token counts. Sizes
stay within :data:`~carbonforge_runtime.offline.replay.trace.MAX_REQUEST_TOKENS` whatever the scale.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from carbonforge_runtime.offline.replay.trace import MAX_REQUEST_TOKENS, RecordedRequest, Recording, ReplayError

PROMPT_FORMATS = ("auto", "ids", "text")

_WORDS_TEXT = (
    "the of and to in is that for it as with was on be by this are or from at an have not which but all "
    "can were one their has more if will when there been so would about what out up into only other some "
    "time could them these two may first then do any like my now over such our man me even most made "
    "after also did many before must through back years where much your way well down should because each "
    "just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three"
)
_WORDS = tuple(_WORDS_TEXT.split())


@dataclass(frozen=True)
class PlanOptions:
    rate: float = 1.0
    token_scale: float = 1.0
    start: int = 0
    limit: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    prompt_format: str = "auto"
    token_id_low: int = 100
    token_id_high: int = 4000
    seed: int = 0

    def validate(self) -> None:
        if not math.isfinite(self.rate) or self.rate <= 0:
            raise ReplayError(f"rate {self.rate} must be a positive number",
                              "pass --rate 1 to keep the recorded pace, 2 for twice as fast, 0.5 for half")
        if not math.isfinite(self.token_scale) or self.token_scale <= 0:
            raise ReplayError(f"token scale {self.token_scale} must be a positive number",
                              "pass --token-scale 1 to keep the recorded sizes, 0.25 for a quarter")
        if self.start < 0:
            raise ReplayError(f"start {self.start} is negative", "pass --start 0 or a later request index")
        if self.limit is not None and self.limit < 1:
            raise ReplayError(f"limit {self.limit} must be at least 1", "pass --limit N with N >= 1, or omit it")
        for name, value in (("max prompt tokens", self.max_prompt_tokens),
                            ("max output tokens", self.max_output_tokens)):
            if value is not None and value < 1:
                raise ReplayError(f"{name} {value} must be at least 1", "pass a positive cap or omit it")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ReplayError(f"prompt format {self.prompt_format!r} is not one of {', '.join(PROMPT_FORMATS)}",
                              "pass --prompt-format auto, ids or text")
        if not 0 <= self.token_id_low < self.token_id_high:
            raise ReplayError(f"token id range {self.token_id_low}:{self.token_id_high} is empty or negative",
                              "pass --token-ids LOW:HIGH with 0 <= LOW < HIGH (ids the model's vocabulary has)")


@dataclass(frozen=True)
class PlannedRequest:
    index: int  # the recording's index
    send_at_s: float  # seconds after the replay starts
    prompt_tokens: int  # intended prompt size (exact for ids, recorded for texts, approximate for words)
    output_tokens: int  # forced with max_tokens + ignore_eos
    template: str | None = None
    #: How :attr:`prompt` is made: "recorded" (``recorded_text``), "ids" or "text" (generated when sent).
    prompt_format: str = "ids"
    recorded_text: str | None = field(default=None, repr=False)
    seed: int = 0
    token_id_low: int = 100
    token_id_high: int = 4000

    @property
    def prompt(self) -> str | list[int]:
        """The prompt to send, made on each call (deterministic): a plan keeps only its size."""
        if self.prompt_format == "recorded":
            assert self.recorded_text is not None
            return self.recorded_text
        if self.prompt_format == "ids":
            return token_id_prompt(self.index, self.prompt_tokens, self.seed, self.token_id_low, self.token_id_high)
        return word_prompt(self.index, self.prompt_tokens, self.seed)


def scaled(value: int, scale: float, cap: int | None) -> int:
    """``value`` times ``scale``, at least 1, at most ``cap`` and :data:`MAX_REQUEST_TOKENS`."""
    out = max(1, round(min(value * scale, MAX_REQUEST_TOKENS)))
    return min(out, cap) if cap is not None else out


def token_id_prompt(index: int, size: int, seed: int, low: int, high: int) -> list[int]:
    """A deterministic prompt of ``size`` token ids; different requests start differently."""
    rng = random.Random(seed * 1_000_003 + index)
    return [rng.randrange(low, high) for _ in range(size)]


def word_prompt(index: int, size: int, seed: int) -> str:
    rng = random.Random(seed * 1_000_003 + index)
    return " ".join(rng.choice(_WORDS) for _ in range(size))


def _cut_text(text: str, scale: float) -> str:
    if scale >= 1.0:
        return text
    return text[: max(1, math.ceil(len(text) * scale))]


def build_plan(recording: Recording, options: PlanOptions) -> list[PlannedRequest]:
    options.validate()
    window: tuple[RecordedRequest, ...] = recording.requests[options.start:]
    if options.limit is not None:
        window = window[: options.limit]
    if not window:
        raise ReplayError(
            f"{recording.path}: no request left after skipping {options.start} of {len(recording.requests)}",
            "pass a smaller --start",
        )
    fmt = options.prompt_format
    if fmt == "auto":
        fmt = "recorded" if recording.has_text else "ids"
    elif recording.has_text:
        fmt = "recorded"
    first = window[0].arrival_s
    span_s = (window[-1].arrival_s - first) / options.rate
    if not math.isfinite(span_s):
        raise ReplayError(
            f"{recording.path}: the recording spans {window[-1].arrival_s - first:.3g} s, which at --rate "
            f"{options.rate:g} is no schedule",
            "check the recording's time stamps (seconds), or pass --start/--limit to replay a part of it",
        )
    planned: list[PlannedRequest] = []
    for req in window:
        output = scaled(req.output_tokens, options.token_scale, options.max_output_tokens)
        prompt_size = scaled(req.prompt_tokens, options.token_scale, options.max_prompt_tokens)
        text: str | None = None
        if fmt == "recorded":
            assert req.prompt_text is not None
            scale = min(options.token_scale, prompt_size / req.prompt_tokens)
            text = _cut_text(req.prompt_text, scale)
        planned.append(PlannedRequest(req.index, (req.arrival_s - first) / options.rate, prompt_size, output,
                                      req.template, fmt, text, options.seed, options.token_id_low,
                                      options.token_id_high))
    return planned
