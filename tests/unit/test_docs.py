"""The docs cannot drift: the generated tables match the code, and the README stays a front page."""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from carbonforge_runtime.cli.main import RUNTIME_FLAGS, app
from carbonforge_runtime.settings import VARIABLES
from tests.support import REPO

DOCS = REPO / "docs"
README = REPO / "README.md"
README_MAX_LINES = 250


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def _block(page: str, name: str) -> str:
    blocks = gen._blocks((DOCS / page).read_text(encoding="utf-8"))
    assert name in blocks, f"docs/{page} has no generated table {name!r}"
    return str(blocks[name])


# ---- the generated tables ----------------------------------------------------------------------------


def test_committed_docs_are_current() -> None:
    problems = gen.check(DOCS)
    assert not problems, "\n".join([*problems, "run: python scripts/gen_docs.py"])


def test_generation_is_deterministic() -> None:
    first = {name: table.render() for name, table in gen.TABLES.items()}
    second = {name: table.render() for name, table in gen.TABLES.items()}
    assert first == second
    assert str(Path.home()) not in "".join(first.values())


def _current_copy(tmp_path: Path) -> Path:
    """A copy of docs/ with every generated table current, whatever the state of the committed one."""
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    shutil.copy(DOCS.parent / "README.md", tmp_path / "README.md")  # its list of subcommands is generated too
    gen.write(docs)
    return docs


def test_a_hand_edit_of_a_generated_table_fails_the_check(tmp_path: Path) -> None:
    docs = _current_copy(tmp_path)
    page = docs / "environment.md"
    text = page.read_text(encoding="utf-8")
    block = gen._blocks(text)["env-vars"]
    edited_block = block.replace("`CF_PORT` | `8000`", "`CF_PORT` | `8080`", 1)
    assert edited_block != block
    page.write_text(text.replace(block, edited_block), encoding="utf-8")
    before = {path: path.read_bytes() for path in docs.rglob("*.md")}

    problems = gen.check(docs)
    assert len(problems) == 1
    assert "environment.md" in problems[0] and "'env-vars'" in problems[0]
    assert gen.main(["--check", "--docs", str(docs)]) == 1
    assert {path: path.read_bytes() for path in docs.rglob("*.md")} == before, "--check wrote something"

    changed, write_problems = gen.write(docs)
    assert changed == [page] and not write_problems
    assert page.read_text(encoding="utf-8") == text
    assert gen.check(docs) == []


def test_prose_around_the_tables_is_left_alone(tmp_path: Path) -> None:
    docs = _current_copy(tmp_path)
    page = docs / "cli.md"
    page.write_text(page.read_text(encoding="utf-8") + "\nA hand-written closing note.\n", encoding="utf-8")
    assert gen.check(docs) == []
    assert gen.write(docs) == ([], [])
    assert page.read_text(encoding="utf-8").endswith("\nA hand-written closing note.\n")


def test_missing_or_unknown_markers_are_reported(tmp_path: Path) -> None:
    docs = _current_copy(tmp_path)
    metrics = docs / "metrics-and-energy.md"
    metrics.write_text(metrics.read_text(encoding="utf-8").replace(gen.END.format("metrics"), ""), encoding="utf-8")
    (docs / "extra.md").write_text(f"{gen.BEGIN.format('nonsense')}\n{gen.END.format('nonsense')}\n",
                                   encoding="utf-8")
    (docs / "exit-codes.md").unlink()
    problems = "\n".join(gen.check(docs))
    assert "metrics-and-energy.md: table 'metrics' needs exactly one" in problems
    assert "extra.md: marker for 'nonsense'" in problems
    assert "exit-codes.md: page missing" in problems
    assert gen.main(["--check", "--docs", str(docs)]) == 1


def test_every_variable_is_in_the_generated_table() -> None:
    table = _block("environment.md", "env-vars")
    missing = [var.name for var in VARIABLES if f"| `{var.name}` |" not in table]
    assert not missing, f"variables missing from docs/environment.md: {missing}"


def test_every_runtime_flag_is_in_the_generated_tables() -> None:
    flags = _block("cli.md", "runtime-flags")
    commands = _block("cli.md", "commands")
    missing = [flag for flag in RUNTIME_FLAGS if f"| `{flag}` |" not in flags or f"`{flag}`" not in commands]
    assert not missing, f"runtime flags missing from docs/cli.md: {missing}"


def test_every_command_is_in_the_generated_table() -> None:
    import typer

    table = _block("cli.md", "commands")
    root = typer.main.get_command(app)
    paths = [" ".join(("carbonforge-runtime", *path)) for path, _ in gen._walk(root)]
    assert len(paths) > 10
    missing = [path for path in paths if f"| `{path}` |" not in table]
    assert not missing, f"commands missing from docs/cli.md: {missing}"


# ---- the README ------------------------------------------------------------------------------------------


def test_readme_is_a_front_page() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move reference material to docs/"


def test_readme_setup_commands_exist() -> None:
    text = README.read_text(encoding="utf-8")
    for script in ("scripts/serve-default.sh", "scripts/test.sh"):
        assert f"bash {script}" in text
        assert (REPO / script).is_file()
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text(encoding="utf-8")


def test_readme_links_every_docs_page() -> None:
    text = README.read_text(encoding="utf-8")
    missing = [page.name for page in sorted(DOCS.glob("*.md")) if f"](docs/{page.name})" not in text]
    assert not missing, f"docs pages the README does not link: {missing}"


def _slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _outside_code(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _outside_code(path.read_text(encoding="utf-8"))
            if re.match(r"#{1,6} ", line)}


def test_links_between_pages_resolve() -> None:
    broken = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for line in _outside_code(page.read_text(encoding="utf-8")):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue
                file_part, _, anchor = target.partition("#")
                linked = (page.parent / file_part) if file_part else page
                if not linked.is_file():
                    broken.append(f"{page.name}: {target} (no such file)")
                elif anchor and anchor not in _anchors(linked):
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# ---- the data the tables come from matches what the code does -----------------------------------------


def test_trace_field_meanings_cover_exactly_the_written_fields() -> None:
    from carbonforge_runtime.core import trace_record as tr

    done = tr.Completion("chatcmpl-1-0123abcd", 10.0, 10.5, 10.7, 12.0, 20, 5, "stop",
                         prompt_token_ids=[1, 2], output_token_ids=[3])
    record = tr.build_record(done, "fcfs", tr.LEVEL_FULL, decode=lambda ids, skip: "x" * len(ids))
    assert list(record) == [*tr.STANDARD_FIELDS, *tr.EXTRA_FIELDS, *tr.FULL_FIELDS]
    assert list(tr.FIELD_MEANINGS) == list(record)
    assert all(meaning.strip() for meaning in tr.FIELD_MEANINGS.values())


_CHECK_NAME = re.compile(r"license|(?:host|gpu|recipe|tracing|storage|engine|group)(?:\.[A-Za-z0-9_{}]+)+")


def _check_names_in_source() -> dict[str, str | None]:
    """Check names the doctor's functions use (``{}`` for a formatted part), with the section when known."""
    from carbonforge_runtime.runtime.doctor import model

    source = REPO / "carbonforge_runtime" / "runtime" / "doctor" / "checks.py"
    tree = ast.parse(source.read_text(encoding="utf-8"))

    def is_the_table(node: ast.stmt) -> bool:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        return any(getattr(target, "id", None) == "CHECKS" for target in targets)

    code = [node for node in tree.body if not is_the_table(node)]

    def text_of(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        else:
            return None
        return text if _CHECK_NAME.fullmatch(text) else None

    found: dict[str, str | None] = {}
    for top in code:
        for node in ast.walk(top):
            name = text_of(node)
            if name is not None:
                found.setdefault(name, None)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("Check", "_directory") and len(node.args) >= 2
                    and isinstance(node.args[0], ast.Name)):
                name = text_of(node.args[1])
                if name is not None:
                    found[name] = getattr(model, node.args[0].id)
    return found


def test_the_doctor_check_table_names_every_check_the_code_makes() -> None:
    from carbonforge_runtime.runtime.doctor.checks import CHECKS
    from carbonforge_runtime.runtime.doctor.model import SECTIONS

    table = {info.name: info for info in CHECKS}
    assert len(table) == len(CHECKS), "a check name is listed twice"
    in_code = _check_names_in_source()
    assert "recipe.memory" in in_code and "gpu.{}.processes" in in_code

    def matches(code_name: str, table_name: str) -> bool:
        pattern = re.escape(code_name).replace(r"\{\}", "[A-Za-z0-9_]+")
        return re.fullmatch(pattern, table_name) is not None

    unlisted = [name for name in in_code if not any(matches(name, listed) for listed in table)]
    assert not unlisted, f"checks.py makes checks that CHECKS does not list: {unlisted}"
    stale = [listed for listed in table if not any(matches(name, listed) for name in in_code)]
    assert not stale, f"CHECKS lists names checks.py never makes: {stale}"
    for name, section in in_code.items():
        for listed in table:
            if matches(name, listed) and section is not None:
                assert table[listed].section == section, f"{listed}: CHECKS says {table[listed].section}"
    assert all(info.section in SECTIONS for info in CHECKS)
    assert [SECTIONS.index(info.section) for info in CHECKS] == sorted(SECTIONS.index(i.section) for i in CHECKS)


def test_the_metrics_table_is_what_the_page_exposes() -> None:
    from carbonforge_runtime.core.feed_protocol import EngineCounters, EngineState
    from carbonforge_runtime.gpu.types import GpuReading
    from carbonforge_runtime.runtime.energy.controller import ControllerStatus
    from carbonforge_runtime.runtime.metrics.exposition import METRICS, PREFIX, families
    from carbonforge_runtime.runtime.metrics.receiver import ReceiverStats
    from carbonforge_runtime.runtime.metrics.state import FamilyStats, Info, RankState, Snapshot, TenantStats

    stats = FamilyStats(prompt_tokens=10, output_tokens=5, energy_j=1.0, requests={("stop", 0): 1})
    stats.queue_wait.observe(0.1)
    stats.ttft.observe(0.2)
    stats.e2e.observe(0.3)
    usage = TenantStats(prompt_tokens=10, cached_prompt_tokens=4, output_tokens=5, energy_j=1.0,
                        requests={"stop": 1})
    usage.ttft.observe(0.2)
    usage.e2e.observe(0.3)
    everything = Snapshot(
        families={"fcfs": stats},
        ranks={0: RankState(EngineState(EngineCounters(steps=3, waiting=1, running=2, emulated_steps_total=3,
                                                       emulated_late_steps_total=1),
                                        sinks={"file": (1, 0), "queue": (0, 1)}), 0.2)},
        feed=ReceiverStats(messages=4),
        gpus=[GpuReading(0, "GPU-0", 300.0, 1e6, 1410, 1593, 60.0, 1 << 30, 400.0, False)],
        controller=ControllerStatus("lock-sm-clock", False, "", targets={0: (1410.0, 400.0)}, load=0.5),
        info=Info("0.2.0", "0.32.0", "k:q:chat:cpu", "r", "premium", 2e9, max_num_seqs=16,
                  queue_wait_target_s=0.5),
        joules_per_output_token=0.2,
        group_hosts_lost=0,
        tenants={"acme": usage},
    )
    exposed = {metric.name: metric for metric in families(everything)}
    assert [spec.name for spec in METRICS] == [name.removeprefix(PREFIX) for name in exposed]
    for spec in METRICS:
        metric = exposed[PREFIX + spec.name]
        assert (metric.type, metric.documentation) == (spec.kind, spec.help), spec.name
        labels = {key for sample in metric.samples for key in sample.labels} - {"le"}
        assert labels == set(spec.labels), spec.name
        assert {sample.name for sample in metric.samples if not sample.name.endswith(("_bucket", "_sum", "_count",
                                                                                      "_created"))} \
            <= {spec.exposed_name}, spec.name


@pytest.mark.parametrize("name", sorted(gen.TABLES))
def test_every_table_has_rows(name: str) -> None:
    body = gen.TABLES[name].render()
    assert body.count("\n| ") >= 2, f"table {name!r} came out empty"
