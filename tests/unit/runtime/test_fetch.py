"""``carbonforge-runtime fetch`` against a local hub double (real HTTP, huggingface_hub's real download
code), and the weights check that pre-flight and the doctor make on what it leaves in the cache.
The runtime runs as a process; no engine is started."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from carbonforge_runtime.runtime.weights.hub_cache import snapshot_state
from tests.support import free_port, tiny_model_dir
from tests.support.hub_double import (
    FETCH_KEY,
    FETCH_REPO,
    NOT_FETCHED,
    HubDouble,
    fetch_env,
    run_runtime,
    snapshot_dir,
    tiny_repo_files,
    write_fetch_recipe,
)

PREMIUM_KEY = "cf-tiny-fetch-premium:bf16:chat:cpu"
PREMIUM_REPO = "carbonforge-test/tiny-fetch-premium"
BIG_REPO = "carbonforge-test/big-weights"
GATED_REPO = "carbonforge-test/gated"
GATED_TOKEN = "hf_test_secret_4f1c2a9e"
#: Bigger than huggingface_hub's 10 MiB download chunk, so that a transfer cut halfway has written
#: some bytes to disk and the retry asks for the rest only.
BIG_SIZE = 24 * 1024 * 1024
ENGINE_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "model.safetensors"}


@pytest.fixture(scope="module")
def hub() -> Iterator[HubDouble]:
    double = HubDouble().start()
    files = tiny_repo_files(tiny_model_dir())
    double.publish(FETCH_REPO, files)
    double.publish(PREMIUM_REPO, files)
    big = hashlib.sha256(b"seed").digest() * (BIG_SIZE // 32)
    double.publish(BIG_REPO, {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": big})
    double.publish(GATED_REPO, {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": b"\0" * 64},
                   token=GATED_TOKEN)
    yield double
    double.stop()


@pytest.fixture
def recipes(tmp_path: Path) -> Path:
    directory = tmp_path / "recipes"
    write_fetch_recipe(directory)
    write_fetch_recipe(directory, key=PREMIUM_KEY, repo=PREMIUM_REPO, served_name="carbonforge/tiny-fetch-premium",
                       plan="premium")
    return directory


def _env(hub: HubDouble | None, recipes: Path, tmp_path: Path, **extra: str) -> dict[str, str]:
    return fetch_env(hub.url if hub else None, recipes, tmp_path / "hf", CF_LOG_DIR=str(tmp_path / "logs"), **extra)


def _commit(hub: HubDouble, repo: str = FETCH_REPO) -> str:
    return hub.repos[repo].commit


def test_fetch_fills_the_hub_layout_with_what_the_engine_reads(hub: HubDouble, recipes: Path, tmp_path: Path) -> None:
    hub.clear()
    done = run_runtime(["fetch", FETCH_KEY], _env(hub, recipes, tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    cache = tmp_path / "hf" / "hub"
    folder = cache / "models--carbonforge-test--tiny-fetch"
    commit = _commit(hub)
    assert (folder / "refs" / "main").read_text() == commit
    snapshot = snapshot_dir(cache, FETCH_REPO, commit)
    files = {path.relative_to(snapshot).as_posix() for path in snapshot.rglob("*") if path.is_file()}
    assert files == ENGINE_FILES  # README, .gitattributes, the duplicate .bin and original/ stay on the hub
    assert all((snapshot / name).is_symlink() for name in files)  # links into blobs/, as the library lays it out
    published = hub.repos[FETCH_REPO].files
    assert all((snapshot / name).read_bytes() == published[name] for name in files)
    fetched = {seen.path.rsplit("/", 1)[-1] for seen in hub.downloads()}
    assert fetched == ENGINE_FILES and not fetched & set(NOT_FETCHED)
    assert f"downloaded 6 of 6 files of {FETCH_REPO}" in done.stdout
    assert "\r" not in done.stdout + done.stderr  # not a terminal: plain lines only
    last = done.stdout.strip().splitlines()[-1].strip()
    assert last.startswith("docker run ")
    assert f"-e CF_CONTEXT_KEY={FETCH_KEY} -e HF_HUB_OFFLINE=1" in last
    assert f"-v {cache}:/var/cache/huggingface/hub" in last and "--gpus" not in last  # a cpu key

    hub.clear()
    again = run_runtime(["fetch", FETCH_KEY], _env(hub, recipes, tmp_path))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"nothing to download: all 6 files of {FETCH_REPO} at {commit[:12]}" in again.stdout
    assert hub.downloads("GET") == [] and hub.downloads("HEAD") == []


def test_an_interrupted_transfer_resumes_where_it_broke(hub: HubDouble, recipes: Path, tmp_path: Path) -> None:
    hub.clear()
    hub.cut_next_transfer(BIG_REPO, "model.safetensors")
    done = run_runtime(["fetch", "--model", BIG_REPO], _env(hub, recipes, tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    transfers = [seen for seen in hub.downloads() if seen.path.endswith("/model.safetensors")]
    assert len(transfers) == 2
    assert transfers[0].range_start is None
    assert transfers[1].range_start is not None and 0 < transfers[1].range_start < BIG_SIZE
    snapshot = snapshot_dir(tmp_path / "hf" / "hub", BIG_REPO, _commit(hub, BIG_REPO))
    assert (snapshot / "model.safetensors").read_bytes() == hub.repos[BIG_REPO].files["model.safetensors"]
    assert "docker run -d --name carbonforge --gpus all" in done.stdout  # no key: the GPU image serves it
    assert done.stdout.strip().endswith(f"carbonforge-runtime {BIG_REPO}")


def test_fetch_to_a_directory_to_carry_over(hub: HubDouble, recipes: Path, tmp_path: Path) -> None:
    target = tmp_path / "carry"
    done = run_runtime(["fetch", FETCH_KEY, "--to", str(target)], _env(hub, recipes, tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (snapshot_dir(target, FETCH_REPO, _commit(hub)) / "model.safetensors").is_file()
    assert not (tmp_path / "hf" / "hub" / "models--carbonforge-test--tiny-fetch").exists()
    last = done.stdout.strip().splitlines()[-1]
    assert (f"-v {target}:/var/cache/huggingface/hub -e HUGGINGFACE_HUB_CACHE=/var/cache/huggingface/hub"
            in last)
    local = f"HF_HUB_OFFLINE=1 HUGGINGFACE_HUB_CACHE={target} carbonforge-runtime --context-key {FETCH_KEY}"
    assert local in done.stdout


def test_a_gated_repository_takes_the_token_from_the_environment(hub: HubDouble, recipes: Path,
                                                                  tmp_path: Path) -> None:
    refused = run_runtime(["fetch", "--model", GATED_REPO], _env(hub, recipes, tmp_path))
    assert refused.returncode == 1
    assert f"error: {GATED_REPO} is gated" in refused.stderr and "HF_TOKEN" in refused.stderr
    assert "Traceback" not in refused.stderr
    hub.clear()
    done = run_runtime(["fetch", "--model", GATED_REPO], _env(hub, recipes, tmp_path, HF_TOKEN=GATED_TOKEN))
    assert done.returncode == 0, done.stdout + done.stderr
    assert {seen.authorization for seen in hub.downloads()} == {f"Bearer {GATED_TOKEN}"}
    assert GATED_TOKEN not in done.stdout + done.stderr


def test_a_premium_key_without_a_licence_is_refused_before_any_download(hub: HubDouble, recipes: Path,
                                                                         tmp_path: Path) -> None:
    hub.clear()
    done = run_runtime(["fetch", FETCH_KEY, PREMIUM_KEY], _env(hub, recipes, tmp_path))
    assert done.returncode == 4  # the licence refusal, as when serving
    assert f"{PREMIUM_KEY} is a premium-plan recipe" in done.stderr and "no license key provided" in done.stderr
    assert hub.requests == []  # refused before the free key was fetched either
    by_model = run_runtime(["fetch", "--model", PREMIUM_REPO], _env(hub, recipes, tmp_path))
    assert by_model.returncode == 4 and PREMIUM_KEY in by_model.stderr  # its repository belongs to a premium recipe
    assert hub.requests == []


def test_the_built_in_model_has_nothing_to_fetch(recipes: Path, tmp_path: Path) -> None:
    done = run_runtime(["fetch", "cf-tiny:bf16:chat:cpu"], _env(None, recipes, tmp_path))
    assert done.returncode == 0, done.stderr
    assert "the built-in model tiny-chat is generated on the serving machine at start; nothing to fetch" in done.stdout
    assert "docker run" not in done.stdout


def test_fetch_takes_the_key_from_cf_context_key(hub: HubDouble, recipes: Path, tmp_path: Path) -> None:
    done = run_runtime(["fetch"], _env(hub, recipes, tmp_path, CF_CONTEXT_KEY=FETCH_KEY))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CF_CONTEXT_KEY is ignored" not in done.stdout + done.stderr
    assert f"{FETCH_KEY}: downloaded 6 of 6 files" in done.stdout


@pytest.mark.parametrize(("args", "expected"), [
    (["fetch"], "fetch needs a context key or --model"),
    (["fetch", "--model", "./models/tiny"], "is not a Hugging Face repository id"),
    (["fetch", FETCH_KEY, "--model", FETCH_REPO], "fetch takes context keys or --model, not both"),
    (["fetch", "nope:bf16:chat:cpu"], "nope"),
])
def test_usage_mistakes_are_one_line_with_the_fix(recipes: Path, tmp_path: Path, args: list[str],
                                                  expected: str) -> None:
    done = run_runtime(args, _env(None, recipes, tmp_path))
    assert done.returncode == 2
    assert expected in done.stderr and "fix:" in done.stderr and "Traceback" not in done.stderr


def _fetched_cache(hub: HubDouble, recipes: Path, tmp_path: Path) -> Path:
    done = run_runtime(["fetch", FETCH_KEY, "--to", str(tmp_path / "cache")], _env(hub, recipes, tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    return tmp_path / "cache"


def test_offline_fetch_checks_the_cache_instead_of_downloading(hub: HubDouble, recipes: Path, tmp_path: Path) -> None:
    cache = _fetched_cache(hub, recipes, tmp_path)
    hub.clear()
    offline = _env(None, recipes, tmp_path, HF_HUB_OFFLINE="1", HUGGINGFACE_HUB_CACHE=str(cache))
    done = run_runtime(["fetch", FETCH_KEY], offline)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "HF_HUB_OFFLINE=1 is set, so nothing was downloaded" in done.stdout
    assert "is complete (6 files)" in done.stdout
    (snapshot_dir(cache, FETCH_REPO, _commit(hub)) / "tokenizer.json").unlink()
    missing = run_runtime(["fetch", FETCH_KEY], offline)
    assert missing.returncode == 1 and "lacks tokenizer.json" in missing.stderr
    assert hub.requests == []


def test_preflight_refuses_a_snapshot_missing_a_weight_file(hub: HubDouble, recipes: Path, tmp_path: Path) -> None:
    cache = _fetched_cache(hub, recipes, tmp_path)
    snapshot = snapshot_dir(cache, FETCH_REPO, _commit(hub))
    env = _env(None, recipes, tmp_path, HF_HUB_OFFLINE="1", HUGGINGFACE_HUB_CACHE=str(cache), CF_PORT=str(free_port()),
               CF_HOST="127.0.0.1")
    doctor = run_runtime(["doctor", "--context-key", FETCH_KEY, "--json"], env)
    weights = next(check for check in json.loads(doctor.stdout)["checks"] if check["name"] == "storage.weights")
    assert weights["status"] == "OK" and str(snapshot) in weights["detail"]

    (snapshot / "model.safetensors").unlink()
    served = run_runtime(["--context-key", FETCH_KEY], env)
    assert served.returncode == 1
    output = served.stdout + served.stderr
    assert "pre-flight: FAIL" in output and "model.safetensors missing" in output
    assert f"carbonforge-runtime fetch {FETCH_KEY}" in output and "HUGGINGFACE_HUB_CACHE" in output
    assert not (tmp_path / "logs" / "vllm.log").exists()  # vLLM was never started
    doctor = run_runtime(["doctor", "--context-key", FETCH_KEY], env)
    assert doctor.returncode == 1 and "model.safetensors missing" in doctor.stdout


def test_an_incomplete_snapshot_is_not_served_offline_by_the_runtime(hub: HubDouble, recipes: Path,
                                                                      tmp_path: Path) -> None:
    """Without HF_HUB_OFFLINE from the operator, a complete snapshot makes the runtime serve offline; an
    incomplete one does not (the engine then downloads the rest)."""
    cache = _fetched_cache(hub, recipes, tmp_path)
    env = _env(hub, recipes, tmp_path, HUGGINGFACE_HUB_CACHE=str(cache), CF_PORT=str(free_port()))
    complete = run_runtime(["--context-key", FETCH_KEY, "--dry-run"], env)
    assert "HF_HUB_OFFLINE=1  (runtime: nothing to download" in complete.stdout, complete.stdout + complete.stderr
    (snapshot_dir(cache, FETCH_REPO, _commit(hub)) / "model.safetensors").unlink()
    partial = run_runtime(["--context-key", FETCH_KEY, "--dry-run"], env)
    assert "HF_HUB_OFFLINE unset" in partial.stdout, partial.stdout + partial.stderr
    assert "WARN" in partial.stdout + partial.stderr and "the engine downloads the rest at start" in (
        partial.stdout + partial.stderr)


def test_fetch_output_names_no_token_even_when_the_hub_fails(recipes: Path, tmp_path: Path) -> None:
    env = _env(None, recipes, tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", HF_TOKEN=GATED_TOKEN,
               HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")
    done = run_runtime(["fetch", FETCH_KEY], env)
    assert done.returncode == 1
    assert "error: cannot download carbonforge-test/tiny-fetch" in done.stderr and "fix:" in done.stderr
    assert GATED_TOKEN not in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert os.environ.get("HF_TOKEN") != GATED_TOKEN


def test_a_terminal_gets_the_libraries_progress_bars(hub: HubDouble, recipes: Path, tmp_path: Path) -> None:
    import fcntl
    import pty
    import struct
    import subprocess
    import sys
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "carbonforge_runtime", "fetch", FETCH_KEY],
                            env=_env(hub, recipes, tmp_path), stdout=subprocess.PIPE, stderr=slave,
                            stdin=subprocess.DEVNULL)
    os.close(slave)
    stdout = proc.communicate(timeout=120)[0].decode()
    bars = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        bars += chunk
    os.close(master)
    assert proc.returncode == 0, stdout
    assert b"Fetching 6 files: 100%" in bars and b"\r" in bars
    assert f"downloaded 6 of 6 files of {FETCH_REPO}" in stdout


def test_a_sharded_repository_passes_the_libraries_own_offline_check(hub: HubDouble, recipes: Path,
                                                                       tmp_path: Path) -> None:
    """What vLLM does offline: snapshot_download(allow_patterns="*.safetensors", local_files_only=True),
    which the library refuses when a file of its cached listing matching the pattern is absent."""
    import subprocess
    import sys

    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = {"metadata": {}, "weight_map": {"a": shards[0], "b": shards[1]}}
    hub.publish("carbonforge-test/sharded", {
        "config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode(),
        shards[0]: b"1" * 64, shards[1]: b"2" * 64, "consolidated.safetensors": b"3" * 128, "README.md": b"#"})
    done = run_runtime(["fetch", "--model", "carbonforge-test/sharded"], _env(hub, recipes, tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    offline = _env(None, recipes, tmp_path, HF_HUB_OFFLINE="1")
    code = ("from huggingface_hub import snapshot_download as s; "
            "print(s('carbonforge-test/sharded', allow_patterns='*.safetensors', local_files_only=True))")
    checked = subprocess.run([sys.executable, "-c", code], env=offline, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr[-2000:]
    snapshot = Path(checked.stdout.strip())
    assert {path.name for path in snapshot.iterdir()} == {"config.json", "model.safetensors.index.json", *shards,
                                                          "consolidated.safetensors"}
    state = snapshot_state(tmp_path / "hf" / "hub", "carbonforge-test/sharded", None)
    assert state.complete and state.source == "listing" and "consolidated.safetensors" in state.expected
