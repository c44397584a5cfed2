"""The chat templates of the shipped recipes' models, vendored as package data, so that a full-level
trace's ``prompt_text`` can be turned back into the ``messages`` a client sent, offline.

Each ``<name>.jinja`` starts with a comment naming where it was copied from (repository, path,
commit). :data:`MODEL_TEMPLATES` maps a recipe's ``model.served_name`` (the ``model`` a request
names, and the one a trace record carries) to its template; :data:`NOT_VENDORED` lists the shipped
models whose exact template is not vendored, with the reason, so that ``trace export`` can say so
instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    #: The markup family the parser reads: ``hermes`` (JSON tool calls in ``<tool_call>``) or
    #: ``qwen3_coder`` (XML tool calls, ``<function=NAME><parameter=P>``).
    family: str
    description: str

    def source(self) -> str:
        """The Jinja text, as transformers and vLLM would render it."""
        return resources.files(__package__).joinpath(f"{self.name}.jinja").read_text(encoding="utf-8")


TEMPLATES: dict[str, ChatTemplate] = {
    template.name: template
    for template in (
        ChatTemplate("qwen2_5", "hermes", "Qwen2.5-Instruct (ChatML, JSON tool calls in `<tool_call>`, no reasoning)"),
        ChatTemplate("qwen3", "hermes", "Qwen3 (hybrid thinking in `<think>`, JSON tool calls in `<tool_call>`)"),
        ChatTemplate("qwen3_next_instruct", "hermes", "Qwen3-Next Instruct (JSON tool calls in `<tool_call>`, no "
                     "thinking)"),
        ChatTemplate("qwen3_coder", "qwen3_coder", "Qwen3-Coder (tools and tool calls in XML, no reasoning)"),
        ChatTemplate("qwen3_coder_vllm", "qwen3_coder", "vLLM's example Qwen3-Coder template "
                     "(examples/tool_chat_template_qwen3coder.jinja), for a deployment that passes it"),
        ChatTemplate("qwen3_6", "qwen3_6", "Qwen3.6 (thinking in `<think>`, tools listed as JSON, tool calls in XML)"),
        ChatTemplate("tiny", "hermes", "the built-in tiny model (Qwen3's thinking and tool-call markup)"),
    )
}

#: A shipped recipe's ``model.served_name`` -> the name of its vendored template.
MODEL_TEMPLATES: dict[str, str] = {
    "carbonforge/tiny-chat": "tiny",
    "Qwen/Qwen2.5-0.5B-Instruct": "qwen2_5",
    "Qwen/Qwen3-32B-FP8": "qwen3",
    "Qwen/Qwen3-Next-80B-A3B-Instruct-FP8": "qwen3_next_instruct",
    "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8": "qwen3_coder",
    "Qwen/Qwen3.6-27B-FP8": "qwen3_6",
}

#: Shipped models whose template is not vendored, and why (``trace export`` names the reason).
NOT_VENDORED: dict[str, str] = {
    "Qwen/Qwen3-Coder-Next-FP8": "Qwen3-Coder-Next's own template was not found with a traceable source (it is "
    "not known to equal Qwen3-Coder's)",
}


def names() -> list[str]:
    return sorted(TEMPLATES)


def for_model(model: str) -> ChatTemplate | None:
    """The vendored template of a served model name, or None."""
    name = MODEL_TEMPLATES.get(model)
    return TEMPLATES[name] if name is not None else None
