"""Round trips of the chat-template parser: for every vendored template, messages (awkward text, several
turns, tool calls with nested JSON arguments, tool results, reasoning, tool definitions) are rendered as
transformers' apply_chat_template renders them, parsed back, and compared with what the template keeps.

What each template drops or changes, and so what the comparison normalises:

* all: tool call ids are not rendered (the parser numbers them ``call_1``, ...; a tool message gets
  the id of the call at its position); ``arguments`` come back as ``json.dumps`` of the object; an
  assistant turn with tool calls and empty content comes back with ``content: None``;
* qwen3: reasoning of assistant turns up to the last user message is dropped; later turns keep it
  with surrounding newlines stripped (the template writes ``reasoning.strip('\\n')``);
* qwen3_6: the same, stripped of all surrounding whitespace, and every message's text is trimmed
  (an empty system text after the tools is not written at all);
* tiny, qwen2_5, qwen3_next_instruct: reasoning is never rendered;
* qwen3_coder, qwen3_coder_vllm: reasoning is never rendered; an assistant's content before tool
  calls is trimmed; a tool's and a parameter's description are trimmed, and ``parameters.type`` is
  not rendered (it comes back as ``object``);
* qwen2_5 and qwen3_coder write a default system text when there is none: a system message equal to
  it would read back as none (the generated texts never equal it).

Texts hold no markup of the templates (``<|im_end|>``, ``<tool_call>``, ...): such text is read as
markup, as the engine tokenized it (a test below shows it).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carbonforge_runtime.offline.trace_tools import chat_parse as cp
from carbonforge_runtime.recipes import chat_templates
from carbonforge_runtime.recipes.chat_templates import TEMPLATES

REPO = Path(__file__).resolve().parents[4]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_AWKWARD = st.sampled_from([*"<>{}[]\"'\\/|=&%$#@!?:;,. \n\t", "é", "ß", "🙂", "中", "\u200b", "<b>", "</", "{%", "}}"])
_TEXT = st.lists(st.one_of(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), _AWKWARD),
                 max_size=12).map("".join).filter(lambda s: not any(m in s for m in cp.MARKUP))
_CONTENT = _TEXT.filter(lambda s: not s.startswith("\n") and not s.startswith(("<think", "<tool")))
_REASONING = _TEXT.filter(lambda s: bool(s.strip("\n")))
_WORD = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)
_DESCRIPTION = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9 ,.()'-]{0,20}[A-Za-z0-9.]", fullmatch=True)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_WORD, inner, max_size=3),
    max_leaves=6,
)
_TYPES = {
    "string": _TEXT,
    "integer": st.integers(-10**9, 10**9),
    "number": st.floats(allow_nan=False, allow_infinity=False, width=64),
    "boolean": st.booleans(),
    "object": st.dictionaries(_WORD, _JSON, max_size=3),
    "array": st.lists(_JSON, max_size=3),
}


@st.composite
def tool_definitions(draw: st.DrawFn) -> list[dict[str, Any]]:
    names = draw(st.lists(_WORD, min_size=1, max_size=3, unique=True))
    tools = []
    for name in names:
        params = draw(st.dictionaries(_WORD, st.sampled_from(sorted(_TYPES)), max_size=3))
        properties = {p: {"type": kind, "description": draw(_DESCRIPTION)} for p, kind in params.items()}
        parameters: dict[str, Any] = {"type": "object", "properties": properties}
        if properties and draw(st.booleans()):
            parameters["required"] = sorted(properties)[:1]
        tools.append({"type": "function",
                      "function": {"name": name, "description": draw(_DESCRIPTION), "parameters": parameters}})
    return tools


@st.composite
def tool_calls(draw: st.DrawFn, tools: list[dict[str, Any]] | None, typed: bool) -> list[dict[str, Any]]:
    calls = []
    for _ in range(draw(st.integers(1, 2))):
        if typed:  # the XML template needs the declared types to read values back
            function = draw(st.sampled_from(tools))["function"]  # type: ignore[arg-type]
            arguments = {p: draw(_TYPES[f["type"]]) for p, f in function["parameters"]["properties"].items()}
            name = function["name"]
        else:
            name = draw(_WORD)
            arguments = draw(st.dictionaries(_WORD, _JSON, max_size=3))
        calls.append({"id": f"client-{draw(_WORD)}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments)}})
    return calls


@st.composite
def conversations(draw: st.DrawFn, typed: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    tools = draw(st.one_of(st.none(), tool_definitions(), tool_definitions()))
    if typed and tools is not None and not any(t["function"]["parameters"]["properties"] for t in tools):
        tools = None
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_TEXT)})
    turns = draw(st.integers(1, 3))
    for turn in range(turns):
        messages.append({"role": "user", "content": draw(_TEXT)})
        rounds = draw(st.integers(0, 2)) if tools is not None or not typed else 0
        for _ in range(rounds):
            calls = draw(tool_calls(tools, typed))
            assistant = {"role": "assistant", "content": draw(st.one_of(st.none(), _CONTENT)), "tool_calls": calls}
            if draw(st.booleans()):
                assistant["reasoning_content"] = draw(_REASONING)
            messages.append(assistant)
            messages.extend({"role": "tool", "tool_call_id": call["id"], "content": draw(_TEXT)} for call in calls)
        if turn < turns - 1:
            answer = {"role": "assistant", "content": draw(_CONTENT)}
            if draw(st.booleans()):
                answer["reasoning_content"] = draw(_REASONING)
            messages.append(answer)
    return messages, tools


#: Templates that keep the reasoning of assistant turns after the last user message.
_HISTORY_REASONING = {"qwen3", "qwen3_6"}
#: Templates that trim every message's text (Qwen3.6), or an assistant's text before tool calls (Qwen3-Coder).
_TRIM_ALL = {"qwen3_6"}
_TRIM_BEFORE_CALLS = {"qwen3_coder", "qwen3_coder_vllm"}


def expected(name: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """What the template keeps of ``messages``, in the parser's form (see the module docstring)."""
    out = copy.deepcopy(messages)
    if name in _TRIM_ALL:
        for message in out:
            if isinstance(message.get("content"), str):
                message["content"] = message["content"].strip()
        if tools and out and out[0]["role"] == "system" and not out[0]["content"]:
            out.pop(0)  # an empty system text after the tools is not written
    users = [i for i, m in enumerate(out) if m["role"] == "user"]
    last_query = users[-1] if users else len(out) - 1
    count = 0
    pending: list[str] = []
    for index, message in enumerate(out):
        message.pop("tool_call_id", None)
        if message["role"] == "assistant":
            reasoning = message.pop("reasoning_content", None)
            if name in _HISTORY_REASONING and index > last_query and reasoning:
                kept = reasoning.strip() if name in _TRIM_ALL else reasoning.strip("\n")
                if kept:
                    message["reasoning_content"] = kept
            if message.get("tool_calls"):
                content = message.get("content") or ""
                if name in _TRIM_BEFORE_CALLS:
                    content = content.strip()
                message["content"] = content or None
                pending = []
                for call in message["tool_calls"]:
                    count += 1
                    call["id"] = f"call_{count}"
                    call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]),
                                                               ensure_ascii=False)
                    pending.append(call["id"])
        elif message["role"] == "tool":
            if pending:
                message["tool_call_id"] = pending.pop(0)
        else:
            pending = []
    return out


def _transformers_render(template: chat_templates.ChatTemplate, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None, **kwargs: Any) -> str:
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = _transformers_render.__dict__.get("tokenizer")
    if tokenizer is None:
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(tokenizers.models.BPE()))
        _transformers_render.__dict__["tokenizer"] = tokenizer
    return str(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                             chat_template=template.source(), **kwargs))


def _round_trip(name: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                enable_thinking: bool | None = None) -> None:
    template = TEMPLATES[name]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = _transformers_render(template, cp.template_messages(messages), tools, **kwargs)
    assert cp.render(template, cp.template_messages(messages), tools, enable_thinking=enable_thinking) == text
    parsed = cp.parse_prompt(template, text)
    assert parsed.messages == expected(name, messages, tools)
    assert parsed.tools == tools
    assert parsed.enable_thinking is (False if enable_thinking is False else None)


_THINKING = st.sampled_from([None, False])


@SETTINGS
@given(conversation=conversations(typed=False), thinking=_THINKING)
def test_qwen3_round_trip(conversation: tuple[list[dict[str, Any]], Any], thinking: bool | None) -> None:
    _round_trip("qwen3", *conversation, enable_thinking=thinking)


@SETTINGS
@given(conversation=conversations(typed=False), thinking=_THINKING)
def test_tiny_round_trip(conversation: tuple[list[dict[str, Any]], Any], thinking: bool | None) -> None:
    _round_trip("tiny", *conversation, enable_thinking=thinking)


@SETTINGS
@given(conversation=conversations(typed=False))
def test_qwen2_5_round_trip(conversation: tuple[list[dict[str, Any]], Any]) -> None:
    _round_trip("qwen2_5", *conversation)


@SETTINGS
@given(conversation=conversations(typed=False))
def test_qwen3_next_instruct_round_trip(conversation: tuple[list[dict[str, Any]], Any]) -> None:
    _round_trip("qwen3_next_instruct", *conversation)


@SETTINGS
@given(conversation=conversations(typed=True))
def test_qwen3_coder_round_trip(conversation: tuple[list[dict[str, Any]], Any]) -> None:
    _round_trip("qwen3_coder", *conversation)


@SETTINGS
@given(conversation=conversations(typed=True))
def test_qwen3_coder_vllm_round_trip(conversation: tuple[list[dict[str, Any]], Any]) -> None:
    _round_trip("qwen3_coder_vllm", *conversation)


@SETTINGS
@given(conversation=conversations(typed=True), thinking=_THINKING)
def test_qwen3_6_round_trip(conversation: tuple[list[dict[str, Any]], Any], thinking: bool | None) -> None:
    _round_trip("qwen3_6", *conversation, enable_thinking=thinking)


def test_every_template_is_covered_by_a_round_trip() -> None:
    for name in TEMPLATES:
        assert callable(globals().get(f"test_{name}_round_trip")), f"no round trip for the template {name}"


def test_the_tiny_template_copy_equals_the_model_builders() -> None:
    from carbonforge_runtime.runtime.weights.tiny_model import CHAT_TEMPLATE

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
                {"role": "tool", "content": "r"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    vendored = TEMPLATES["tiny"]
    own = chat_templates.ChatTemplate("tiny", "hermes", "")
    object.__setattr__(own, "source", lambda: CHAT_TEMPLATE)
    for thinking in (None, False):
        assert cp.render(vendored, messages, tools, enable_thinking=thinking) == \
            cp.render(own, messages, tools, enable_thinking=thinking)


def test_every_shipped_recipe_model_has_a_template_or_a_stated_reason() -> None:
    served = set()
    for path in (REPO / "recipes").glob("*.yaml"):
        served.add(yaml.safe_load(path.read_text())["model"]["served_name"])
    assert served == set(chat_templates.MODEL_TEMPLATES) | set(chat_templates.NOT_VENDORED)
    assert not set(chat_templates.MODEL_TEMPLATES) & set(chat_templates.NOT_VENDORED)
    for template in TEMPLATES.values():
        assert "Source" in template.source().split("-#}", 1)[0] or template.name == "tiny"


def test_vllm_form_tools_with_null_fields_round_trip() -> None:
    """vLLM hands templates ``tool.model_dump()``: unset fields are null, and Qwen3-Coder writes them as None."""
    tools = [{"type": "function", "function": {"name": "f", "description": None, "parameters": None,
                                                "defer_loading": None}, "defer_loading": None}]
    messages = [{"role": "user", "content": "go"}]
    for name in ("qwen3", "qwen3_coder"):
        template = TEMPLATES[name]
        text = cp.render(template, messages, tools)
        parsed = cp.parse_prompt(template, text)
        assert parsed.messages == messages
        assert parsed.tools is not None and parsed.tools[0]["function"]["name"] == "f"
        assert cp.render(template, messages, parsed.tools) == text


def test_markup_in_a_text_is_read_as_structure() -> None:
    template = TEMPLATES["qwen3"]
    text = cp.render(template, [{"role": "user", "content": "a<|im_end|>\n<|im_start|>user\nb"}])
    parsed = cp.parse_prompt(template, text)
    assert [m["content"] for m in parsed.messages] == ["a", "b"]


@pytest.mark.parametrize("text, reason", [
    ("hello", "expected <|im_start|>"),
    ("<|im_start|>user\nhi<|im_end|>\n", "ends without the assistant"),
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nI think", "does not write"),
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n"
     "</tool_call><|im_end|>\n<|im_start|>assistant\n", "not a JSON object"),
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n"
     "</tool_call><|im_end|>\n<|im_start|>assistant\n", "render"),  # qwen3 writes no newline there
])
def test_text_off_the_grammar_is_refused_with_a_reason(text: str, reason: str) -> None:
    with pytest.raises(cp.Unparsable, match=reason):
        cp.parse_prompt(TEMPLATES["qwen3"], text)


def test_an_untyped_xml_value_that_could_be_a_string_is_refused() -> None:
    template = TEMPLATES["qwen3_coder"]
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"function": {"name": "f", "arguments": {"n": 5}}}]},
                {"role": "tool", "content": "ok"}]
    with pytest.raises(cp.Unparsable, match="declares no type"):
        cp.parse_prompt(template, cp.render(template, messages))
    messages[1]["tool_calls"][0]["function"]["arguments"] = {"n": "five"}
    assert cp.parse_prompt(template, cp.render(template, messages)).messages[1]["tool_calls"][0]["function"][
        "arguments"] == '{"n": "five"}'


def test_answers_are_read_like_vllms_parsers() -> None:
    tiny, coder = TEMPLATES["tiny"], TEMPLATES["qwen3_coder"]
    prompt = cp.parse_prompt(tiny, cp.render(tiny, [{"role": "user", "content": "hi"}]))
    assert prompt.thinking_open
    answer = cp.parse_answer(tiny, 'hmm\n</think>\n\nSure.\n<tool_call>\n{"name": "f", "arguments": {"a": [1]}}\n'
                                   "</tool_call>", prompt)
    assert answer == {"role": "assistant", "content": "Sure.", "reasoning_content": "hmm",
                      "tool_calls": [{"id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": '{"a": [1]}'}}]}
    tools = [{"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}}}]
    prompt = cp.parse_prompt(coder, cp.render(coder, [{"role": "user", "content": "hi"}], tools))
    answer = cp.parse_answer(coder, "<tool_call>\n<function=g>\n<parameter=n>\n7\n</parameter>\n<parameter=s>\n7\n"
                                    "</parameter>\n</function>\n</tool_call>", prompt)
    assert answer["content"] is None
    assert json.loads(answer["tool_calls"][0]["function"]["arguments"]) == {"n": 7, "s": "7"}
    plain = cp.parse_answer(coder, "Just text.<|im_end|>", prompt)
    assert plain == {"role": "assistant", "content": "Just text."}
    with pytest.raises(cp.Unparsable, match="not JSON"):
        cp.parse_answer(tiny, "</think><tool_call>\n{oops}\n</tool_call>", cp.parse_prompt(
            tiny, cp.render(tiny, [{"role": "user", "content": "x"}])))
