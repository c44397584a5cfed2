"""Is a model on disk a copy of a premium model under another name? Its shape, from its config.json.

A name identifies most copies (see :func:`~carbonforge_runtime.runtime.vllm_cli.served_model.model_matches`),
but a local directory with a neutral name and a config.json without ``_name_or_path``, or a hub repository
mirrored under another name, carries none. Their config.json still declares the architecture and sizes,
which the shipped table ``premium-shapes.json`` (beside the shipped recipes) records for every model a
shipped premium recipe serves. A model matches a premium model when its config.json has every field
the table lists for it, with the same value.

Where the config.json is read: the model's own directory when it is a local path, else the snapshot of
that repository in the hub cache the engine uses (when it is already there). A hub repository not yet
downloaded is known only by its name until then. What this does not catch: a config.json edited so that
one listed field differs (the engine would then build a model that does not fit the weights, or a
different model), and a model whose entry in the table is null (shape not yet recorded).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from carbonforge_runtime import files
from carbonforge_runtime.recipes.loader import shipped_recipes_dir
from carbonforge_runtime.runtime.vllm_cli.served_model import MAX_CONFIG_BYTES, normalise_model_id

SHAPES_FILE = "premium-shapes.json"


@functools.lru_cache(maxsize=1)
def premium_shapes() -> dict[str, dict[str, Any] | None]:
    """Normalised model id -> the config.json fields that identify it (None: not recorded)."""
    data = json.loads((shipped_recipes_dir() / SHAPES_FILE).read_text(encoding="utf-8"))
    return {normalise_model_id(repo): shape for repo, shape in data["models"].items()}


def _read_config(directory: Path) -> dict[str, Any] | None:
    try:
        raw = files.read_regular(directory / "config.json", MAX_CONFIG_BYTES)
        config = json.loads(raw.decode("utf-8", errors="replace"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def model_config(model: str, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The config.json ``model`` would be built from, when it can be read without the network."""
    text = os.path.expanduser(model.strip())
    try:
        if os.path.isdir(text):
            return _read_config(Path(text))
    except (OSError, ValueError):
        return None
    if text.count("/") != 1:
        return None
    from carbonforge_runtime.runtime.weights.hub_cache import find_hub_snapshot, hub_cache_dir

    cache_dir, _ = hub_cache_dir(os.environ if environ is None else environ)
    try:
        snapshot = find_hub_snapshot(Path(cache_dir), text, None)
    except (OSError, ValueError):
        return None
    return _read_config(snapshot) if snapshot is not None else None


def config_matches(config: Mapping[str, Any], shape: Mapping[str, Any]) -> bool:
    """Whether ``config`` has every field of ``shape`` with the same value (a nested text_config counts)."""
    nested = config.get("text_config")
    inner = nested if isinstance(nested, dict) else {}
    for name, value in shape.items():
        if name == "architectures":
            if config.get(name) != value:
                return False
        elif config.get(name, inner.get(name)) != value:
            return False
    return bool(shape)


def shape_matches(model: str, premium_repo: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the config.json of ``model`` (on disk or in the hub cache) has the shape recorded for
    the premium model ``premium_repo``. False when either is unknown."""
    shape = premium_shapes().get(normalise_model_id(premium_repo))
    if not shape:
        return False
    config = model_config(model, environ)
    return config is not None and config_matches(config, shape)
