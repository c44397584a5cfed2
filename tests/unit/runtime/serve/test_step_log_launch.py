"""--step-log at launch: the engine contract's step_log part, refusals before anything starts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from carbonforge_runtime.core.contract import CONTRACT_ENV, EngineContract
from carbonforge_runtime.errors import CarbonForgeError, UsageError
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.runtime.serve.launch import ServeOptions, _create_step_log, describe_prepared, prepare
from carbonforge_runtime.settings import load_settings
from tests.support import TINY_KEY


def prepared(options: ServeOptions):  # type: ignore[no-untyped-def]
    return prepare(options, load_settings({}), {}, FakeGpuBackend(host("l4")))


def test_off_by_default() -> None:
    ready = prepared(ServeOptions(context_key=TINY_KEY))
    contract: dict[str, Any] = json.loads(ready.plan.engine_env()[CONTRACT_ENV])
    assert contract["step_log"] is None
    assert "step log:           off" in describe_prepared(ready, ServeOptions(), {})


def test_step_log_reaches_the_engine_contract(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "steps.jsonl"
    ready = prepared(ServeOptions(context_key=TINY_KEY, step_log=str(path)))
    contract = EngineContract.from_json(ready.plan.engine_env()[CONTRACT_ENV])
    assert contract.step_log is not None and contract.step_log.file == str(path)
    assert contract.tracing is None  # independent of the request trace
    assert f"step log:           {path}" in describe_prepared(ready, ServeOptions(), {})
    assert not path.exists()  # preparing creates nothing; serve() creates it before launch
    _create_step_log(ready.plan.contract)
    assert path.is_file()


def test_relative_path_is_made_absolute_in_override_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ready = prepared(ServeOptions(step_log="steps.jsonl", vllm_args=["/models/tiny"]))
    contract = EngineContract.from_json(ready.plan.engine_env()[CONTRACT_ENV])
    assert contract.step_log is not None and contract.step_log.file == os.path.join(str(tmp_path), "steps.jsonl")


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--step-log is empty"):
        prepared(ServeOptions(context_key=TINY_KEY, step_log=" "))
    with pytest.raises(UsageError, match="scheduler-cls"):
        prepared(ServeOptions(step_log=str(tmp_path / "s.jsonl"),
                              vllm_args=["/models/tiny", "--scheduler-cls", "my.Scheduler"]))
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "elsewhere")
    ready = prepared(ServeOptions(context_key=TINY_KEY, step_log=str(link)))
    with pytest.raises(CarbonForgeError, match="symbolic link"):
        _create_step_log(ready.plan.contract)
    assert not (tmp_path / "elsewhere").exists()
