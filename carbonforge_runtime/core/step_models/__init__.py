"""Step-time models shipped as data: one YAML file per GPU and tensor-parallel size of the shipped
recipes, each versioned and carrying its provenance. Reading and validating them is pure (a file
read, no other I/O).

A file holds ``name``, ``version``, ``gpu``, ``tensor_parallel_size``, ``coefficients_ms``
(``floor``, ``per_batched_token``, ``per_kv_token_read``, ``attention``, ``overhead``),
``kv_capacity_tokens``, ``provenance``, and, for a model derived from figures of another model or
GPU, ``proxy: true`` with its ``scaling_rule``. A model fitted on a host may add
``admission_delay_ms`` (``base``, ``per_prompt_token``): the host's delay from the API server's
arrival stamp to the engine core (:func:`carbonforge_runtime.core.twin_data.admission_delay_s`);
without it the delay is zero.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from carbonforge_runtime import files
from carbonforge_runtime.core.twin_data import SimError, StepCostModel

#: A step-time model is a few lines of YAML; anything far larger is not one.
MAX_MODEL_BYTES = 64 * 1024
_COEFFICIENTS = ("floor", "per_batched_token", "per_kv_token_read", "attention", "overhead")
_ADMISSION = ("base", "per_prompt_token")
_OPTIONAL = {"proxy", "scaling_rule", "admission_delay_ms"}
_FIELDS = {"name", "version", "gpu", "tensor_parallel_size", "coefficients_ms", "kv_capacity_tokens", "provenance",
           *_OPTIONAL}


def shipped_dir() -> Path:
    return Path(__file__).resolve().parent


def shipped_models() -> dict[str, StepCostModel]:
    """Every shipped model by name, in name order."""
    models = [load_model_file(path) for path in sorted(shipped_dir().glob("*.yaml"))]
    return {m.name: m for m in sorted(models, key=lambda m: m.name)}


class _NoAliases(yaml.SafeLoader):
    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.constructor.ConstructorError(None, None, "YAML aliases are not allowed",
                                                    self.peek_event().start_mark)
        return super().compose_node(parent, index)


def _fail(path: Path, problem: str) -> SimError:
    return SimError(f"step-time model {path}: {problem}",
                    "fix the file (see docs/sim.md for its fields) or pass --cost-model with a shipped name")


def load_model_file(path: Path) -> StepCostModel:
    try:
        raw = files.read_regular(path, MAX_MODEL_BYTES)
        if len(raw) > MAX_MODEL_BYTES:
            raise _fail(path, f"over {MAX_MODEL_BYTES} bytes is too large for a step-time model")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise SimError(f"step-time model {path} does not exist",
                       "pass --cost-model with a shipped model's name or the path of a YAML file") from None
    except files.NotRegularFile as exc:
        raise SimError(f"step-time model {exc}", files.NOT_REGULAR_REMEDY) from None
    except OSError as exc:
        raise SimError(f"step-time model {path} cannot be read ({exc.strerror})",
                       "check the file's permissions") from None
    except UnicodeDecodeError:
        raise _fail(path, "is not UTF-8 text") from None
    try:
        data = yaml.load(text, Loader=_NoAliases)
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        raise _fail(path, f"is not valid YAML ({str(exc)[:120]})") from None
    return model_from_mapping(data, path)


def _number(path: Path, name: str, raw: Any, minimum: float = 0.0) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or raw < minimum:
        raise _fail(path, f"{name} must be a finite number >= {minimum:g}, got {str(raw)[:40]!r}")
    return float(raw)


def _integer(path: Path, name: str, raw: Any, minimum: int = 1) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < minimum:
        raise _fail(path, f"{name} must be a whole number >= {minimum}, got {str(raw)[:40]!r}")
    return raw


def _text(path: Path, name: str, raw: Any, required: bool = True) -> str | None:
    if raw is None and not required:
        return None
    if not isinstance(raw, str) or not raw.strip():
        raise _fail(path, f"{name} must be non-empty text")
    return raw.strip()


def model_from_mapping(data: Any, path: Path) -> StepCostModel:
    if not isinstance(data, dict):
        raise _fail(path, "is not a YAML mapping")
    unknown = sorted(str(k) for k in data if k not in _FIELDS)
    if unknown:
        raise _fail(path, f"unknown field(s) {', '.join(unknown[:5])}")
    missing = sorted(k for k in _FIELDS - _OPTIONAL if k not in data)
    if missing:
        raise _fail(path, f"missing field(s) {', '.join(missing)}")
    coefficients = data["coefficients_ms"]
    if not isinstance(coefficients, dict) or set(coefficients) != set(_COEFFICIENTS):
        raise _fail(path, f"coefficients_ms must have exactly {', '.join(_COEFFICIENTS)}")
    c = {k: _number(path, f"coefficients_ms.{k}", coefficients[k]) for k in _COEFFICIENTS}
    admission = data.get("admission_delay_ms")
    delay = dict.fromkeys(_ADMISSION, 0.0)
    if admission is not None:
        if not isinstance(admission, dict) or set(admission) != set(_ADMISSION):
            raise _fail(path, f"admission_delay_ms must have exactly {', '.join(_ADMISSION)}")
        delay = {k: _number(path, f"admission_delay_ms.{k}", admission[k]) for k in _ADMISSION}
    proxy = data.get("proxy", False)
    if not isinstance(proxy, bool):
        raise _fail(path, "proxy must be true or false")
    rule = _text(path, "scaling_rule", data.get("scaling_rule"), required=proxy)
    name = _text(path, "name", data["name"])
    gpu = _text(path, "gpu", data["gpu"])
    provenance = _text(path, "provenance", data["provenance"])
    assert name is not None and gpu is not None and provenance is not None
    return StepCostModel(
        name=name,
        version=_integer(path, "version", data["version"]),
        gpu=gpu,
        tensor_parallel_size=_integer(path, "tensor_parallel_size", data["tensor_parallel_size"]),
        floor_ms=c["floor"], per_batched_token_ms=c["per_batched_token"],
        per_kv_token_read_ms=c["per_kv_token_read"], attention_ms=c["attention"], overhead_ms=c["overhead"],
        kv_capacity_tokens=_integer(path, "kv_capacity_tokens", data["kv_capacity_tokens"], minimum=16),
        provenance=provenance, proxy=proxy, scaling_rule=rule, source=str(path),
        admission_base_ms=delay["base"], admission_per_prompt_token_ms=delay["per_prompt_token"],
    )


def resolve_model(choice: str | None, gpu: str | None, tensor_parallel_size: int) -> StepCostModel:
    """``choice`` (a shipped name or a YAML path); without one, the shipped model for ``gpu`` and the TP size."""
    models = shipped_models()
    if choice:
        if choice in models:
            return models[choice]
        if choice.endswith((".yaml", ".yml")) or "/" in choice:
            return load_model_file(Path(choice))
        raise SimError(f"no step-time model named {choice!r}",
                       f"pass --cost-model with one of {', '.join(models)} or the path of a YAML file")
    matching = [m for m in models.values() if m.gpu == gpu and m.tensor_parallel_size == tensor_parallel_size]
    if not matching:
        raise SimError(f"no shipped step-time model for {gpu or 'this hardware'} at tensor-parallel size "
                       f"{tensor_parallel_size}",
                       f"pass --cost-model with one of {', '.join(models)} or the path of a YAML file")
    return matching[0]
