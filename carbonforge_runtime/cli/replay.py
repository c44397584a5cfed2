"""``carbonforge-runtime replay TRACE --base-url URL``. Imports nothing heavy until it runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from carbonforge_runtime.cli.errors import run_guarded


def _parse_token_ids(text: str) -> tuple[int, int]:
    from carbonforge_runtime.offline.replay.trace import ReplayError

    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise ReplayError(f"token id range {text!r} is not LOW:HIGH",
                          "pass --token-ids like 100:4000 (ids the served model's vocabulary has)") from None


def replay_command(
    trace: Path = typer.Argument(..., help="A JSONL trace (standard or full level) or an Azure-format CSV."),
    base_url: str = typer.Option(..., "--base-url", help="The OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1."),
    model: str | None = typer.Option(None, "--model",
                                     help="Model name to request (default: the first the server lists)."),
    api_key: str = typer.Option("unused", "--api-key", envvar="OPENAI_API_KEY", show_envvar=False,
                                help="Bearer token, if the endpoint wants one."),
    rate: float = typer.Option(1.0, "--rate",
                               help="Speed factor on the recorded inter-arrival times (2 = twice as fast)."),
    token_scale: float = typer.Option(1.0, "--token-scale",
                                      help="Multiply prompt and output sizes (e.g. 0.25 for a small model)."),
    start: int = typer.Option(0, "--start", help="Skip this many requests of the recording."),
    limit: int | None = typer.Option(None, "--limit", help="Replay at most this many requests."),
    max_prompt_tokens: int | None = typer.Option(None, "--max-prompt-tokens", help="Cap each prompt (after scaling)."),
    max_output_tokens: int | None = typer.Option(None, "--max-output-tokens", help="Cap each output (after scaling)."),
    prompt_format: str = typer.Option("auto", "--prompt-format",
                                      help="auto: recorded text at full level, else token ids; ids; text "
                                      "(plain words)."),
    token_ids: str = typer.Option("100:4000", "--token-ids",
                                  help="Range LOW:HIGH of the token ids generated prompts use."),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated prompts."),
    concurrency: int = typer.Option(256, "--concurrency", help="Most requests in flight at once."),
    deadline_s: float = typer.Option(3600.0, "--deadline-s", help="Stop everything after this many seconds."),
    request_timeout_s: float = typer.Option(600.0, "--request-timeout-s",
                                            help="Give up on one request after this long."),
    output: Path = typer.Option(Path("replay-result.json"), "--output", "-o", help="Where to write the JSON result."),
    send_true_length: bool = typer.Option(False, "--send-true-length",
                                          help="Benchmarks only: tell the server each request's true output length "
                                          "(for the oracle scheduler family)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
) -> None:
    """Replay recorded traffic against an OpenAI-compatible endpoint and write latencies as JSON."""
    code = run_guarded(lambda: _run(trace, base_url, model, api_key, rate, token_scale, start, limit,
                                    max_prompt_tokens, max_output_tokens, prompt_format, token_ids, seed,
                                    concurrency, deadline_s, request_timeout_s, output, send_true_length, quiet))
    raise typer.Exit(code)


def _run(trace: Path, base_url: str, model: str | None, api_key: str, rate: float, token_scale: float, start: int,
         limit: int | None, max_prompt_tokens: int | None, max_output_tokens: int | None, prompt_format: str,
         token_ids: str, seed: int, concurrency: int, deadline_s: float, request_timeout_s: float, output: Path,
         send_true_length: bool, quiet: bool) -> int:
    import asyncio

    from carbonforge_runtime.core.figure_labels import EMULATED, MEASURED
    from carbonforge_runtime.files import write_text_atomic
    from carbonforge_runtime.offline.replay.aggregate import format_table
    from carbonforge_runtime.offline.replay.plan import PlanOptions, build_plan
    from carbonforge_runtime.offline.replay.runner import RunOptions, run_replay
    from carbonforge_runtime.offline.replay.trace import ReplayError, load_recording

    low, high = _parse_token_ids(token_ids)
    plan_options = PlanOptions(rate=rate, token_scale=token_scale, start=start, limit=limit,
                               max_prompt_tokens=max_prompt_tokens, max_output_tokens=max_output_tokens,
                               prompt_format=prompt_format, token_id_low=low, token_id_high=high, seed=seed)
    run_options = RunOptions(base_url=base_url.rstrip("/"), model=model, api_key=api_key, concurrency=concurrency,
                             deadline_s=deadline_s, request_timeout_s=request_timeout_s,
                             send_true_length=send_true_length)
    plan_options.validate()
    run_options.validate()
    if output.exists() and output.is_dir():
        raise ReplayError(f"output {output} is a directory", "pass --output FILE.json")
    recording = load_recording(trace)
    plan = build_plan(recording, plan_options)

    def progress(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    progress(f"replay: {len(plan)} requests from {trace} ({recording.kind}) over "
             f"{plan[-1].send_at_s:.1f} s against {run_options.base_url}")
    result = asyncio.run(run_replay(plan, run_options, progress))
    summary = result.summary()
    label = {"kind": f"{MEASURED} or {EMULATED}",
             "text": f"{MEASURED} by this client against {run_options.base_url} (the serving host is not recorded "
                     f"here; a server run with serve --emulate gives {EMULATED} figures, its /metrics counts the "
                     "late steps)"}
    document: dict[str, Any] = {
        "trace": str(trace),
        "trace_kind": recording.kind,
        "base_url": run_options.base_url,
        "model": result.model,
        "started_at": result.started_at,
        "options": {"rate": rate, "token_scale": token_scale, "start": start, "limit": limit,
                    "max_prompt_tokens": max_prompt_tokens, "max_output_tokens": max_output_tokens,
                    "prompt_format": prompt_format, "seed": seed, "concurrency": concurrency,
                    "deadline_s": deadline_s, "send_true_length": send_true_length},
        "summary": summary,
        "label": label,
        "requests": [o.to_json() for o in result.outcomes],
    }
    print(f"figures: {label['text']}")
    print(format_table(summary))  # before the file: a write that fails still shows the run's figures
    try:
        write_text_atomic(output, json.dumps(document, indent=1) + "\n")
    except OSError as exc:
        raise ReplayError(f"cannot write the result to {output} ({exc.strerror or exc})",
                          "pass --output with a path in a writable directory") from None
    print(f"result: {output}")
    return 0 if summary["failed"] == 0 else 1
