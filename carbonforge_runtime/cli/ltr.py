"""``carbonforge-runtime ltr fit|eval``: the command line of :mod:`carbonforge_runtime.offline.ltr_fit`.
Imports nothing heavy until a command runs."""

from __future__ import annotations

from pathlib import Path

import typer

from carbonforge_runtime.cli.errors import run_guarded
from carbonforge_runtime.errors import UsageError

ltr_app = typer.Typer(help="Fit and check the learned ranker of the ltr and hybrid scheduler families.",
                      no_args_is_help=True)


_guarded = run_guarded


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
        from carbonforge_runtime.core.ordering.ltr import LtrParams
        from carbonforge_runtime.offline.ltr_fit import fit_report, load_tokenize, read_examples

        if not 0.0 <= holdout < 1.0:
            raise UsageError(f"--holdout {holdout} is outside [0, 1)", "pass a fraction like 0.2 (or 0 to use all)")
        params = LtrParams.from_mapping({"prior_weight": prior_weight, "ridge": ridge}, where="ltr fit")
        examples = read_examples(trace, load_tokenize(tokenizer) if tokenizer else None)
        model, report = fit_report(examples, holdout, params)
        try:
            model.save(output)
        except OSError as exc:
            raise UsageError(f"cannot write the model to {output} ({exc.strerror})",
                             "pass --output with a path in a writable directory") from None
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
        from carbonforge_runtime.core.ordering.ltr import LtrModel, evaluate
        from carbonforge_runtime.offline.ltr_fit import load_tokenize, read_examples

        model = LtrModel.load(model_path)
        examples = read_examples(trace, load_tokenize(tokenizer) if tokenizer else None)
        tau = evaluate(model, examples, learn=online)
        typer.echo(f"Kendall tau over {len(examples)} requests: {tau:.3f}")

    _guarded(run)
