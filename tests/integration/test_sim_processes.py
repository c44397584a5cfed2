"""``carbonforge-runtime sim`` in two separate processes, started with different hash seeds, writes
byte-identical files (issue 16, acceptance 2): sim pins the seed by running itself again, which only
a fresh interpreter shows, so this lives here and not in tests/unit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.unit.cli.test_sim_cli import KEY, mooncake


def test_two_processes_write_identical_files(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    # KV pressure (preemption, eviction) and prefix sharing: where vLLM's set iteration order shows.
    trace = mooncake(tmp_path / "m.jsonl", count=80, seed=5)
    procs = []
    for name, seed in (("a", "1"), ("b", "2")):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env["PYTHONHASHSEED"] = seed  # each run pins 0 for itself by running again
        env["PYTHONPATH"] = str(REPO)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "carbonforge_runtime", "sim", str(trace), "--context-key", KEY,
             "--family", "hybrid", "--kv-tokens", "12000", "--rate", "4", "-q", "-o", str(tmp_path / f"{name}.json")],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr[-2000:]
    a, _b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert a["sim"]["preemptions"]["total"] > 0 and a["sim"]["prefix_cache"]["hit_rate"] > 0
    assert (tmp_path / "a.json").read_bytes().replace(b"/a.", b"/x.") == \
        (tmp_path / "b.json").read_bytes().replace(b"/b.", b"/x.")
    assert (tmp_path / "a.requests.jsonl").read_bytes() == (tmp_path / "b.requests.jsonl").read_bytes()
