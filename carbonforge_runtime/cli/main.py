"""The command line. Thin: parse, build settings, call one function, map errors to exit codes.

Launch modes (see README): no arguments runs the doctor (or serves CF_CONTEXT_KEY when set);
arguments that are not a subcommand are a serve command line.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Sequence
from typing import Any

import typer
import typer.core

from carbonforge_runtime import PINNED_VLLM_VERSION, __version__
from carbonforge_runtime import log as cflog
from carbonforge_runtime.cli.calibrate import calibrate_command as calibrate_host_command
from carbonforge_runtime.cli.errors import run_guarded
from carbonforge_runtime.cli.fetch import FETCH_EPILOG, fetch_command
from carbonforge_runtime.cli.ltr import ltr_app
from carbonforge_runtime.cli.replay import replay_command
from carbonforge_runtime.cli.sim import calibrate_command, pin_hash_seed, sim_command
from carbonforge_runtime.cli.top import TOP_EPILOG, top_command
from carbonforge_runtime.cli.trace import trace_app
from carbonforge_runtime.cli.tune import tune_command
from carbonforge_runtime.errors import CarbonForgeError, UsageError
from carbonforge_runtime.gpu.select import default_backend
from carbonforge_runtime.gpu.types import GpuBackend
from carbonforge_runtime.settings import Settings, load_settings

#: The exceptions of the Click that typer runs on (its own copy in later releases, the click package in
#: earlier ones), found through a class typer exports.
_click_errors: Any = sys.modules[typer.BadParameter.__module__]


class _UnknownOption(_click_errors.UsageError):  # type: ignore[misc]
    """An option no command knows, reported in the runtime's own words (``unknown option ...: did you
    mean ...?`` and a fix) wherever it stands on the command line, instead of Click's message."""

    def __init__(self, error: UsageError) -> None:
        super().__init__(error.message)
        self.error = error

    def show(self, file: Any = None) -> None:
        typer.echo(self.error.render(), err=True)


def _runtime_style(exc: Any) -> _UnknownOption:
    command = exc.ctx.command if exc.ctx is not None else None
    if command is None or command.name == "serve":
        return _UnknownOption(unknown_option(exc.option_name))
    path = exc.ctx.command_path if exc.ctx is not None else "carbonforge-runtime"
    options = tuple(opt for param in command.params if param.param_type_name == "option" for opt in param.opts)
    return _UnknownOption(unknown_option(exc.option_name, options,
                                         f"`{path} --help` lists its options"))


class _RootGroup(typer.core.TyperGroup):
    """The root command: its help also lists the runtime flags (the ``serve`` options), since a command
    line that starts with one of them is a serve command line. An unknown option, on any command, is
    reported in the runtime's own style."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except _click_errors.NoSuchOption as exc:
            raise _runtime_style(exc) from None

    def invoke(self, ctx: Any) -> Any:
        try:  # every subcommand's (and sub-group's) options are parsed in here
            return super().invoke(ctx)
        except _click_errors.NoSuchOption as exc:
            raise _runtime_style(exc) from None

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        serve_command = self.commands.get("serve")
        if serve_command is not None:
            serve_ctx = type(ctx)(serve_command, info_name="serve", parent=ctx)
            rows = [record for param in serve_command.params if param.param_type_name == "option"
                    if (record := param.get_help_record(serve_ctx)) is not None]
            with formatter.section("Runtime flags (the options of serve; put vLLM's own flags after --)"):
                formatter.write_dl(rows)
        super().format_commands(ctx, formatter)


app = typer.Typer(
    cls=_RootGroup,
    name="carbonforge-runtime",
    help="Serve benchmarked vLLM recipes by context key, diagnose the host, and trace every request.",
    add_completion=False,
    no_args_is_help=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
recipes_app = typer.Typer(help="List and inspect the recipes this runtime knows.", no_args_is_help=True)
app.add_typer(recipes_app, name="recipes")
app.add_typer(ltr_app, name="ltr")
app.command("replay")(replay_command)
app.command("sim")(sim_command)
app.command("sim-calibrate")(calibrate_command)
app.command("tune")(tune_command)
app.command("calibrate")(calibrate_host_command)
app.command("fetch", epilog=FETCH_EPILOG)(fetch_command)
app.command("top", epilog=TOP_EPILOG)(top_command)
app.add_typer(trace_app, name="trace")
from carbonforge_runtime.cli.license import license_app  # noqa: E402

app.add_typer(license_app, name="license")
from carbonforge_runtime.cli.keys import keys_app  # noqa: E402

app.add_typer(keys_app, name="keys")

def gpu_backend() -> GpuBackend:
    """The GPU backend commands use; tests replace this function."""
    return default_backend()


def _settings() -> Settings:
    return load_settings(os.environ)


_guard = run_guarded


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"carbonforge-runtime {__version__} (vLLM pinned to {PINNED_VLLM_VERSION})")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", "-V", callback=_version_callback, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Serve benchmarked vLLM recipes by context key, diagnose the host, and trace every request."""


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": False},
    epilog="Arguments after -- go to vLLM: appended to the recipe's with --context-key, "
    "or as the whole vLLM command line without it.",
)
def serve(
    ctx: typer.Context,
    context_key: str | None = typer.Option(None, "--context-key",
                                           help="Recipe to serve: model:quant:workload:hardware."),
    strict_hardware: bool = typer.Option(False, "--strict-hardware",
                                         help="Refuse to start when the GPUs do not match the key's hardware "
                                              "(a host of a multi-host group always refuses)."),
    request_trace: str = typer.Option("off", "--request-trace", help="Trace level: off, standard or full."),
    trace_file: str | None = typer.Option(None, "--trace-file", help="Append one JSON line per request here."),
    trace_endpoint: str | None = typer.Option(None, "--trace-endpoint", help="OTLP collector URL."),
    trace_format: str | None = typer.Option(None, "--trace-format", help="Format for --trace-endpoint: otlp."),
    step_log: str | None = typer.Option(None, "--step-log",
                                        help="Append one JSON line per engine step and per new request here "
                                        "(for sim-calibrate)."),
    metrics: bool = typer.Option(False, "--metrics",
                                 help="Serve Prometheus metrics on CF_METRICS_PORT (default 9105)."),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="Print the effective configuration and the vLLM command; start nothing."),
    skip_preflight: bool = typer.Option(False, "--skip-preflight",
                                        help="Do not run the pre-flight checks (a failing one stops the launch)."),
    nnodes: int | None = typer.Option(None, "--nnodes", min=1,
                                      help="Hosts in this serving group (else CF_NNODES or LWS_GROUP_SIZE)."),
    node_rank: int | None = typer.Option(None, "--node-rank", min=0,
                                         help="This host's rank, 0 = leader (else CF_NODE_RANK or LWS_WORKER_INDEX)."),
    master_addr: str | None = typer.Option(None, "--master-addr",
                                           help="The leader's address (else CF_MASTER_ADDR or LWS_LEADER_ADDRESS)."),
    master_port: int | None = typer.Option(None, "--master-port", min=1, max=65535,
                                           help="Port where the group meets on the leader (else CF_MASTER_PORT)."),
    emulate: bool = typer.Option(False, "--emulate",
                                 help="Serve the recipe on this machine's CPU with the built-in model standing in "
                                      "for its weights, every step paced to the recipe's GPU (docs/emulate.md)."),
    cost_model: str | None = typer.Option(None, "--cost-model", metavar="NAME|FILE",
                                          help="With --emulate: the step-time model (default: the recipe's)."),
    emulate_slowdown: float = typer.Option(1.0, "--emulate-slowdown", metavar="K",
                                           help="With --emulate: every step K times longer than the model says."),
) -> None:
    """Serve a recipe (--context-key) or a vLLM command line given after --."""
    from carbonforge_runtime.runtime.planning.plan import ServeOptions
    from carbonforge_runtime.runtime.serve.launch import serve as do_serve

    # The options above are ServeOptions' fields by name: one list of serve flags. --dry-run is the
    # runtime's wherever it stands, after -- too: it never reaches vLLM.
    vllm_args = [arg for arg in ctx.args if arg != DRY_RUN_FLAG]
    params = {**ctx.params, "dry_run": dry_run or len(vllm_args) != len(ctx.args)}
    options = ServeOptions(**params, vllm_args=vllm_args)
    code = _guard(lambda: do_serve(options, _settings(), os.environ, gpu_backend()))
    raise typer.Exit(code)


def _serve_flags() -> tuple[str, ...]:
    """Every flag of ``serve``, read from its definition above."""
    import typer.main

    command = typer.main.get_command(app)
    serve_command = command.commands["serve"]  # type: ignore[attr-defined]
    return tuple(opt for param in serve_command.params if param.param_type_name == "option" for opt in param.opts)


#: Runtime flags: an argument list starting with one of these is a runtime command line.
RUNTIME_FLAGS = _serve_flags()
DRY_RUN_FLAG = "--dry-run"
#: The vLLM flags that can name the model: a command line that starts with another flag is a vLLM
#: command line only when one of these follows (the licence gate reads the model there).
VLLM_MODEL_FLAGS = ("--model", "--config")


def _names_a_model(args: Sequence[str]) -> bool:
    return any(arg.split("=", 1)[0] in VLLM_MODEL_FLAGS for arg in args)


#: The fix of an unknown runtime flag.
RUNTIME_FLAG_FIX = ("runtime flags are listed by `carbonforge-runtime --help`; a vLLM command line goes after -- "
                    "with the model first (carbonforge-runtime [runtime flags] -- MODEL [vLLM flags])")


def unknown_option(option: str, known: Sequence[str] | None = None, fix: str = RUNTIME_FLAG_FIX) -> UsageError:
    """An option nothing knows: by default a runtime flag (a flag-first command line that is neither a
    runtime command line nor a vLLM one, or a serve option), else one of a subcommand's ``known``."""
    name = option.split("=", 1)[0]
    candidates = RUNTIME_FLAGS if known is None else known
    close = difflib.get_close_matches(name.lower().replace("_", "-"), candidates, n=1, cutoff=0.75)
    suggestion = f": did you mean {close[0]}?" if close else ""
    return UsageError(f"unknown option {name!r}{suggestion}", fix)


@app.command()
def doctor(
    context_key: str | None = typer.Option(None, "--context-key", help="Also check this recipe against the host."),
    json_output: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
    metrics: bool = typer.Option(False, "--metrics", help="Also check that the metrics port is free."),
    trace_file: str | None = typer.Option(None, "--trace-file", help="Also check that this trace file can be written."),
    request_trace: str | None = typer.Option(None, "--request-trace",
                                             help="The trace level serve will run with (off, standard or full), "
                                                  "for the trace policy line."),
    deep: bool = typer.Option(False, "--deep", help="Also hash every cached weight file and compare it with the "
                              "sha256 that fetch recorded in the lock (slow: reads the whole model)."),
) -> None:
    """Diagnose the host: GPUs, recipe fit, licence, tracing, storage, engine. Exit 1 on FAIL.

    Checks the recipe of --context-key, else of CF_CONTEXT_KEY when set.
    """
    from carbonforge_runtime.runtime.doctor import DoctorRequest, run_doctor

    def run() -> int:
        request = DoctorRequest(context_key=context_key, metrics=metrics, trace_file=trace_file, deep=deep,
                                request_trace=request_trace)
        text, code = run_doctor(request, os.environ, gpu_backend(), json_output=json_output)
        typer.echo(text)
        return code

    raise typer.Exit(_guard(run))


@recipes_app.command("list")
def recipes_list() -> None:
    """One line per recipe: key, plan, model, hardware."""
    from carbonforge_runtime.runtime.serve.launch import load_all_recipes

    def run() -> None:
        recipes = load_all_recipes(_settings())
        rows = [("KEY", "PLAN", "MODEL", "HARDWARE")]
        for key in sorted(recipes):
            recipe = recipes[key]
            model = recipe.model.repo + ("" if recipe.model.verified else " (unverified)")
            rows.append((key, recipe.plan, model, str(recipe.key.hardware)))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        for row in rows:
            typer.echo("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())

    _guard(run)


@recipes_app.command("show")
def recipes_show(key: str = typer.Argument(..., help="The context key to show.")) -> None:
    """The resolved recipe and the exact vLLM command line it runs."""
    import shlex

    from carbonforge_runtime.core.figure_labels import benchmark_lines
    from carbonforge_runtime.core.redaction import redact_args
    from carbonforge_runtime.files import read_regular
    from carbonforge_runtime.recipes.loader import MAX_RECIPE_BYTES
    from carbonforge_runtime.runtime.group.placement import Group, place_command
    from carbonforge_runtime.runtime.planning.command import ENGINE_MODULE, build_recipe_plan
    from carbonforge_runtime.runtime.serve.launch import load_all_recipes

    def run() -> None:
        from carbonforge_runtime.recipes import resolve

        settings = _settings()
        recipe = resolve(key, load_all_recipes(settings))
        typer.echo(f"# {recipe.source}")
        typer.echo(read_regular(recipe.source, MAX_RECIPE_BYTES).decode("utf-8", errors="replace").rstrip())
        typer.echo("\n# where the benchmark figures come from")
        for line in benchmark_lines(recipe.benchmark):
            typer.echo(f"# {line}")
        model_path = str(settings.tiny_model_dir) if recipe.model.builtin else None
        plan = build_recipe_plan(recipe, settings, [], model_path=model_path)
        if recipe.hosts is None:
            typer.echo("\n# vLLM command")
            typer.echo(shlex.join(redact_args(plan.argv)))
            return
        typer.echo(f"\n# hosts: {recipe.hosts.describe(recipe.vllm)}")
        for rank in (0, 1):
            group = Group(recipe.hosts.nodes, rank, "LEADER_ADDRESS", settings.value("CF_MASTER_PORT"),
                          settings.value("CF_JOIN_TIMEOUT_S"))
            which = "the leader (rank 0)" if rank == 0 else f"each worker (here rank 1 of {recipe.hosts.nodes})"
            typer.echo(f"\n# vLLM command of {which}")
            typer.echo(shlex.join(redact_args(place_command(plan.argv, ENGINE_MODULE, group))))

    _guard(run)


def _dispatch(args: list[str], environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """Turn a container command line into the typer command line (the three launch modes)."""
    logger = cflog.get_logger()
    if not args:
        key = environ.get("CF_CONTEXT_KEY", "").strip()
        return ["serve", "--context-key", key] if key else ["doctor"]
    if environ.get("CF_CONTEXT_KEY", "").strip():
        first = args[0]
        if first not in ("doctor", "fetch", "recipes", "license", "top", "--help", "-h", "--version", "-V"):
            logger.info("CF_CONTEXT_KEY is ignored because a command was given; pass --context-key to serve a recipe")
    first = args[0]
    # A command registered without an explicit name is named after its function (as typer does it).
    names = {cmd.name or (cmd.callback.__name__.lower().replace("_", "-") if cmd.callback else None)
             for cmd in app.registered_commands} | {grp.name for grp in app.registered_groups}
    if first in names or first in ("--help", "-h", "--version", "-V"):
        return args
    if first == "--" or any(first == flag or first.startswith(flag + "=") for flag in RUNTIME_FLAGS):
        return ["serve", *args]
    if first.startswith("-") and first.split("=", 1)[0] not in VLLM_MODEL_FLAGS:
        # A flag first: a mistyped runtime flag, or a vLLM command line that names its model by --model.
        name = first.split("=", 1)[0].lower().replace("_", "-")
        if difflib.get_close_matches(name, RUNTIME_FLAGS, n=1, cutoff=0.75) or not _names_a_model(args):
            raise unknown_option(first)
    # Not a runtime flag: the whole list is the vLLM command line.
    return ["serve", "--", *args]


def main(argv: Sequence[str] | None = None) -> None:
    cflog.configure()
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        command = _dispatch(args, os.environ)
    except CarbonForgeError as exc:
        typer.echo(exc.render(), err=True)
        raise SystemExit(exc.exit_code) from None
    if command and command[0] in ("sim", "tune", "calibrate"):
        pin_hash_seed(command)
    app(args=command, prog_name="carbonforge-runtime")
