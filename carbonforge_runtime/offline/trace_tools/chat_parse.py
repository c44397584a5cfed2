"""The OpenAI ``messages`` of a request, rebuilt from the templated prompt a full-level trace holds.

A full-level record's ``prompt_text`` is the prompt as the engine served it: the chat template of
the served model applied to the request's ``messages`` (and ``tools``), special tokens included.
:func:`parse_prompt` reads it back for the vendored templates (carbonforge_runtime/recipes/
chat_templates): system, user, assistant and tool messages, assistant ``tool_calls``, reasoning
(``reasoning_content``, kept apart from ``content``) where the template writes it, and the
``tools`` definitions from the system turn. :func:`parse_answer` reads the generated
``output_text`` the way vLLM's reasoning and tool-call parsers do.

Exact or nothing: every result is rendered again with the same template (a Jinja sandbox set up as
transformers' ``apply_chat_template`` sets it up, as vLLM uses it) and must reproduce the prompt
character for character; otherwise, and whenever the text does not follow the template's grammar,
:class:`Unparsable` says why. Nothing is guessed, but some things are not in the text at all, and
are filled the documented way:

* tool call ids are not rendered: they are ``call_1``, ``call_2``, ... in order of appearance, and
  each tool message gets the id of the call at its position in the run that follows the calls;
* tool call ``arguments`` are the JSON of the rendered object (``json.dumps``, keys in their order;
  the client's own spacing is not in the prompt);
* the templates' markup in a text (``<|im_end|>``, ``<tool_call>``, ``<tool_response>``, ``<think>``,
  ...) is read as markup: the engine tokenized it as such, so the model saw structure there;
* what a template drops is absent: Qwen3 drops the reasoning of assistant turns before the last
  user message, Qwen3-Coder trims an assistant's content before its tool calls, and so on (the
  round-trip tests list each such normalisation);
* Qwen3-Coder writes scalars with Python's ``str`` (its checkpoint's template lists too, as Python
  literals): ``None``, ``True`` and ``False`` in the tools block are read as null and booleans,
  numbers as numbers for the JSON Schema keywords that hold numbers; a tool call's parameter value
  (Qwen3-Coder's or Qwen3.6's XML) is converted by the type its tool declares, and a value that could
  be a string or something else with no declared type is refused;
* a system text equal to the one a template writes when there is none (Qwen2.5, Qwen3-Coder) reads
  back as no system message.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from carbonforge_runtime.errors import CarbonForgeError
from carbonforge_runtime.recipes.chat_templates import ChatTemplate

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
#: Markup strings of the vendored templates: a text holding one cannot be told apart from structure.
MARKUP = (IM_START, IM_END, "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
          "<tool_response>", "</tool_response>", "<tools>", "</tools>", "<function=", "</function>",
          "<parameter=", "</parameter>")
#: End-of-turn tokens an output may end with when special tokens were kept.
_END_TOKENS = (IM_END, "<|endoftext|>")


class Unparsable(Exception):
    """The text does not follow the template, or could be read more than one way."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class ParsedPrompt:
    #: The request's messages in the OpenAI chat format.
    messages: list[dict[str, Any]]
    #: The ``tools`` the template wrote into the system turn (None: no tools).
    tools: list[dict[str, Any]] | None
    #: ``enable_thinking`` as the generation prompt shows it (None: the template's default).
    enable_thinking: bool | None
    #: How many tool calls the prompt holds (the answer's ids continue from there).
    calls: int = 0
    #: Whether the generation prompt opened a reasoning block the answer continues.
    thinking_open: bool = False
    template_messages: list[dict[str, Any]] = field(default_factory=list, repr=False)


# --------------------------------------------------------------------------------------------
# Rendering, as transformers' apply_chat_template does it


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise ValueError(message)


@lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    try:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 comes with the engine and with transformers
        raise CarbonForgeError("rebuilding chat messages needs jinja2", "pip install jinja2") from None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def render(template: ChatTemplate, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
           *, add_generation_prompt: bool = True, enable_thinking: bool | None = None) -> str:
    """The prompt the template makes of ``messages`` (in the form vLLM hands templates: tool call
    arguments as objects, missing content as ``""``; see :func:`template_messages`)."""
    kwargs: dict[str, Any] = {}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    return str(_compiled(template.source()).render(messages=list(messages), tools=list(tools) if tools else None,
                                                   add_generation_prompt=add_generation_prompt, **kwargs))


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as vLLM hands them to a chat template: a missing content is ``""`` and a tool
    call's ``arguments`` (a JSON string) is the object it encodes (``{}`` when it is not one)."""
    out = []
    for message in messages:
        item = {key: value for key, value in message.items() if key not in ("tool_call_id", "name")}
        if item.get("content") is None:
            item["content"] = ""
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call["function"])
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments) if arguments else {}
                    except ValueError:
                        arguments = {}
                function["arguments"] = arguments if isinstance(arguments, dict) else {}
                calls.append({**call, "function": function})
            item["tool_calls"] = calls
        elif "tool_calls" in item:
            item.pop("tool_calls")
        out.append(item)
    return out


# --------------------------------------------------------------------------------------------
# Shared reading


def _blocks(text: str) -> tuple[list[tuple[str, str]], str]:
    """The ``<|im_start|>role\\nbody<|im_end|>\\n`` turns, and what follows the final
    ``<|im_start|>assistant\\n`` (the generation prompt's tail)."""
    blocks: list[tuple[str, str]] = []
    pos = 0
    while True:
        if pos == len(text) and blocks:
            raise Unparsable("the prompt ends without the assistant's generation prompt")
        if not text.startswith(IM_START, pos):
            where = "the start" if pos == 0 else f"character {pos}"
            raise Unparsable(f"expected {IM_START} at {where} (is this prompt from another chat template?)")
        newline = text.find("\n", pos + len(IM_START))
        if newline < 0:
            raise Unparsable(f"a turn at character {pos} has no role line")
        role = text[pos + len(IM_START):newline]
        end = text.find(IM_END + "\n", newline + 1)
        if end < 0:
            if role != "assistant":
                raise Unparsable("the prompt does not end with the assistant's generation prompt")
            return blocks, text[newline + 1:]
        blocks.append((role, text[newline + 1:end]))
        pos = end + len(IM_END) + 1


def _number_calls(messages: list[dict[str, Any]], start: int = 0) -> int:
    """Give tool calls the ids ``call_<n>`` and tool messages the id of the call at their position."""
    count = start
    pending: list[str] = []
    for message in messages:
        if message["role"] == "assistant":
            pending = []
            for call in message.get("tool_calls") or ():
                count += 1
                call["id"] = f"call_{count}"
                pending.append(call["id"])
        elif message["role"] == "tool":
            if pending:
                message["tool_call_id"] = pending.pop(0)
        else:
            pending = []
    return count


def _openai_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": "", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _check(template: ChatTemplate, text: str, parsed: ParsedPrompt) -> None:
    try:
        again = render(template, parsed.template_messages, parsed.tools, enable_thinking=parsed.enable_thinking)
    except Exception as exc:  # the sandbox, a template's raise_exception, a type error: not this prompt
        raise Unparsable(f"the template cannot render the rebuilt messages ({exc})") from None
    if again != text:
        at = next((i for i, (a, b) in enumerate(zip(again, text, strict=False)) if a != b), min(len(again), len(text)))
        raise Unparsable(f"the rebuilt messages render differently from the prompt (from character {at}: "
                         f"{text[at:at + 40]!r} in the prompt, {again[at:at + 40]!r} rendered)")


def parse_prompt(template: ChatTemplate, text: str) -> ParsedPrompt:
    """The request behind ``text`` (a ``prompt_text`` the template rendered); :class:`Unparsable` when
    it does not follow the template or could be read more than one way."""
    if template.family == "hermes":
        parsed = _parse_hermes(template, text)
    elif template.family == "qwen3_coder":
        parsed = _parse_coder(_CODER[template.name], text)
    elif template.family == "qwen3_6":
        parsed = _parse_qwen36(text)
    else:  # pragma: no cover - every vendored template has a family
        raise Unparsable(f"no parser for the template family {template.family}")
    _check(template, text, parsed)
    parsed.calls = _number_calls(parsed.messages)
    return parsed


# --------------------------------------------------------------------------------------------
# Hermes-style: JSON tool calls in <tool_call> (Qwen2.5, Qwen3, Qwen3-Next Instruct, the tiny model)


@dataclass(frozen=True)
class _Hermes:
    tools_head: str
    tools_tail: str
    #: Consecutive tool results share one user turn.
    grouped_tool_responses: bool
    #: A newline precedes even the first tool call of an assistant turn without content.
    newline_before_every_call: bool
    #: Reasoning of assistant turns after the last user message is rendered (Qwen3).
    history_reasoning: bool
    #: The generation prompt's tail -> (enable_thinking, whether the answer continues a reasoning block).
    generation_tails: dict[str, tuple[bool | None, bool]]
    #: The system text the template writes when the request has no system message (Qwen2.5); the tools
    #: head then follows the system text directly (its own separator included).
    default_system: str | None = None


_QWEN3_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
               "with function signatures within <tools></tools> XML tags:\n<tools>")
_QWEN3_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>")
_EMPTY_THINK = "<think>\n\n</think>\n\n"
_NO_THINKING: dict[str, tuple[bool | None, bool]] = {"": (None, False)}
_HERMES: dict[str, _Hermes] = {
    "qwen2_5": _Hermes("\n\n" + _QWEN3_HEAD, _QWEN3_TAIL, grouped_tool_responses=True, newline_before_every_call=False,
                       history_reasoning=False, generation_tails=_NO_THINKING,
                       default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    "qwen3_next_instruct": _Hermes(_QWEN3_HEAD, _QWEN3_TAIL, grouped_tool_responses=True,
                                   newline_before_every_call=False, history_reasoning=False,
                                   generation_tails=_NO_THINKING),
    "qwen3": _Hermes(_QWEN3_HEAD, _QWEN3_TAIL, grouped_tool_responses=True, newline_before_every_call=False,
                     history_reasoning=True, generation_tails={"": (None, False), _EMPTY_THINK: (False, False)}),
    "tiny": _Hermes("# Tools\n\nFunction signatures are inside <tools></tools>:\n<tools>",
                    "\n</tools>\n\nTo call a function, return a JSON object with its name and arguments inside "
                    "<tool_call></tool_call>.",
                    grouped_tool_responses=False, newline_before_every_call=True, history_reasoning=False,
                    generation_tails={"<think>\n": (None, True), _EMPTY_THINK: (False, False)}),
}
_RESPONSE_OPEN, _RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"
_CALL_OPEN, _CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
_DECODER = json.JSONDecoder()


def _hermes_tools(text: str) -> list[dict[str, Any]]:
    if not text.startswith("\n"):
        raise Unparsable("the tools list in the system turn is malformed")
    tools = []
    for line in text[1:].split("\n"):
        try:
            tool = json.loads(line)
        except ValueError:
            raise Unparsable("a tool definition in the system turn is not JSON") from None
        if not isinstance(tool, dict):
            raise Unparsable("a tool definition in the system turn is not a JSON object")
        tools.append(tool)
    return tools


def _hermes_call(text: str) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of ``{"name": "NAME", "arguments": {...}}`` as the template writes it."""
    head = '{"name": "'
    middle = '", "arguments": '
    if not text.startswith(head):
        raise Unparsable("a tool call in an assistant turn is not the template's JSON")
    cut = text.find(middle, len(head))
    if cut < 0:
        raise Unparsable("a tool call in an assistant turn has no arguments")
    name = text[len(head):cut]
    try:
        arguments, end = _DECODER.raw_decode(text, cut + len(middle))
    except ValueError:
        raise Unparsable(f"the arguments of a call to {name} are not JSON") from None
    if text[end:] != "}":
        raise Unparsable(f"a call to {name} has text after its arguments")
    if not isinstance(arguments, dict):
        raise Unparsable(f"the arguments of a call to {name} are not a JSON object")
    return name, arguments


def _hermes_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    calls = []
    pos = 0
    while True:
        if not text.startswith(_CALL_OPEN, pos):
            raise Unparsable("the tool calls of an assistant turn are malformed")
        end = text.find(_CALL_CLOSE, pos)
        if end < 0:
            raise Unparsable("a tool call of an assistant turn is not closed")
        calls.append(_hermes_call(text[pos + len(_CALL_OPEN):end]))
        pos = end + len(_CALL_CLOSE)
        if pos == len(text):
            return calls
        if text[pos] != "\n":
            raise Unparsable("text follows a tool call in an assistant turn")
        pos += 1


def _parse_hermes(template: ChatTemplate, text: str) -> ParsedPrompt:
    dialect = _HERMES[template.name]
    blocks, tail = _blocks(text)
    if tail not in dialect.generation_tails:
        raise Unparsable(f"the generation prompt ends with {tail[:40]!r}, which this template does not write")
    enable_thinking, thinking_open = dialect.generation_tails[tail]
    tools: list[dict[str, Any]] | None = None
    messages: list[dict[str, Any]] = []
    start = 0
    if blocks and blocks[0][0] == "system":
        body = blocks[0][1]
        head = body.rfind(dialect.tools_head)
        if head >= 0 and body.endswith(dialect.tools_tail):
            tools = _hermes_tools(body[head + len(dialect.tools_head):len(body) - len(dialect.tools_tail)])
            prefix = body[:head]
            if dialect.default_system is not None:
                if prefix != dialect.default_system:
                    messages.append({"role": "system", "content": prefix})
            elif prefix:
                if not prefix.endswith("\n\n"):
                    raise Unparsable("the system message is not separated from the tools")
                messages.append({"role": "system", "content": prefix[:-2]})
        elif body != dialect.default_system:
            messages.append({"role": "system", "content": body})
        start = 1
    raw_assistant: dict[int, str] = {}
    for role, body in blocks[start:]:
        if role == "user" and body.startswith(_RESPONSE_OPEN) and body.endswith(_RESPONSE_CLOSE):
            inner = body[len(_RESPONSE_OPEN):len(body) - len(_RESPONSE_CLOSE)]
            parts = inner.split(_RESPONSE_CLOSE + "\n" + _RESPONSE_OPEN) if dialect.grouped_tool_responses else [inner]
            messages.extend({"role": "tool", "content": part} for part in parts)
        elif role == "assistant":
            raw_assistant[len(messages)] = body
            messages.append({"role": "assistant"})
        else:
            messages.append({"role": role, "content": body})
    users = [i for i, message in enumerate(messages) if message["role"] == "user"]
    last_query = users[-1] if users else len(messages) - 1
    for index, body in raw_assistant.items():
        _hermes_assistant(dialect, messages[index], body,
                          after_query=dialect.history_reasoning and index > last_query,
                          last=index == len(messages) - 1)
    parsed = ParsedPrompt(messages=messages, tools=tools, enable_thinking=enable_thinking,
                          thinking_open=thinking_open)
    parsed.template_messages = template_messages(messages)
    return parsed


def _hermes_assistant(dialect: _Hermes, message: dict[str, Any], body: str, *, after_query: bool,
                      last: bool) -> None:
    reasoning: str | None = None
    if after_query and body.startswith("<think>\n"):
        close = body.find("\n</think>\n\n")
        if close < 0:
            raise Unparsable("an assistant turn's reasoning block is not closed")
        reasoning, body = body[len("<think>\n"):close], body[close + len("\n</think>\n\n"):]
        if not reasoning:
            if not last:
                raise Unparsable("an empty reasoning block in an assistant turn cannot be told apart from "
                                 "whitespace-only reasoning")
            reasoning = None
    start = body.find(_CALL_OPEN)
    calls: list[tuple[str, dict[str, Any]]] = []
    content = body
    if start >= 0:
        calls = _hermes_calls(body[start:])
        content = body[:start]
        if content or dialect.newline_before_every_call:
            if not content.endswith("\n"):
                raise Unparsable("an assistant turn's tool call does not start on a new line")
            content = content[:-1]
    message["content"] = content if content or not calls else None
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [_openai_call(name, arguments) for name, arguments in calls]


# --------------------------------------------------------------------------------------------
# Qwen3-Coder: XML tool calls


_CODER_DEFAULT_SYSTEM = "You are Qwen, a helpful AI assistant that can interact with a computer to solve tasks."
_CODER_TAIL = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in "
    "natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer "
    "the question like normal with your current knowledge and do not tell the user about function calls\n"
    "</IMPORTANT>"
)
#: How a template writes a tool call's parameter value, or a tool field render_extra_keys writes:
#: ``py``: objects as JSON, everything else with Python's str (lists too, as Python literals);
#: ``py_json``: objects and lists as JSON, scalars with Python's str; ``json``: strings as they are,
#: everything else as JSON.
_PY, _PY_JSON, _JSON = "py", "py_json", "json"


@dataclass(frozen=True)
class _Coder:
    head: str
    values: str


_CODER: dict[str, _Coder] = {
    "qwen3_coder": _Coder("\n\nYou have access to the following functions:\n\n<tools>", _PY),
    "qwen3_coder_vllm": _Coder("\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>", _PY_JSON),
}
#: JSON Schema keywords whose value is a number (Qwen3-Coder writes scalars with Python's str).
_NUMERIC_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                               "minLength", "maxLength", "minItems", "maxItems", "minProperties",
                               "maxProperties"})
_INTEGER = re.compile(r"-?(?:0|[1-9]\d*)\Z")
_FLOAT = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?\Z")
_TAG = re.compile(r"\n<([^<>\n/]+)>")


class _Reader:
    """A cursor over the tools block."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def take(self, literal: str) -> bool:
        if self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return True
        return False

    def expect(self, literal: str) -> None:
        if not self.take(literal):
            raise Unparsable(f"the tools block of the system turn is malformed (expected {literal.strip()!r})")

    def until(self, literal: str) -> str:
        end = self.text.find(literal, self.pos)
        if end < 0:
            raise Unparsable(f"the tools block of the system turn is malformed (no {literal.strip()!r})")
        value = self.text[self.pos:end]
        self.pos = end + len(literal)
        return value

    def extra(self, stop: str) -> tuple[str, str] | None:
        """A ``\\n<key>value</key>`` the template's render_extra_keys wrote, or None at ``stop``."""
        if self.text.startswith(stop, self.pos):
            return None
        match = _TAG.match(self.text, self.pos)
        if match is None:
            raise Unparsable("the tools block of the system turn is malformed")
        key = match.group(1)
        self.pos = match.end()
        return key, self.until(f"</{key}>")


def _python_list(text: str) -> list[Any] | None:
    """A list written with Python's str (a Python literal), or None."""
    if not text.startswith("["):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, list) else None


def _extra_value(key: str, text: str, values: str) -> Any:
    if values == _PY and (listed := _python_list(text)) is not None:
        return listed
    if text[:1] in "{[":
        try:
            return json.loads(text)
        except ValueError:
            pass
    literal = {"None": None, "True": True, "False": False}
    if text in literal:
        return literal[text]
    if key in _NUMERIC_KEYWORDS and _FLOAT.match(text):
        return int(text) if _INTEGER.match(text) else float(text)
    return text


def _schema_type(text: str) -> Any:
    if text.startswith("["):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise Unparsable(f"a parameter type {text!r} in the tools block cannot be read") from None
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return value
        raise Unparsable(f"a parameter type {text!r} in the tools block cannot be read")
    return text


def _coder_tools(text: str, values: str) -> list[dict[str, Any]]:
    reader = _Reader(text)
    tools = []
    while reader.pos < len(text):
        reader.expect("\n<function>\n<name>")
        function: dict[str, Any] = {"name": reader.until("</name>")}
        if reader.take("\n<description>"):
            description = reader.until("</description>")
            function["description"] = None if description == "None" else description
        reader.expect("\n<parameters>")
        properties: dict[str, Any] = {}
        parameters: dict[str, Any] = {"type": "object", "properties": properties}
        while reader.take("\n<parameter>\n<name>"):
            name = reader.until("</name>")
            fields: dict[str, Any] = {}
            if reader.take("\n<type>"):
                fields["type"] = _schema_type(reader.until("</type>"))
            if reader.take("\n<description>"):
                fields["description"] = reader.until("</description>")
            while (item := reader.extra("\n</parameter>")) is not None:
                fields[item[0]] = _extra_value(*item, values)
            reader.expect("\n</parameter>")
            properties[name] = fields
        while (item := reader.extra("\n</parameters>")) is not None:
            parameters[item[0]] = _extra_value(*item, values)
        reader.expect("\n</parameters>")
        function["parameters"] = parameters
        while (item := reader.extra("\n</function>")) is not None:
            function[item[0]] = _extra_value(*item, values)
        reader.expect("\n</function>")
        tools.append({"type": "function", "function": function})
    return tools


def _declared_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        if isinstance(properties, dict):
            out[function.get("name", "")] = {name: (fields or {}).get("type") if isinstance(fields, dict) else None
                                            for name, fields in properties.items()}
    return out


def _argument(function: str, name: str, text: str, declared: Any, values: str) -> Any:
    """A rendered parameter value back to what the client sent, by the type its tool declares (the
    template wrote it as ``values`` says)."""
    where = f"parameter {name} of a call to {function}"
    kind = declared if isinstance(declared, str) else None
    if kind == "string":
        return text
    if kind in ("object", "array") or (kind is None and text[:1] in "{["):
        value: Any = None
        if kind != "object" and values == _PY:
            value = _python_list(text)
        if value is None:
            try:
                value = json.loads(text)
            except ValueError:
                value = None
        if kind is None and isinstance(value, dict | list):
            raise Unparsable(f"{where} reads {text[:40]!r}, which a string renders to as well as an object or "
                             "array, and its tool declares no type to tell them apart")
        if kind is not None:
            if isinstance(value, dict if kind == "object" else list):
                return value
            raise Unparsable(f"{where} is declared an {kind} but is not one")
    if values == _JSON:
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        expected = {"integer": int, "number": int | float, "boolean": bool, "null": type(None)}.get(kind or "")
        if expected is not None:
            if isinstance(value, expected) and (kind == "boolean" or not isinstance(value, bool)):
                return value
            raise Unparsable(f"{where} is declared {kind} but reads {text[:40]!r}")
        if kind is None and not isinstance(value, str):
            raise Unparsable(f"{where} reads {text[:40]!r}, which a string renders to as well as a "
                             "non-string, and its tool declares no type to tell them apart")
        return text
    if kind == "integer":
        if _INTEGER.match(text):
            return int(text)
        raise Unparsable(f"{where} is declared an integer but reads {text[:40]!r}")
    if kind == "number":
        if _INTEGER.match(text):
            return int(text)
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is not None and str(number) == text:
            return number
        raise Unparsable(f"{where} is declared a number but reads {text[:40]!r}")
    if kind == "boolean":
        if text in ("True", "False"):
            return text == "True"
        raise Unparsable(f"{where} is declared a boolean but reads {text[:40]!r}")
    if kind == "null" and text == "None":
        return None
    if text in ("None", "True", "False") or _FLOAT.match(text):
        raise Unparsable(f"{where} reads {text[:40]!r}, which a string renders to as well as a "
                         "non-string, and its tool declares no type to tell them apart")
    return text


def _coder_calls(text: str, types: dict[str, dict[str, Any]], values: str) -> list[tuple[str, dict[str, Any]]]:
    calls = []
    pos = 0
    while pos < len(text):
        head = "\n<tool_call>\n<function="
        if not text.startswith(head, pos):
            raise Unparsable("the tool calls of an assistant turn are malformed")
        close = text.find(">\n", pos + len(head))
        if close < 0:
            raise Unparsable("a tool call of an assistant turn is malformed")
        name = text[pos + len(head):close]
        pos = close + 2
        arguments: dict[str, Any] = {}
        while text.startswith("<parameter=", pos):
            close = text.find(">\n", pos)
            if close < 0:
                raise Unparsable(f"a parameter of a call to {name} is malformed")
            parameter = text[pos + len("<parameter="):close]
            end = text.find("\n</parameter>\n", close + 2)
            if end < 0:
                raise Unparsable(f"parameter {parameter} of a call to {name} is not closed")
            if parameter in arguments:
                raise Unparsable(f"a call to {name} names parameter {parameter} twice")
            arguments[parameter] = _argument(name, parameter, text[close + 2:end],
                                             types.get(name, {}).get(parameter), values)
            pos = end + len("\n</parameter>\n")
        tail = "</function>\n</tool_call>"
        if not text.startswith(tail, pos):
            raise Unparsable(f"a call to {name} is not closed")
        pos += len(tail)
        calls.append((name, arguments))
    return calls


def _parse_coder(dialect: _Coder, text: str) -> ParsedPrompt:
    blocks, tail = _blocks(text)
    if tail:
        raise Unparsable(f"the generation prompt ends with {tail[:40]!r}, which this template does not write")
    tools: list[dict[str, Any]] | None = None
    messages: list[dict[str, Any]] = []
    start = 0
    if blocks and blocks[0][0] == "system":
        body = blocks[0][1]
        head = body.rfind(dialect.head)
        if head >= 0 and body.endswith(_CODER_TAIL):
            tools = _coder_tools(body[head + len(dialect.head):len(body) - len(_CODER_TAIL)], dialect.values)
            if not tools:
                raise Unparsable("the system turn lists no tools")
            if body[:head] != _CODER_DEFAULT_SYSTEM:
                messages.append({"role": "system", "content": body[:head]})
        else:
            messages.append({"role": "system", "content": body})
        start = 1
    types = _declared_types(tools)
    for role, body in blocks[start:]:
        if role == "user" and body.startswith("<tool_response>\n") and body.endswith("\n</tool_response>\n"):
            inner = body[len("<tool_response>\n"):len(body) - len("\n</tool_response>\n")]
            messages.extend({"role": "tool", "content": part}
                            for part in inner.split("\n</tool_response>\n<tool_response>\n"))
            continue
        if role == "assistant":
            calls_at = 0 if body.startswith("<tool_call>\n<function=") else body.find("\n\n<tool_call>\n<function=")
            if calls_at >= 0:
                content = body[:calls_at]
                if content != content.strip():
                    raise Unparsable("an assistant turn's content before its tool calls is not trimmed")
                section = "\n" + body if calls_at == 0 else body[calls_at + 1:]
                calls = _coder_calls(section, types, dialect.values)
                messages.append({"role": "assistant", "content": content or None,
                                 "tool_calls": [_openai_call(name, arguments) for name, arguments in calls]})
                continue
        messages.append({"role": role, "content": body})
    parsed = ParsedPrompt(messages=messages, tools=tools, enable_thinking=None)
    parsed.template_messages = template_messages(messages)
    return parsed


# --------------------------------------------------------------------------------------------
# Qwen3.6: thinking, tools listed as JSON, XML tool calls, every text trimmed


_QWEN36_HEAD = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
_QWEN36_GENERATION = {"<think>\n": (None, True), _EMPTY_THINK: (False, False)}


def _parse_qwen36(text: str) -> ParsedPrompt:
    blocks, tail = _blocks(text)
    if tail not in _QWEN36_GENERATION:
        raise Unparsable(f"the generation prompt ends with {tail[:40]!r}, which this template does not write")
    enable_thinking, thinking_open = _QWEN36_GENERATION[tail]
    tools: list[dict[str, Any]] | None = None
    messages: list[dict[str, Any]] = []
    start = 0
    if blocks and blocks[0][0] == "system":
        body = blocks[0][1]
        end = body.find(_CODER_TAIL)
        if body.startswith(_QWEN36_HEAD) and end >= 0:
            tools = _hermes_tools(body[len(_QWEN36_HEAD):end])
            rest = body[end + len(_CODER_TAIL):]
            if rest:
                if not rest.startswith("\n\n") or rest[2:] != rest[2:].strip() or not rest[2:]:
                    raise Unparsable("the system message after the tools is malformed")
                messages.append({"role": "system", "content": rest[2:]})
        else:
            messages.append({"role": "system", "content": body})
        start = 1
    types = _declared_types(tools)
    raw_assistant: dict[int, str] = {}
    for role, body in blocks[start:]:
        if role == "user" and body.startswith(_RESPONSE_OPEN) and body.endswith(_RESPONSE_CLOSE):
            inner = body[len(_RESPONSE_OPEN):len(body) - len(_RESPONSE_CLOSE)]
            messages.extend({"role": "tool", "content": part}
                            for part in inner.split(_RESPONSE_CLOSE + "\n" + _RESPONSE_OPEN))
        elif role == "assistant":
            raw_assistant[len(messages)] = body
            messages.append({"role": "assistant"})
        else:
            messages.append({"role": role, "content": body})
    users = [i for i, message in enumerate(messages) if message["role"] == "user"]
    last_query = users[-1] if users else len(messages) - 1
    for index, body in raw_assistant.items():
        message = messages[index]
        if index > last_query:
            if not body.startswith("<think>\n"):
                raise Unparsable("an assistant turn after the last user message has no reasoning block")
            close = body.find("\n</think>\n\n")
            if close < 0:
                raise Unparsable("an assistant turn's reasoning block is not closed")
            reasoning, body = body[len("<think>\n"):close], body[close + len("\n</think>\n\n"):]
            if reasoning:
                message["reasoning_content"] = reasoning
        calls_at = 0 if body.startswith("<tool_call>\n<function=") else body.find("\n\n<tool_call>\n<function=")
        if calls_at < 0:
            message["content"] = body
            continue
        content = body[:calls_at]
        section = "\n" + (body if calls_at == 0 else body[calls_at + 2:])
        message["content"] = content or None
        message["tool_calls"] = [_openai_call(name, arguments)
                                 for name, arguments in _coder_calls(section, types, _JSON)]
    parsed = ParsedPrompt(messages=messages, tools=tools, enable_thinking=enable_thinking,
                          thinking_open=thinking_open)
    parsed.template_messages = template_messages(messages)
    return parsed


# --------------------------------------------------------------------------------------------
# The answer


_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_CODER_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]*)>(.*?)</function>\s*</tool_call>", re.S)
_CODER_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.S)


def _answer_value(text: str, declared: Any) -> Any:
    """vLLM's qwen3_coder tool parser's reading of a parameter value: by the declared type, else a string."""
    kind = declared if isinstance(declared, str) else None
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
        if kind == "boolean":
            return text.strip().lower() == "true"
        if kind in ("object", "array"):
            return json.loads(text)
    except ValueError:
        return text
    return text


def parse_answer(template: ChatTemplate, output_text: str, prompt: ParsedPrompt) -> dict[str, Any]:
    """The assistant message of a generated answer, as vLLM's reasoning and tool-call parsers read it:
    reasoning apart (``reasoning_content``), tool calls parsed (ids continue the prompt's), the rest
    as ``content``. :class:`Unparsable` when a tool call cannot be read."""
    text = output_text
    changed = True
    while changed:
        changed = False
        for token in _END_TOKENS:
            if text.endswith(token):
                text, changed = text[: -len(token)], True
    reasoning: str | None = None
    if prompt.thinking_open or text.lstrip().startswith("<think>"):
        body = text.lstrip()
        body = body[len("<think>"):] if body.startswith("<think>") else body
        if "</think>" in body:
            reasoning, text = body.split("</think>", 1)
        else:
            reasoning, text = body, ""
        reasoning = reasoning.strip("\n")
    text = text.lstrip("\n")
    calls: list[tuple[str, dict[str, Any]]] = []
    first = text.find("<tool_call>")
    if first >= 0:
        section = text[first:]
        text = text[:first]
        if template.family == "hermes":
            for match in _HERMES_CALL.finditer(section):
                try:
                    call = json.loads(match.group(1))
                except ValueError:
                    raise Unparsable("a tool call in the answer is not JSON") from None
                if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                    raise Unparsable("a tool call in the answer has no function name")
                arguments = call.get("arguments", {})
                if not isinstance(arguments, dict):
                    raise Unparsable("the arguments of a tool call in the answer are not a JSON object")
                calls.append((call["name"], arguments))
        else:
            types = _declared_types(prompt.tools)
            for match in _CODER_CALL.finditer(section):
                name = match.group(1)
                declared = types.get(name, {})
                calls.append((name, {parameter: _answer_value(value, declared.get(parameter))
                                     for parameter, value in _CODER_PARAMETER.findall(match.group(2))}))
        if not calls:
            raise Unparsable("the answer opens a tool call that cannot be read")
    content = text.rstrip() if calls else text
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [_openai_call(name, arguments) for name, arguments in calls]
        for number, call in enumerate(message["tool_calls"], start=prompt.calls + 1):
            call["id"] = f"call_{number}"
    return message
