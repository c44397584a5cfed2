"""The twin's plain data: requests to replay, the engine knobs, the step-time model and the outcome. Pure.

The twin (:mod:`carbonforge_runtime.engine.twin`) drives vLLM's real scheduler in virtual time; a
step-time model stands in for the forward pass. A step costs

``max(floor, per_batched_token * batched_tokens) + per_kv_token_read * kv_read_tokens
+ attention * sum(chunk * (context + chunk / 2)) + overhead`` milliseconds,

where ``kv_read_tokens`` sums the context of every decoding request and the attention term sums
over every prompt chunk the step computes (``context`` is what was already computed before it).
Models are versioned YAML files (:mod:`carbonforge_runtime.core.step_models`).

A model may also carry the host's *admission delay*: the time from the API server's arrival stamp
(vLLM's ``Request.arrival_time``, taken when rendering and tokenisation start) to the moment the
request is in the engine core's input queue, ready to be taken in at the next step boundary. It is
``base + per_prompt_token * prompt_tokens`` milliseconds of host time (:func:`admission_delay_s`),
zero unless a model says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from carbonforge_runtime.errors import UsageError


class SimError(UsageError):
    """The simulation's inputs or options cannot be used."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request to replay through the twin.

    ``blocks`` names the content of the prompt in blocks of ``block_tokens`` tokens: two requests
    with the same id at the same position have identical tokens there (and, as ids are chained,
    identical tokens before it), so vLLM's prefix cache finds them. ``None``: the prompt shares
    nothing with any other request."""

    index: int
    arrival_s: float  # seconds after the first arrival
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] | None = None
    block_tokens: int = 0
    tenant: str | None = None  # the trace's tenant column (None: the default tenant)
    priority: int = 0  # the trace's priority column: the request's priority class


@dataclass(frozen=True)
class TwinSettings:
    """The engine the twin models: the recipe's vLLM knobs, its ordering, and the KV capacity."""

    family: str
    params: Mapping[str, Any]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_tokens: int
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    block_size: int = 16
    async_scheduling: bool = True
    #: Virtual seconds between two samples of KV use, running and waiting requests.
    sample_every_s: float = 1.0

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SimError(f"{name.replace('_', '-')} {value!r} must be a whole number of at least 1",
                               f"pass --{name.replace('_', '-')} N with N >= 1")
        if self.long_prefill_token_threshold < 0:
            raise SimError(f"long-prefill-token-threshold {self.long_prefill_token_threshold} is negative",
                           "pass 0 (vLLM's default) or a positive number of tokens")
        if self.kv_tokens < self.block_size:
            raise SimError(f"kv-tokens {self.kv_tokens} is less than one block of {self.block_size} tokens",
                           "pass --kv-tokens with the KV cache size the engine log prints")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise SimError(f"without chunked prefill max-num-batched-tokens ({self.max_num_batched_tokens}) must be "
                           f"at least max-model-len ({self.max_model_len})",
                           "raise --max-num-batched-tokens, lower --max-model-len or keep chunked prefill on")

    @property
    def kv_blocks(self) -> int:
        return self.kv_tokens // self.block_size


@dataclass(frozen=True)
class StepCostModel:
    """A step-time model: coefficients in milliseconds, and where they come from."""

    name: str
    version: int
    gpu: str
    tensor_parallel_size: int
    floor_ms: float
    per_batched_token_ms: float
    per_kv_token_read_ms: float
    attention_ms: float  # per unit of chunk * (context + chunk / 2)
    overhead_ms: float
    kv_capacity_tokens: int
    provenance: str
    proxy: bool = False
    scaling_rule: str | None = None
    source: str = ""  # the file it was read from
    #: The host's admission delay (see the module's description), in milliseconds of host time: the
    #: API server's and the engine core's own work, not a GPU's, so a slowdown of the steps leaves it alone.
    admission_base_ms: float = 0.0
    admission_per_prompt_token_ms: float = 0.0

    @property
    def has_admission_delay(self) -> bool:
        return self.admission_base_ms > 0.0 or self.admission_per_prompt_token_ms > 0.0

    def describe(self) -> str:
        text = f"{self.name} v{self.version} ({self.gpu}, TP {self.tensor_parallel_size})"
        return text + (" [PROXY: " + (self.scaling_rule or "scaled from another model") + "]" if self.proxy else "")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "version": self.version, "gpu": self.gpu,
            "tensor_parallel_size": self.tensor_parallel_size,
            "coefficients_ms": {"floor": self.floor_ms, "per_batched_token": self.per_batched_token_ms,
                                "per_kv_token_read": self.per_kv_token_read_ms, "attention": self.attention_ms,
                                "overhead": self.overhead_ms},
            "kv_capacity_tokens": self.kv_capacity_tokens, "proxy": self.proxy, "scaling_rule": self.scaling_rule,
            "provenance": self.provenance,
        }
        if self.has_admission_delay:  # absent when zero, so results without a delay stay as they were
            out["admission_delay_ms"] = {"base": self.admission_base_ms,
                                         "per_prompt_token": self.admission_per_prompt_token_ms}
        return out

    def without_admission_delay(self) -> StepCostModel:
        return replace(self, admission_base_ms=0.0, admission_per_prompt_token_ms=0.0)


def step_time_s(model: StepCostModel, batched_tokens: int, kv_read_tokens: int, attention_units: float) -> float:
    """Seconds one engine step takes (see the module's formula)."""
    ms = (max(model.floor_ms, model.per_batched_token_ms * batched_tokens)
          + model.per_kv_token_read_ms * kv_read_tokens + model.attention_ms * attention_units + model.overhead_ms)
    return ms / 1000.0


def admission_delay_s(model: StepCostModel, prompt_tokens: int) -> float:
    """Seconds of host time from a request's arrival stamp until the engine core can take it in."""
    return (model.admission_base_ms + model.admission_per_prompt_token_ms * prompt_tokens) / 1000.0


@dataclass(slots=True)
class SimOutcome:
    """What happened to one request, in virtual seconds after the first arrival."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # asked for
    generated_tokens: int = 0
    scheduled_s: float | None = None  # first admission into the running batch
    first_token_s: float | None = None
    completion_s: float | None = None
    cached_prompt_tokens: int | None = None  # at first admission
    preemptions: int = 0
    priority_score: float | None = None
    finish_reason: str = "abort"
    tenant: str | None = None
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Sample:
    """The engine at one moment of virtual time."""

    t_s: float
    kv_usage: float  # fraction of KV blocks in use (vLLM's own figure)
    running: int
    waiting: int


@dataclass
class TwinRun:
    outcomes: list[SimOutcome]
    steps: int = 0
    makespan_s: float = 0.0
    busy_s: float = 0.0  # virtual seconds with a step running
    prefill_tokens: int = 0
    decode_tokens: int = 0
    samples: list[Sample] = field(default_factory=list)
