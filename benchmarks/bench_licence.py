#!/usr/bin/env python3
"""Licence verification cost. Target: under 1 ms per verification.

Measures, side by side in one process: a full ``verify`` of a valid licence, the bare Ed25519
signature check it contains, and the refusals (bad signature, oversize input). Then, in a fresh
interpreter, the first verification including the lazy import of the crypto backend (paid once
per start of the runtime, only when a premium recipe is served).

    .venv/bin/python benchmarks/bench_licence.py [--rounds N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.harness import median  # noqa: E402
from carbonforge_runtime.runtime.licensing import LicenseInvalid, verify  # noqa: E402
from tests.support.licensed_runtime import Signer  # noqa: E402

TARGET_S = 1e-3


def per_call_s(fn: Callable[[], object], rounds: int, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean time of ``rounds`` calls."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        samples.append((time.perf_counter() - start) / rounds)
    return median(samples)


def refused(text: str, table: dict[str, bytes], now: float) -> Callable[[], object]:
    def run() -> object:
        try:
            verify(text, table, now)
        except LicenseInvalid as exc:
            return exc
        raise AssertionError("accepted")
    return run


COLD = """
import sys, time
sys.path.insert(0, {repo!r})
start = time.perf_counter()
from carbonforge_runtime.runtime.licensing import verify
imported = time.perf_counter()
verify({text!r}, {{{kid!r}: bytes.fromhex({pub!r})}}, {now!r})
done = time.perf_counter()
print(imported - start, done - imported)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()

    signer = Signer("bench-1")
    now = time.time()
    text = signer.issue(entitlements=("*", "qwen3-32b:*:*:*", "model=Qwen/Qwen3.6-27B-FP8"), issued_at=int(now))
    # A table like a production one after two rotations.
    table = {**Signer("bench-0").table, **signer.table, **Signer("bench-2").table}
    verify(text, table, now)  # warm: imports the crypto backend

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    payload_b64, signature_b64 = text.split(".")[1:]
    from carbonforge_runtime.runtime.licensing.core import b64url_decode

    payload, signature = b64url_decode(payload_b64), b64url_decode(signature_b64)

    def bare() -> None:
        Ed25519PublicKey.from_public_bytes(signer.public).verify(signature, payload)

    tampered = text[:-3] + ("A" if text[-3] != "A" else "B") + text[-2:]
    rows = [
        ("verify(), valid licence", per_call_s(lambda: verify(text, table, now), args.rounds)),
        ("bare Ed25519 check alone", per_call_s(bare, args.rounds)),
        ("verify(), bad signature", per_call_s(refused(tampered, table, now), args.rounds)),
        ("verify(), 1 MiB input", per_call_s(refused("A" * (1 << 20), table, now), args.rounds)),
    ]
    result = subprocess.run(
        [sys.executable, "-c", COLD.format(repo=str(REPO), text=text, kid=signer.key_id, pub=signer.public.hex(),
                                           now=now)],
        capture_output=True, text=True, check=True, timeout=60,
    )
    import_s, first_s = (float(x) for x in result.stdout.split())

    print(f"licence length: {len(text)} characters; key table: {len(table)} keys; {args.rounds} calls x 7")
    for name, seconds in rows:
        print(f"  {name:<28} {seconds * 1e6:8.1f} us   {TARGET_S / seconds:7.1f}x under the 1 ms target")
    overhead = rows[0][1] - rows[1][1]
    print(f"  checks around the signature  {overhead * 1e6:8.1f} us   "
          f"({rows[0][1] / rows[1][1]:.2f}x the bare signature check)")
    print(f"fresh process: import of the licensing package {import_s * 1e3:.1f} ms; first verification "
          f"(loads the crypto backend) {first_s * 1e3:.1f} ms")
    ok = rows[0][1] < TARGET_S
    print(f"per-verification figure: {rows[0][1] * 1e3:.3f} ms -> {'PASS' if ok else 'FAIL'} (target < 1 ms)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
