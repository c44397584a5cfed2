"""Where a latency or throughput figure came from, said the same way everywhere.

Every figure the product prints or ships carries one of three labels:

* ``predicted``: computed by the twin (vLLM's scheduler in virtual time) with a step-time model;
  the label names the model and says whether it is a *proxy* (scaled from another model or GPU
  rather than fitted to the steps of the hardware it stands for);
* ``emulated``: served by the real engine with every step paced to a step-time model's time
  (``serve --emulate``); the label names the model, whether it is a proxy, and the share of steps
  that ran past their modelled time (a run with more than :data:`LATE_SHARE_LIMIT` of them late is
  not faithful);
* ``measured``: served by the real engine on real hardware; the label names the host (GPU name and
  count, driver, vLLM version) and the date.

:class:`FigureLabel` holds one label; :meth:`FigureLabel.text` renders it for people and
:meth:`FigureLabel.to_json` for result files. :func:`benchmark_labels` reads the labels of a
recipe's ``benchmark`` block. Plain data, pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PREDICTED = "predicted"
EMULATED = "emulated"
MEASURED = "measured"
#: The label vocabulary, in order of how much the figures can be trusted for real hardware.
KINDS = (PREDICTED, EMULATED, MEASURED)

#: Above this share of late steps an emulated run is not faithful to its step-time model.
LATE_SHARE_LIMIT = 0.01


@dataclass(frozen=True)
class StepModelRef:
    """The step-time model behind a predicted or emulated figure."""

    name: str
    version: int | None = None
    proxy: bool = False

    def text(self) -> str:
        shown = self.name + (f" v{self.version}" if self.version is not None else "")
        return shown + (", a proxy" if self.proxy else ", not a proxy")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "proxy": self.proxy}


@dataclass(frozen=True)
class Host:
    """The machine measured figures came from (None: not recorded)."""

    gpu: str | None = None
    gpu_count: int | None = None
    driver: str | None = None
    vllm: str | None = None

    def text(self) -> str:
        gpu = self.gpu or "an unrecorded GPU"
        parts = [f"{self.gpu_count} x {gpu}" if self.gpu_count else gpu]
        parts.append(f"driver {self.driver}" if self.driver else "driver not recorded")
        parts.append(f"vLLM {self.vllm}" if self.vllm else "vLLM version not recorded")
        return ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "gpu_count": self.gpu_count, "driver": self.driver, "vllm": self.vllm}


@dataclass(frozen=True)
class FigureLabel:
    """One figure's (or one table's) origin. Build it with :func:`predicted`, :func:`emulated` or
    :func:`measured`."""

    kind: str  # one of KINDS
    step_model: StepModelRef | None = None  # predicted, emulated
    late_steps: int | None = None  # emulated: steps that ran past their modelled time
    steps: int | None = None  # emulated: steps in all
    host: Host | None = None  # measured
    date: str | None = None  # measured: when (ISO date)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown figure label {self.kind!r} (one of {', '.join(KINDS)})")

    @property
    def late_share(self) -> float | None:
        if self.late_steps is None or not self.steps:
            return None
        return self.late_steps / self.steps

    @property
    def faithful(self) -> bool:
        """False for an emulated run with too many late steps; True otherwise."""
        share = self.late_share
        return self.kind != EMULATED or share is None or share <= LATE_SHARE_LIMIT

    def text(self) -> str:
        """One line: ``predicted by the twin with step-time model a100-80-tp1 v1, a proxy``."""
        if self.kind == PREDICTED:
            model = self.step_model.text() if self.step_model else "an unnamed model"
            return f"{PREDICTED} by the twin with step-time model {model}"
        if self.kind == EMULATED:
            model = self.step_model.text() if self.step_model else "an unnamed model"
            text = f"{EMULATED}: the real engine paced to step-time model {model}"
            share = self.late_share
            if share is None:
                return text + "; late steps not recorded"
            text += f"; {share:.2%} of {self.steps:,} steps late"
            return text + ("" if self.faithful else f" (over {LATE_SHARE_LIMIT:.0%}: not faithful)")
        host = self.host.text() if self.host else "an unrecorded host"
        return f"{MEASURED} on {host}, " + (self.date or "date not recorded")

    def to_json(self) -> dict[str, Any]:
        """The label for a result file: its kind, its details, and the rendered text."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.step_model is not None:
            out["step_model"] = self.step_model.to_json()
        if self.kind == EMULATED:
            out["late_steps"] = self.late_steps
            out["steps"] = self.steps
            share = self.late_share
            out["late_share"] = None if share is None else round(share, 6)
        if self.kind == MEASURED:
            out["host"] = (self.host or Host()).to_json()
            out["date"] = self.date
        out["text"] = self.text()
        return out


def predicted(model: str, version: int | None = None, proxy: bool = False) -> FigureLabel:
    return FigureLabel(PREDICTED, step_model=StepModelRef(model, version, proxy))


def emulated(model: str, version: int | None, proxy: bool, late_steps: int | None,
             steps: int | None) -> FigureLabel:
    return FigureLabel(EMULATED, step_model=StepModelRef(model, version, proxy), late_steps=late_steps,
                       steps=steps)


def measured(gpu: str | None, gpu_count: int | None, driver: str | None, vllm: str | None,
             date: str | None) -> FigureLabel:
    return FigureLabel(MEASURED, host=Host(gpu, gpu_count, driver, vllm), date=date)


def of_cost_model(cost: Any) -> FigureLabel:
    """The predicted label of a step-time model object (anything with ``name``, ``version``, ``proxy``)."""
    return predicted(str(cost.name), getattr(cost, "version", None), bool(getattr(cost, "proxy", False)))


# --- a recipe's benchmark block -------------------------------------------------------------------------


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value)


def _model_ref(raw: Any) -> StepModelRef:
    if isinstance(raw, Mapping):
        return StepModelRef(str(raw.get("name") or "unnamed"), _count(raw.get("version")), bool(raw.get("proxy")))
    return StepModelRef(str(raw or "unnamed"))


def _host(raw: Any) -> Host:
    """``measured_on``: a mapping (``gpu``, ``gpu_count``, ``driver``, ``vllm``) or one line of text."""
    if isinstance(raw, Mapping):
        return Host(_text(raw.get("gpu")), _count(raw.get("gpu_count")), _text(raw.get("driver")),
                    _text(raw.get("vllm")))
    return Host(gpu=_text(raw))


def benchmark_labels(block: Mapping[str, Any] | None) -> list[tuple[str, FigureLabel]]:
    """The labels of a recipe's ``benchmark`` block, as (the part of the block, its label):

    * ``figures`` when ``measured_on`` names a host: measured (a mapping ``gpu``, ``gpu_count``,
      ``driver``, ``vllm``, or a line of text; the date from ``date``);
    * ``predicted``: predicted, with its ``cost_model``.

    Empty when the block holds no figures."""
    out: list[tuple[str, FigureLabel]] = []
    if not block:
        return out
    host = block.get("measured_on")
    if host:
        date = block.get("date")
        out.append(("figures", FigureLabel(MEASURED, host=_host(host), date=None if date is None else str(date))))
    forecast = block.get("predicted")
    if isinstance(forecast, Mapping):
        out.append(("predicted", FigureLabel(PREDICTED, step_model=_model_ref(forecast.get("cost_model")))))
    return out


def describe_benchmark(block: Mapping[str, Any] | None) -> str:
    """One line for a recipe's figures: every label of its benchmark block, or that it has none."""
    labels = benchmark_labels(block)
    if not labels:
        return "no benchmark figures (neither measured nor predicted)"
    return "; ".join(label.text() for _, label in labels)


def benchmark_lines(block: Mapping[str, Any] | None) -> list[str]:
    """Lines for ``recipes show``: one per labelled part of the benchmark block (``benchmark.predicted:
    predicted by the twin with ...``), or one saying there are no figures."""
    labels = benchmark_labels(block)
    if not labels:
        return ["benchmark figures: none (neither measured nor predicted)"]
    return [f"benchmark.{part}: {label.text()}" for part, label in labels]
