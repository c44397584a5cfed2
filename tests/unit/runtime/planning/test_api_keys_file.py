"""How serve wires the keys file: checked before anything starts, its path (never a secret) handed to
vLLM's API server, vLLM's own key check left off so that named keys pass, and CF_API_KEY beside it as a
digest only."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from carbonforge_runtime.core.api_keys import KEYS_FILE_VARIABLE, SHORTCUT_DIGEST_VARIABLE, KeysFileError
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.runtime.planning.plan import ServeOptions, build_plan, command_line, describe_plan
from carbonforge_runtime.runtime.serve.api_key import check_keys_file
from carbonforge_runtime.settings import load_settings
from tests.unit.runtime.planning.test_api_wiring import OPEN_WARNING, SHIPPED

TINY = "cf-tiny:bf16:chat:cpu"
KEY = "cf-shortcut-7d2e1f0a9b8c"
ENTRY = f"keys:\n  - name: team-a\n    sha256: {'ab' * 32}\n    scopes: [inference:invoke]\n"


def planned(environ: dict[str, str], vllm_args: list[str] | None = None, api_key: str | None = None):  # type: ignore[no-untyped-def]
    settings = load_settings(environ)
    options = ServeOptions(context_key=TINY, vllm_args=vllm_args or [])
    return build_plan(options, settings, SHIPPED, environ, api_key=api_key, keys_file=check_keys_file(settings))


def test_the_keys_file_reaches_the_api_server_by_path(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(ENTRY)
    plan = planned({KEYS_FILE_VARIABLE: str(path)})
    env = plan.launch.env
    assert env[KEYS_FILE_VARIABLE] == str(path) and "VLLM_API_KEY" not in env and SHORTCUT_DIGEST_VARIABLE not in env
    assert not [m for m in plan.messages if OPEN_WARNING in m.text]
    lines = describe_plan(plan, ServeOptions(), {})
    assert f"API keys:           required (Authorization: Bearer); named keys from {path} (re-read when it " \
           "changes)" in lines


def test_cf_api_key_beside_the_file_travels_as_a_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(ENTRY)
    monkeypatch.chdir(tmp_path)
    plan = planned({KEYS_FILE_VARIABLE: "keys.yaml", "CF_API_KEY": KEY}, api_key=KEY)
    env = plan.launch.env
    assert env[KEYS_FILE_VARIABLE] == str(path)  # made absolute: vLLM runs elsewhere
    assert env[SHORTCUT_DIGEST_VARIABLE] == hashlib.sha256(KEY.encode()).hexdigest()
    assert "VLLM_API_KEY" not in env and "CF_API_KEY" not in env
    lines = describe_plan(plan, ServeOptions(), {})
    assert any("and CF_API_KEY with every scope" in line for line in lines)
    assert KEY not in "\n".join(lines) + command_line(plan) + " ".join(env.values())
    assert not any(env[SHORTCUT_DIGEST_VARIABLE] in line for line in lines)


def test_a_bad_keys_file_stops_the_start_with_the_entry_and_fix(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(ENTRY + "  - name: b\n    sha256: 00\n    scopes: [models:read]\n")
    with pytest.raises(KeysFileError) as caught:
        planned({KEYS_FILE_VARIABLE: str(path)})
    assert f"{path}: entry 2 ('b', line 5): sha256: is not 64 hexadecimal digits" in caught.value.message
    assert "keys new" in caught.value.remedy
    with pytest.raises(UsageError, match="cannot be read"):
        planned({KEYS_FILE_VARIABLE: str(tmp_path / "absent.yaml")})


def test_vllm_api_key_flag_beside_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(ENTRY)
    with pytest.raises(UsageError, match="cannot be used with CF_API_KEYS_FILE") as caught:
        planned({KEYS_FILE_VARIABLE: str(path)}, vllm_args=["--api-key", "abc"])
    assert "CF_API_KEY" in caught.value.remedy
