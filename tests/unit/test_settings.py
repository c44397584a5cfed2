"""Every variable is parsed once, and a value that cannot be meant is refused before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

from carbonforge_runtime.errors import OverrideError
from carbonforge_runtime.settings import DEFAULT_API_PORT, VARIABLES, Settings, VarName, load_settings


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "0", "-5", "soon"])
def test_a_deadline_must_be_a_finite_positive_number(raw: str) -> None:
    with pytest.raises(OverrideError, match="CF_READY_TIMEOUT_S") as info:
        load_settings({"CF_READY_TIMEOUT_S": raw})
    assert "set CF_READY_TIMEOUT_S" in info.value.remedy


def test_typed_values_and_defaults() -> None:
    settings = load_settings({"CF_READY_TIMEOUT_S": "90", "CF_METRICS_PORT": "9200", "CF_VLLM_EXTRA_ARGS": "--a 'b c'"})
    assert settings.ready_timeout_s == 90.0 and settings.metrics_port == 9200
    assert settings.vllm_extra_args == ["--a", "b c"]
    assert load_settings({}).metrics_port == 9105 and load_settings({}).fake_nvml is None
    assert not load_settings({}).is_set("CF_METRICS_PORT")


@pytest.mark.parametrize(("raw", "offline"), [
    ("1", True), ("ON", True), ("on", True), ("Yes", True), ("TRUE", True), ("tRuE", True),
    ("0", False), ("off", False), ("false", False), ("2", False), ("offline", False), (" 1", False),
])
def test_hf_hub_offline_reads_every_value_as_huggingface_hub_does(raw: str, offline: bool) -> None:
    """huggingface_hub takes 1/ON/YES/TRUE in any case for true and anything else for false, never an error."""
    assert load_settings({"HF_HUB_OFFLINE": raw}).hf_hub_offline is offline
    from huggingface_hub.constants import _is_true

    assert _is_true(raw) is offline  # the library the engine uses agrees


def test_every_typed_name_is_declared_once() -> None:
    """mypy refuses a declaration whose name VarName does not list; this catches the converse (a listed
    name that nothing declares) and a name declared twice."""
    names = [var.name for var in VARIABLES]
    assert len(names) == len(set(names))
    assert set(get_args(VarName)) == set(names)


def test_each_attribute_reads_its_declared_variable() -> None:
    settings = load_settings({"CF_PORT": "8100", "CF_API_KEY": "k", "CF_LOG_DIR": "~/logs", "CF_NNODES": "2"})
    assert Settings.port.name == "CF_PORT" and settings.port == 8100 and settings.value("CF_PORT") == 8100
    assert settings.api_key == "k" and settings.nnodes == 2 and settings.is_set("CF_NNODES")
    assert settings.log_dir == Path("~/logs").expanduser()
    defaults = load_settings({})
    assert defaults.port == DEFAULT_API_PORT and defaults.api_key is None and defaults.vllm_extra_args == []
    assert defaults.compile_cache_dir == "~/.cache/carbonforge/compile"  # not expanded
