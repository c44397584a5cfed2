"""Which model a vLLM argument list would serve, resolved the way vLLM 0.32 parses it.

The licence gate depends on this answer, so it follows vLLM's parser (``FlexibleArgumentParser``
in front of argparse) step by step, and refuses what a reader could take two ways:

1. The runtime launches ``python -m vllm.entrypoints.openai.api_server``, which serves ``--model``
   only (a positional model is parsed there and ignored). The override mode therefore turns a
   first argument that is not a flag into ``--model ARG`` (see ``build_override_plan``).
2. ``--config FILE`` (exactly that token) is replaced by the file's ``key: value`` pairs, placed
   before the other arguments; a ``model:`` key becomes ``--model VALUE``.
3. Flag names have ``_`` turned into ``-`` (``--model`` has none, but ``--config`` file keys may).
4. Any ``-x.y`` argument is a dotted JSON field that consumes the next argument unless written
   ``-x.y=v``; those pairs are removed before argparse sees the rest.
5. argparse keeps the last ``--model``/``--model=VALUE``; a flag's value is the next argument.

Refused as ambiguous: two different models named at once (positional, ``--model``, config),
abbreviations or other spellings of ``--model`` (``--mod``, ``--MODEL``, ``--model.x``),
``--config=FILE`` (vLLM ignores that form), more than one ``--config``, a config file that
cannot be read, a bare ``--`` among vLLM's arguments, an empty model.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carbonforge_runtime import files
from carbonforge_runtime.errors import LicenseError
from carbonforge_runtime.runtime.vllm_cli.args import normalise

CANNOT_GATE = "could not determine which model to gate"
REMEDY_MODEL = ("put the model as the first argument after -- (carbonforge-runtime -- MODEL ...) "
                "or pass it once as --model MODEL")
MODEL_FLAG = "--model"
CONFIG_FLAG = "--config"
#: The most of a --config file the runtime reads to find its model.
MAX_CONFIG_BYTES = 1024 * 1024



@dataclass(frozen=True)
class ModelChoice:
    """The model vLLM would serve and where it was named."""

    model: str
    origin: str  # "first argument", "--model", "--config FILE"


def _refuse(message: str, remedy: str = REMEDY_MODEL) -> LicenseError:
    return LicenseError(f"{CANNOT_GATE}: {message}", remedy)


def read_config_file(path: str) -> Any:
    """The parsed YAML of a ``--config`` file (relative paths as vLLM, started in the same directory)."""
    import yaml

    data = files.read_regular(path, MAX_CONFIG_BYTES)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"larger than {MAX_CONFIG_BYTES} bytes")
    return yaml.safe_load(data)


def _config_args(path: str, read: Callable[[str], Any]) -> list[str]:
    """The arguments vLLM derives from a config file, as far as they can name the model."""
    if path.split(".")[-1] not in ("yaml", "yml"):
        raise _refuse(f"the --config file {path!r} is not a .yaml/.yml file (vLLM refuses it too)")
    try:
        config = read(path)
    except Exception as exc:
        raise _refuse(f"the --config file {path!r} cannot be read ({exc})",
                      "make the config file readable, or name the model on the command line") from None
    if not isinstance(config, dict):
        raise _refuse(f"the --config file {path!r} is not a YAML mapping (vLLM refuses it too)")
    out: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key)
        if isinstance(value, bool):
            # True -> bare flag; False -> "--no-KEY" or nothing. A bare --model is an error in vLLM.
            if value:
                out.append(flag)
            continue
        if isinstance(value, list):
            if value:
                out += [flag, *(str(item) for item in value)]
            continue
        out += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return out


def _drop_dotted(args: list[str]) -> list[str]:
    """Remove ``-x.y VALUE`` / ``-x.y=VALUE`` pairs the way vLLM does before argparse."""
    kept: list[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg.startswith("--") and "." not in arg:
            kept.append(arg)
            continue
        if arg.startswith("-") and "." in arg:
            if "=" in arg:
                if "." not in arg.split("=", 1)[0]:
                    kept.append(arg)  # the dot was in the value
                continue
            if i + 1 < len(args):
                skip = True
            continue
        kept.append(arg)
    return kept


def _is_model_spelling(name: str) -> bool:
    """A flag name a reader could take for --model but vLLM does not parse as exactly --model."""
    lowered = name.lower()
    if lowered == MODEL_FLAG:
        return name != MODEL_FLAG
    if lowered.startswith(MODEL_FLAG + "."):
        return True
    # argparse abbreviations (--mo, --mode, ...); vLLM rejects them as ambiguous, refuse them first.
    return len(lowered) > 2 and lowered.startswith("--") and MODEL_FLAG.startswith(lowered)


def model_choices(args: Sequence[str], read: Callable[[str], Any] = read_config_file) -> list[ModelChoice]:
    """Every place the argument list names a model, in the order vLLM's parser sees them."""
    raw = list(args)
    for arg in raw:
        if arg == "--":
            raise _refuse("a bare -- inside the vLLM arguments makes the rest positional", REMEDY_MODEL)
        name = arg.split("=", 1)[0]
        if name.startswith("-") and _is_model_spelling(name.replace("_", "-")):
            raise _refuse(f"{name!r} is not a spelling of --model vLLM accepts")
        if name == CONFIG_FLAG and "=" in arg:
            raise _refuse("--config=FILE is not read by vLLM (only --config FILE is)",
                          "write --config FILE as two arguments, or name the model on the command line")
    origins: list[str] = []
    if raw and not raw[0].startswith("-"):
        raw = [MODEL_FLAG, raw[0], *raw[1:]]
        origins.append("first argument")
    if raw.count(CONFIG_FLAG) > 1:
        raise _refuse("more than one --config file (vLLM refuses that too)")
    config_origin = None
    if CONFIG_FLAG in raw:
        index = raw.index(CONFIG_FLAG)
        if index == len(raw) - 1:
            raise _refuse("--config has no file after it")
        path = raw[index + 1]
        config = _config_args(path, read)
        for arg in config:
            name = arg.split("=", 1)[0]
            if name.startswith("-") and _is_model_spelling(normalise(name)):
                raise _refuse(f"the --config file {path!r} has a key {name[2:]!r}, not a spelling of 'model' "
                              "vLLM accepts")
        config_origin = f"--config {path}"
        raw = config + raw[:index] + raw[index + 2:]
    processed = _drop_dotted([normalise(arg) for arg in raw])
    config_count = 0 if config_origin is None else len(_drop_dotted([normalise(a) for a in config]))
    found: list[ModelChoice] = []
    first_seen = False
    for i, arg in enumerate(processed):
        origin = config_origin if i < config_count and config_origin else None
        if arg == MODEL_FLAG:
            if i + 1 >= len(processed) or processed[i + 1].startswith("-"):
                raise _refuse("--model has no value after it")
            value = processed[i + 1]
        elif arg.startswith(MODEL_FLAG + "="):
            value = arg.split("=", 1)[1]
        else:
            continue
        if origin is None:
            origin = origins[0] if origins and not first_seen else MODEL_FLAG
            first_seen = True
        found.append(ModelChoice(value, origin))
    return found


def resolve_model(args: Sequence[str], read: Callable[[str], Any] = read_config_file) -> ModelChoice:
    """The one model these vLLM arguments serve; LicenseError (``could not determine which model
    to gate``) when there is none, it is empty, or the arguments name different models."""
    choices = model_choices(args, read)
    if not choices:
        raise _refuse("no model in the vLLM arguments")
    for choice in choices:
        if not choice.model.strip():
            raise _refuse(f"the model given by {choice.origin} is empty")
    distinct = {normalise_model_id(choice.model) for choice in choices}
    if len(distinct) > 1:
        named = "; ".join(f"{c.model!r} ({c.origin})" for c in choices)
        raise _refuse(f"the vLLM arguments name more than one model: {named}",
                      "name the model exactly once (first after --, or --model MODEL)")
    return choices[-1]


def model_from_args(args: Sequence[str]) -> str:
    """The model the override-mode arguments serve, as vLLM will receive it."""
    return resolve_model(args).model


# --- identity: does a model argument denote a recipe's model? ----------------------------------

_HF_CACHE_DIR = re.compile(r"models--(.+?)--(.+)", re.IGNORECASE)
_HUB_URL = re.compile(r"^(https?://)?(www\.)?(huggingface\.co|hf\.co)/", re.IGNORECASE)


def normalise_model_id(model: str) -> str:
    """How two model ids compare: case, surrounding spaces and trailing slashes do not count."""
    return model.strip().rstrip("/").strip().lower()


def _name_part(repo: str) -> str:
    return normalise_model_id(repo).rsplit("/", 1)[-1]


def _path_identities(text: str) -> tuple[set[str], set[str]]:
    """(full ids, bare names) a local path could stand for: ``org/name`` and ``name`` from its last
    components, the Hugging Face cache layout ``models--org--name``, and ``_name_or_path`` in its
    config.json."""
    ids: set[str] = set()
    names: set[str] = set()
    candidates = {os.path.normpath(os.path.expanduser(text.strip()))}
    with contextlib.suppress(OSError, ValueError):
        candidates.add(os.path.realpath(os.path.expanduser(text.strip())))
    for path in candidates:
        parts = [p for p in Path(path).parts if p not in ("/", ".", "..")]
        for part in parts:
            match = _HF_CACHE_DIR.fullmatch(part)
            if match:
                ids.add(normalise_model_id(f"{match.group(1)}/{match.group(2)}"))
                names.add(normalise_model_id(match.group(2)))
        if parts:
            names.add(normalise_model_id(parts[-1]))
        if len(parts) >= 2:
            ids.add(normalise_model_id(f"{parts[-2]}/{parts[-1]}"))
        config = Path(path) / "config.json"
        try:
            raw = files.read_regular(config, MAX_CONFIG_BYTES) if config.exists() else b""
            if raw and len(raw) <= MAX_CONFIG_BYTES:
                declared = json.loads(raw.decode("utf-8", errors="replace")).get("_name_or_path")
                if isinstance(declared, str) and declared.strip():
                    ids.add(normalise_model_id(declared))
                    names.add(_name_part(declared))
        except (OSError, ValueError, AttributeError):
            pass
    return ids, names


def model_matches(model: str, repo: str) -> bool:
    """Whether serving ``model`` (a hub id or a local path, any spelling) serves the recipe
    repository ``repo``. Deliberately broad: the same repository name under another owner or in a
    local directory counts as the same model."""
    wanted = normalise_model_id(repo)
    if not wanted:
        return False
    text = _HUB_URL.sub("", model.strip())
    given = normalise_model_id(text)
    if not given:
        return False
    if given == wanted or _name_part(given) == _name_part(wanted):
        return True
    ids, names = _path_identities(text)
    return wanted in ids or _name_part(wanted) in names
