#!/usr/bin/env python3
"""Write the reference tables in docs/ (and README's list of subcommands) from the code, or check that
the committed ones are current.

    python scripts/gen_docs.py            # rewrite every generated table in docs/
    python scripts/gen_docs.py --check    # exit 1, naming each page and table that differs; writes nothing

A generated table sits between two marker comments in a page, e.g.

    <!-- BEGIN GENERATED: env-vars -->
    ...
    <!-- END GENERATED: env-vars -->

Everything outside the markers is written by hand and left alone. Every table is built at run time
from the code (the typer app, ``settings.VARIABLES``, ``exposition.METRICS``, the trace record's
field tables, the doctor's ``CHECKS``, the error classes, the shipped recipes and their predicted
benchmark blocks, the API's request contract, the ordering benchmark's committed result), never from
a list kept here. The output is deterministic: no timestamps, no machine-specific paths.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PACKAGE = "carbonforge_runtime"
DOCS_DIR = REPO / "docs"
PROG = "carbonforge-runtime"

BEGIN = "<!-- BEGIN GENERATED: {} -->"
END = "<!-- END GENERATED: {} -->"
_MARKER = re.compile(r"<!-- (BEGIN|END) GENERATED: ([A-Za-z0-9_.-]+) -->")


class GenerationError(Exception):
    """The code is inconsistent in a way that makes a table impossible to generate."""


# --- Markdown helpers ---------------------------------------------------------------------------


def _cell(text: object) -> str:
    """One table cell: a single line, with ``|`` escaped."""
    return re.sub(r"\s+", " ", str(text)).strip().replace("|", "\\|")


def _code(text: object) -> str:
    text = str(text)
    if not text:
        return ""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _rst_to_md(text: str) -> str:
    """Docstrings use reST ``literals``; the docs use Markdown `literals`."""
    return re.sub(r"``(.+?)``", r"`\1`", text)


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(value) for value in row) + " |")
    return "\n".join(lines)


def _first_paragraph(text: str | None) -> str:
    if not text:
        return ""
    return re.split(r"\n\s*\n", inspect.cleandoc(text), maxsplit=1)[0]


def _first_sentence(text: str) -> str:
    paragraph = " ".join(_first_paragraph(text).split())
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    return match.group(1) if match else paragraph


# --- commands (the typer app) -------------------------------------------------------------------

_VALUE_KINDS = {"str": "text", "int": "integer", "float": "number", "Path": "path", "bool": "flag"}


def _typer_root() -> Any:
    import typer

    from carbonforge_runtime.cli.main import app

    return typer.main.get_command(app)


def _walk(command: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every command under ``command`` (itself first), children sorted by name."""
    found = [(path, command)]
    children = getattr(command, "commands", None) or {}
    for name in sorted(children):
        child = children[name]
        if not getattr(child, "hidden", False):
            found.extend(_walk(child, (*path, name)))
    return found


def _value_kind(param: Any) -> str:
    if getattr(param, "is_flag", False):
        return "flag"
    bare = param.bare_type() if hasattr(param, "bare_type") else getattr(getattr(param, "type", None), "name", "")
    list_of = re.fullmatch(r"list\[(.+)\]", str(bare))
    if list_of:
        return _VALUE_KINDS.get(list_of.group(1), list_of.group(1)) + ", one or more"
    return _VALUE_KINDS.get(str(bare), str(bare))


def _param_name(param: Any) -> str:
    if param.param_type_name == "argument":
        name = (param.metavar or param.name).upper()
        return _code(name + ("..." if param.nargs == -1 else ""))
    return ", ".join(_code(opt) for opt in [*param.opts, *param.secondary_opts])


def _param_default(param: Any) -> str:
    if param.required:
        return "required"
    default = param.default
    if getattr(param, "is_flag", False):
        return "on" if default else "off"
    if default is None or default == ():
        return ""
    return _code(default)


def _param_rows(command: Any) -> list[tuple[str, str, str, str]]:
    return [(_param_name(p), _value_kind(p), _param_default(p), _rst_to_md(getattr(p, "help", None) or ""))
            for p in command.params if not getattr(p, "hidden", False)]


def _command_help(command: Any) -> str:
    text = inspect.cleandoc(command.help or "")
    parts = [" ".join(paragraph.split()) for paragraph in re.split(r"\n\s*\n", text) if paragraph.strip()]
    if getattr(command, "epilog", None):
        parts.append(" ".join(command.epilog.split()))
    return " ".join(parts)


def commands_table() -> str:
    """A summary of every command, then each command's arguments and options."""
    commands = _walk(_typer_root())
    out = [_table(["Command", "What it does"],
                  ((_code(" ".join((PROG, *path))), _first_paragraph(cmd.help)) for path, cmd in commands))]
    header = ["Argument or option", "Takes", "Default", "Meaning"]
    for path, cmd in commands:
        if getattr(cmd, "commands", None) and not cmd.params:
            continue  # a group without options of its own: its commands follow
        out.append(f"### `{' '.join((PROG, *path))}`")
        out.append(_command_help(cmd))
        rows = _param_rows(cmd)
        out.append(_table(header, rows) if rows else "No arguments or options.")
    return "\n\n".join(out)


def subcommands_list() -> str:
    """README's table of the subcommands: each command that runs something, its arguments, what it does."""
    rows = []
    for path, cmd in _walk(_typer_root()):
        if not path or getattr(cmd, "commands", None):
            continue  # the root and the groups: their commands are listed
        arguments = [(p.metavar or p.name).upper() + ("..." if p.nargs == -1 else "")
                     for p in cmd.params if p.param_type_name == "argument"]
        rows.append((_code(" ".join((*path, *arguments))), _rst_to_md(_first_sentence(cmd.help or ""))))
    return _table(["Subcommand", "What it does"], rows)


def runtime_flags_table() -> str:
    """The serve options that make a container command line a runtime command line."""
    from carbonforge_runtime.cli.main import RUNTIME_FLAGS

    serve = _typer_root().commands.get("serve")
    if serve is None:
        raise GenerationError("the CLI has no serve command")
    by_flag = {opt: p for p in serve.params if p.param_type_name == "option" for opt in p.opts}
    unknown = [flag for flag in RUNTIME_FLAGS if flag not in by_flag]
    if unknown:
        raise GenerationError(f"RUNTIME_FLAGS names {', '.join(unknown)}, which serve does not take")
    missing = sorted(set(by_flag) - set(RUNTIME_FLAGS))
    if missing:
        raise GenerationError(f"serve takes {', '.join(missing)}, which RUNTIME_FLAGS does not list")
    rows = []
    for flag in RUNTIME_FLAGS:
        param = by_flag[flag]
        rows.append((_code(flag), _value_kind(param), _param_default(param), _rst_to_md(param.help or "")))
    return _table(["Flag", "Takes", "Default", "Meaning"], rows)


# --- environment variables ----------------------------------------------------------------------


def _env_default(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return _code("1" if value else "0")
    if isinstance(value, float) and value.is_integer():
        return _code(int(value))
    text = str(value)
    home = str(Path.home())
    if home not in ("", "/") and (text == home or text.startswith(home + "/")):
        text = "~" + text[len(home):]
    return _code(text)


def env_vars_table() -> str:
    from carbonforge_runtime.settings import VARIABLES

    rows = [(_code(var.name), _env_default(var.default), "yes" if var.departs_from_benchmark else "", var.doc)
            for var in VARIABLES]
    return _table(["Variable", "Default", "Departs from the benchmark", "Meaning"], rows)


# --- recipes ------------------------------------------------------------------------------------


def recipes_table() -> str:
    from carbonforge_runtime.recipes.loader import load_recipes, shipped_recipes_dir

    rows = []
    for key, recipe in sorted(load_recipes([shipped_recipes_dir()]).items()):
        model = recipe.model
        if model.builtin:
            shown = f"built-in `{model.builtin}`, generated locally"
        else:
            shown = _code(model.repo) + ("" if model.verified else " (unverified: nearest published)")
        drain = f"{recipe.drain_timeout_s:g} s"
        rows.append((_code(key), recipe.plan, shown, _code(recipe.scheduler.family), drain, recipe.description))
    return _table(["Context key", "Plan", "Model", "Scheduler family", "Drain time", "Description"], rows)


def _change(value: float, base: float) -> str:
    return f"{(value / base - 1.0) * 100:+.1f}%" if base else "n/a"


def recipes_predicted_table() -> str:
    """The shipped recipes' ``benchmark.predicted`` blocks (written by benchmarks/recipes_twin.py)."""
    from carbonforge_runtime.recipes.loader import load_recipes, shipped_recipes_dir

    rows = []
    for key, recipe in sorted(load_recipes([shipped_recipes_dir()]).items()):
        block = recipe.benchmark.get("predicted")
        if not block:
            why = ("none: no step-time model ships for the CPU engine" if recipe.key.hardware.is_cpu
                   else "none yet")
            rows.append((_code(key), why, "", _code(recipe.scheduler.family), "", "", "", ""))
            continue
        chosen, base, model = block["chosen"], block["baseline"], block["cost_model"]
        if chosen.get("family") != recipe.scheduler.family:
            raise GenerationError(f"{key}: benchmark.predicted is for family {chosen.get('family')!r}, the recipe "
                                  f"serves {recipe.scheduler.family!r}; run benchmarks/recipes_twin.py --write")
        trace = block["trace"]
        rows.append((
            _code(key),
            f"{trace['name']} ({trace['served']:,} requests) at {block['window']['load']:.0%}",
            f"{model['name']} v{model['version']}" + (" (proxy)" if model.get("proxy") else ""),
            _code(chosen["candidate"]),
            f"{chosen['e2e_mean_s']:.2f} ({_change(chosen['e2e_mean_s'], base['e2e_mean_s'])})",
            f"{chosen['e2e_p99_s']:.2f} ({_change(chosen['e2e_p99_s'], base['e2e_p99_s'])})",
            f"{chosen['ttft_mean_s']:.2f} ({_change(chosen['ttft_mean_s'], base['ttft_mean_s'])})",
            f"{chosen['throughput_rps']:.3f}",
        ))
    return _table(["Context key", "Predicted on", "Step-time model", "Family", "mean e2e s (vs FCFS)",
                   "p99 e2e s (vs FCFS)", "mean TTFT s (vs FCFS)", "req/s"], rows)


def recipe_labels_table() -> str:
    """For each shipped recipe, the label of its benchmark figures, as ``recipes show`` prints it
    (:mod:`carbonforge_runtime.core.figure_labels`)."""
    from carbonforge_runtime.core.figure_labels import benchmark_labels
    from carbonforge_runtime.recipes.loader import load_recipes, shipped_recipes_dir

    rows = []
    for key, recipe in sorted(load_recipes([shipped_recipes_dir()]).items()):
        labels = benchmark_labels(recipe.benchmark)
        if not labels:
            rows.append((_code(key), "none", "no figures: neither measured nor predicted"))
        for part, label in labels:
            rows.append((_code(key), f"{label.kind} (`benchmark.{part}`)", label.text()))
    return _table(["Context key", "Figures", "Label (as `recipes show` prints it)"], rows)


#: The ordering benchmark's committed result (benchmarks/ordering_twin.py --full).
ORDERING_RESULT = REPO / "benchmarks" / "results" / "ordering_twin_full.json"


def ordering_twin_table() -> str:
    """Per trace and load: FCFS, the best deployable family and the total-cost oracle, from the
    committed result of the ordering benchmark on the twin."""
    import json

    try:
        data = json.loads(ORDERING_RESULT.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise GenerationError(f"cannot read {ORDERING_RESULT.relative_to(REPO)}: {exc}") from None
    cells: dict[tuple[str, float], dict[str, dict[str, Any]]] = {}
    for r in data["results"]:
        if r["variant"] == "nominal":
            cells.setdefault((r["trace"], r["load"]), {})[r["label"]] = r
    best = data["summary"]["best"]
    rows = []
    for trace in [t["name"] for t in data["meta"]["traces"]]:
        for load in sorted(x for t, x in cells if t == trace):
            cell = cells[(trace, load)]
            fcfs = cell["fcfs"]
            label = best[f"{trace}/{load:g}"]["mean_e2e"]
            top = cell[label]
            oracle = cell.get("oracle-cost")
            rows.append((
                trace, f"{load:.0%}", f"{fcfs['e2e_mean_s']:.2f} / {fcfs['e2e_p99_s']:.2f}", _code(label),
                f"{_change(top['e2e_mean_s'], fcfs['e2e_mean_s'])} / {_change(top['e2e_p99_s'], fcfs['e2e_p99_s'])}",
                _change(top["ttft_mean_s"], fcfs["ttft_mean_s"]),
                "" if oracle is None else (f"{_change(oracle['e2e_mean_s'], fcfs['e2e_mean_s'])} / "
                                           f"{_change(oracle['e2e_p99_s'], fcfs['e2e_p99_s'])}"),
            ))
    return _table(["Trace", "Load", "FCFS mean / p99 e2e s", "Best deployable family (mean e2e)",
                   "its mean / p99 e2e vs FCFS", "its mean TTFT vs FCFS", "`oracle-cost` mean / p99 vs FCFS"], rows)

#: The twin held to the paced engine (benchmarks/twin_vs_paced.py).
TWIN_VS_PACED_RESULT = REPO / "benchmarks" / "results" / "twin_vs_paced.json"
_TVP_METRICS = (("mean_e2e", "mean e2e s"), ("p99_e2e", "p99 e2e s"), ("mean_ttft", "mean TTFT s"),
                ("throughput", "req/s"))


def _twin_vs_paced() -> dict[str, Any]:
    import json

    try:
        data: dict[str, Any] = json.loads(TWIN_VS_PACED_RESULT.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise GenerationError(f"cannot read {TWIN_VS_PACED_RESULT.relative_to(REPO)}: {exc}") from None
    return data


def twin_vs_paced_table() -> str:
    """Every cell of the twin against the paced engine: both figures, the error, the targets met,
    FCFS served twice against itself, and the paced engine's late-step share and the machine's load."""
    data = _twin_vs_paced()
    rows = []
    for c in data["cells"]:
        twin, paced, errors = c["twin"], c["paced"], c["errors"]
        missed = [label.split(" s")[0] for metric, label in _TVP_METRICS if not c["pass"][metric]]
        repeat = c.get("repeat")
        rows.append((
            c["trace"], f"{c['load']:.0%}", _code(c["run"]),
            *(f"{twin[m]:.2f} / {paced[m]:.2f} ({errors[m] * 100:+.1f}%)" if m != "throughput" else
              f"{twin[m]:.3f} / {paced[m]:.3f} ({errors[m] * 100:+.1f}%)" for m, _ in _TVP_METRICS),
            "yes" if not missed else "no (" + ", ".join(missed) + ")",
            "" if c["run"] != "fcfs" or not repeat else " / ".join(f"{repeat[m] * 100:.1f}%" for m, _ in _TVP_METRICS),
            f"{paced['late_share'] * 100:.1f}%"
            + ("" if "arrival_excess_s" not in paced else f" / {paced['arrival_excess_s'] * 1000:.0f} ms")
            + (f" (attempt {len(paced['discarded']) + 1})" if paced.get("discarded") else ""),
            "-" if "speed" not in paced else f"{(paced['speed'] - 1) * 100:+.1f}%",
            "-" if not c.get("errors_at_run_speed") else " / ".join(
                f"{c['errors_at_run_speed'][m] * 100:+.1f}%" for m, _ in _TVP_METRICS),
            f"{paced['loadavg_start']:.1f}-{paced['loadavg_end']:.1f}",
        ))
    return _table(["Trace", "Load", "Run", *(f"{label}: twin / paced (error)" for _, label in _TVP_METRICS),
                   "Targets met", "FCFS vs FCFS (the 4 figures)", "Late steps / worst arrival lag",
                   "Paced steps vs model", "Twin at the run's step speed: errors (the 4 figures)",
                   "Load average"], rows)


def twin_vs_paced_ordering_table() -> str:
    """Each family against FCFS on the same arrivals, as the twin predicts it and as the paced engine
    serves it, beside the paced engine's FCFS-against-itself difference."""
    data = _twin_vs_paced()
    by_cell: dict[tuple[str, float], dict[str, dict[str, Any]]] = {}
    for c in data["cells"]:
        by_cell.setdefault((c["trace"], c["load"]), {})[c["run"]] = c
    rows = []
    for (trace, load), runs in by_cell.items():
        fcfs = runs.get("fcfs")
        if fcfs is None:
            continue
        repeat = fcfs.get("repeat") or {}
        for run, c in runs.items():
            if c["family"] == "fcfs":
                continue
            cells = []
            for metric in ("mean_e2e", "p99_e2e", "mean_ttft"):
                twin = _change(c["twin"][metric], fcfs["twin"][metric])
                paced = _change(c["paced"][metric], fcfs["paced"][metric])
                cells.append(f"{twin} / {paced}")
            noise = repeat.get("mean_e2e")
            rows.append((trace, f"{load:.0%}", _code(run), *cells, "-" if noise is None else f"{noise * 100:.1f}%"))
    return _table(["Trace", "Load", "Family", "mean e2e vs FCFS: twin / paced", "p99 e2e vs FCFS: twin / paced",
                   "mean TTFT vs FCFS: twin / paced", "paced FCFS vs itself, mean e2e"], rows)


FAIRNESS_RESULT = REPO / "benchmarks" / "results" / "fairness.json"


def fairness_twin_table() -> str:
    """The flood and priority cases of the fairness benchmark on the twin, from its committed result."""
    import json

    try:
        data = json.loads(FAIRNESS_RESULT.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise GenerationError(f"cannot read {FAIRNESS_RESULT.relative_to(REPO)}: {exc}") from None
    rows = []
    for mix, case in data["flood"].items():
        alone = case["alone"]["steady"]["e2e_p99_s"]
        fcfs, vtc = case["fcfs"], case["vtc"]
        rows.append((f"flood, {mix}", f"steady tenant's p99 e2e: {alone:.1f} s",
                     f"{fcfs['steady']['e2e_p99_s'] / alone:.1f}x", f"{vtc['steady']['e2e_p99_s'] / alone:.2f}x",
                     _change(vtc["flood"]["request_rate"], fcfs["flood"]["request_rate"])))
    prio = data["priority"]
    alone = prio["alone"]["interactive"]["ttft_p99_s"]
    classes = prio["classes, bound 60 s"]
    rows.append(("priority classes, decode-heavy", f"interactive p99 TTFT: {alone:.2f} s",
                 f"{prio['one class (FCFS)']['interactive']['ttft_p99_s'] / alone:.1f}x",
                 f"{classes['interactive']['ttft_p99_s'] / alone:.2f}x (longest wait "
                 f"{classes['max_queue_wait_s']:.0f} s, {classes['past_bound']} past the 60 s bound)", "-"))
    return _table(["Case", "Alone", "FCFS vs alone", "VTC / classes vs alone", "Flood throughput, VTC vs FCFS"], rows)


def recipe_api_table() -> str:
    """What a client of each shipped recipe talks to: the model name, the parsers, the thinking budgets."""
    from carbonforge_runtime.core.api_contract import EFFORTS
    from carbonforge_runtime.recipes.loader import load_recipes, shipped_recipes_dir

    rows = []
    for key, recipe in sorted(load_recipes([shipped_recipes_dir()]).items()):
        api = recipe.api
        if api is None:
            raise GenerationError(f"the shipped recipe {key} has no api section")
        if api.reasoning_parser:
            budget = " / ".join(str(api.thinking_budget.get(effort) or "no cap") for effort in EFFORTS)
        else:
            budget = "no thinking"
        rows.append((_code(key), _code(recipe.model.served_name), _code(api.reasoning_parser or "none"), budget,
                     _code(api.tool_call_parser) if api.tool_call_parser else "`none` (tools refused)"))
    return _table(["Context key", "Model name", "Reasoning parser", f"Thinking tokens ({' / '.join(EFFORTS)})",
                   "Tool-call parser"], rows)


# --- the API's request contract ----------------------------------------------------------------


def _contract_verdict(body: dict[str, Any]) -> Any:
    """What the request-contract middleware makes of a chat request ``body`` for a model that reasons and
    calls tools: the forwarded request (parsed), or the ApiError it answers with."""
    import orjson

    from carbonforge_runtime.core.api_contract import CHAT_PATH, EFFORTS, ApiContract, check_request

    # Budgets 1, 2, 3 stand for the recipe's low, medium and xhigh, so a forwarded budget names its effort.
    contract = ApiContract(True, True, {effort: i for i, effort in enumerate(EFFORTS, start=1)})
    verdict = check_request(CHAT_PATH, orjson.dumps(body), contract)
    return verdict if not isinstance(verdict, bytes) else orjson.loads(verdict)


def efforts_table() -> str:
    """Every effort a chat request may ask for, and what the model's chat template and vLLM get for it."""
    import json

    from carbonforge_runtime.core.api_contract import EFFORTS, ApiError

    def row(sent: str, top_level: str, body: dict[str, Any]) -> tuple[str, str, str, str]:
        forwarded = _contract_verdict({"messages": [], **body})
        if isinstance(forwarded, ApiError):
            raise GenerationError(f"the request contract refuses {body}: {forwarded.message}")
        budget = forwarded.get("thinking_token_budget")
        cap = f"the recipe's `{EFFORTS[budget - 1]}` budget" if budget else "none (no thinking)"
        return sent, top_level, _code(json.dumps(forwarded.get("chat_template_kwargs"))), cap

    rows = [row("nothing (the default)", "", {})]
    for effort in EFFORTS:
        kwargs_form = {"chat_template_kwargs": {"reasoning_effort": effort}}
        if _contract_verdict({"messages": [], "reasoning_effort": effort}) != _contract_verdict(
                {"messages": [], **kwargs_form}):
            raise GenerationError(f"reasoning_effort {effort!r} means something else at the top level")
        rows.append(row(_code(json.dumps(kwargs_form["chat_template_kwargs"])), _code(json.dumps(effort)),
                        kwargs_form))
    off = {"enable_thinking": False}
    rows.append(row(_code(json.dumps(off)), "(no equivalent)", {"chat_template_kwargs": off}))
    return _table(["`chat_template_kwargs`", "or top-level `reasoning_effort`", "The chat template gets",
                   "`thinking_token_budget`"], rows)


def api_errors_table() -> str:
    """The errors the runtime's request contract answers with, each produced by the code for an example."""
    import orjson

    from carbonforge_runtime.core.api_contract import (
        CHAT_PATH,
        JSON_PATHS,
        LICENCE_EXPIRED_ERROR,
        MSG_EXPIRED_KEY,
        RESPONSES_PATH,
        ApiContract,
        ApiError,
        auth_error,
        check_request,
        concurrency_error,
        rate_limit_error,
        scope_error,
        too_large_error,
    )
    from carbonforge_runtime.core.api_keys import INFERENCE_INVOKE
    from carbonforge_runtime.core.request_tags import MAX_KEY_CHARS, MAX_TAGS, MAX_TASK_CHARS, MAX_VALUE_CHARS
    from carbonforge_runtime.settings import DEFAULT_MAX_REQUEST_BYTES

    def refused(when: str, body: bytes, contract: ApiContract, path: str = CHAT_PATH,
                task_header: bytes = b"") -> tuple[str, ...]:
        error = check_request(path, body, contract, task_header)
        if not isinstance(error, ApiError):
            raise GenerationError(f"the request contract no longer refuses {body!r} ({when})")
        return fields(when, error)

    def fields(when: str, error: ApiError) -> tuple[str, ...]:
        return (_code(error.status), _code(error.message), _code(error.type), _code(error.param or "null"),
                _code(error.code or "null"), when)

    thinking = ApiContract(reasoning=True, tools=True)
    paths = ", ".join(_code(path) for path in sorted(JSON_PATHS))
    rows = [
        refused(f"the body of a POST to {paths} is not a JSON object", b'{"messages": [', thinking),
        refused("a chat request has no `messages`", b'{"model": "m"}', thinking),
        refused("`chat_template_kwargs` is anything but one of the efforts above (another value, another key), "
                "or disagrees with the top-level `reasoning_effort`",
                b'{"messages": [], "chat_template_kwargs": {"reasoning_effort": "high"}}', thinking),
        refused("the top-level `reasoning_effort` is not one of the efforts above",
                b'{"messages": [], "reasoning_effort": "high"}', thinking),
        refused(f"a request to `{RESPONSES_PATH}` has a `reasoning.effort` that is not one of the efforts above",
                b'{"input": "x", "reasoning": {"effort": "high"}}', thinking, RESPONSES_PATH),
        refused("`tools` sent (and `tool_choice` is not `none`) to a model served without a tool-call parser",
                b'{"messages": [], "tools": [{"type": "function"}]}', ApiContract(tools=False)),
        refused(f"`metadata` has more than {MAX_TAGS} pairs (the message says how many came)",
                orjson.dumps({"messages": [], "metadata": {f"k{i}": "v" for i in range(MAX_TAGS + 1)}}), thinking),
        refused(f"a `metadata` key is longer than {MAX_KEY_CHARS} characters (or empty)",
                orjson.dumps({"messages": [], "metadata": {"k" * (MAX_KEY_CHARS + 1): "v"}}), thinking),
        refused(f"a `metadata` value is longer than {MAX_VALUE_CHARS} characters",
                orjson.dumps({"messages": [], "metadata": {"k": "v" * (MAX_VALUE_CHARS + 1)}}), thinking),
        refused("`metadata` is not an object, or a value in it is not a string",
                b'{"messages": [], "metadata": {"k": 1}}', thinking),
        refused(f"the `X-CF-Task` header is longer than {MAX_TASK_CHARS} characters, or not printable UTF-8 text",
                b'{"messages": []}', thinking, task_header=b"a\x01"),
        fields("keys are required and the request has no `Authorization` header", auth_error(key_sent=False)),
        fields("keys are required and the header holds another key, a revoked one (or is not `Bearer KEY`); "
               "with `WWW-Authenticate: Bearer error=\"invalid_token\"` (without a key: `Bearer`)",
               auth_error(key_sent=True)),
        fields("the named key has expired (its `expires` in the keys file)",
               auth_error(key_sent=True, message=MSG_EXPIRED_KEY)),
        fields("the named key lacks the scope the route needs (the message names it; `models:read` for "
               "`GET /v1/models`, `inference:invoke` for requests to the engine: see [Routes](#routes)); with "
               "`WWW-Authenticate: Bearer error=\"insufficient_scope\", scope=\"...\"`",
               scope_error(INFERENCE_INVOKE)),
        fields("the named key has spent its `requests_per_minute` (the message names the limit); with "
               "`Retry-After` and the `x-ratelimit-*-requests` headers", rate_limit_error(60, ())),
        fields("the named key has `max_in_flight` requests in flight already; with `Retry-After: 1`",
               concurrency_error(4, ())),
        fields("the body is longer than `CF_MAX_REQUEST_BYTES` (the message names the limit; "
               f"{DEFAULT_MAX_REQUEST_BYTES} bytes unless set), by its `Content-Length` or as it streams in",
               too_large_error(DEFAULT_MAX_REQUEST_BYTES)),
        fields("the licence the server runs under has expired: every request but `/metrics` "
               "(requests in flight finish)", LICENCE_EXPIRED_ERROR),
    ]
    return _table(["Status", "`message`", "`type`", "`param`", "`code`", "When"], rows)


# --- Prometheus metrics -------------------------------------------------------------------------


def metrics_table() -> str:
    from carbonforge_runtime.runtime.metrics.exposition import METRICS

    rows = [(_code(spec.exposed_name), spec.kind, ", ".join(_code(label) for label in spec.labels), spec.help)
            for spec in METRICS]
    return _table(["Metric", "Type", "Labels", "Meaning"], rows)


# --- trace record -------------------------------------------------------------------------------


def _trace_fields(group: str) -> Callable[[], str]:
    def render() -> str:
        from carbonforge_runtime.core import trace_record as tr

        groups = {"standard": tr.STANDARD_FIELDS, "added": tr.EXTRA_FIELDS, "full": tr.FULL_FIELDS}
        every = [name for names in groups.values() for name in names]
        undocumented = [name for name in every if name not in tr.FIELD_MEANINGS]
        unknown = sorted(set(tr.FIELD_MEANINGS) - set(every))
        if undocumented or unknown:
            raise GenerationError(f"FIELD_MEANINGS in trace_record.py is out of step with the field lists "
                                  f"(no meaning: {undocumented}; not a field: {unknown})")
        return _table(["Field", "Meaning"], ((_code(name), tr.FIELD_MEANINGS[name]) for name in groups[group]))

    return render


# --- doctor checks ------------------------------------------------------------------------------


def doctor_checks_table() -> str:
    from carbonforge_runtime.runtime.doctor.checks import CHECKS

    rows = [(_code(info.name), info.section, info.looks_at, info.problem or "never: information only")
            for info in CHECKS]
    return _table(["Check (`name`)", "Section", "Looks at", "WARN or FAIL when"], rows)


# --- exit codes ---------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def error_classes() -> list[type]:
    """Every subclass of ``CarbonForgeError`` defined in the package, found by reading its source.

    The source is read (not ``__subclasses__`` of what happens to be imported) so that the table
    does not depend on import order; the modules found are then imported for the real classes.
    """
    from carbonforge_runtime.errors import CarbonForgeError

    defined: list[tuple[str, str, set[str]]] = []
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = {base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                         for base in node.bases}
                defined.append((_module_name(path), node.name, bases))
    family = {CarbonForgeError.__name__}
    grew = True
    while grew:
        grew = False
        for _, name, bases in defined:
            if name not in family and bases & family:
                family.add(name)
                grew = True
    found = []
    for module, name, _ in defined:
        if name in family:
            cls = getattr(importlib.import_module(module), name, None)
            if isinstance(cls, type) and issubclass(cls, CarbonForgeError):
                found.append(cls)
    return sorted(found, key=lambda cls: (cls.exit_code, cls.__name__, cls.__module__))


def exit_codes_table() -> str:
    rows = []
    for cls in error_classes():
        meaning = _rst_to_md(_first_sentence(inspect.getdoc(cls) or ""))
        rows.append((_code(cls.exit_code), _code(cls.__name__), _code(cls.__module__), meaning))
    return _table(["Exit code", "Error", "Defined in", "Raised when"], rows)


# --- the pages ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generated:
    page: str  # relative to the docs directory (README.md is ../README.md)
    render: Callable[[], str]


def api_routes_table() -> str:
    """The paths open without a key, and the routes whose request bodies the contract judges, with the
    scope each needs of a named key."""
    from carbonforge_runtime.core.api_contract import PUBLIC_PATHS, ROUTES
    from carbonforge_runtime.core.api_keys import MODELS_READ_PATHS, OPERATOR_PATHS, WHOAMI_PATH, required_scope

    checks = {
        "chat": "JSON object, `messages`, effort (`chat_template_kwargs`, `reasoning_effort`), tools; "
                "the effort mapped, with the recipe's thinking budget",
        "chat_batch": "as a chat request; the effort mapped, no thinking budget (vLLM's batch request has none)",
        "invocation": "a body with `messages` as a chat request, any other as a completion",
        "responses": "JSON object, effort (`reasoning.effort`, `chat_template_kwargs`), tools; the effort "
                     "mapped, no thinking budget (vLLM's Responses API has none)",
        "json": "JSON object",
        "generate": "JSON object (vLLM's token-in, token-out route)",
    }

    def tags(route: Any) -> str:
        if not route.tags:
            return ""
        return "`metadata`, `X-CF-Task`" if route.metadata else "`X-CF-Task`"

    def scope(method: str, path: str) -> str:
        needed = required_scope(method, path)
        return _code(needed) if needed else "any valid key"

    rows = [(_code(path), "no", why, "", "") for path, why in PUBLIC_PATHS.items()]
    rows.append((_code(f"GET {WHOAMI_PATH}"), scope("GET", WHOAMI_PATH),
                 "answered by the runtime: the key's name, scopes, limits and expiry", "", ""))
    rows += [(_code(f"GET {path}"), scope("GET", path), "", "", "")
             for path in sorted(MODELS_READ_PATHS | {"/v1/models/{model}"})]
    rows += [(_code(f"POST {path}"), scope("POST", path), checks[route.kind], "yes" if route.answers else "",
              tags(route)) for path, route in sorted(ROUTES.items())]
    rows += [(_code(path), scope("POST", path), "the size limit only; server-wide, so only `CF_API_KEY` may call it",
              "", "") for path in sorted(OPERATOR_PATHS)]
    rows.append(("any other path (`/tokenize`, `/v1/responses/{id}`, the audio and realtime routes, ...)",
                 scope("POST", "/any"), "the size limit only", "", ""))
    return _table(["Path", "Key needed (a named key's scope)", "Checked before vLLM (for an open path: why it is "
                   "open)", "`reasoning_content` added", "Tags recorded from"], rows)


def chat_templates_table() -> str:
    from carbonforge_runtime.recipes import chat_templates
    from carbonforge_runtime.recipes.loader import load_recipes, shipped_recipes_dir

    rows = []
    for key, recipe in sorted(load_recipes([shipped_recipes_dir()]).items()):
        served = recipe.model.served_name
        template = chat_templates.for_model(served)
        if template is not None:
            shown = f"{_code(template.name)}: {template.description}"
        elif served in chat_templates.NOT_VENDORED:
            shown = f"not vendored: {chat_templates.NOT_VENDORED[served]}"
        else:
            raise GenerationError(f"recipe {key} serves {served}, which neither MODEL_TEMPLATES nor NOT_VENDORED lists")
        rows.append((_code(key), _code(served), shown))
    return _table(["Context key", "Served model (the record's `model`)", "Chat template `trace export` reads"], rows)


def scrub_patterns_table() -> str:
    from carbonforge_runtime.offline.trace_tools.scrub import PATTERNS, SECRET_KEYS

    keyed = {kind for kind, _ in SECRET_KEYS}
    return _table(["Kind", "What it catches"],
                  [(_code(kind), meaning + (" (and the whole string value of a JSON key of that name)"
                                            if kind in keyed else "")) for kind, meaning, _ in PATTERNS])


#: Every generated table: its marker name, the page it lives in, and the function that builds it.
TABLES: dict[str, Generated] = {
    "commands": Generated("cli.md", commands_table),
    "subcommands": Generated("../README.md", subcommands_list),
    "runtime-flags": Generated("cli.md", runtime_flags_table),
    "env-vars": Generated("environment.md", env_vars_table),
    "recipes": Generated("recipes.md", recipes_table),
    "recipes-predicted": Generated("recipes.md", recipes_predicted_table),
    "recipe-labels": Generated("recipes.md", recipe_labels_table),
    "recipe-labels-sim": Generated("sim.md", recipe_labels_table),
    "ordering-twin": Generated("ordering.md", ordering_twin_table),
    "fairness-twin": Generated("ordering.md", fairness_twin_table),
    "twin-vs-paced": Generated("sim.md", twin_vs_paced_table),
    "twin-vs-paced-ordering": Generated("ordering.md", twin_vs_paced_ordering_table),
    "recipe-api": Generated("clients.md", recipe_api_table),
    "api-efforts": Generated("clients.md", efforts_table),
    "api-errors": Generated("clients.md", api_errors_table),
    "api-routes": Generated("clients.md", api_routes_table),
    "metrics": Generated("metrics-and-energy.md", metrics_table),
    "trace-fields-standard": Generated("tracing.md", _trace_fields("standard")),
    "trace-fields-added": Generated("tracing.md", _trace_fields("added")),
    "trace-fields-full": Generated("tracing.md", _trace_fields("full")),
    "doctor-checks": Generated("doctor.md", doctor_checks_table),
    "exit-codes": Generated("exit-codes.md", exit_codes_table),
    "chat-templates": Generated("datasets.md", chat_templates_table),
    "scrub-patterns": Generated("datasets.md", scrub_patterns_table),
}


def _splice(text: str, name: str, body: str) -> tuple[str, str | None]:
    """``text`` with the block ``name`` replaced by ``body``, or (text, problem) when the markers are wrong."""
    begin, end = BEGIN.format(name), END.format(name)
    if text.count(begin) != 1 or text.count(end) != 1:
        return text, f"needs exactly one {begin} and one {end}"
    start = text.index(begin) + len(begin)
    stop = text.index(end)
    if stop < start:
        return text, f"{end} comes before {begin}"
    # Blank lines around the body, so that Markdown never reads the markers as part of a table.
    return text[:start] + "\n\n" + body.strip("\n") + "\n\n" + text[stop:], None


@dataclass
class Outcome:
    pages: dict[Path, str]  # page -> the text it should have
    problems: list[str]  # what cannot be generated or placed
    broken: set[Path]  # pages with such a problem


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def generate(docs_dir: Path = DOCS_DIR) -> Outcome:
    """What every page under ``docs_dir`` should hold, plus the problems that prevent it."""
    docs_dir = Path(docs_dir)
    pages: dict[Path, str] = {}
    problems: list[str] = []
    broken: set[Path] = set()

    def problem(path: Path, text: str) -> None:
        problems.append(f"{_shown(path)}: {text}")
        broken.add(path)

    for name, table in TABLES.items():
        path = docs_dir / table.page
        if path not in pages:
            if not path.is_file():
                problem(path, f"page missing (it holds the generated table {name!r})")
                continue
            pages[path] = path.read_text(encoding="utf-8")
        try:
            body = table.render()
        except GenerationError as exc:
            problem(path, f"cannot generate table {name!r}: {exc}")
            continue
        pages[path], wrong = _splice(pages[path], name, body)
        if wrong:
            problem(path, f"table {name!r} {wrong}")
    for path in sorted(docs_dir.rglob("*.md")):
        for match in _MARKER.finditer(path.read_text(encoding="utf-8")):
            name = match.group(2)
            if name not in TABLES or docs_dir / TABLES[name].page != path:
                problem(path, f"marker for {name!r}, which gen_docs.py does not generate in this page")
    return Outcome(pages, sorted(set(problems)), broken)


def _blocks(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(
        r"<!-- BEGIN GENERATED: ([A-Za-z0-9_.-]+) -->(.*?)<!-- END GENERATED: \1 -->", text, re.S)}


def check(docs_dir: Path = DOCS_DIR) -> list[str]:
    """One line per page and table that differs from what the code generates; empty when all are current."""
    outcome = generate(docs_dir)
    problems = list(outcome.problems)
    for path, wanted in sorted(outcome.pages.items()):
        current = path.read_text(encoding="utf-8")
        if current == wanted:
            continue
        have, want = _blocks(current), _blocks(wanted)
        names = sorted(name for name in want if have.get(name) != want[name])
        for name in names:
            problems.append(f"{_shown(path)}: table {name!r} differs from what the code generates")
        if not names:
            problems.append(f"{_shown(path)}: differs from what the code generates")
    return problems


def write(docs_dir: Path = DOCS_DIR) -> tuple[list[Path], list[str]]:
    """Rewrite the generated tables; returns (pages changed, problems). Pages with a problem are left alone."""
    outcome = generate(docs_dir)
    changed = []
    for path, wanted in sorted(outcome.pages.items()):
        if path in outcome.broken:
            continue
        if path.read_text(encoding="utf-8") != wanted:
            path.write_text(wanted, encoding="utf-8")
            changed.append(path)
    return changed, outcome.problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming every page and table that is not current")
    parser.add_argument("--docs", type=Path, default=DOCS_DIR, help="the docs directory (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.docs)
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("docs are out of date: run `python scripts/gen_docs.py` and commit the result", file=sys.stderr)
            return 1
        print(f"docs: all {len(TABLES)} generated tables are current")
        return 0
    changed, problems = write(args.docs)
    for path in changed:
        print(f"wrote {_shown(path)}")
    for line in problems:
        print(line, file=sys.stderr)
    if not changed and not problems:
        print("docs: nothing to change")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
