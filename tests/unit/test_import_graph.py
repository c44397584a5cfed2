"""No import cycles anywhere in the package, function-level imports included, and the check finds one
when there is one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import grimp
import pytest

from tests.support import REPO


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


graph_tool = _load_script()


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("carbonforge_runtime", include_external_packages=False, cache_dir=None)


def test_no_cycle_between_modules(graph: grimp.ImportGraph) -> None:
    assert graph_tool.cycles(graph_tool.module_edges(graph)) == []


@pytest.mark.parametrize("depth", [2, 3])
def test_no_cycle_between_packages(graph: grimp.ImportGraph, depth: int) -> None:
    assert graph_tool.cycles(graph_tool.package_edges(graph, depth)) == []


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "cyclic_pkg"
    (package / "a").mkdir(parents=True)
    (package / "b").mkdir()
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("from cyclic_pkg.b import helper\n")
    (package / "b" / "__init__.py").write_text(
        "def helper():\n    from cyclic_pkg.a import thing  # hidden inside a function\n    return thing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cyclic = grimp.build_graph("cyclic_pkg", include_external_packages=False, cache_dir=None)
    assert graph_tool.cycles(graph_tool.module_edges(cyclic)) == [["cyclic_pkg.a", "cyclic_pkg.b"]]
    assert graph_tool.cycles(graph_tool.package_edges(cyclic, 2)) == [["cyclic_pkg.a", "cyclic_pkg.b"]]


def test_the_engine_package_is_the_only_one_importing_vllm() -> None:
    offenders = []
    for path in (REPO / "carbonforge_runtime").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if ("import vllm" in text or "from vllm" in text) and "engine" not in path.relative_to(REPO).parts:
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []
