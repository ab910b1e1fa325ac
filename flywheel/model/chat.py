"""The chat format: how a conversation becomes text, turn by turn, and how generated text becomes
tool calls. One interface (`ChatFormat`), one family per convention of tool calling:

    HermesFormat   ChatML turns, tool calls as JSON inside <tool_call></tool_call> (Hermes style):
                   flywheel's own, Qwen2.5, Qwen3, and ChatML templates without tools (SmolLM2),
                   which get flywheel's tools header (`tools_source = "flywheel"`)
    Llama3Format   Llama 3.x headers, a tool call as the JSON body of the assistant turn
                   (flywheel/model/chat_llama3.py)

Which format a tokenizer's model speaks is decided from its own chat template and recorded on it
(flywheel/model/formats.py); every caller asks `formats.format_of(tokenizer)`.

flywheel's own format (`FLYWHEEL`), the embedded default:

    <|im_start|>system\\n...# Tools ... <tools>[schemas]</tools><|im_end|>\\n
    <|im_start|>user\\nFix the failing test.<|im_end|>\\n
    <|im_start|>assistant\\nLooking.\\n<tool_call>\\n{"name": "grep", "arguments": {...}}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n

`CHAT_TEMPLATE` is its Jinja template, stored on the tokenizer (so `apply_chat_template` and any
HF-compatible server render exactly this), and a format's `turn_pieces` produce the same text one
turn at a time, which is how the episode runner appends turns without re-tokenizing earlier ones.
Consecutive tool results share one user turn, as in Qwen's template. The module-level functions
(`render_messages`, `parse_assistant`, ...) are flywheel's own format's.

A model trained without the tool schemas in its prompt (the embedded default) says so on its
tokenizer (`tools_in_prompt`); every renderer asks it, so training, episodes and the server agree.

`parse` turns generated text into content plus `ToolCall`s. A malformed call (bad JSON, unknown
tool, wrong arguments, an unclosed tag) becomes an invalid `ToolCall` carrying the reason: it is
answered with the error and counted, never dropped.

What a format renders as the model wrote it, whatever its template would: an assistant turn (the
model's own text, markup included; a template that rewrites earlier turns, as Qwen3's drops their
reasoning, is not followed there: token in, token out) and tool-call arguments given as a string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

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


def arguments_text(arguments: Any) -> str:
    """A call's arguments as the model writes them: a string as it stands, else JSON."""
    return arguments if isinstance(arguments, str) else _json(arguments)


class ChatFormat:
    """How one model family's chat template renders turns and how its tool calls are parsed.

    Every rendered turn begins with one of `turn_starts` (control tokens the tokenizer splits on
    first), so turns tokenize one by one with the ids of the whole; `control_strings` are the
    format's token strings, which a client's or a tool's text never becomes (`ConversationEncoder`)."""

    name: str
    family: Literal["hermes", "llama3"]
    # Where the tool instructions in the prompt come from: the model's template ("template"), or
    # flywheel's header, added because the template has no way to list tools ("flywheel").
    tools_source: Literal["template", "flywheel"] = "template"
    end_token: str  # what ends an assistant turn, as renders write it
    stop_tokens: tuple[str, ...]  # any of these ends a generated turn
    turn_starts: tuple[str, ...]
    control_strings: tuple[str, ...]

    def call_texts(self, text: str) -> list[str]:
        """The text of each tool call in generated `text` as the model wrote it, in `parse`'s order."""
        raise NotImplementedError

    def client_view(self, answer: str, content: str, calls: Sequence[ToolCall]) -> tuple[str, list[ToolCall]]:
        """What an OpenAI client is sent of a parsed answer (`content`, `calls` = self.parse(answer),
        possibly renamed or re-checked): the valid calls as `tool_calls`, and as text the prose followed
        by the markup of each call the client could not dispatch (unparsable, cut at max_tokens, an
        undeclared tool, arguments its schema refuses).

        Why: OpenAI's contract is that a tool call names a declared tool with arguments that parse;
        standard clients (the OpenAI Agents SDK) end the run on any other ("Tool ? not found"). The
        invalid call is the model's all the same: the served record keeps every call with its error, and
        the broken-call penalty is taken from there."""
        withheld = [text for text, call in zip(self.call_texts(answer), calls, strict=True) if not call.valid]
        if not withheld:
            return content, list(calls)
        return "\n".join(part for part in (content, *withheld) if part), [c for c in calls if c.valid]

    def turn_pieces(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = False) -> list[Pieces]:
        """Each turn of the prompt as its pieces: which text the template wrote and which a client or
        a tool did (a user's or system message, a tool result). An assistant turn is the model's own
        text, markup included, as it wrote it (or as the client says it did)."""
        raise NotImplementedError

    def assistant_body(self, message: dict[str, Any]) -> str:
        """What the model writes for an assistant message: its text and calls, then `end_token`."""
        raise NotImplementedError

    def user_reply_pieces(self, text: str) -> Pieces:
        """Appended after a generated end token: the user's turn and the next assistant header."""
        raise NotImplementedError

    def tool_reply_pieces(self, contents: Sequence[str]) -> Pieces:
        """Appended after a generated end token: the tool results and the next assistant header."""
        raise NotImplementedError

    def continuation_pieces(self, messages: Sequence[dict[str, Any]], closed: bool = True) -> Pieces:
        """What follows a generated turn when a client sends `messages` after it: what the template
        writes after an end token (for a turn cut at its token cap, `closed=False`, the end token
        too), the messages' turns, then the next assistant header."""
        raise NotImplementedError

    def parse(self, text: str, call_id_prefix: str = "call",
              schemas: Mapping[str, dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
        """Generated assistant text as its prose and its tool calls (valid or not), validated
        against `schemas` (by name), by default the agent's own tools."""
        raise NotImplementedError

    def forced_call(self, name: str | None) -> str:
        """The opening of an assistant turn that must call a tool (`name`, or any with None)."""
        raise NotImplementedError

    def visible_content(self, text: str) -> str:
        """The prose of a partial answer, cut before anything that is or may become a tool call."""
        raise NotImplementedError

    def template_kwargs(self) -> dict[str, Any]:
        """What `apply_chat_template` needs to render as this format does (a fixed date, say)."""
        return {}

    def strip_end(self, text: str) -> str:
        for token in self.stop_tokens:
            if text.endswith(token):
                return text[: -len(token)]
        return text

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
               add_generation_prompt: bool = False) -> str:
        return "".join(joined(turn) for turn in self.turn_pieces(messages, tools, add_generation_prompt))

    def record(self) -> dict[str, Any]:
        """What the version's record and the tokenizer keep (`formats.format_from_record` reads it)."""
        return {"name": self.name, "family": self.family, "tools_source": self.tools_source}

    def describe(self) -> str:
        tools = ("tools as its template lists them" if self.tools_source == "template"
                 else "its template lists no tools: flywheel's tools header added")
        return f"{self.family} tool calls, {tools}"


@dataclass(frozen=True)
class HermesFormat(ChatFormat):
    """ChatML turns with Hermes-style tool calls. The variants differ only in the system turn that
    lists the tools: its text (`tools_intro`, `tools_outro`) and what leads it when the conversation
    has no system message; and in the system turn a template writes when there is none."""

    name: str
    tools_intro: str  # before the schemas: "# Tools ... <tools>"
    tools_outro: str  # after them: "\n</tools>" and any instructions
    # The system text the template writes when the conversation has none (None: no system turn).
    default_system: str | None = None
    # What leads the tools header without a system message: "default" (the default system text,
    # or nothing but the separator), "none" (the header alone, as Qwen3's template writes it).
    tools_lead: Literal["default", "none"] = "default"
    tools_source: Literal["template", "flywheel"] = "template"
    family: Literal["hermes"] = "hermes"
    end_token: str = IM_END
    stop_tokens: tuple[str, ...] = (IM_END,)
    turn_starts: tuple[str, ...] = (IM_START,)
    control_strings: tuple[str, ...] = (*SPECIAL_TOKENS, *MARKUP_TOKENS)

    def system_pieces(self, content: str | None, tools: Sequence[dict[str, Any]] | None) -> Pieces:
        """The system turn: `content` (None: the conversation has no system message)."""
        if not tools:
            text = self.default_system if content is None else content
            if text is None:
                return []
            return [(f"{IM_START}system\n", False), (text, content is not None), (f"{IM_END}\n", False)]
        listed = "".join("\n" + _json(t) for t in tools)
        header = f"{self.tools_intro}{listed}{self.tools_outro}{IM_END}\n"
        if content is not None:
            lead: Pieces = [(content, True), ("\n\n", False)]
        elif self.tools_lead == "none":
            lead = []
        else:
            lead = [((self.default_system or "") + "\n\n", False)]
        return [(f"{IM_START}system\n", False), *lead, (header, False)]

    def render_tool_call(self, call: dict[str, Any]) -> str:
        return (f'{TOOL_CALL_OPEN}\n{{"name": {_json(call["function"]["name"])}, '
                f'"arguments": {arguments_text(call["function"]["arguments"])}}}\n{TOOL_CALL_CLOSE}')

    def assistant_body(self, message: dict[str, Any]) -> str:
        text = message.get("content") or ""
        for i, call in enumerate(message.get("tool_calls") or []):
            text += ("\n" if text or i else "") + self.render_tool_call(call)
        return text + IM_END

    def tool_results_pieces(self, contents: Sequence[str]) -> Pieces:
        """One user turn holding consecutive tool results, then nothing else."""
        pieces: Pieces = [(f"{IM_START}user", False)]
        for c in contents:
            pieces += [(f"\n{TOOL_RESPONSE_OPEN}\n", False), (c, True), (f"\n{TOOL_RESPONSE_CLOSE}", False)]
        return pieces + [(f"{IM_END}\n", False)]

    def user_reply_pieces(self, text: str) -> Pieces:
        # the newline the template puts after <|im_end|>, the user's message, the next header
        return [(f"\n{IM_START}user\n", False), (text, True), (f"{IM_END}\n{GENERATION_PROMPT}", False)]

    def tool_reply_pieces(self, contents: Sequence[str]) -> Pieces:
        return [("\n", False), *self.tool_results_pieces(contents), (GENERATION_PROMPT, False)]

    def continuation_pieces(self, messages: Sequence[dict[str, Any]], closed: bool = True) -> Pieces:
        head = "\n" if closed else f"{IM_END}\n"
        return [(head, False)] + [p for turn in self._turns(messages, None, True, first=False) for p in turn]

    def turn_pieces(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = False) -> list[Pieces]:
        return self._turns(messages, tools, add_generation_prompt, first=True)

    def _turns(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
               add_generation_prompt: bool, first: bool) -> list[Pieces]:
        out: list[Pieces] = []
        i = 0
        if first:
            has_system = bool(messages) and messages[0]["role"] == "system"
            system = self.system_pieces(messages[0]["content"] if has_system else None, tools)
            if system:
                out.append(system)
            i = 1 if has_system else 0
        while i < len(messages):
            m = messages[i]
            if m["role"] in ("user", "system"):
                out.append([(f"{IM_START}{m['role']}\n", False), (m["content"], True), (f"{IM_END}\n", False)])
            elif m["role"] == "assistant":
                out.append([(f"{IM_START}assistant\n{self.assistant_body(m)}\n", False)])
            elif m["role"] == "tool":
                j = i
                while j < len(messages) and messages[j]["role"] == "tool":
                    j += 1
                out.append(self.tool_results_pieces([t["content"] for t in messages[i:j]]))
                i = j
                continue
            else:
                raise ValueError(f"unknown message role {m['role']!r}; expected system, user, assistant or tool")
            i += 1
        if add_generation_prompt:
            out.append([(GENERATION_PROMPT, False)])
        return out

    def parse(self, text: str, call_id_prefix: str = "call",
              schemas: Mapping[str, dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
        text = self.strip_end(text)
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

    def call_texts(self, text: str) -> list[str]:
        return [m.group(0) for m in _CALL_RE.finditer(self.strip_end(text))]

    def forced_call(self, name: str | None) -> str:
        if name is None:
            return f"{TOOL_CALL_OPEN}\n"
        return f'{TOOL_CALL_OPEN}\n{{"name": {_json(name)}, "arguments": '

    def visible_content(self, text: str) -> str:
        return self.strip_end(text).split(TOOL_CALL_OPEN, 1)[0].rstrip("\n")

    def record(self) -> dict[str, Any]:
        return {**super().record(), "default_system": self.default_system}


FLYWHEEL_TOOLS_INTRO = ("# Tools\n\nCall tools inside <tool_call></tool_call> tags as JSON with name and "
                        "arguments.\n<tools>")
FLYWHEEL = HermesFormat(name="flywheel", tools_intro=FLYWHEEL_TOOLS_INTRO, tools_outro="\n</tools>")


# ---- flywheel's own format, as module functions (the embedded default's callers use these) ----

def system_pieces(content: str, tools: Sequence[dict[str, Any]] | None) -> Pieces:
    return FLYWHEEL.system_pieces(content, tools)


def render_tool_call(call: dict[str, Any]) -> str:
    return FLYWHEEL.render_tool_call(call)


def render_assistant_body(message: dict[str, Any]) -> str:
    """What the model writes for an assistant message (without the header, with the end tag)."""
    return FLYWHEEL.assistant_body(message)


def tool_results_pieces(contents: Sequence[str]) -> Pieces:
    return FLYWHEEL.tool_results_pieces(contents)


def user_reply_pieces(text: str) -> Pieces:
    """Appended after a generated `<|im_end|>`: the newline the template puts there, the user's
    message, and the header of the next assistant turn."""
    return FLYWHEEL.user_reply_pieces(text)


def tool_reply_pieces(contents: Sequence[str]) -> Pieces:
    """Appended after a generated `<|im_end|>`: the tool results as one user turn, then the next
    assistant header."""
    return FLYWHEEL.tool_reply_pieces(contents)


def render_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = False) -> str:
    """The same text as CHAT_TEMPLATE, in Python (tests check the two agree)."""
    return FLYWHEEL.render(messages, tools, add_generation_prompt)


def render_turns(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                 add_generation_prompt: bool = False) -> list[str]:
    """`render_messages` as its turns: each piece starts with <|im_start|>, and they join to the whole.

    Because a tokenizer splits on special tokens before anything else, the pieces can be tokenized
    one by one (and cached: the server tokenizes the long tools prompt once) with the same ids."""
    return [joined(turn) for turn in turn_pieces(messages, tools, add_generation_prompt)]


def turn_pieces(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                add_generation_prompt: bool = False) -> list[Pieces]:
    return FLYWHEEL.turn_pieces(messages, tools, add_generation_prompt)


_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL)


def parse_assistant(text: str, call_id_prefix: str = "call",
                    schemas: Mapping[str, dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
    """Split generated assistant text into its prose and its tool calls (valid or not).

    Calls are validated against `schemas` (by name), by default the agent's own tools."""
    return FLYWHEEL.parse(text, call_id_prefix, schemas)


def parse_call(body: str, call_id: str, schemas: Mapping[str, dict[str, Any]] | None = None,
               arguments_key: str = "arguments") -> ToolCall:
    """One call's JSON `{"name": ..., arguments_key: {...}}` as a ToolCall, invalid with the reason."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(call_id, "?", {}, error=f"bad JSON in tool call: {exc.msg} at char {exc.pos}")
    except ValueError as exc:  # an integer past Python's int-string conversion limit (4,300 digits)
        return ToolCall(call_id, "?", {}, error=f"bad JSON in tool call: {exc}")
    return call_from_payload(payload, call_id, schemas, arguments_key)


def call_from_payload(payload: Any, call_id: str, schemas: Mapping[str, dict[str, Any]] | None = None,
                      arguments_key: str = "arguments") -> ToolCall:
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(call_id, "?", {},
                        error=f'a tool call must be {{"name": ..., "{arguments_key}": {{...}}}}')
    name, arguments = payload["name"], payload.get(arguments_key, payload.get("arguments", {}))
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except ValueError:  # not JSON (JSONDecodeError), or an integer past int()'s 4,300 digits
            return ToolCall(call_id, name, {}, error="arguments is a string that is not JSON")
    error = validate_arguments(name, arguments, schemas)
    return ToolCall(call_id, name, arguments if isinstance(arguments, dict) else {}, error=error)


def openai_tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
