"""OpenAI's request and response records, the parts flywheel serves, as both servers read and write them.

    parse_chat(body) -> ChatRequest                   400 (ApiError) naming the first three problems
    parse_text_completion(body) -> TextCompletionRequest
    ChatCompletionResponse, TextCompletionResponse, ModelList    what /openapi.json documents; the
                                                      live server's fuzz test checks every response
    openai_tool_call(call), chat_logprobs(...), usage(...)       pieces of a response, as OpenAI shapes them

A request record says what may be asked and refuses, with a message that says the fix, what flywheel
does not do (penalties, logit_bias, response formats other than text: the sampled tokens' logprobs
must be the model's, for the Learner). Fields OpenAI has and flywheel ignores are accepted. The
`flywheel` field of a response is flywheel's own (version, arm, session); strict clients ignore it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flywheel.api.errors import ApiError, describe_errors, first_error

MAX_ID_CHARS = 200  # a session or user id: it goes back in a header, and into the store
MAX_CHOICES = 16  # choices of one chat request (n); each is an engine request of its own


# ---- requests


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _Function(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class _MessageToolCall(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: _Function


def _message_schema(schema: dict[str, Any]) -> None:
    """ChatMessage's JSON schema says what `_content` checks: content is required except for assistant
    messages, and only they carry tool_calls (so a schema-valid message is a valid message)."""
    props = schema["properties"]
    assistant = {"type": "object", "required": ["role"], "properties": {
        **props, "role": {"const": "assistant"}}}
    other = {"type": "object", "required": ["role", "content"], "properties": {
        **props, "role": {"enum": ["system", "developer", "user", "tool"]},
        "content": {"anyOf": [s for s in props["content"]["anyOf"] if s.get("type") != "null"]},
        "tool_calls": {"type": "null"}}}
    title = schema.get("title", "ChatMessage")
    schema.clear()
    schema.update({"title": title, "oneOf": [assistant, other]})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_message_schema)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    tool_calls: list[_MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def as_template_message(self) -> dict[str, Any]:
        """The dict `render_messages` takes (developer is OpenAI's newer name for system)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return message

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class _FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is None:
            return None
        properties = parameters.get("properties", {})
        if not isinstance(properties, dict) or not all(isinstance(v, dict) for v in properties.values()):
            raise ValueError("parameters.properties must be an object of JSON schemas")
        required = parameters.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("parameters.required must be a list of argument names")
        return parameters


class _ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: _FunctionSpec


class _NamedFunction(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")


class _NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: _NamedFunction


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # other OpenAI fields (penalties, seed, ...) are accepted and ignored
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    # Kept as sent, so the system prompt renders them byte for byte as the client wrote them.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | _NamedToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    # with logprobs: the k most likely tokens at each position (not streamed, not /v1/completions yet)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)  # same seed and request: the same answer
    frequency_penalty: float | None = None  # refused unless 0 (below)
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    n: int | None = Field(default=1, ge=1, le=MAX_CHOICES)  # n > 1: a GRPO group in one request
    stop: str | list[str] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    metadata: dict[str, Any] | None = None
    # extra_body; it goes back in the x-session-id header, hence visible ASCII
    # (documented here, checked with the header's and metadata's by the live server's `identity`, whose message
    # says the fix)
    session_id: str | None = Field(default=None, json_schema_extra={"pattern": rf"^[!-~]{{1,{MAX_ID_CHARS}}}$"})

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(tools or []):
            try:
                _ToolSpec.model_validate(tool)
            except ValidationError as exc:
                raise ValueError(f"tools[{i}] is not {{'type': 'function', 'function': {{'name', 'parameters'}}}}: "
                                 f"{first_error(exc)}") from None
        return tools

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (len(stops) > 4 or not all(0 < len(x) <= 200 for x in stops)):
            raise ValueError("stop takes at most 4 sequences of 1 to 200 characters each")
        return stops or None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("frequency and presence penalties are not supported (the engine samples from the "
                             "model's distribution, which the Learner's logprobs must match); leave them unset or 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError("logit_bias is not supported (the sampled tokens' logprobs must be the model's); "
                             "leave it unset")
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, fmt: dict[str, Any] | None) -> dict[str, Any] | None:
        if fmt is not None and fmt.get("type", "text") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return fmt


class TextCompletionRequest(BaseModel):
    """POST /v1/completions: a raw prompt, as text or as token ids (token in, token out for RL
    frameworks). Not chat-templated: the prompt is exactly the tokens the engine sees."""

    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    logprobs: int | None = Field(default=None, ge=0, le=1)  # 1: the sampled token's logprob (no alternatives)
    n: int | None = Field(default=1, ge=1, le=1)
    stream: Literal[False] | None = False
    echo: Literal[False] | None = False
    user: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    metadata: dict[str, Any] | None = None
    session_id: str | None = Field(default=None, json_schema_extra={"pattern": rf"^[!-~]{{1,{MAX_ID_CHARS}}}$"})

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: str | list[int]) -> str | list[int]:
        if isinstance(prompt, list) and any(not 0 <= t < 2**31 for t in prompt):
            raise ValueError("prompt token ids must be non-negative integers below 2**31")
        return prompt



def parse_chat(body: bytes) -> ChatRequest:
    try:
        return ChatRequest.model_validate_json(body)
    except ValidationError as exc:
        raise ApiError(400, f"invalid chat completion request: {describe_errors(exc)}") from None


def parse_text_completion(body: bytes) -> TextCompletionRequest:
    try:
        return TextCompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        raise ApiError(400, f"invalid completion request: {describe_errors(exc)}") from None


# ---- responses


class _ReplyToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")  # `error`: why a call the model wrote is invalid
    id: str
    type: Literal["function"]
    function: _Function


class _ReplyMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[_ReplyToolCall] | None = None


class _TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]]


class _Logprobs(BaseModel):
    content: list[_TokenLogprob]


class _Choice(BaseModel):
    index: int
    message: _ReplyMessage
    logprobs: _Logprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]
    completion_id: str | None = None  # n > 1: this choice's Completion (the id its feedback events name)


class _Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Served(BaseModel):
    version: int
    arm: str
    session_id: str
    engine_ms: float
    ttft_ms: float | None = None  # streamed: from the request to its first token
    # Declared tools a model trained on flywheel's own (no `tools_in_prompt`) does not know: it never
    # saw their schemas and will not call them.
    unknown_tools: list[str] | None = None
    # Calls the model wrote that no client could dispatch (unparsable, cut off, an undeclared tool,
    # arguments the schema refuses): sent as text, not `tool_calls`, and recorded as invalid calls.
    invalid_tool_calls: int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[_Choice]
    usage: _Usage
    flywheel: _Served


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class _TextChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"]


class _ServedTokens(_Served):
    prompt_token_ids: list[int]
    token_ids: list[int]


class TextCompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[_TextChoice]
    usage: _Usage
    flywheel: _ServedTokens




def openai_tool_call(call: Any) -> dict[str, Any]:
    """A valid call as OpenAI sends it (an invalid one goes to the client as text: model/chat.py `client_view`)."""
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


def chat_logprobs(token_ids: list[int], logprobs: list[float], tokenizer: Any,
              top: list[list[tuple[int, float]]] | None = None) -> dict[str, Any]:
    """OpenAI's chat `logprobs.content`: each sampled token with its logprob and, when asked, the
    k most likely tokens at its position (`top`, the engine's, under the same distribution)."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        content.append({**entry(token_id, logprob),
                        "top_logprobs": [entry(t, lp) for t, lp in top[i]] if top is not None else []})
    return {"content": content}



def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_card(name: str) -> dict[str, Any]:
    """One entry of GET /v1/models."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "flywheel"}
