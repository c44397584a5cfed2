"""The request contract of the OpenAI-compatible API: what the runtime tells the API server, and the
decision over one request body. Pure: plain data in, plain data out.

The runtime builds an :class:`ApiContract` from the recipe (does the model reason, does it call
tools, how many thinking tokens each effort allows) and hands it to vLLM's API server process in the
environment variable :data:`API_CONTRACT_VARIABLE`. The ASGI middleware there
(:mod:`carbonforge_runtime.apiserver.request_contract`) calls :func:`check_request` on every JSON
request and either forwards the (possibly rewritten) body or answers with the :class:`ApiError`.

Effort values a client may send (``chat_template_kwargs`` or the OpenAI SDK's ``reasoning_effort``):
``low`` (the default), ``medium``, ``xhigh``, or ``{"enable_thinking": false}``. Each accepted value
becomes what a Qwen3-style chat template understands: ``enable_thinking`` in the template
arguments, plus vLLM's ``thinking_token_budget`` when the recipe caps that effort.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from carbonforge_runtime.core.contract import ContractError
from carbonforge_runtime.core.request_tags import RESERVED_ARGS, TagError, request_tags, tag_args
from carbonforge_runtime.settings import DEFAULT_MAX_REQUEST_BYTES

API_CONTRACT_VERSION = 1
#: The variable the API server process reads its contract from.
API_CONTRACT_VARIABLE = "CF_API_CONFIG"
#: Names a file the API server checks on ``/health``: once it exists (the leader of a multi-host group
#: lost a host), ``/health`` answers 503, so that probes and load balancers stop sending at once.
GROUP_DOWN_VARIABLE = "CF_GROUP_DOWN_FILE"
#: Names a file the API server checks on every request: once it exists (the licence the server was
#: started under has expired), new requests are answered 503 ``licence_expired``; requests already
#: in flight finish.
LICENCE_EXPIRED_VARIABLE = "CF_LICENCE_EXPIRED_FILE"
EFFORTS = ("low", "medium", "xhigh")
DEFAULT_EFFORT = "low"
#: The effort that turns thinking off.
NO_THINKING = "off"

CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
INVOCATIONS_PATH = "/invocations"
COMPLETIONS_PATH = "/v1/completions"
GENERATE_PATH = "/inference/v1/generate"


@dataclass(frozen=True)
class Route:
    """What a path's handler does with a request body, as far as the contract is concerned.

    ``kind`` is ``chat`` (one conversation in ``messages``), ``chat_batch`` (a list of conversations),
    ``responses`` (the Responses API: effort in ``reasoning.effort``), ``invocation`` (SageMaker's
    route: chat when the body has ``messages``, a completion otherwise), ``generate`` (vLLM's
    token-in, token-out route: ``vllm_xargs`` is ``sampling_params.extra_args`` there) or ``json``
    (the body must be a JSON object, nothing more). ``answers`` is true where the answer is a
    generated chat completion, which gets ``reasoning_content`` beside vLLM's ``reasoning``.

    ``tags`` is true where the request reaches the engine: it gets the request's tags and the model
    name it asks for in ``vllm_xargs`` (:mod:`~carbonforge_runtime.core.request_tags`), its
    ``metadata`` read as tags where ``metadata`` is true (the OpenAI field; Anthropic's
    ``/v1/messages`` and ``generate`` have none of that shape). On every route, values a client
    puts under the reserved ``vllm_xargs`` keys are dropped.
    """

    kind: str
    answers: bool = False
    tags: bool = False
    metadata: bool = True


#: Every path of vLLM 0.32's API server whose handler takes a JSON body the contract judges, by the
#: path as routed (after the root path). A path absent here is not looked at.
ROUTES: Mapping[str, Route] = {
    CHAT_PATH: Route("chat", answers=True, tags=True),
    "/v1/chat/completions/render": Route("chat"),
    "/v1/chat/completions/batch": Route("chat_batch", answers=True, tags=True),
    INVOCATIONS_PATH: Route("invocation", answers=True, tags=True),
    RESPONSES_PATH: Route("responses", tags=True),
    "/v1/responses/render": Route("responses"),
    COMPLETIONS_PATH: Route("json", tags=True),
    "/v1/completions/render": Route("json"),
    "/v1/embeddings": Route("json"),
    "/v1/messages": Route("json", tags=True, metadata=False),
    GENERATE_PATH: Route("generate", tags=True, metadata=False),
}
#: Endpoints whose body must be a JSON object (some get the full check: see :data:`ROUTES`).
JSON_PATHS = frozenset(ROUTES)
#: The paths anyone may call when API keys are required; every other path needs the key, including
#: paths a later vLLM adds. ``/health`` and ``/ping`` (SageMaker's name for it) are what load
#: balancers and orchestrators probe; ``/metrics`` is what Prometheus scrapes. None of them takes or
#: returns a request's content.
PUBLIC_PATHS: Mapping[str, str] = {
    "/health": "liveness and readiness probes (503 once the server stops taking requests)",
    "/ping": "the same probe under the name SageMaker-style hosts use",
    "/metrics": "the engine's Prometheus metrics, for the scraper",
}
MSG_INVALID_JSON = "Invalid JSON payload"
MSG_MISSING_MESSAGES = "Missing required parameter: 'messages'"
MSG_BAD_EFFORT = "Unexpected reasoning effort"
MSG_NO_TOOLS = "This model does not support tool calls"
MSG_NO_KEY = "Authentication Error, No api key passed in."
MSG_WRONG_KEY = "Authentication Error, Invalid API key passed in."
MSG_TOO_LARGE = "Request body too large"
MSG_EXPIRED_KEY = "Authentication Error, the API key has expired."
MSG_NO_SCOPE = "Permission Error, the API key lacks the scope"
MSG_RATE_LIMIT = "Rate limit reached for requests"
MSG_CONCURRENCY = "Too many requests in flight"
MSG_LICENCE_EXPIRED = "The licence this server runs under has expired; new requests are refused"


@dataclass(frozen=True)
class ApiContract:
    """What the API server enforces and how it maps efforts for the served model."""

    #: The model thinks before answering (a reasoning parser splits the thinking off).
    reasoning: bool = False
    #: Tool calls are parsed out of the output (a tool-call parser is configured).
    tools: bool = False
    #: Thinking tokens allowed per effort (``low``, ``medium``, ``xhigh``); ``None`` or absent: no cap.
    thinking_budget: Mapping[str, int | None] = field(default_factory=dict)
    #: The largest request body read (``CF_MAX_REQUEST_BYTES``); a larger one is answered 413.
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def to_json(self) -> str:
        return orjson.dumps({
            "version": API_CONTRACT_VERSION,
            "reasoning": self.reasoning,
            "tools": self.tools,
            "thinking_budget": dict(self.thinking_budget),
            "max_request_bytes": self.max_request_bytes,
        }).decode()

    def env(self) -> dict[str, str]:
        return {API_CONTRACT_VARIABLE: self.to_json()}

    @classmethod
    def from_json(cls, text: str) -> ApiContract:
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ContractError(f"{API_CONTRACT_VARIABLE} is not JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("version") != API_CONTRACT_VERSION:
            raise ContractError(f"{API_CONTRACT_VARIABLE} is not version {API_CONTRACT_VERSION} of the API contract")
        unknown = set(data) - {"version", "reasoning", "tools", "thinking_budget", "max_request_bytes"}
        if unknown:
            raise ContractError(f"{API_CONTRACT_VARIABLE} has unknown fields: {', '.join(sorted(unknown))}")
        reasoning, tools = data.get("reasoning", False), data.get("tools", False)
        budget = data.get("thinking_budget", {})
        if not isinstance(reasoning, bool) or not isinstance(tools, bool) or not isinstance(budget, dict):
            raise ContractError(f"{API_CONTRACT_VARIABLE} has an ill-typed field")
        for effort, tokens in budget.items():
            if effort not in EFFORTS or not (tokens is None or (isinstance(tokens, int) and tokens > 0)):
                raise ContractError(f"{API_CONTRACT_VARIABLE}: bad thinking budget {effort}={tokens!r}")
        cap = data.get("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
        if not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0:
            raise ContractError(f"{API_CONTRACT_VARIABLE}: bad max_request_bytes {cap!r}")
        return cls(reasoning, tools, budget, cap)


@dataclass(frozen=True)
class ApiError:
    """An error answer in the OpenAI shape."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"
    #: Headers the answer carries besides its content type and length (``WWW-Authenticate``,
    #: ``Retry-After``, the rate-limit headers).
    headers: tuple[tuple[bytes, bytes], ...] = ()

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}})


def auth_error(key_sent: bool, message: str | None = None) -> ApiError:
    """The 401 for a request whose key is refused: no key at all, or one that is unknown, revoked or
    expired (``message`` says which where it is not just unknown), with ``WWW-Authenticate`` as RFC
    6750 has it (``error="invalid_token"`` for a key sent)."""
    if key_sent:
        return ApiError(401, message or MSG_WRONG_KEY, None, "invalid_api_key", "authentication_error",
                        ((b"www-authenticate", b'Bearer error="invalid_token"'),))
    return ApiError(401, MSG_NO_KEY, None, "missing_api_key", "authentication_error",
                    ((b"www-authenticate", b"Bearer"),))


def scope_error(scope: str) -> ApiError:
    """The 403 for a valid key without the scope the route needs."""
    return ApiError(403, f"{MSG_NO_SCOPE}: this route needs the scope '{scope}'", None, "insufficient_scope",
                    "permission_error",
                    ((b"www-authenticate", f'Bearer error="insufficient_scope", scope="{scope}"'.encode()),))


def rate_limit_error(limit: int, headers: tuple[tuple[bytes, bytes], ...]) -> ApiError:
    """The 429 for a key past its requests per minute (``headers``: the rate-limit ones and ``Retry-After``)."""
    return ApiError(429, f"{MSG_RATE_LIMIT}: the limit of this key is {limit} requests per minute", None,
                    "rate_limit_exceeded", "rate_limit_error", headers)


def concurrency_error(limit: int, headers: tuple[tuple[bytes, bytes], ...]) -> ApiError:
    """The 429 for a key with as many requests in flight as it may have."""
    return ApiError(429, f"{MSG_CONCURRENCY}: this key may have {limit} requests in flight", None,
                    "concurrency_limit_exceeded", "rate_limit_error", headers)


def too_large_error(limit: int) -> ApiError:
    """The 413 for a body over ``limit`` bytes (announced by its length, or found while reading it)."""
    return ApiError(413, f"{MSG_TOO_LARGE}: the limit is {limit} bytes (CF_MAX_REQUEST_BYTES)", None,
                    "request_too_large")


LICENCE_EXPIRED_ERROR = ApiError(503, MSG_LICENCE_EXPIRED, None, "licence_expired", "service_unavailable")


def route_path(path: str, root_path: str) -> str:
    """The path as the app routes it: ``path`` without the root path (``--root-path``), the way
    Starlette matches routes (a path outside the root path is routed as it is)."""
    if not root_path or not path.startswith(root_path):
        return path
    rest = path[len(root_path):]
    return rest if rest == "" or rest.startswith("/") else path


def is_public(route: str) -> bool:
    """Whether ``route`` (see :func:`route_path`) is answered without the key."""
    return route in PUBLIC_PATHS


_BAD_EFFORT = ApiError(400, MSG_BAD_EFFORT, "chat_template_kwargs", "invalid_reasoning_effort")


def effort_of(template_kwargs: Any, top_level: Any, top_param: str = "reasoning_effort") -> str | ApiError:
    """The effort a chat request asks for (``low``, ``medium``, ``xhigh`` or :data:`NO_THINKING`).

    ``template_kwargs`` is the request's ``chat_template_kwargs``; ``top_level`` its
    ``reasoning_effort`` (what the OpenAI SDK sends), or what the field named ``top_param`` holds
    (``reasoning.effort`` in the Responses API). Both may be absent (``None``).
    """
    from_kwargs: str | None = None
    if template_kwargs is not None:
        if not isinstance(template_kwargs, dict):
            return _BAD_EFFORT
        if template_kwargs == {"enable_thinking": False}:
            from_kwargs = NO_THINKING
        elif len(template_kwargs) == 1 and template_kwargs.get("reasoning_effort") in EFFORTS:
            from_kwargs = template_kwargs["reasoning_effort"]
        elif template_kwargs:
            return _BAD_EFFORT
    from_top: str | None = None
    if top_level is not None:
        if top_level not in EFFORTS:
            return ApiError(400, MSG_BAD_EFFORT, top_param, "invalid_reasoning_effort")
        from_top = top_level
    if from_kwargs is not None and from_top is not None and from_kwargs != from_top:
        return _BAD_EFFORT
    return from_kwargs or from_top or DEFAULT_EFFORT


def apply_effort(request: dict[str, Any], effort: str, contract: ApiContract, budget: bool = True) -> None:
    """Rewrite ``request`` in place into what the served model's chat template understands; with
    ``budget`` false (an endpoint without vLLM's ``thinking_token_budget``) the cap is left out."""
    request.pop("reasoning_effort", None)
    if not contract.reasoning:
        request.pop("chat_template_kwargs", None)
        return
    thinking = effort != NO_THINKING
    request["chat_template_kwargs"] = {"enable_thinking": thinking}
    tokens = contract.thinking_budget.get(effort) if thinking and budget else None
    if tokens is not None and request.get("thinking_token_budget") is None:
        request["thinking_token_budget"] = tokens


def _wants_tools(request: Mapping[str, Any]) -> bool:
    return bool(request.get("tools")) and request.get("tool_choice") != "none"


def check_request(path: str, body: bytes, contract: ApiContract, task_header: bytes = b"",
                  tenant: Mapping[str, str | int | float] | None = None) -> bytes | ApiError:
    """The body to forward for a POST to ``path`` (the routed path, see :func:`route_path`): ``body``
    itself when nothing changes, a rewritten body, or the error to answer with. Paths outside
    :data:`ROUTES` are not looked at. ``task_header`` is the request's ``X-CF-Task`` header
    (``b""``: none), recorded as the tag ``task``. ``tenant`` holds the reserved ``vllm_xargs``
    entries of the request's named key (:func:`~carbonforge_runtime.core.request_tags.tenant_args`),
    written where the route reaches the engine; None: no named key, no tenant."""
    route = ROUTES.get(path)
    if route is None:
        return body
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ApiError(400, MSG_INVALID_JSON, None, "invalid_json")
    if not isinstance(request, dict):
        return ApiError(400, MSG_INVALID_JSON, None, "invalid_json")
    verdict: bytes | ApiError = body
    if route.kind == "chat":
        verdict = _check_chat(body, request, contract, budget=True)
    elif route.kind == "chat_batch":  # vLLM's batch request has no thinking_token_budget
        verdict = _check_chat(body, request, contract, budget=False)
    elif route.kind == "invocation":  # vLLM tries a chat request first, then a completion
        verdict = _check_chat(body, request, contract, budget=True) if "messages" in request else body
    elif route.kind == "responses":
        verdict = _check_responses(request, body, contract)
    if isinstance(verdict, ApiError):
        return verdict
    return _tagged(verdict, body, request, route, task_header, tenant)


def _tagged(verdict: bytes, body: bytes, request: dict[str, Any], route: Route, task_header: bytes,
            tenant: Mapping[str, str | int | float] | None = None) -> bytes | ApiError:
    """``verdict`` (the body to forward, parsed from ``body`` as ``request``) with the request's tags,
    model name and tenant in ``vllm_xargs`` where the route reaches the engine, and without a client's
    values under the reserved keys on every route."""
    added: dict[str, str | int | float] = {}
    if route.tags:
        tags = request_tags(request.get("metadata") if route.metadata else None, task_header)
        if isinstance(tags, TagError):
            return ApiError(400, tags.message, tags.param, tags.code)
        added = {**tag_args(tags, request.get("model")), **(tenant or {})}
    if route.kind != "generate" and "vllm_xargs" not in request:  # the common case: add, no re-serialising
        return _with_fields(verdict, {"vllm_xargs": added}) if added else verdict
    document = request if verdict is body else orjson.loads(verdict)
    holder: Any = document
    if route.kind == "generate":
        holder = document.get("sampling_params")
        if not isinstance(holder, dict):
            return verdict  # vLLM refuses it
    key = "extra_args" if route.kind == "generate" else "vllm_xargs"
    xargs = holder.get(key)
    if xargs is None:
        xargs = {}
    if not isinstance(xargs, dict):
        return verdict  # vLLM refuses it
    kept = {k: v for k, v in xargs.items() if k not in RESERVED_ARGS}
    if len(kept) == len(xargs) and not added:
        return verdict
    holder[key] = {**kept, **added}
    return orjson.dumps(document)


def _check_chat(body: bytes, request: dict[str, Any], contract: ApiContract, budget: bool) -> bytes | ApiError:
    if "messages" not in request:
        return ApiError(400, MSG_MISSING_MESSAGES, "messages", "missing_required_parameter")
    effort = effort_of(request.get("chat_template_kwargs"), request.get("reasoning_effort"))
    if isinstance(effort, ApiError):
        return effort
    if not contract.tools and _wants_tools(request):
        return ApiError(400, MSG_NO_TOOLS, "tools", "tools_not_supported")
    if not contract.reasoning and "chat_template_kwargs" not in request and "reasoning_effort" not in request:
        return body
    if contract.reasoning and not _MAPPED_FIELDS.intersection(request):
        # The common case (nothing sent: the default effort): add the fields, no re-serialising.
        added: dict[str, Any] = {}
        apply_effort(added, effort, contract, budget)
        return _with_fields(body, added)
    apply_effort(request, effort, contract, budget)
    return orjson.dumps(request)


_RESPONSES_EFFORT = "reasoning.effort"


def _check_responses(request: dict[str, Any], body: bytes, contract: ApiContract) -> bytes | ApiError:
    """The Responses API: the effort comes as ``reasoning: {"effort": ...}`` (or in
    ``chat_template_kwargs``), by the same rule as chat; vLLM 0.32 has no thinking budget there."""
    reasoning = request.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        return ApiError(400, MSG_BAD_EFFORT, "reasoning", "invalid_reasoning_effort")
    top = reasoning.get("effort") if reasoning else None
    effort = effort_of(request.get("chat_template_kwargs"), top, _RESPONSES_EFFORT)
    if isinstance(effort, ApiError):
        return effort
    if not contract.tools and _wants_tools(request):
        return ApiError(400, MSG_NO_TOOLS, "tools", "tools_not_supported")
    if not contract.reasoning and "chat_template_kwargs" not in request and top is None:
        return body
    if reasoning:
        request["reasoning"] = {k: v for k, v in reasoning.items() if k != "effort"}
    apply_effort(request, effort, contract, budget=False)
    return orjson.dumps(request)


#: The request fields :func:`apply_effort` may write or remove.
_MAPPED_FIELDS = frozenset({"chat_template_kwargs", "reasoning_effort", "thinking_token_budget"})


def _with_fields(body: bytes, fields: Mapping[str, Any]) -> bytes:
    """A JSON object's text with ``fields`` (absent from it) added before its closing brace."""
    head = body[: body.rstrip().rfind(b"}")].rstrip()
    return head + (b"" if head.endswith(b"{") else b",") + orjson.dumps(fields)[1:-1] + b"}"


#: vLLM 0.32 names the thinking ``reasoning``; clients of the OpenAI-compatible API read
#: ``reasoning_content`` (the name DeepSeek's API made common). Answers carry both.
_REASONING = b'"reasoning"'
#: ``"reasoning":"<a JSON string>"`` as vLLM writes it (compact). Inside a JSON string every quote is
#: escaped, so a match is always a key; one match per body is spliced without parsing.
_REASONING_VALUE = re.compile(rb'"reasoning":("[^"\\]*(?:\\.[^"\\]*)*"|null)')  # runs, not characters


def _alias_choices(response: Any) -> bool:
    changed = False
    if not isinstance(response, dict):
        return False
    for choice in response.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        for part in ("message", "delta"):
            holder = choice.get(part)
            if isinstance(holder, dict) and "reasoning" in holder and "reasoning_content" not in holder:
                holder["reasoning_content"] = holder["reasoning"]
                changed = True
    return changed


def _splice(body: bytes) -> bytes | None:
    """``body`` with its one reasoning value repeated as ``reasoning_content``; None when the body
    has the key more than once or in another form (then it is parsed instead)."""
    if body.count(_REASONING) != 1:
        return None
    match = _REASONING_VALUE.search(body)
    if match is None:
        return None
    end = match.end()
    return body[:end] + b',"reasoning_content":' + match.group(1) + body[end:]


def alias_reasoning_json(body: bytes) -> bytes:
    """A chat completion answer (or one streamed chunk) with ``reasoning_content`` beside ``reasoning``."""
    if _REASONING not in body or b'"reasoning_content"' in body:
        return body
    spliced = _splice(body)
    return spliced if spliced is not None else _parsed_alias(body)


def _parsed_alias(body: bytes) -> bytes:
    try:
        response = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    return orjson.dumps(response) if _alias_choices(response) else body


def alias_reasoning_events(events: bytes) -> bytes:
    """Server-sent events of a streamed chat completion (whole ``data: ...`` events), each chunk
    with ``delta.reasoning_content`` beside ``delta.reasoning``."""
    if _REASONING not in events:
        return events
    if events.count(b"data: ") == 1 and b'"reasoning_content"' not in events:
        spliced = _splice(events)  # one event, as vLLM writes them
        if spliced is not None:
            return spliced
    out = []
    for event in events.split(b"\n\n"):
        if event.startswith(b"data: {") and _REASONING in event:
            event = b"data: " + alias_reasoning_json(event[6:])
        out.append(event)
    return b"\n\n".join(out)
