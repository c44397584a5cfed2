"""A launch that fails after the observability started leaves nothing of it behind: here the group's
watch port is taken, so the leader cannot open it after the metrics feed and the Prometheus endpoint
are up; the serve fails with the fix, and their threads, sockets and feed folder are gone."""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from carbonforge_runtime.errors import CarbonForgeError
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.runtime.serve.launch import ServeOptions, serve
from carbonforge_runtime.settings import load_settings
from tests.support import free_port, tiny_model_dir, wait_until

OURS = ("cf-metrics-receiver", "cf-gpu-monitor", "cf-restore-on-stop")


@pytest.fixture
def signals_restored() -> Iterator[None]:
    """serve() installs SIGTERM/SIGINT handlers in this process: put pytest's back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def feed_folders() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "cf-metrics-*")))


@pytest.fixture
def own_tempdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The feed folder is made under tempfile's directory: give this test one of its own, since other
    test workers make and remove cf-metrics-* folders in the shared one at the same time. It is short,
    as the feed's Unix socket path must fit in 108 bytes."""
    folder = tempfile.mkdtemp(prefix="cft-")
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield
    shutil.rmtree(folder, ignore_errors=True)


def our_threads() -> list[threading.Thread]:
    """The runtime's own threads, and the Prometheus endpoint's (prometheus_client names none)."""
    return [t for t in threading.enumerate() if t.is_alive() and (t.name in OURS or "serve_forever" in t.name)]


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_busy_watch_port_leaves_no_metrics_thread_socket_or_feed_folder(tmp_path: Path, own_tempdir: None,
                                                                           signals_restored: None) -> None:
    metrics_port, watch_port = free_port(), free_port()
    env = {
        "PATH": os.environ.get("PATH", ""), "CF_LOG_DIR": str(tmp_path / "logs"), "CF_HOST": "127.0.0.1",
        "CF_PORT": str(free_port()), "CF_METRICS_PORT": str(metrics_port), "CF_GROUP_PORT": str(watch_port),
        "CF_NNODES": "2", "CF_NODE_RANK": "0", "CF_MASTER_ADDR": "127.0.0.1", "CF_MASTER_PORT": str(free_port()),
        "CF_JOIN_TIMEOUT_S": "30", "HF_HUB_OFFLINE": "1", "CF_GROUP_SECRET": secrets.token_hex(32),
    }
    options = ServeOptions(metrics=True, skip_preflight=True,
                           vllm_args=[str(tiny_model_dir()), "--pipeline-parallel-size", "2"])
    threads_before = {t.ident for t in our_threads()}
    folders_before = feed_folders()
    with socket.socket() as busy:  # the group's watch port, taken before the leader opens it
        busy.bind(("0.0.0.0", watch_port))
        busy.listen()
        with pytest.raises(CarbonForgeError, match=f"watch port {watch_port} cannot be opened"):
            serve(options, load_settings(env), env, FakeGpuBackend(host(None)))
    wait_until(lambda: not [t for t in our_threads() if t.ident not in threads_before], 5, every_s=0.05)
    assert [t.name for t in our_threads() if t.ident not in threads_before] == []
    assert feed_folders() - folders_before == set(), "the metrics feed's socket folder was left behind"
    assert port_free(metrics_port), "the Prometheus endpoint still listens"
