"""Where the licence comes from: the variable, the file, an unreadable file; and `license show`."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from carbonforge_runtime.cli.license import show_license
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs
from carbonforge_runtime.runtime.licensing import LicenseInvalid, read_license
from carbonforge_runtime.runtime.licensing.gate import gate_recipe
from carbonforge_runtime.settings import load_settings
from tests.support import TEST_RECIPES
from tests.support.licensed_runtime import Signer

SIGNER = Signer("source-test-1")
PREMIUM_KEY = "cf-tiny-premium:bf16:chat:cpu"


@pytest.fixture(scope="module")
def premium() -> Recipe:
    return load_recipes(recipe_dirs(str(TEST_RECIPES)))[PREMIUM_KEY]


@pytest.fixture()
def licence() -> str:
    return SIGNER.issue(entitlements=(PREMIUM_KEY,), issued_at=int(time.time()) - 60)


@pytest.fixture()
def shared_dir() -> Iterator[Path]:
    """A directory any user can enter (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="cf-licence-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def as_unprivileged_user() -> Iterator[None]:
    """Run the block with the effective uid/gid of 'nobody' when we are root (the file mode then applies)."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def settings_for(**env: str):  # type: ignore[no-untyped-def]
    return load_settings(env)


def test_variable_wins_over_the_file(shared_dir: Path, licence: str) -> None:
    path = shared_dir / "license.key"
    path.write_text("cfl1.from-the-file.x\n")
    source = read_license(settings_for(CARBONFORGE_LICENSE_KEY=licence, CF_LICENSE_FILE=str(path)))
    assert (source.origin, source.text, source.problem) == ("CARBONFORGE_LICENSE_KEY", licence, None)
    assert source.shadowed == str(path)
    assert "CARBONFORGE_LICENSE_KEY" in source.describe() and str(path) in source.describe()
    assert licence not in source.describe()


def test_file_is_read_when_the_variable_is_unset(shared_dir: Path, licence: str) -> None:
    path = shared_dir / "license.key"
    path.write_text(f"\ufeff{licence}\r\n")  # BOM and CRLF from a Windows editor
    source = read_license(settings_for(CF_LICENSE_FILE=str(path)))
    assert (source.origin, source.problem) == (str(path), None)
    assert source.text is not None and source.text.strip("\ufeff\r\n") == licence


def test_nothing_found() -> None:
    source = read_license(settings_for())  # default /etc/carbonforge/license.key
    if Path("/etc/carbonforge/license.key").exists():
        pytest.skip("this host has a real licence file")
    assert (source.origin, source.text, source.problem) == (None, None, None)


def test_directory_instead_of_file(shared_dir: Path) -> None:
    source = read_license(settings_for(CF_LICENSE_FILE=str(shared_dir)))
    assert source.text is None and source.problem is not None and "directory" in source.problem


@pytest.mark.timeout(10)  # without the check, this open would block forever
def test_a_fifo_as_licence_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "license.key"
    os.mkfifo(fifo)  # nobody writes to it: reading it would block forever
    source = read_license(settings_for(CF_LICENSE_FILE=str(fifo)))
    assert source.text is None and source.problem is not None and "not a regular file" in source.problem


def test_a_licence_file_that_does_not_exist_is_told_so_with_how_to_provide_it(
        tmp_path: Path, premium: Recipe) -> None:
    from carbonforge_runtime.runtime.doctor.probes import SystemProbes

    path = tmp_path / "license.key"
    settings = settings_for(CF_LICENSE_FILE=str(path))
    source = read_license(settings)
    assert source.missing and source.problem == "does not exist (CF_LICENSE_FILE points to it)"
    fix = (f"put the licence file at {path} (in a container, mount it: -v ./license.key:{path}:ro), set "
           "CF_LICENSE_FILE to where it is, or pass the key in CARBONFORGE_LICENSE_KEY instead")
    out, err, code = show_license({"CF_LICENSE_FILE": str(path)}, time.time(), keys=lambda: SIGNER.table)
    assert code == 4 and "MISSING: does not exist" in out
    assert err == (f"error: no license key provided: the licence file {path} does not exist (CF_LICENSE_FILE "
                   f"points to it)\n  fix: {fix}")
    assert "readable" not in err
    facts = SystemProbes().license(settings, None, time.time())
    assert facts.missing and facts.remedy == fix
    with pytest.raises(LicenseInvalid) as info:
        gate_recipe(premium, settings, time.time(), keys=lambda: SIGNER.table)
    assert f"the licence file {path} does not exist" in info.value.message
    assert "readable" not in info.value.remedy and "CARBONFORGE_LICENSE_KEY" in info.value.remedy


def test_unreadable_file_gives_the_documented_message_and_the_variable_works(
        shared_dir: Path, licence: str, premium: Recipe) -> None:
    path = shared_dir / "license.key"
    path.write_text(licence + "\n")
    path.chmod(0o600 if os.geteuid() == 0 else 0o000)
    settings = settings_for(CF_LICENSE_FILE=str(path))
    with as_unprivileged_user():
        source = read_license(settings)
        with pytest.raises(LicenseInvalid) as info:
            gate_recipe(premium, settings, time.time(), keys=lambda: SIGNER.table)
        out, err, code = show_license({"CF_LICENSE_FILE": str(path)}, time.time(), keys=lambda: SIGNER.table)
    assert source.text is None and source.origin == str(path)
    assert source.problem is not None and source.problem.startswith("permission denied: mode 0")
    assert "owner uid" in source.problem
    message = info.value.render()
    assert info.value.reason == "unreadable"
    assert "no license key provided" in message and "permission denied" in message
    assert "CARBONFORGE_LICENSE_KEY" in info.value.remedy and "Traceback" not in message
    assert code == 4 and "UNREADABLE: permission denied" in out and "no license key provided" in err
    # The variable is the way round it (and wins over the unreadable file).
    settings = settings_for(CF_LICENSE_FILE=str(path), CARBONFORGE_LICENSE_KEY=licence)
    with as_unprivileged_user():
        claims = gate_recipe(premium, settings, time.time(), keys=lambda: SIGNER.table)
    assert claims is not None and claims.licence_id == "lic-test-0001"


def test_gate_logs_the_source_never_the_key(licence: str, premium: Recipe, caplog: pytest.LogCaptureFixture,
                                            shared_dir: Path) -> None:
    logger = logging.getLogger("carbonforge")
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="carbonforge"):
            gate_recipe(premium, settings_for(CARBONFORGE_LICENSE_KEY=licence, CF_LICENSE_FILE=str(shared_dir / "x")),
                        time.time(), keys=lambda: SIGNER.table)
    finally:
        logger.propagate = False
    text = caplog.text
    assert "from CARBONFORGE_LICENSE_KEY" in text and "lic-test-0001" in text and "days left" in text
    assert licence not in text and licence.split(".")[2] not in text


def test_free_recipe_needs_no_licence(premium: Recipe) -> None:
    free = load_recipes(recipe_dirs(None))["cf-tiny:bf16:chat:cpu"]
    assert gate_recipe(free, settings_for(CF_LICENSE_FILE="/nonexistent/license.key"), time.time()) is None


def test_license_show(licence: str, shared_dir: Path) -> None:
    now = time.time()
    out, err, code = show_license({"CARBONFORGE_LICENSE_KEY": licence}, now, keys=lambda: SIGNER.table)
    assert code == 0 and err == ""
    assert "source:        the licence key from CARBONFORGE_LICENSE_KEY" in out
    assert "status:        valid" in out and "licensee:      Acme Test GmbH" in out
    assert "(30 days left)" in out and f"entitlements:  {PREMIUM_KEY}" in out
    assert licence not in out
    path = shared_dir / "license.key"
    path.write_text(licence)
    out, err, code = show_license({"CF_LICENSE_FILE": str(path)}, now + 31 * 86400, keys=lambda: SIGNER.table)
    assert code == 4
    assert f"source:        the licence file {path}" in out
    assert "INVALID (expired)" in out and "NOT verified" in out and "days ago" in out
    assert "renew" in err
    out, err, code = show_license({"CF_LICENSE_FILE": "/nonexistent/cf/license.key"}, now)
    assert code == 4 and "no license key provided" in err


def test_license_show_refuses_garbage_from_a_file_without_traceback(shared_dir: Path, licence: str) -> None:
    import subprocess
    import sys

    path = shared_dir / "license.key"
    cases = {
        "too-large": "A" * (1024 * 1024),
        "malformed": "   \n\n",
        "bad-signature": licence[:-5] + ("AAAAA" if not licence.endswith("AAAAA") else "BBBBA"),
    }
    for reason, text in cases.items():
        path.write_text(text)
        out, err, code = show_license({"CF_LICENSE_FILE": str(path)}, time.time(), keys=lambda: SIGNER.table)
        assert code == 4 and f"INVALID ({reason})" in out and "fix:" in err, (reason, out, err)
        result = subprocess.run([sys.executable, "-m", "carbonforge_runtime", "license", "show"],
                                env={**os.environ, "CF_LICENSE_FILE": str(path)}, capture_output=True, text=True,
                                timeout=60, check=False)
        assert result.returncode == 4 and "Traceback" not in result.stdout + result.stderr
        assert "error: " in result.stderr and "fix: " in result.stderr
