"""Test-only launcher: the runtime with extra trusted public keys, for end-to-end licence tests.

The product has no way to add trusted keys (that would be a bypass); this file patches the embedded
key table in its own process and then runs the normal entry point. Keys come from the variable
CF_TEST_TRUSTED_KEYS ("ID=BASE64URL,ID=BASE64URL"), which only this file reads.

    python tests/support/licensed_runtime.py [runtime arguments...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from carbonforge_runtime.runtime.licensing import keys

TEST_KEYS_VAR = "CF_TEST_TRUSTED_KEYS"


def install_test_keys(spec: str) -> None:
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key_id, _, encoded = item.partition("=")
        keys.decode_public_key(encoded)  # fail loudly on a malformed test key
        keys.EMBEDDED_PUBLIC_KEYS[key_id] = encoded


if __name__ == "__main__":
    install_test_keys(os.environ.get(TEST_KEYS_VAR, ""))
    from carbonforge_runtime.cli.main import main

    main()


# --- helpers for the licence tests (imported as tests.support.licensed_runtime) -------------------

_TOOL = Path(__file__).resolve().parents[2] / "scripts" / "cf-license"


def vendor_tool():  # type: ignore[no-untyped-def]
    """The vendor tool scripts/cf-license, loaded as a module."""
    import importlib.machinery
    import importlib.util

    cached = sys.modules.get("cf_license_tool")
    if cached is not None:
        return cached
    loader = importlib.machinery.SourceFileLoader("cf_license_tool", str(_TOOL))
    spec = importlib.util.spec_from_loader("cf_license_tool", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cf_license_tool"] = module
    loader.exec_module(module)
    return module


class Signer:
    """A test key pair and a licence factory; ``table`` is the public-key table to verify with."""

    def __init__(self, key_id: str = "test-1") -> None:
        tool = vendor_tool()
        self.key_id = key_id
        self.private, self.public = tool.new_key_pair()

    @property
    def table(self) -> dict[str, bytes]:
        return {self.key_id: self.public}

    @property
    def public_text(self) -> str:
        from carbonforge_runtime.runtime.licensing.core import b64url_encode

        return b64url_encode(self.public)

    def issue(self, entitlements: tuple[str, ...] = ("*",), days: float = 30, licensee: str = "Acme Test GmbH",
              not_before: int | None = None, issued_at: int | None = None, key_id: str | None = None,
              check_term: bool = True, licence_id: str | None = "lic-test-0001") -> str:
        return str(vendor_tool().issue_licence(
            self.private, key_id or self.key_id, licensee, list(entitlements), days,
            not_before=not_before, issued_at=issued_at, licence_id=licence_id, check_term=check_term,
        ))

    def sign_payload(self, payload: bytes) -> str:
        from carbonforge_runtime.runtime.licensing.core import assemble

        return str(assemble(payload, vendor_tool().sign(self.private, payload)))


# --- the vendor tool as a command and the runtime through this launcher (licence tests on processes) ----

PREMIUM_KEY = "cf-tiny-premium:bf16:chat:cpu"


def tool(*args: str) -> str:
    """``scripts/cf-license ARGS`` as the vendor runs it; its standard output."""
    import subprocess

    result = subprocess.run([sys.executable, str(_TOOL), *args], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def new_vendor(directory: Path) -> dict[str, str]:
    """A fresh key pair made by the vendor tool in ``directory`` and the trusted-key entry for its public half."""
    import json

    key_file = directory / "e2e-key.json"
    tool("keygen", "--key-id", "e2e-test-1", "--out", str(key_file))
    public = json.loads(key_file.read_text())["public_key"]
    return {"key_file": str(key_file), "trusted": f"e2e-test-1={public}"}


def issue(vendor: dict[str, str], *extra: str) -> str:
    return tool("issue", "--key", vendor["key_file"], "--licensee", "E2E Test Ltd", *extra).strip()


def premium_runtime(log_dir: Path, vendor: dict[str, str], **env: str):  # type: ignore[no-untyped-def]
    """The runtime asked for the premium test recipe, through this launcher, trusting ``vendor``'s key;
    a RuntimeProcess not yet started (no licence file unless ``env`` names one)."""
    from tests.support import TEST_RECIPES, RuntimeProcess

    base = {"CF_RECIPES_DIR": str(TEST_RECIPES), TEST_KEYS_VAR: vendor["trusted"],
            "CF_LICENSE_FILE": str(log_dir / "no-licence-here.key")}
    return RuntimeProcess(["--context-key", PREMIUM_KEY], log_dir, env={**base, **env},
                          python=[sys.executable, str(Path(__file__).resolve())])
