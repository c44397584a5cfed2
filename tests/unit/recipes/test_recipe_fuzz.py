"""Recipe loading on hostile files: any bytes or YAML in a CF_RECIPES_DIR file gives RecipeError (exit 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli

runner = CliRunner()
SHIPPED = Path(__file__).resolve().parents[3] / "recipes" / "cf-tiny--bf16--chat--cpu.yaml"
BASE: dict[str, Any] = yaml.safe_load(SHIPPED.read_text(encoding="utf-8"))
KEY = "cf-tiny:bf16:chat:l4x1"  # a key no shipped recipe has, so the fuzzed file is the one resolved

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from([10**30, -(10**30), 2**64]),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
RAW_YAML = st.sampled_from([
    "a: &x [1]\nb: *x\n", "[" * 3000 + "]" * 3000, "{" * 3000, "key: !!python/object:os.system x\n",
    "key: .inf\n", "key: 1e999\n", "- - - - -\n", "%YAML 9.9\n---\na: 1\n", "\t\x00\x01", "key: [1, 2\n",
    "key: " + "9" * 5000 + "\n", "? [a, b]\n: c\n", "---\na: 1\n---\nb: 2\n",
])


def _mutated(changes: list[tuple[list[str], Any]]) -> bytes:
    doc = yaml.safe_load(SHIPPED.read_text(encoding="utf-8"))
    doc["key"] = KEY
    for path, value in changes:
        node: Any = doc
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                break
        else:
            node[path[-1]] = value
    return yaml.safe_dump(doc, allow_unicode=True).encode("utf-8", "surrogatepass")


FIELD_PATHS = [[name] for name in BASE] + [[section, name] for section, body in BASE.items()
                                           if isinstance(body, dict) for name in body]
RECIPE_FILES = st.one_of(
    st.lists(st.tuples(st.sampled_from(FIELD_PATHS), VALUES), min_size=1, max_size=3).map(_mutated),
    st.binary(max_size=200), RAW_YAML.map(str.encode), VALUES.map(lambda v: yaml.safe_dump(v).encode()),
    st.just(b"\xff\xfe" + "key: x".encode("utf-16-le")),
)


# 30 files a run (about 40 ms each through the CLI, 0.7 s for the deeply nested ones) keep the unit
# suite's budget; every run draws new ones, and a failure found once is replayed from Hypothesis's
# database. No deadline: a loaded machine must not fail it on time.
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=RECIPE_FILES, show=st.booleans())
def test_any_recipe_file_gives_a_recipe_error_not_a_traceback(tmp_path: Path, data: bytes, show: bool) -> None:
    folder = tmp_path / "recipes"
    folder.mkdir(exist_ok=True)
    (folder / "fuzzed.yaml").write_bytes(data)
    args = ["recipes", "show", KEY] if show else ["recipes", "list"]
    result = runner.invoke(cli.app, args, env={"CF_RECIPES_DIR": str(folder)})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        raise AssertionError("".join(traceback.format_exception(result.exception)))
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output
    if result.exit_code:
        assert [line for line in result.stderr.splitlines() if line.startswith("error: ")], result.output
