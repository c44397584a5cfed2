"""The image's entrypoint steps, run outside Docker as the image's user with the image's ENV pointed
at directories standing for its volumes: the dry run, the doctor, a launch up to the engine start
(which records the served address), and the healthcheck probing that address on a non-default port.
As root the user is created when missing; without root and without that user the test is skipped."""

from __future__ import annotations

import http.server
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.runtime.planning.plan import ServeOptions
from carbonforge_runtime.runtime.process import supervisor
from carbonforge_runtime.runtime.serve import address as serve_address
from carbonforge_runtime.runtime.serve.launch import serve
from carbonforge_runtime.settings import load_settings
from tests.support import REPO, TINY_KEY, free_port
from tests.support.engine_double import Health
from tests.unit.image.test_dockerfile import the

VENV_BIN = Path(sys.executable).parent
NAME = "carbonforge"


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for line in the("ENV"):
        for pair in line.split():
            name, _, value = pair.partition("=")
            env[name] = value
    return env


@pytest.fixture(scope="module")
def image_user() -> tuple[int, int]:
    uid, _, gid = the("USER")[-1].partition(":")
    try:
        entry = pwd.getpwnam(NAME)
    except KeyError:
        if os.geteuid() != 0:
            pytest.skip(f"not root and no {NAME} user to run as")
        done = subprocess.run(["useradd", "--uid", uid, "--user-group", "--no-create-home",
                               "--shell", "/usr/sbin/nologin", NAME], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot create the {NAME} user: {done.stderr.strip()}")
        entry = pwd.getpwnam(NAME)
    assert str(entry.pw_uid) == uid and (not gid or str(entry.pw_gid) == gid)
    if os.geteuid() not in (0, entry.pw_uid):
        pytest.skip(f"cannot switch to {NAME} without root")
    user = (entry.pw_uid, entry.pw_gid)
    reach = as_user(user, [sys.executable, "-c", "import carbonforge_runtime"],
                    {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/"})
    if reach.returncode != 0:  # the checkout lies under a directory only root may enter
        pytest.skip(f"{NAME} cannot run this checkout's interpreter: {reach.stderr.strip()[-200:]}")
    return user


@pytest.fixture
def volumes(image_user: tuple[int, int]) -> Iterator[dict[str, Path]]:
    """Directories standing for the image's: the three volumes owned by the user, a root-owned
    /etc/carbonforge (the read-only licence mount) and the home directory."""
    root = Path(tempfile.mkdtemp(prefix="cf-image-"))
    root.chmod(0o755)  # pytest's tmp_path is private to root; this one the user can traverse
    paths = {name: root / name for name in ("log", "compile", "hf", "home", "etc")}
    for name, path in paths.items():
        path.mkdir(mode=0o755)
        if name != "etc":
            os.chown(path, *image_user)
    yield paths
    shutil.rmtree(root)


def env_for(volumes: dict[str, Path], **extra: str) -> dict[str, str]:
    env = image_env()
    where = {"/var/log/carbonforge": volumes["log"], "/var/cache/carbonforge": volumes["compile"],
             "/var/cache/huggingface": volumes["hf"], "/home/carbonforge": volumes["home"],
             "/etc/carbonforge": volumes["etc"]}
    for name, value in env.items():
        for image_path, path in where.items():
            if value == image_path or value.startswith(image_path + "/"):
                env[name] = str(path) + value[len(image_path):]
    assert {"HOME", "CF_LOG_DIR", "HF_HOME", "CF_COMPILE_CACHE_DIR"} <= env.keys()
    env.update(PATH=f"{VENV_BIN}:/usr/bin:/bin", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), **extra)
    return env


def as_user(user: tuple[int, int], argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    prefix = [] if os.geteuid() == user[0] else ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}",
                                                 "--init-groups", "--"]
    return subprocess.run(prefix + argv, env=env, cwd=env["HOME"], capture_output=True, text=True, timeout=120)


@pytest.fixture
def api() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


LAUNCH = """
import sys, types
from carbonforge_runtime.runtime.process import supervisor
from carbonforge_runtime.runtime.weights import tiny_model
from carbonforge_runtime.runtime.planning.plan import ServeOptions
from carbonforge_runtime.runtime.serve.launch import serve
from carbonforge_runtime.settings import load_settings
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
import os
tiny_model.ensure_tiny_model = lambda path: path  # the model is not needed: the engine never starts
supervisor.supervise = lambda *a, **k: types.SimpleNamespace(exit_code=0)
sys.exit(serve(ServeOptions(context_key=sys.argv[1], skip_preflight=True), load_settings(os.environ),
               os.environ, FakeGpuBackend(host(None))))
"""


def test_dry_run_doctor_launch_and_healthcheck_as_the_image_user(
        image_user: tuple[int, int], volumes: dict[str, Path], api: int) -> None:
    env = env_for(volumes, CF_PORT=str(api))
    runtime = str(VENV_BIN / "carbonforge-runtime")

    dry = as_user(image_user, [runtime, "--context-key", TINY_KEY, "--dry-run"], env)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"--port {api}" in dry.stdout

    doctor = as_user(image_user, [runtime, "doctor", "--json"], env)
    assert doctor.returncode in (0, 1), doctor.stderr
    report = json.loads(doctor.stdout)
    assert str(volumes["log"]) in json.dumps(report)

    launch = as_user(image_user, [sys.executable, "-c", LAUNCH, TINY_KEY], env)
    assert launch.returncode == 0, launch.stdout + launch.stderr
    recorded = volumes["log"] / serve_address.FILE_NAME
    info = recorded.stat()
    assert (info.st_uid, info.st_gid) == image_user and info.st_mode & 0o777 == 0o644
    assert json.loads(recorded.read_text())["port"] == api

    # The healthcheck finds the port in the file alone (CF_PORT unset), and reports the API's state.
    probe_env = {k: v for k, v in env.items() if k != "CF_PORT"}
    check = [sys.executable, str(REPO / "docker" / "healthcheck.py")]
    healthy = as_user(image_user, check, probe_env)
    assert healthy.returncode == 0, healthy.stderr
    serve_address.write(volumes["log"], "0.0.0.0", free_port())  # the plan now serves where nothing answers
    assert as_user(image_user, check, probe_env).returncode == 1


def test_the_launch_records_the_port_vllm_arguments_choose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setattr(supervisor, "supervise", lambda *a, **k: type("R", (), {"exit_code": 0})())
    monkeypatch.setattr("carbonforge_runtime.runtime.weights.tiny_model.ensure_tiny_model", lambda path: path)
    env = {"CF_LOG_DIR": str(tmp_path), "CF_PORT": "8123", "CF_HOST": "::",
           "CF_VLLM_EXTRA_ARGS": f"--port {port}", "CF_TINY_MODEL_DIR": str(tmp_path / "tiny")}
    assert serve(ServeOptions(context_key=TINY_KEY, skip_preflight=True), load_settings(env), env,
                 FakeGpuBackend(host(None))) == 0
    assert json.loads((tmp_path / "serve.json").read_text()) == {"host": "::", "port": port,
                                                                 "probe_host": "127.0.0.1"}


def test_without_the_file_the_healthcheck_probes_cf_port(tmp_path: Path, api: int) -> None:
    env = {"PATH": "/usr/bin:/bin", "CF_LOG_DIR": str(tmp_path), "CF_PORT": str(api)}
    done = subprocess.run([sys.executable, str(REPO / "docker" / "healthcheck.py")], env=env, timeout=30)
    assert done.returncode == 0
    (tmp_path / "serve.json").write_text("{not json")
    done = subprocess.run([sys.executable, str(REPO / "docker" / "healthcheck.py")], env=env, timeout=30)
    assert done.returncode == 0  # a garbled file falls back too
