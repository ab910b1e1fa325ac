"""The chat format: ChatML with Hermes-style tool calls, the convention of Qwen2.5/Qwen3 models.

    <|im_start|>system\n...# Tools ... <tools>[schemas]</tools><|im_end|>\n
    <|im_start|>user\nFix the failing test.<|im_end|>\n
    <|im_start|>assistant\nLooking first.\n<tool_call>\n{"name": "grep", "arguments": {...}}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n...\n</tool_response><|im_end|>\n

`CHAT_TEMPLATE` is the Jinja template stored on the tokenizer (so `apply_chat_template` and any
HF-compatible server render exactly this), and `render_message` produces the same text one
message at a time, which is how the episode runner appends turns without re-tokenizing earlier
ones. Consecutive tool results share one user turn, as in Qwen's template.

A model trained without the tool schemas in its prompt (the embedded default) says so on its
tokenizer (`tools_in_prompt`); every renderer asks it, so training, episodes and the server agree.

`parse_assistant` turns generated text into content plus `ToolCall`s. A malformed call (bad JSON,
unknown tool, wrong arguments, an unclosed tag) becomes an invalid `ToolCall` carrying the reason:
it is answered with the error and counted, never dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from flywheel.env.toolspec import TOOL_SCHEMAS, ToolCall, validate_arguments

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]
# Single tokens too (not "special": they are part of the text the model writes and reads).
MARKUP_TOKENS = [TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE]

SYSTEM_PROMPT = (
    "You are a coding agent working in a project folder. Use the tools to inspect and change files "
    "and to run commands. If the request leaves out something you need, ask one short question. "
    "Call finish when the task is done."
)

# Rendered by `tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=...)`.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nCall tools inside <tool_call></tool_call> tags as JSON with name and "
    "arguments.\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if (message.content or '') or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call.function.name | tojson) + ', \"arguments\": ' }}"
    "{%- if call.function.arguments is string %}{{- call.function.arguments }}"
    "{%- else %}{{- call.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
GENERATION_PROMPT = f"{IM_START}assistant\n"
# The template of a model trained without the tool schemas in its prompt (see `tools_in_prompt`):
# the system turn is rendered as if no tools were given, whatever the request carries.
CHAT_TEMPLATE_NO_TOOLS = CHAT_TEMPLATE.replace("{%- if tools %}", "{%- if false %}", 1)
TOOLS_IN_PROMPT = "tools_in_prompt"  # the tokenizer setting, saved in tokenizer_config.json


def tools_in_prompt(tokenizer: Any) -> bool:
    """Whether prompts for this tokenizer's model list the tool schemas in the system turn.

    A real checkpoint reads its tools from the prompt (Qwen's convention, the default). A tiny
    model trained from scratch on one fixed toolset learns the tools from its demonstrations
    instead; for it the ~650 tokens of schemas are pure cost: every token attends to them, and on
    2 cores they halved the SFT steps per minute and slowed the learning of copying a path or a
    name from the context (`bench/sft.py`, variant `tools_in_prompt`)."""
    return bool(getattr(tokenizer, "init_kwargs", {}).get(TOOLS_IN_PROMPT, True))


def tool_schemas(names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    return [TOOL_SCHEMAS[n] for n in (names or TOOL_SCHEMAS)]


def _json(value: Any) -> str:
    # Matches Jinja's `tojson` as HF renders it (json.dumps with default separators).
    return json.dumps(value, ensure_ascii=False)


# A rendered turn as pieces: (text, written by a client or a tool). The template's own text holds
# the only control and markup tokens a prompt may have; `ConversationEncoder` encodes the other
# pieces so that no token string in them becomes its token.
Pieces = list[tuple[str, bool]]


def joined(pieces: Pieces) -> str:
    """The text of rendered pieces, as the template writes it."""
    return "".join(text for text, _ in pieces)


def system_pieces(content: str, tools: Sequence[dict[str, Any]] | None) -> Pieces:
    if not tools:
        return [(f"{IM_START}system\n", False), (content, True), (f"{IM_END}\n", False)]
    listed = "".join("\n" + _json(t) for t in tools)
    return [
        (f"{IM_START}system\n", False), (content, True),
        (f"\n\n# Tools\n\nCall tools inside <tool_call></tool_call> tags as JSON "
         f"with name and arguments.\n<tools>{listed}\n</tools>{IM_END}\n", False),
    ]


def render_tool_call(call: dict[str, Any]) -> str:
    args = call["function"]["arguments"]
    args_text = args if isinstance(args, str) else _json(args)
    return (f'{TOOL_CALL_OPEN}\n{{"name": {_json(call["function"]["name"])}, "arguments": {args_text}}}'
            f'\n{TOOL_CALL_CLOSE}')


def render_assistant_body(message: dict[str, Any]) -> str:
    """What the model writes for an assistant message (without the header, with the end tag)."""
    text = message.get("content") or ""
    for i, call in enumerate(message.get("tool_calls") or []):
        text += ("\n" if text or i else "") + render_tool_call(call)
    return text + IM_END


def tool_results_pieces(contents: Sequence[str]) -> Pieces:
    """One user turn holding consecutive tool results, then nothing else."""
    pieces: Pieces = [(f"{IM_START}user", False)]
    for c in contents:
        pieces += [(f"\n{TOOL_RESPONSE_OPEN}\n", False), (c, True), (f"\n{TOOL_RESPONSE_CLOSE}", False)]
    return pieces + [(f"{IM_END}\n", False)]


def user_reply_pieces(text: str) -> Pieces:
    """Appended after a generated `<|im_end|>`: the newline the template puts there, the user's
    message, and the header of the next assistant turn."""
    return [(f"\n{IM_START}user\n", False), (text, True), (f"{IM_END}\n{GENERATION_PROMPT}", False)]


def tool_reply_pieces(contents: Sequence[str]) -> Pieces:
    """Appended after a generated `<|im_end|>`: the tool results as one user turn, then the next
    assistant header."""
    return [("\n", False), *tool_results_pieces(contents), (GENERATION_PROMPT, False)]


def render_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = False) -> str:
    """The same text as CHAT_TEMPLATE, in Python (tests check the two agree)."""
    return "".join(render_turns(messages, tools, add_generation_prompt))


def render_turns(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                 add_generation_prompt: bool = False) -> list[str]:
    """`render_messages` as its turns: each piece starts with <|im_start|>, and they join to the whole.

    Because a tokenizer splits on special tokens before anything else, the pieces can be tokenized
    one by one (and cached: the server tokenizes the long tools prompt once) with the same ids."""
    return [joined(turn) for turn in turn_pieces(messages, tools, add_generation_prompt)]


def turn_pieces(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                add_generation_prompt: bool = False) -> list[Pieces]:
    """`render_turns`, each turn as its pieces: which text the template wrote and which a client or
    a tool did (a user's or system message, a tool result). An assistant turn is the model's own
    text, markup included, as it wrote it (or as the client says it did)."""
    out: list[Pieces] = []
    i = 0
    if messages and messages[0]["role"] == "system":
        out.append(system_pieces(messages[0]["content"], tools))
        i = 1
    elif tools:
        out.append(system_pieces("", tools))
    while i < len(messages):
        m = messages[i]
        if m["role"] in ("user", "system"):
            out.append([(f"{IM_START}{m['role']}\n", False), (m["content"], True), (f"{IM_END}\n", False)])
        elif m["role"] == "assistant":
            out.append([(f"{IM_START}assistant\n{render_assistant_body(m)}\n", False)])
        elif m["role"] == "tool":
            j = i
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
            out.append(tool_results_pieces([t["content"] for t in messages[i:j]]))
            i = j
            continue
        else:
            raise ValueError(f"unknown message role {m['role']!r}; expected system, user, assistant or tool")
        i += 1
    if add_generation_prompt:
        out.append([(GENERATION_PROMPT, False)])
    return out


_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL)


def parse_assistant(text: str, call_id_prefix: str = "call",
                    schemas: Mapping[str, dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
    """Split generated assistant text into its prose and its tool calls (valid or not).

    Calls are validated against `schemas` (by name), by default the agent's own tools."""
    text = text.removesuffix(IM_END)
    calls = []
    for i, match in enumerate(_CALL_RE.finditer(text)):
        call_id = f"{call_id_prefix}_{i}"
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall(call_id, "?", {}, error="unclosed <tool_call> tag"))
            continue
        calls.append(parse_call(body, call_id, schemas))
    first = text.find(TOOL_CALL_OPEN)
    content = (text if first < 0 else text[:first]).rstrip("\n")
    return content, calls


def client_view(answer: str, content: str, calls: Sequence[ToolCall]) -> tuple[str, list[ToolCall]]:
    """What an OpenAI client is sent of a parsed answer (`content`, `calls` = parse_assistant(answer),
    possibly renamed or re-checked): the valid calls as `tool_calls`, and as text the prose followed
    by the markup of each call the client could not dispatch (unparsable, cut at max_tokens, an
    undeclared tool, arguments its schema refuses).

    Why: OpenAI's contract is that a tool call names a declared tool with arguments that parse;
    standard clients (the OpenAI Agents SDK) end the run on any other ("Tool ? not found"). The
    invalid call is the model's all the same: the served record keeps every call with its error, and
    the broken-call penalty is taken from there."""
    raw = [m.group(0) for m in _CALL_RE.finditer(answer.removesuffix(IM_END))]
    withheld = [text for text, call in zip(raw, calls, strict=True) if not call.valid]
    if not withheld:
        return content, list(calls)
    return "\n".join(part for part in (content, *withheld) if part), [c for c in calls if c.valid]


def parse_call(body: str, call_id: str, schemas: Mapping[str, dict[str, Any]] | None = None) -> ToolCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(call_id, "?", {}, error=f"bad JSON in tool call: {exc.msg} at char {exc.pos}")
    except ValueError as exc:  # an integer past Python's int-string conversion limit (4,300 digits)
        return ToolCall(call_id, "?", {}, error=f"bad JSON in tool call: {exc}")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(call_id, "?", {}, error='a tool call must be {"name": ..., "arguments": {...}}')
    name, arguments = payload["name"], payload.get("arguments", {})
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except ValueError:  # not JSON (JSONDecodeError), or an integer past int()'s 4,300 digits
            return ToolCall(call_id, name, {}, error="arguments is a string that is not JSON")
    error = validate_arguments(name, arguments, schemas)
    return ToolCall(call_id, name, arguments if isinstance(arguments, dict) else {}, error=error)


def openai_tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
