"""The engine's compile and kernel caches: one directory for all of them, operator values kept, and the
mountinfo reading the doctor's volume check stands on."""

from __future__ import annotations

import pytest

from carbonforge_runtime.errors import OverrideError
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs
from carbonforge_runtime.runtime.engine_env.compile_cache import (
    ANONYMOUS,
    CACHE_VARIABLES,
    EMPTY_DIR,
    MEMORY,
    ROOT_LAYER,
    VOLUME,
    Mount,
    cache_location,
    engine_cache_env,
    is_container_root,
    mount_of,
    parse_mountinfo,
    persistence,
    resolve_root,
)
from carbonforge_runtime.runtime.planning.plan import ServeOptions, build_plan, describe_plan
from carbonforge_runtime.settings import load_settings

SHIPPED: dict[str, Recipe] = load_recipes(recipe_dirs(None))
TINY = ServeOptions(context_key="cf-tiny:bf16:chat:cpu")
ALL_CACHES = {
    "VLLM_CACHE_ROOT": "/var/cache/carbonforge/vllm",
    "TORCHINDUCTOR_CACHE_DIR": "/var/cache/carbonforge/torchinductor",
    "TRITON_CACHE_DIR": "/var/cache/carbonforge/triton",
    "FLASHINFER_WORKSPACE_BASE": "/var/cache/carbonforge/flashinfer",
    "CUDA_CACHE_PATH": "/var/cache/carbonforge/cuda",
}


def test_every_cache_goes_under_the_one_directory() -> None:
    cache = engine_cache_env("/var/cache/carbonforge", {"PATH": "/usr/bin"})
    assert cache.env == ALL_CACHES
    assert [line.name for line in cache.lines] == [var.name for var in CACHE_VARIABLES]
    assert all(line.why.startswith("runtime: ") for line in cache.lines)
    assert cache.notes == []


def test_a_cache_variable_the_operator_or_the_recipe_set_is_kept() -> None:
    operator = {"TRITON_CACHE_DIR": "/fast/triton", "VLLM_CACHE_ROOT": " "}  # blank counts as unset, as in vLLM
    env = {**operator, "CUDA_CACHE_PATH": "/recipe/cuda"}  # the recipe's variables joined the environment
    cache = engine_cache_env("/c", env, operator=operator)
    assert "TRITON_CACHE_DIR" not in cache.env and "CUDA_CACHE_PATH" not in cache.env
    assert cache.env["VLLM_CACHE_ROOT"] == "/c/vllm"
    why = {line.name: (line.value, line.why) for line in cache.lines}
    assert why["TRITON_CACHE_DIR"] == ("/fast/triton", "environment, kept: compiled Triton kernels stay there")
    assert why["CUDA_CACHE_PATH"][0] == "/recipe/cuda" and why["CUDA_CACHE_PATH"][1].startswith("recipe, kept")


def test_a_disabled_compile_cache_is_said() -> None:
    assert engine_cache_env("/c", {"VLLM_DISABLE_COMPILE_CACHE": "0"}).notes == []
    notes = engine_cache_env("/c", {"VLLM_DISABLE_COMPILE_CACHE": "1"}).notes
    assert len(notes) == 1 and "every start compiles the model again" in notes[0]


def test_the_home_in_the_default_is_the_engines() -> None:
    assert resolve_root("~/.cache/carbonforge/compile", {"HOME": "/home/op/"}) == "/home/op/.cache/carbonforge/compile"
    assert resolve_root("/var/cache/carbonforge/", {"HOME": "/x"}) == "/var/cache/carbonforge"
    assert resolve_root("~", {"HOME": "/home/op"}) == "/home/op"


def test_the_directory_must_be_absolute() -> None:
    given = load_settings({"CF_COMPILE_CACHE_DIR": "/var/cache/carbonforge"})
    assert given.compile_cache_dir == "/var/cache/carbonforge"
    assert load_settings({}).compile_cache_dir == "~/.cache/carbonforge/compile"
    with pytest.raises(OverrideError) as info:
        load_settings({"CF_COMPILE_CACHE_DIR": "cache"})
    assert "is not an absolute path" in info.value.message and "CF_COMPILE_CACHE_DIR=/" in info.value.remedy


def test_the_operators_vllm_cache_root_is_the_one_that_must_persist() -> None:
    assert cache_location("/c", "default", {}) == ("/c", "default")
    assert cache_location("/c", "CF_COMPILE_CACHE_DIR", {"VLLM_CACHE_ROOT": "/vol/vllm"}) == ("/vol/vllm",
                                                                                            "VLLM_CACHE_ROOT")


# ---- in the plan -------------------------------------------------------------------------------------------


def test_the_serve_plan_points_the_engine_at_the_directory() -> None:
    environ = {"HOME": "/home/op", "CF_COMPILE_CACHE_DIR": "/var/cache/carbonforge", "TRITON_CACHE_DIR": "/t"}
    plan = build_plan(TINY, load_settings(environ), SHIPPED, environ)
    env = plan.launch.engine_env()
    assert {name: env[name] for name in ALL_CACHES} == {**ALL_CACHES, "TRITON_CACHE_DIR": "/t"}
    lines = describe_plan(plan, TINY, environ)
    assert ("engine environment: VLLM_CACHE_ROOT=/var/cache/carbonforge/vllm  (runtime: vLLM's torch.compile "
            "cache, under CF_COMPILE_CACHE_DIR)") in lines
    assert "engine environment: TRITON_CACHE_DIR=/t  (environment, kept: compiled Triton kernels stay there)" in lines


def test_the_default_directory_is_under_the_home_and_the_override_mode_gets_it_too() -> None:
    environ = {"HOME": "/home/op"}
    options = ServeOptions(vllm_args=["/models/m"])
    plan = build_plan(options, load_settings(environ), SHIPPED, environ)
    assert plan.launch.engine_env()["VLLM_CACHE_ROOT"] == "/home/op/.cache/carbonforge/compile/vllm"
    assert plan.launch.engine_env()["CUDA_CACHE_PATH"] == "/home/op/.cache/carbonforge/compile/cuda"


# ---- mountinfo --------------------------------------------------------------------------------------------

# Shaped like a Docker container's: an overlay root, named and anonymous volumes, a tmpfs, an overmount.
ANONYMOUS_ID = "0f1e2d3c4b5a6978" * 4
MOUNTINFO = f"""\
812 700 0:77 / / rw,relatime master:1 - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/A,upperdir=/u
813 812 0:80 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
820 812 259:2 /var/lib/docker/volumes/carbonforge-compile/_data /var/cache/carbonforge rw - ext4 /dev/nvme0n1p2 rw
821 812 259:2 /var/lib/docker/volumes/{ANONYMOUS_ID}/_data /var/cache/huggingface rw - ext4 /dev/nvme0n1p2 rw
822 812 0:90 / /tmp rw,nosuid - tmpfs tmpfs rw,size=65536k
823 812 259:2 /srv/my\\040models /models rw - ext4 /dev/nvme0n1p2 rw
824 823 259:2 /srv/other /models rw - xfs /dev/sdb1 rw
825 812 0:95 /var/lib/kubelet/pods/1b2c/volumes/kubernetes.io~empty-dir/cache /k8s/cache rw - ext4 /dev/sda1 rw
broken line without a separator
"""


def test_mountinfo_lines_become_mounts() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert len(mounts) == 8
    assert mounts[0] == Mount("/", "overlay", "overlay", "/")
    assert mounts[2] == Mount("/var/cache/carbonforge", "ext4", "/dev/nvme0n1p2",
                              "/var/lib/docker/volumes/carbonforge-compile/_data")
    assert mounts[5].root == "/srv/my models"  # octal escapes undone


def test_the_deepest_mount_holds_a_path_and_the_last_of_an_overmount_wins() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert mount_of("/var/cache/carbonforge/vllm/torch_compile_cache", mounts) == mounts[2]
    assert mount_of("/var/cache/carbonforge", mounts) == mounts[2]
    assert mount_of("/var/cache/carbonforgex", mounts) == mounts[0]  # a sibling sharing the prefix is not inside
    assert mount_of("/models/a", mounts) == mounts[6]
    assert mount_of("/home/x", mounts) == mounts[0]
    assert mount_of("/x", []) is None


@pytest.mark.parametrize(("path", "kind"), [
    ("/var/cache/carbonforge", VOLUME),
    ("/home/carbonforge/.cache/carbonforge/compile", ROOT_LAYER),
    ("/var/cache/huggingface/x", ANONYMOUS),
    ("/tmp/cache", MEMORY),
    ("/k8s/cache", EMPTY_DIR),
    ("/models", VOLUME),
])
def test_what_a_mount_means_for_the_next_container(path: str, kind: str) -> None:
    mount = mount_of(path, parse_mountinfo(MOUNTINFO))
    assert mount is not None and persistence(mount) == kind


def test_a_layered_root_tells_a_container() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert is_container_root(mounts)
    host_like = parse_mountinfo("27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n")
    assert not is_container_root(host_like)
    assert not is_container_root([])
