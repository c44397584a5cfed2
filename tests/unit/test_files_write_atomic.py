"""The one writer of user files (``files.write_atomic``): a new file of a random name beside the
target, renamed over it once complete. A planted temporary name or a link at the target is never
written through; a failure leaves the old file as it was and no temporary file behind. And no other
module of the package writes a user's file directly."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path
from typing import IO, Any

import pytest

from carbonforge_runtime import files

PACKAGE = Path(files.__file__).parent
SECRET = "do not touch\n"


def leftovers(directory: Path, *keep: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name not in keep)


def test_the_file_is_written_whole_with_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "out" / "result.json"  # the directory is created
    files.write_text_atomic(target, "{}\n")
    assert target.read_text() == "{}\n"
    assert stat.S_IMODE(target.stat().st_mode) == files.WRITE_MODE
    files.write_atomic(target, lambda handle: handle.write(b"\x89PNG"), binary=True, mode=0o600)
    assert target.read_bytes() == b"\x89PNG" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert leftovers(target.parent, "result.json") == []


def test_a_link_at_the_target_is_replaced_and_its_target_left_alone(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text(SECRET)
    target = tmp_path / "result.json"
    target.symlink_to(victim)
    files.write_text_atomic(target, "new\n")
    assert not target.is_symlink() and target.read_text() == "new\n"
    assert victim.read_text() == SECRET


def test_links_planted_at_every_fixed_temporary_name_are_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text(SECRET)
    target = tmp_path / "model.json"
    for name in ("model.json.tmp", ".model.json.tmp", "model.tmp", ".model.json.swp"):
        (tmp_path / name).symlink_to(victim)
    files.write_text_atomic(target, "model\n")
    assert target.read_text() == "model\n" and victim.read_text() == SECRET


def test_a_failure_mid_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "result.json"
    target.write_text("old\n")

    def half_then_fail(handle: IO[Any]) -> None:
        handle.write("half of the new conte")
        handle.flush()
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        files.write_atomic(target, half_then_fail)
    assert target.read_text() == "old\n"
    assert leftovers(tmp_path, "result.json") == []


def test_a_directory_at_the_target_is_an_error_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(IsADirectoryError):
        files.write_text_atomic(tmp_path / "out", "x")
    assert leftovers(tmp_path, "out") == [] and os.listdir(tmp_path / "out") == []


# -- no direct writes elsewhere ------------------------------------------------------------------

#: (module, function) -> why it may write without :func:`files.write_atomic`.
ALLOWED = {
    ("files.py", "write_atomic"): "the writer itself",
    ("log.py", "_NoFollowRotatingHandler._open"): "runtime.log: append-only, opened by files.open_append",
    ("runtime/process/supervisor.py", "EngineProcess.start"): "vllm.log: append-only, opened by files.open_append",
    ("gpu/fake.py", "FakeGpuSession._record"): "the scripted fake NVML's call log: append-only, for tests",
    ("engine/twin.py", "_model_dir"): "a config in a private directory the function has just created",
    ("runtime/weights/tiny_model.py", "ensure_tiny_model"): "written in a private staging directory that is "
                                                            "then renamed into place as a whole",
    ("runtime/doctor/probes.py", "SystemProbes.directory"): "a write probe: a new file, removed at once",
    ("engine/trace_sinks.py", "Rotation.rename"): "a trace file of whole lines renamed, between records, to a "
                                                  "segment name nothing else uses",
}


#: Modules whose ``open`` takes the path first, as the built-in one does.
_MODULES = ("io", "gzip", "bz2", "lzma", "codecs", "builtins")


def _mode(call: ast.Call) -> str | None:
    for keyword in call.keywords:
        if keyword.arg == "mode" and isinstance(keyword.value, ast.Constant) and isinstance(keyword.value.value, str):
            return keyword.value.value
    func = call.func
    owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
    # open(path, mode), os.fdopen(fd, mode), gzip.open(path, mode)...; but a_path.open(mode)
    positional = 1 if isinstance(func, ast.Name) or getattr(func, "attr", "") == "fdopen" or owner in _MODULES else 0
    if len(call.args) > positional:
        value = call.args[positional]
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value
    return None


def _write_kind(call: ast.Call, source: str) -> str | None:
    """What kind of direct write ``call`` is, or None."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
    if name == "fdopen" or (name == "open" and owner != "os"):
        mode = _mode(call)
        return f"open({mode!r})" if mode and set(mode) & set("wax+") else None
    if name in ("write_text", "write_bytes", "savefig", "mkstemp", "NamedTemporaryFile"):
        return name
    if owner == "os" and name in ("replace", "rename"):
        return f"os.{name}"
    if owner == "shutil" and name in ("copy", "copy2", "copyfile", "move"):
        return f"shutil.{name}"
    if owner == "os" and name == "open" and any(flag in (ast.get_source_segment(source, call) or "")
                                                for flag in ("O_CREAT", "O_WRONLY", "O_RDWR", "O_TRUNC")):
        return "os.open for writing"
    return None


def _visit(node: ast.AST, source: str, module: str, scope: list[str], inside_writer: bool,
           found: list[tuple[str, str, str, int]]) -> None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        scope = [*scope, node.name]
    if isinstance(node, ast.Call):
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name in ("write_atomic", "write_text_atomic"):
            inside_writer = True
        elif not inside_writer and (kind := _write_kind(node, source)) is not None:
            found.append((module, ".".join(scope), kind, node.lineno))
    for child in ast.iter_child_nodes(node):
        _visit(child, source, module, scope, inside_writer, found)


def direct_writes() -> list[tuple[str, str, str, int]]:
    """(module, function, kind, line) of every direct file write in the package; a write inside the
    arguments of a ``write_atomic`` call (a plot saved into the handle it gives) is the writer's."""
    found: list[tuple[str, str, str, int]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        _visit(ast.parse(source), source, path.relative_to(PACKAGE).as_posix(), [], False, found)
    return found


def test_every_user_file_goes_through_the_one_writer() -> None:
    unexpected = [f"{module}:{line} {scope or '<module>'}: {kind}" for module, scope, kind, line in direct_writes()
                  if (module, scope) not in ALLOWED]
    assert unexpected == [], ("write these through carbonforge_runtime.files.write_atomic, or add the function to "
                              "ALLOWED with the reason:\n" + "\n".join(unexpected))


def test_the_allow_list_names_only_functions_that_still_write() -> None:
    writing = {(module, scope) for module, scope, _kind, _line in direct_writes()}
    assert set(ALLOWED) - writing == set()


def test_the_search_finds_the_writes_it_looks_for() -> None:
    source = ("def f(p, fd):\n    open(p, 'w')\n    p.write_text('x')\n    os.replace(p, p)\n"
              "    os.open(p, os.O_WRONLY | os.O_CREAT)\n    fig.savefig(p)\n    gzip.open(p, 'wt')\n"
              "    p.open('a')\n    shutil.copy(p, p)\n    open(p)\n    p.open()\n    gzip.open(p)\n")
    calls = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)]
    kinds = [kind for call in calls if (kind := _write_kind(call, source)) is not None]
    assert kinds == ["open('w')", "write_text", "os.replace", "os.open for writing", "savefig", "open('wt')",
                     "open('a')", "shutil.copy"]
    inside = "def g(p):\n    write_atomic(p, lambda h: fig.savefig(h))\n    fig.savefig(p)\n"
    found: list[tuple[str, str, str, int]] = []
    _visit(ast.parse(inside), inside, "m.py", [], False, found)
    assert found == [("m.py", "g", "savefig", 3)]  # the plot saved into the writer's handle is the writer's
