"""Fitting the ranker of the ``ltr``/``hybrid`` families offline, from a trace (``ltr fit|eval``).

A full-level trace has each request's rendered ``prompt_text`` but not its token ids. The key
the ranker learns per is the engine's hash of the first prompt tokens, so the text is tokenized
again with the served model's tokenizer and hashed the same way the engine does
(:func:`carbonforge_runtime.core.ordering.ltr.prefix_hash`). Records that already carry a
``prefix_hash`` field use it as is. The trace is read by the offline tools' one reader.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from carbonforge_runtime.core.ordering.ltr import Example, evaluate, fit, kendall_tau_b, prefix_hash
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.offline.trace_reader import MAX_REQUEST_TOKENS, numbered_records


def load_tokenize(model_dir: str) -> Callable[[str], list[int]]:
    """Token ids of a rendered prompt, as the served model's tokenizer makes them."""
    path = Path(model_dir).expanduser()
    fast = path / "tokenizer.json"
    if fast.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UsageError("tokenizing prompt_text needs the 'tokenizers' package",
                             "install the serving engine (it brings tokenizers) or pip install tokenizers") from None

        tokenizer = Tokenizer.from_file(str(fast))
        return lambda text: list(tokenizer.encode(text, add_special_tokens=False).ids)
    try:
        from transformers import AutoTokenizer

        auto = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # missing directory, no tokenizer files, no network for a hub name
        raise UsageError(f"cannot load a tokenizer from {model_dir} ({exc.__class__.__name__})",
                         "pass --tokenizer with the directory of the served model (it has tokenizer.json)") from None
    return lambda text: list(auto.encode(text, add_special_tokens=False))


def read_examples(trace: Path, tokenize: Callable[[str], list[int]] | None) -> list[Any]:
    """The trace's completed requests as ranker examples, in arrival order."""

    rows: list[tuple[float, Any]] = []
    for number, record in numbered_records(trace):
        try:
            arrival = float(record.get("t_arrival", number))
            prompt = int(record["prompt_tokens"])
            output = int(record["output_tokens"])
        except (ValueError, KeyError, TypeError, OverflowError):
            raise UsageError(f"{trace}:{number}: not a trace record with prompt_tokens and output_tokens",
                             "fit on a trace written by --request-trace full") from None
        if not math.isfinite(arrival):
            raise UsageError(f"{trace}:{number}: t_arrival is not a finite number of seconds",
                             "fix or drop that line")
        for name, count in (("prompt_tokens", prompt), ("output_tokens", output)):
            if not 0 <= count <= MAX_REQUEST_TOKENS:
                shown = str(count) if len(str(count)) <= 20 else f"{str(count)[:17]}..."
                raise UsageError(f"{trace}:{number}: {name}={shown} is outside 0..{MAX_REQUEST_TOKENS:,}",
                                 "fix or drop that line")
        if record.get("finish_reason") in ("abort", "error"):
            continue  # an aborted request's length says nothing about its natural length
        key = record.get("prefix_hash")
        if not isinstance(key, int) or isinstance(key, bool):
            text = record.get("prompt_text")
            if not isinstance(text, str):
                raise UsageError(
                    f"{trace}:{number}: the record has no prompt_text (a standard-level trace?)",
                    "capture a full-level trace (--request-trace full) to fit the ranker",
                )
            if tokenize is None:
                raise UsageError("the trace has prompt text but no prefix_hash: the text must be tokenized",
                                 "pass --tokenizer with the served model's directory")
            key = prefix_hash(tokenize(text))
        rows.append((arrival, Example(key, prompt, output)))
    if not rows:
        raise UsageError(f"trace {trace} has no completed requests", "fit on a trace with requests in it")
    rows.sort(key=lambda row: row[0])
    return [example for _, example in rows]


def fit_report(examples: Sequence[Any], holdout: float, params: Any) -> tuple[Any, dict[str, float]]:
    """Fit on the first part, measure Kendall tau on the held-out rest, then learn that too."""
    n_test = round(len(examples) * holdout)
    train, test = examples[: len(examples) - n_test], examples[len(examples) - n_test:]
    model = fit(train, params)
    report: dict[str, float] = {"train": float(len(train)), "held_out": float(len(test))}
    if test:
        report["tau_held_out"] = evaluate(model, test, learn=False)
        report["tau_prompt_tokens_held_out"] = kendall_tau_b([e.prompt_tokens for e in test],
                                                             [e.output_tokens for e in test])
        for example in test:
            model.observe(example.prefix_hash, example.prompt_tokens, example.output_tokens)
    report["keys"] = float(len(model.keys))
    return model, report
