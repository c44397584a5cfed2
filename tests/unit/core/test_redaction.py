"""Secrets leave vLLM's command line for its environment, and every printed command or URL hides them."""

from __future__ import annotations

from carbonforge_runtime.core.redaction import REDACTED, redact_args, redact_url, secrets_to_env


def test_single_secret_values_move_to_the_environment() -> None:
    args, env, notes = secrets_to_env(["--max-num-seqs", "4", "--api-key", "k1", "--hf-token=hf_2", "--seed", "1"])
    assert args == ["--max-num-seqs", "4", "--seed", "1"]
    assert env == {"VLLM_API_KEY": "k1", "HF_TOKEN": "hf_2"}
    assert len(notes) == 2 and "VLLM_API_KEY" in notes[0] and "k1" not in "".join(notes)


def test_bare_or_multi_valued_secret_flags_stay_but_print_redacted() -> None:
    args, env, _ = secrets_to_env(["--api-key", "a", "b", "--hf-token", "--seed", "1"])
    assert env == {} and args == ["--api-key", "a", "b", "--hf-token", "--seed", "1"]
    assert redact_args(args) == ["--api-key", REDACTED, REDACTED, "--hf-token", "--seed", "1"]
    assert redact_args(["--api-key=zz"]) == [f"--api-key={REDACTED}"]


def test_url_credentials_are_redacted() -> None:
    assert redact_url("https://user:token@collector:4318/v1/traces") == f"https://{REDACTED}@collector:4318/v1/traces"
    assert redact_url("http://collector:4317") == "http://collector:4317"
    assert redact_args(["--otlp-traces-endpoint", "https://u:p@h:1"]) == ["--otlp-traces-endpoint",
                                                                         f"https://{REDACTED}@h:1"]
