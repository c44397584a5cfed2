"""Synthetic workloads for the ordering benchmark and tests, written as trace-shaped JSONL.

* :func:`templated` -- a few applications, each with its own system prompt (a shared prefix)
  and its own output-length distribution, arriving as a Poisson stream. Written at the full
  level (rendered ``prompt_text``), so ``ltr fit`` can learn from it and a replay sends the
  very same text (and so the same shared prefixes).
* :func:`prefill_heavy` -- the arrival pattern of a recording with long prompts and short
  outputs (code-completion-like traffic), at the standard level.
* :func:`window` -- a slice of a recording (e.g. the Azure conversation trace), re-timed.

Generation is deterministic given the seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from carbonforge_runtime.offline.replay.trace import Recording

TokenCounter = Callable[[str], int]

#: The chat markup of the built-in tiny model (and of Qwen models).
CHAT_TEMPLATE = "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"

_VOCAB_TEXT = (
    "account address answer api apply archive batch billing branch buffer build cache change check client "
    "cluster code commit config context contract customer dashboard data debug deploy detail device error "
    "event export feature field file filter format function gateway graph handler header history host "
    "index input invoice issue item job key label layer limit line list log merge message metric model "
    "module node order output owner package page parameter patch path payment plan policy port price "
    "process profile project query queue quota record region release report request resource result "
    "review role route rule schema scope script search secret server service session setting shard signal "
    "source stage state status step storage stream subscription summary support table task team template "
    "tenant test thread ticket token topic trace update usage user value version volume warning window "
    "worker zone"
)
_VOCAB = tuple(_VOCAB_TEXT.split())


@dataclass(frozen=True)
class Template:
    """One application: its system prompt, user-message size and output-length law."""

    name: str
    system_words: int  # length of its system prompt (the shared prefix)
    user_words_median: int
    user_words_sigma: float
    output_median: float  # median output tokens (or, with output_per_user_word, the multiplier's base)
    output_sigma: float  # log-normal spread of the output length
    output_per_user_word: float = 0.0  # > 0: output scales with the user message (summaries, translations)
    weight: float = 1.0  # share of the traffic


#: Six applications whose output lengths differ, two of them growing with their input.
DEFAULT_TEMPLATES: tuple[Template, ...] = (
    Template("classify", 120, 40, 0.5, 4, 0.3, weight=1.5),
    Template("extract-json", 160, 80, 0.5, 24, 0.35),
    Template("support-qa", 220, 30, 0.6, 60, 0.45, weight=1.5),
    Template("summarize", 100, 160, 0.6, 0, 0.25, output_per_user_word=0.3),
    Template("translate", 80, 40, 0.7, 0, 0.2, output_per_user_word=1.1),
    Template("write-code", 260, 40, 0.5, 220, 0.4, weight=0.8),
)


def _system_prompt(template: Template) -> str:
    rng = random.Random(f"system:{template.name}")
    words = [rng.choice(_VOCAB) for _ in range(template.system_words)]
    return f"You are the {template.name} service. " + " ".join(words)


def _approx_tokens(text: str) -> int:
    return max(1, len(text.split()) + text.count("<|") * 2)


def templated(n: int, seed: int, rate: float, templates: Sequence[Template] = DEFAULT_TEMPLATES,
              count_tokens: TokenCounter | None = None, max_output_tokens: int = 1024,
              start_time: float = 1_700_000_000.0) -> list[dict[str, Any]]:
    """``n`` full-level records of templated traffic arriving as a Poisson stream of ``rate`` req/s.

    ``count_tokens`` gives the engine's token count of a rendered prompt (pass the served
    model's tokenizer); without it the count is estimated from the words.
    """
    if n < 1 or rate <= 0:
        raise ValueError("templated needs n >= 1 and rate > 0")
    count = count_tokens or _approx_tokens
    rng = random.Random(seed)
    systems = {t.name: _system_prompt(t) for t in templates}
    weights = [t.weight for t in templates]
    records: list[dict[str, Any]] = []
    now = start_time
    for _ in range(n):
        now += rng.expovariate(rate)
        template = rng.choices(list(templates), weights)[0]
        user_words = max(3, round(template.user_words_median * math.exp(rng.gauss(0.0, template.user_words_sigma))))
        user = " ".join(rng.choice(_VOCAB) for _ in range(user_words))
        if template.output_per_user_word > 0:
            median = template.output_per_user_word * user_words
        else:
            median = template.output_median
        output = round(median * math.exp(rng.gauss(0.0, template.output_sigma)))
        output = min(max(output, 1), max_output_tokens)
        text = CHAT_TEMPLATE.format(system=systems[template.name], user=user)
        records.append({
            "t_arrival": round(now, 6),
            "prompt_tokens": count(text),
            "output_tokens": output,
            "prompt_text": text,
            "template": template.name,
        })
    return records


def prefill_heavy(recording: Recording, prompt_factor: float = 2.0, output_divisor: float = 8.0,
                  max_prompt_tokens: int | None = None, start_time: float = 1_700_000_000.0,
                  ) -> list[dict[str, Any]]:
    """The recording's arrivals with prompts ``prompt_factor`` longer and outputs ``output_divisor`` shorter."""
    records = []
    for req in recording.requests:
        prompt = max(1, round(req.prompt_tokens * prompt_factor))
        if max_prompt_tokens is not None:
            prompt = min(prompt, max_prompt_tokens)
        records.append({
            "t_arrival": round(start_time + req.arrival_s, 6),
            "prompt_tokens": prompt,
            "output_tokens": max(1, round(req.output_tokens / output_divisor)),
        })
    return records


def window(recording: Recording, start: int, n: int, start_time: float = 1_700_000_000.0) -> list[dict[str, Any]]:
    """Requests ``start`` .. ``start + n`` of a recording as standard-level records."""
    chosen = recording.requests[start:start + n]
    if not chosen:
        raise ValueError(f"the recording has no request at index {start}")
    first = chosen[0].arrival_s
    return [{"t_arrival": round(start_time + r.arrival_s - first, 6), "prompt_tokens": r.prompt_tokens,
             "output_tokens": r.output_tokens} for r in chosen]


def tokenizer_counter(model_dir: str) -> TokenCounter:
    """Token counts as the served model's tokenizer (``tokenizer.json`` in ``model_dir``) makes them."""
    from pathlib import Path

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=True).ids)

    return count
