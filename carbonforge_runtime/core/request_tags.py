"""Request tags: what a client labels a request with, carried from the API server to the trace record.

A request's tags are its OpenAI ``metadata`` (string keys and string values) plus the ``X-CF-Task``
header as the tag ``task``; the header is what a gateway sets, so it wins over ``metadata["task"]``.
The limits are the OpenAI API's own (:data:`MAX_TAGS` pairs, keys up to :data:`MAX_KEY_CHARS`
characters, values up to :data:`MAX_VALUE_CHARS`); a request past them is refused, never truncated.

The API server's middleware checks them (:func:`request_tags`) and hands them, with the model name
the client asked for, to the engine in vLLM's ``vllm_xargs`` under the reserved keys
:data:`TAGS_ARG` (the tags as one JSON object in a string) and :data:`MODEL_ARG`. vLLM copies
``vllm_xargs`` into ``SamplingParams.extra_args``, which nothing in vLLM 0.32 reads under these
names: they change nothing in generation and never appear in an answer. The record builder reads
them back with :func:`tags_from_arg`, :func:`model_from_arg` and :func:`tenant_from_arg`, which check
them again (a value that is not what the middleware writes is recorded as no tags, no model, or no
tenant).

Pure: plain data in, plain data out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

#: The ``vllm_xargs`` key that carries the tags (a JSON object, as a string: vLLM's ``vllm_xargs``
#: values are strings, numbers or lists).
TAGS_ARG = "cf_tags"
#: The ``vllm_xargs`` key that carries the model name the client asked for.
MODEL_ARG = "cf_model"
#: The ``vllm_xargs`` keys that carry the tenant of the request's API key (its name, never the
#: secret), the key's priority class (an integer, higher is served sooner) and its fair share (a
#: positive weight), as the middleware took them from the keys file.
TENANT_ARG = "cf_tenant"
PRIORITY_ARG = "cf_priority"
SHARE_ARG = "cf_share"
#: The ``vllm_xargs`` keys only the middleware writes; a client's own values under them are dropped.
RESERVED_ARGS = (TAGS_ARG, MODEL_ARG, TENANT_ARG, PRIORITY_ARG, SHARE_ARG)
#: The header a gateway (or a client) names the request's task with.
TASK_HEADER = "X-CF-Task"
#: The tag the header's value is recorded under.
TASK_TAG = "task"
#: The OpenAI API's limits on ``metadata``.
MAX_TAGS = 16
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 512
#: The longest ``X-CF-Task`` value (it becomes a tag value).
MAX_TASK_CHARS = MAX_VALUE_CHARS
#: The longest model name recorded (vLLM refuses a name it does not serve before the engine sees it).
MAX_MODEL_CHARS = 1024
#: The longest tenant name recorded (a key's name in the keys file); a longer value is recorded as no tenant.
MAX_TENANT_CHARS = 64


@dataclass(frozen=True)
class TagError:
    """Why a request's tags are refused: the message (naming the fix), the request field or header
    at fault, and an OpenAI-style code."""

    message: str
    param: str
    code: str


def _metadata_error(message: str, code: str) -> TagError:
    return TagError(message, "metadata", code)


def metadata_tags(metadata: Any) -> dict[str, str] | TagError:
    """The tags of a request's ``metadata`` (absent or ``null``: none), or why they are refused."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        return _metadata_error(
            f"Invalid type for 'metadata': expected an object of string keys and string values, but got "
            f"{_json_type(metadata)} instead.", "invalid_type")
    if len(metadata) > MAX_TAGS:
        return _metadata_error(
            f"Invalid 'metadata': too many properties. Expected an object with at most {MAX_TAGS} properties, "
            f"but got an object with {len(metadata)} properties instead.", "object_above_max_properties")
    for key, value in metadata.items():
        if not key:
            return _metadata_error("Invalid 'metadata': a key is empty. Name every key with 1 to "
                                   f"{MAX_KEY_CHARS} characters.", "empty_string")
        if len(key) > MAX_KEY_CHARS:
            return _metadata_error(
                f"Invalid 'metadata': key '{key[:16]}...' is too long. Expected a key with at most "
                f"{MAX_KEY_CHARS} characters, but got {len(key)} characters instead.", "string_above_max_length")
        if not isinstance(value, str):
            return _metadata_error(
                f"Invalid type for 'metadata.{key}': expected a string, but got {_json_type(value)} instead. "
                "Send every metadata value as a string.", "invalid_type")
        if len(value) > MAX_VALUE_CHARS:
            return _metadata_error(
                f"Invalid 'metadata.{key}': string too long. Expected a string with maximum length "
                f"{MAX_VALUE_CHARS}, but got a string with length {len(value)} instead.", "string_above_max_length")
    return dict(metadata)


def task_from_header(raw: bytes) -> str | TagError | None:
    """The task an ``X-CF-Task`` header names (``b""``: no header, or an empty one), or why it is refused."""
    if not raw:
        return None
    try:
        task = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        task = None
    if task is None or not task.isprintable():
        return TagError(f"Invalid '{TASK_HEADER}' header: expected printable UTF-8 text.", TASK_HEADER,
                        "invalid_task_header")
    if len(task) > MAX_TASK_CHARS:
        return TagError(f"Invalid '{TASK_HEADER}' header: too long. Expected at most {MAX_TASK_CHARS} "
                        f"characters, but got {len(task)} characters instead.", TASK_HEADER, "invalid_task_header")
    return task or None


def request_tags(metadata: Any, task_header: bytes) -> dict[str, str] | TagError:
    """A request's tags: its ``metadata``, and the ``X-CF-Task`` header as ``task`` (the header wins
    over ``metadata["task"]``); or why they are refused."""
    tags = metadata_tags(metadata)
    if isinstance(tags, TagError):
        return tags
    task = task_from_header(task_header)
    if isinstance(task, TagError):
        return task
    if task is not None:
        tags[TASK_TAG] = task
    return tags


def tag_args(tags: Mapping[str, str], model: Any) -> dict[str, str]:
    """The reserved ``vllm_xargs`` entries for ``tags`` and the request's ``model`` (each left out when empty)."""
    args: dict[str, str] = {}
    if tags:
        args[TAGS_ARG] = orjson.dumps(dict(tags)).decode()
    if isinstance(model, str) and model:
        args[MODEL_ARG] = model
    return args


def tenant_args(tenant: str, priority: int, share: float) -> dict[str, str | int | float]:
    """The reserved ``vllm_xargs`` entries for a request made with the named key ``tenant``: its name,
    priority class and fair share (never the key itself)."""
    return {TENANT_ARG: tenant, PRIORITY_ARG: priority, SHARE_ARG: share}


def _valid_tags(value: Any) -> bool:
    return (isinstance(value, dict) and len(value) <= MAX_TAGS + 1 and all(
        isinstance(k, str) and 0 < len(k) <= MAX_KEY_CHARS and isinstance(v, str) and len(v) <= MAX_VALUE_CHARS
        for k, v in value.items()))


def tags_from_arg(value: Any) -> dict[str, str]:
    """The tags a request carried in :data:`TAGS_ARG` (what :func:`tag_args` wrote); ``{}`` when it
    carried none, or anything else."""
    if not isinstance(value, str) or not value:
        return {}
    try:
        tags = orjson.loads(value)
    except orjson.JSONDecodeError:
        return {}
    return tags if _valid_tags(tags) else {}


def model_from_arg(value: Any) -> str | None:
    """The model name a request carried in :data:`MODEL_ARG`; None when it carried none (or not a name)."""
    return value if isinstance(value, str) and 0 < len(value) <= MAX_MODEL_CHARS else None


def tenant_from_arg(value: Any) -> str | None:
    """The tenant a request carried in :data:`TENANT_ARG` (its API key's name); None when it carried none,
    or anything but printable, non-blank text of at most :data:`MAX_TENANT_CHARS` characters."""
    if isinstance(value, str) and len(value) <= MAX_TENANT_CHARS and value.isprintable() and value.strip():
        return value
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
