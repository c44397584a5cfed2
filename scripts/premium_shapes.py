#!/usr/bin/env python3
"""Record the shape of each shipped premium recipe's model in recipes/premium-shapes.json, from the
config.json in the hub cache (fill it first with `carbonforge-runtime fetch KEY`, or only the config:
the first phase of a fetch), or check the table against those configs.

    python scripts/premium_shapes.py            # write the entries of every model whose config is cached
    python scripts/premium_shapes.py --check    # exit 1 naming each entry that differs from its cached config

A model whose config is not in the cache keeps its entry as it is (null when never recorded). The cache
is the one the engine uses (HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from carbonforge_runtime import files
from carbonforge_runtime.recipes import shipped_recipes_dir
from carbonforge_runtime.runtime.licensing.gate import shipped_recipes
from carbonforge_runtime.runtime.licensing.premium import SHAPES_FILE, model_config


def shape_of(config: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    nested = config.get("text_config")
    inner = nested if isinstance(nested, dict) else {}
    return {name: config.get(name, inner.get(name)) for name in fields
            if config.get(name, inner.get(name)) is not None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; write nothing")
    args = parser.parse_args()
    path = shipped_recipes_dir() / SHAPES_FILE
    table = json.loads(path.read_text(encoding="utf-8"))
    models: dict[str, Any] = table["models"]
    differ = []
    for repo in sorted({recipe.model.repo for recipe in shipped_recipes() if recipe.is_premium}):
        config = model_config(repo, os.environ)
        if config is None:
            kept = "recorded" if models.get(repo) else "null"
            print(f"{repo}: config.json not in the hub cache; entry kept ({kept})")
            models.setdefault(repo, None)
            continue
        shape = shape_of(config, table["fields"])
        if models.get(repo) != shape:
            differ.append(repo)
            print(f"{repo}: the table says {json.dumps(models.get(repo))}, the cached config {json.dumps(shape)}")
        models[repo] = shape
    if args.check:
        return 1 if differ else 0
    files.write_text_atomic(path, json.dumps(table, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
