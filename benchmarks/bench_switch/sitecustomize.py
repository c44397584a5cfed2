"""Benchmark-only: the ``bench-switch`` scheduler family, registered in every Python process that
has this directory on ``PYTHONPATH`` (the runtime, vLLM's API server and its engine core).

``benchmarks/bench_ordering.py`` serves ONE engine whose recipe names ``bench-switch`` and switches
the active family between runs by rewriting a small control file, so every family is measured
minutes apart on the same engine instead of in separate engine sessions whose speed drifts with
whatever else the machine runs. Not part of the product: it lives with the benchmark.
"""

from __future__ import annotations

import os

if os.environ.get("CF_BENCH_SWITCH"):
    import json
    import time
    from collections.abc import Mapping
    from pathlib import Path
    from typing import Any

    from carbonforge_runtime.core.ordering import registry as policy

    class BenchSwitch:
        """Delegates to the family named in the control file (checked at most every 0.1 s)."""

        name = "bench-switch"
        reorders = True

        def __init__(self, params: Mapping[str, Any]) -> None:
            self.control = Path(params["control"])
            self.members = {name: policy.make_family(name, p) for name, p in params["families"].items()}
            self.cache_lookup_limit = int(params.get("cache_lookup_limit", 128))
            self.max_overtake_s = float(params.get("max_overtake_s", 60.0))
            self.active_name = "fcfs"
            self.active = self.members["fcfs"]
            self._checked = 0.0

        def _refresh(self) -> None:
            now = time.monotonic()
            if now - self._checked < 0.1:
                return
            self._checked = now
            try:
                name = json.loads(self.control.read_text())["family"]
            except (OSError, ValueError, KeyError):
                return
            if name != self.active_name and name in self.members:
                self.active_name, self.active = name, self.members[name]

        @property
        def needs_cache_lookup(self) -> bool:  # read by the queue before every scoring pass
            self._refresh()
            return bool(self.active.needs_cache_lookup)

        def score(self, req: Any, now: float) -> float | None:
            active = self.active
            if not active.reorders:
                return 0.0  # equal scores: pick_next serves the earliest arrival (FCFS)
            return active.score(req, now)

        def observe(self, req: Any, output_tokens: int) -> None:
            for member in self.members.values():
                member.observe(req, output_tokens)

    policy.FAMILIES["bench-switch"] = BenchSwitch  # type: ignore[assignment]
