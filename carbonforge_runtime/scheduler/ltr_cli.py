"""``carbonforge-runtime ltr fit|eval``: fit the ranker of the ``ltr``/``hybrid`` families from a trace.

A full-level trace has each request's rendered ``prompt_text`` but not its token ids. The key
the ranker learns per is the engine's hash of the first prompt tokens, so the text is tokenized
again with the served model's tokenizer (``--tokenizer MODEL_DIR``) and hashed the same way the
engine does (:func:`carbonforge_runtime.scheduler.ltr.prefix_hash`). Records that already carry a
``prefix_hash`` field use it as is. Imports nothing heavy until a command runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import typer

from carbonforge_runtime.cli_errors import run_guarded
from carbonforge_runtime.errors import UsageError

ltr_app = typer.Typer(help="Fit and check the learned ranker of the ltr and hybrid scheduler families.",
                      no_args_is_help=True)


_guarded = run_guarded


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
    from carbonforge_runtime.scheduler.ltr import Example, prefix_hash

    if not trace.is_file():
        raise UsageError(f"trace {trace} does not exist", "pass the path of a full-level JSONL trace")
    rows: list[tuple[float, Any]] = []
    with trace.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                arrival = float(record.get("t_arrival", number))
                prompt = int(record["prompt_tokens"])
                output = int(record["output_tokens"])
            except (ValueError, KeyError, TypeError, AttributeError):
                raise UsageError(f"{trace}:{number}: not a trace record with prompt_tokens and output_tokens",
                                 "fit on a trace written by --request-trace full") from None
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
    from carbonforge_runtime.scheduler.ltr import evaluate, fit, kendall_tau_b

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


@ltr_app.command("fit")
def fit_command(
    trace: Path = typer.Argument(..., help="A full-level JSONL trace (--request-trace full)."),
    output: Path = typer.Option(..., "--output", "-o", help="Where to write the model (JSON)."),
    tokenizer: str | None = typer.Option(None, "--tokenizer",
                                         help="Directory of the served model (tokenizes prompt_text as the engine)."),
    holdout: float = typer.Option(0.2, "--holdout", help="Fraction (latest arrivals) held out to report Kendall tau."),
    prior_weight: float = typer.Option(4.0, "--prior-weight",
                                       help="Pseudo-observations shrinking each key to the global mean."),
    ridge: float = typer.Option(2.0, "--ridge", help="Pull of each per-key slope towards 0."),
) -> None:
    """Fit the ranker on a trace and report its Kendall tau on held-out requests."""

    def run() -> None:
        from carbonforge_runtime.scheduler.ltr import LtrParams

        if not 0.0 <= holdout < 1.0:
            raise UsageError(f"--holdout {holdout} is outside [0, 1)", "pass a fraction like 0.2 (or 0 to use all)")
        params = LtrParams.from_mapping({"prior_weight": prior_weight, "ridge": ridge}, where="ltr fit")
        examples = read_examples(trace, load_tokenize(tokenizer) if tokenizer else None)
        model, report = fit_report(examples, holdout, params)
        model.save(output)
        typer.echo(f"fitted on {int(report['train'])} requests, {int(report['keys'])} prefix keys; model: {output}")
        if "tau_held_out" in report:
            typer.echo(f"Kendall tau on {int(report['held_out'])} held-out requests: {report['tau_held_out']:.3f} "
                       f"(prompt length alone: {report['tau_prompt_tokens_held_out']:.3f})")

    _guarded(run)


@ltr_app.command("eval")
def eval_command(
    model_path: Path = typer.Argument(..., metavar="MODEL", help="A model written by `ltr fit`."),
    trace: Path = typer.Argument(..., help="A full-level JSONL trace."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="Directory of the served model."),
    online: bool = typer.Option(False, "--online", help="Keep learning while evaluating, as the engine does."),
) -> None:
    """Kendall tau between the model's predicted and the actual output lengths of a trace."""

    def run() -> None:
        from carbonforge_runtime.scheduler.ltr import LtrModel, evaluate

        model = LtrModel.load(model_path)
        examples = read_examples(trace, load_tokenize(tokenizer) if tokenizer else None)
        tau = evaluate(model, examples, learn=online)
        typer.echo(f"Kendall tau over {len(examples)} requests: {tau:.3f}")

    _guarded(run)
