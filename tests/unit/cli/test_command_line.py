"""Command lines mean what they say: typos of runtime flags, --dry-run anywhere, the help, the
CF_CONTEXT_KEY rule, --strict-hardware without a key, and where the API really listens."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from tests.support import TINY_KEY

runner = CliRunner()
#: A log directory that cannot be created: a launch that should not happen stops there (exit 1).
NO_LOG_DIR = "/proc/no-such-dir/logs"


@pytest.fixture(autouse=True)
def _fake_l4(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "gpu_backend", lambda: FakeGpuBackend(host("l4")))


def invoke(*args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return runner.invoke(cli.app, list(args), env={"CF_LOG_DIR": NO_LOG_DIR, **(env or {})})


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    # main() would attach a handler to this test's captured stderr for good: keep the logging as it is.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli.cflog, "configure", lambda: None)
        with pytest.raises(SystemExit) as info:
            cli.main(args)
    code = info.value.code
    return (code if isinstance(code, int) else 1), capsys.readouterr().err


# ---- 2. a mistyped runtime flag ----------------------------------------------------------------

@pytest.mark.parametrize(("args", "suggestion"), [
    (["--contex-key", TINY_KEY], "--context-key"),
    (["--context_key", TINY_KEY], "--context-key"),
    (["--context_key=" + TINY_KEY, "--dry-run"], "--context-key"),
    (["--metric", "--", "/models/m"], "--metrics"),
    (["--request_trace", "standard", "--model", "m"], "--request-trace"),
])
def test_a_mistyped_runtime_flag_names_the_close_one(args: list[str], suggestion: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(args, capsys)
    assert code == 2
    name = args[0].split("=", 1)[0]
    assert f"error: unknown option '{name}': did you mean {suggestion}?" in err
    assert "fix:" in err and "could not determine which model" not in err and "Traceback" not in err


def test_an_unknown_flag_first_is_refused_without_a_guess(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(["--bogus"], capsys)
    assert code == 2
    assert "error: unknown option '--bogus'" in err and "did you mean" not in err
    assert "could not determine which model" not in err


@pytest.mark.parametrize(("args", "name", "suggestion", "fix"), [
    (["--context-key", TINY_KEY, "--dry-rn"], "--dry-rn", "--dry-run", "runtime flags are listed by"),
    (["serve", "--metric"], "--metric", "--metrics", "runtime flags are listed by"),
    (["--context-key", TINY_KEY, "--max-num-seqs", "3"], "--max-num-seqs", None, "goes after --"),
    (["doctor", "--jsn"], "--jsn", "--json", "`carbonforge-runtime doctor --help` lists its options"),
    (["trace", "summarize", "--bogus", "t.jsonl"], "--bogus", None,
     "`carbonforge-runtime trace summarize --help` lists its options"),
    (["replay", "t.csv", "--base-ur", "http://127.0.0.1:8000/v1"], "--base-ur", "--base-url",
     "`carbonforge-runtime replay --help` lists its options"),
])
def test_an_unknown_option_after_the_first_is_reported_in_the_runtimes_style(
        args: list[str], name: str, suggestion: str | None, fix: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(args, capsys)
    assert code == 2
    first = err.splitlines()[0]
    assert first == f"error: unknown option '{name}'" + (f": did you mean {suggestion}?" if suggestion else "")
    assert "fix: " in err and fix in err
    assert "No such option" not in err and "Possible options" not in err and "Usage:" not in err


def test_an_unknown_option_through_the_app_is_reported_in_the_runtimes_style() -> None:
    result = invoke("recipes", "show", "--verbose", TINY_KEY)
    assert result.exit_code == 2
    assert "error: unknown option '--verbose'" in result.output and "No such option" not in result.output


@pytest.mark.parametrize(("args", "expected"), [
    (["--model", "m", "--seed", "1"], ["serve", "--", "--model", "m", "--seed", "1"]),
    (["--model=m"], ["serve", "--", "--model=m"]),
    (["--config", "c.yaml"], ["serve", "--", "--config", "c.yaml"]),
    (["--max-model-len", "100", "--model", "m"], ["serve", "--", "--max-model-len", "100", "--model", "m"]),
    (["Qwen/Qwen2.5-0.5B-Instruct", "--dry-run"], ["serve", "--", "Qwen/Qwen2.5-0.5B-Instruct", "--dry-run"]),
    (["--", "m"], ["serve", "--", "m"]),
])
def test_vllm_command_lines_stay_full_overrides(args: list[str], expected: list[str]) -> None:
    assert cli._dispatch(args, {}) == expected


def test_a_flag_first_line_without_a_model_is_not_a_vllm_command_line() -> None:
    with pytest.raises(UsageError, match="unknown option '--max-model-len'"):
        cli._dispatch(["--max-model-len", "100"], {})


# ---- 3. CF_CONTEXT_KEY with arguments ------------------------------------------------------------

def test_the_context_key_variable_with_flags_only_shows_the_command_with_the_key() -> None:
    result = invoke("serve", "--request-trace", "standard", "--trace-file", "/tmp/t.jsonl", "--metrics",
                    env={"CF_CONTEXT_KEY": TINY_KEY})
    assert result.exit_code == 2, result.output
    assert f"CF_CONTEXT_KEY ({TINY_KEY}) is ignored when arguments are given" in result.output
    assert (f"carbonforge-runtime --context-key {TINY_KEY} --request-trace standard "
            "--trace-file /tmp/t.jsonl --metrics") in result.output
    assert "Traceback" not in result.output


def test_nothing_to_serve_without_the_variable_is_a_usage_error() -> None:
    result = invoke("serve", "--metrics")
    assert result.exit_code == 2
    assert "nothing to serve: no context key and no vLLM arguments" in result.output
    assert "is ignored" not in result.output


# ---- 4. --dry-run anywhere ----------------------------------------------------------------------

def test_dry_run_after_the_double_dash_is_the_runtimes() -> None:
    result = invoke("serve", "--context-key", TINY_KEY, "--", "--max-num-seqs", "4", "--dry-run")
    assert result.exit_code == 0, result.output
    command = result.output.split("vLLM command:\n", 1)[1].splitlines()[0]
    assert "--max-num-seqs 4" in command and "--dry-run" not in command


def test_dry_run_inside_a_full_override_is_the_runtimes() -> None:
    result = invoke("serve", "--", "/models/m", "--max-model-len", "512", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "mode:               override" in result.output
    command = result.output.split("vLLM command:\n", 1)[1].splitlines()[0]
    assert "--model /models/m --max-model-len 512" in command and "--dry-run" not in command


# ---- 5. --strict-hardware needs a key ------------------------------------------------------------

def test_strict_hardware_in_the_full_override_is_refused() -> None:
    result = invoke("serve", "--strict-hardware", "--dry-run", "--", "/models/m")
    assert result.exit_code == 2, result.output
    assert "--strict-hardware needs a context key" in result.output
    assert "fix: serve a recipe with --context-key KEY --strict-hardware" in result.output


# ---- 1. the endpoint given after -- --------------------------------------------------------------

def test_the_dry_run_shows_the_port_host_and_name_given_after_the_double_dash() -> None:
    result = invoke("serve", "--context-key", TINY_KEY, "--dry-run", "--",
                    "--port", "9123", "--host", "127.0.0.2", "--served-model-name", "tiny-alias",
                    env={"CF_PORT": "8000"})
    assert result.exit_code == 0, result.output
    assert "served model name:  tiny-alias" in result.output
    assert "API:                http://127.0.0.2:9123/v1" in result.output


# ---- 10. the help --------------------------------------------------------------------------------

def test_the_top_level_help_lists_the_runtime_flags() -> None:
    result = runner.invoke(cli.app, ["--help"])
    assert result.exit_code == 0
    flags = result.output.split("Runtime flags", 1)[1].split("Commands:", 1)[0]
    for flag in ("--context-key", "--dry-run", "--request-trace", "--trace-file", "--trace-endpoint",
                 "--trace-format", "--metrics", "--strict-hardware", "--skip-preflight"):
        assert flag in flags, flag
    assert "doctor" in result.output.split("Commands:", 1)[1]
