"""What the runtime tells the scheduler shim, carried in one environment variable.

The runtime sets :data:`CONFIG_ENV` on the vLLM process; the engine-core process inherits it and
the shim reads it at construction. (``--additional-config`` would also reach the engine, but it
changes vLLM's compile-cache key and forces a recompile.) Pure: no vLLM import.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.tracing.config import TraceConfig

#: JSON: {"family": ..., "params": {...}, "trace": {...} | null}. Internal: set by the runtime.
CONFIG_ENV = "CF_SCHEDULER_CONFIG"
#: The value of vLLM's --scheduler-cls: a factory that picks the synchronous or asynchronous base.
SCHEDULER_CLS = "carbonforge_runtime.scheduler.shim.make_scheduler"
DEFAULT_FAMILY = "fcfs"


@dataclass(frozen=True)
class ShimConfig:
    family: str = DEFAULT_FAMILY
    params: Mapping[str, Any] = field(default_factory=dict)
    trace: TraceConfig | None = None

    def to_json(self) -> str:
        return json.dumps({
            "family": self.family,
            "params": dict(self.params),
            "trace": self.trace.to_dict() if self.trace else None,
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ShimConfig:
        try:
            data = json.loads(text)
            trace = data.get("trace")
            return cls(
                family=str(data.get("family") or DEFAULT_FAMILY),
                params=dict(data.get("params") or {}),
                trace=TraceConfig.from_dict(trace) if trace else None,
            )
        except (ValueError, TypeError, AttributeError) as exc:
            raise UsageError(
                f"{CONFIG_ENV} is not a valid scheduler configuration: {exc}",
                f"let carbonforge-runtime set {CONFIG_ENV}; do not set it by hand",
            ) from None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ShimConfig:
        text = environ.get(CONFIG_ENV)
        return cls.from_json(text) if text else cls()

    def env(self) -> dict[str, str]:
        return {CONFIG_ENV: self.to_json()}
