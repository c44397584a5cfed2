"""No read of a path an operator names can block: a FIFO without a writer (or a device, a socket) is
refused at once, with the path and the fix, by every reader: the library functions, the offline
tools' commands and the dry run of ``serve``.

Every check runs in a subprocess with a timeout, so that a read that blocks again fails the test
instead of hanging the run; a fresh interpreter for each is the point, which is why this file lives in
tests/integration and not in tests/unit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from carbonforge_runtime.core.ordering.ltr import LtrModel
from tests.support import REPO, TINY_KEY

#: How long a refusal may take once the code runs (the acceptance asks for 5 s).
REFUSED_WITHIN_S = 5.0
#: The subprocess's limit, imports included, on a loaded machine: a blocked read ends here.
HANG_S = 120
DEAD_URL = "http://127.0.0.1:9/v1"


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "input.yaml"  # a .yaml name, so that vLLM's --config reading gets as far as the open
    os.mkfifo(path)  # nobody ever writes to it: a blocking open or read waits forever
    return path


def base_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "CF_", "CARBONFORGE_"))}
    env.update({"PYTHONPATH": str(REPO), "CF_LOG_DIR": str(tmp_path / "logs"), "CF_LOG_LEVEL": "warning",
                "CF_LICENSE_FILE": str(tmp_path / "no-licence.key")})
    return env


def run_python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=base_env(tmp_path), cwd=REPO, timeout=HANG_S)


#: Each reader, called on the FIFO ``F``; it must raise ``expected`` (printed as ``name: message``).
READERS = {
    "the files helper": ("from carbonforge_runtime.files import read_regular as read", "read(F, 10)"),
    "ltr ranker model": ("from carbonforge_runtime.core.ordering.ltr import LtrModel", "LtrModel.load(Path(F))"),
    "ltr recipe parameter": ("from carbonforge_runtime.core.ordering.registry import make_family",
                             "make_family('hybrid', {'model': F})"),
    "OTLP CA certificate": ("from carbonforge_runtime.runtime.planning.trace_options import resolve_trace_options",
                            "resolve_trace_options('standard', None, 'https://c:4318', 'otlp', "
                            "{'OTEL_EXPORTER_OTLP_CERTIFICATE': F})"),
    "OTLP client key": ("from carbonforge_runtime.runtime.planning.trace_options import resolve_trace_options",
                        "resolve_trace_options('standard', None, 'https://c:4318', 'otlp', "
                        "{'OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE': CERT, 'OTEL_EXPORTER_OTLP_CLIENT_KEY': F})"),
    "vLLM --config": ("from carbonforge_runtime.runtime.vllm_cli.served_model import model_choices",
                      "model_choices(['--config', F])"),
    "trace input": ("from carbonforge_runtime.offline.trace_reader import check_readable",
                    "check_readable(Path(F))"),
    "licence file": ("from carbonforge_runtime.runtime.licensing.source import read_license\n"
                     "from carbonforge_runtime.settings import load_settings",
                     "raise SystemError(read_license(load_settings({'CF_LICENSE_FILE': F})).problem)"),
    "API key file": ("from carbonforge_runtime.runtime.serve.api_key import read_api_key\n"
                     "from carbonforge_runtime.settings import load_settings",
                     "read_api_key(load_settings({'CF_API_KEY_FILE': F}))"),
    "recipe file": ("from carbonforge_runtime.recipes.loader import load_recipe_file", "load_recipe_file(Path(F))"),
    "step-time model": ("from carbonforge_runtime.core.step_models import load_model_file",
                        "load_model_file(Path(F))"),
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_refuses_a_fifo_at_once(reader: str, fifo: Path, tmp_path: Path) -> None:
    imports, call = READERS[reader]
    cert = tmp_path / "client.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    done = run_python(f"""
        import time
        from pathlib import Path
        {imports.replace(chr(10), chr(10) + ' ' * 8)}
        F, CERT = {str(fifo)!r}, {str(cert)!r}
        started = time.monotonic()
        try:
            {call}
        except Exception as exc:
            print(f"{{time.monotonic() - started:.3f}} {{type(exc).__name__}}: {{exc}}")
        else:
            print("not refused")
        """, tmp_path)
    assert done.returncode == 0, done.stderr
    took, _, refusal = done.stdout.strip().partition(" ")
    assert float(took) < REFUSED_WITHIN_S, done.stdout
    assert str(fifo) in refusal or reader in ("licence file",), refusal
    assert "FIFO" in refusal, refusal


def run_cli(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = base_env(tmp_path)
    full.update(env)
    return subprocess.run([sys.executable, "-m", "carbonforge_runtime", *args], capture_output=True, text=True,
                          env=full, cwd=tmp_path, timeout=HANG_S)


def assert_refused(done: subprocess.CompletedProcess[str], fifo: Path, codes: set[int]) -> None:
    assert done.returncode in codes, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(fifo) in errors[0] and "FIFO" in errors[0], done.stderr
    assert "fix: " in done.stderr


#: The offline tools: their arguments, with {F} the FIFO and {T} a valid trace.
TOOLS = {
    "trace summarize": ["trace", "summarize", "{F}"],
    "trace sessions": ["trace", "sessions", "{F}", "-o", "{tmp}/groups.jsonl"],
    "trace plot": ["trace", "plot", "{F}", "-o", "{tmp}/p.png"],
    "replay": ["replay", "{F}", "--base-url", DEAD_URL, "-o", "{tmp}/r.json", "--quiet"],
    "ltr fit": ["ltr", "fit", "{F}", "-o", "{tmp}/m.json"],
    "ltr eval (model)": ["ltr", "eval", "{F}", "{T}"],
    "ltr eval (trace)": ["ltr", "eval", "{tmp}/m.json", "{F}"],
    "sim": ["sim", "{F}", "--context-key", TINY_KEY, "--cost-model", "l4-tp1", "-o", "{tmp}/s.json"],
    "sim --cost-model": ["sim", "{T}", "--context-key", TINY_KEY, "--cost-model", "{F}", "-o", "{tmp}/s.json"],
    "sim-calibrate": ["sim-calibrate", "{F}", "-o", "{tmp}/model.yaml"],
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_offline_tool_refuses_a_fifo_input(tool: str, fifo: Path, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t_arrival": 1.0, "prompt_tokens": 3, "output_tokens": 2}\n')
    LtrModel().save(tmp_path / "m.json")
    args = [a.format(F=fifo, T=trace, tmp=tmp_path) for a in TOOLS[tool]]
    assert_refused(run_cli(args, tmp_path), fifo, {1, 2})


def ranker_recipe(tmp_path: Path, model: Path) -> tuple[str, dict[str, str]]:
    """A recipe directory with a hybrid-ordered copy of the tiny CPU recipe whose model file is ``model``."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    text = (REPO / "recipes" / "cf-tiny--bf16--chat--cpu.yaml").read_text()
    text = text.replace("key: cf-tiny:bf16:chat:cpu", "key: cf-tiny-ranked:bf16:chat:cpu")
    text = text.replace("  family: fcfs\n  params: {}", f"  family: hybrid\n  params: {{model: {str(model)!r}}}")
    (recipes / "cf-tiny-ranked--bf16--chat--cpu.yaml").write_text(text)
    return "cf-tiny-ranked:bf16:chat:cpu", {"CF_RECIPES_DIR": str(recipes)}


def test_the_dry_run_refuses_a_fifo_as_ranker_model(fifo: Path, tmp_path: Path) -> None:
    key, env = ranker_recipe(tmp_path, fifo)
    assert_refused(run_cli(["--context-key", key, "--dry-run"], tmp_path, **env), fifo, {2})


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_CERTIFICATE", "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE"])
def test_the_dry_run_refuses_a_fifo_as_tls_file(variable: str, fifo: Path, tmp_path: Path) -> None:
    done = run_cli(["--context-key", TINY_KEY, "--request-trace", "standard", "--trace-endpoint",
                    "https://collector.example:4318", "--dry-run"], tmp_path, **{variable: str(fifo)})
    assert_refused(done, fifo, {2})


def test_the_dry_run_refuses_a_fifo_as_vllm_config(fifo: Path, tmp_path: Path) -> None:
    done = run_cli(["--dry-run", "--", "--config", str(fifo)], tmp_path)
    assert_refused(done, fifo, {4})


def test_sigterm_while_planning_ends_the_runtime(fifo: Path, tmp_path: Path) -> None:
    """With every input a FIFO, SIGTERM at any moment of the start-up ends the process: no read can
    hold it (the handler installed for the launch only sets a flag that a blocked read would never see)."""
    key, env = ranker_recipe(tmp_path, fifo)
    env.update({"CF_API_KEY_FILE": str(fifo), "CF_LICENSE_FILE": str(fifo),
                "OTEL_EXPORTER_OTLP_CERTIFICATE": str(fifo)})
    for delay_s in (0.5, 1.5, 3.0):
        full = base_env(tmp_path)
        full.update(env)
        proc = subprocess.Popen([sys.executable, "-m", "carbonforge_runtime", "--context-key", key,
                                 "--request-trace", "standard", "--trace-endpoint", "https://c.example:4318",
                                 "--dry-run"], env=full, cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            _, err = proc.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise AssertionError(f"still running {HANG_S} s after SIGTERM at {delay_s} s") from None
        assert time.monotonic() - sent < 30, delay_s  # a blocked read would be stuck until the timeout
        assert "Traceback" not in err, err
        assert proc.returncode in (2, -signal.SIGTERM, 0), (proc.returncode, err)
