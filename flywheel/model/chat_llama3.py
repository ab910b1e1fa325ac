"""The Llama 3.x chat format: header-delimited turns, a tool call as the JSON body of an assistant turn.

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n
    Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n{system}<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, ... {schemas} {task}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "grep", "parameters": {...}}<|eot_id|>
    <|start_header_id|>ipython<|end_header_id|>\\n\\n"...the result, as a JSON string..."<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n

As Meta's template for Llama 3.1/3.2/3.3 writes it (tests/fixtures/chat_templates/llama3.1.jinja):
the tools go into the first user turn (`tools_in_user_message`, the template's default), each
schema as JSON indented by 4; message text is trimmed; a tool result is written as a JSON string
(the template's `content is iterable` holds for a string). The date is the template's own default
(`date_string`), pinned, so a prompt does not change with the day it is rendered on; Llama 3.2's
template would otherwise put today's date there.

Departures, where the template cannot say what flywheel's agent does: the template refuses more
than one call per assistant turn; flywheel writes several as one JSON object per line, and parses
them back the same way. An assistant turn that calls tools is only its calls (the template drops
the prose of such a turn, and so does `assistant_body`). A body is read as calls when it starts with
"{" (after an optional <|python_tag|>); anything else is prose.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from flywheel.env.toolspec import ToolCall
from flywheel.model.chat import ChatFormat, Pieces, arguments_text, call_from_payload

BEGIN, START_HEADER, END_HEADER = "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"
EOT, EOM, PYTHON_TAG, END_OF_TEXT = "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|end_of_text|>"
LLAMA3_TOKENS = (BEGIN, START_HEADER, END_HEADER, EOT, EOM, PYTHON_TAG, END_OF_TEXT)
DATE = "26 Jul 2024"  # the template's own default `date_string`
TOOLS_PREAMBLE = ("Given the following functions, please respond with a JSON for a function call with its proper "
                  "arguments that best answers the given prompt.\n\n"
                  'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
                  'value}.Do not use variables.\n\n')


def header(role: str) -> str:
    return f"{START_HEADER}{role}{END_HEADER}\n\n"


@dataclass(frozen=True)
class Llama3Format(ChatFormat):
    name: str = "llama3"
    family: Literal["llama3"] = "llama3"
    tools_source: Literal["template", "flywheel"] = "template"
    end_token: str = EOT
    stop_tokens: tuple[str, ...] = (EOT, EOM)
    turn_starts: tuple[str, ...] = (BEGIN, START_HEADER)
    control_strings: tuple[str, ...] = LLAMA3_TOKENS

    def template_kwargs(self) -> dict[str, Any]:
        return {"date_string": DATE}

    def turn_pieces(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = False) -> list[Pieces]:
        messages = list(messages)
        system: str = ""
        if messages and messages[0]["role"] == "system":
            system = messages.pop(0)["content"]
        opening: Pieces = [(BEGIN + header("system") + ("Environment: ipython\n" if tools else "")
                            + f"Cutting Knowledge Date: December 2023\nToday Date: {DATE}\n\n", False)]
        out = [opening + ([(system.strip(), True)] if system.strip() else []) + [(EOT, False)]]
        if tools:
            if not messages:
                raise ValueError("the Llama 3 format lists the tools in the first user message; the conversation has "
                                 "none")
            first = messages.pop(0)["content"].strip()
            schemas = "".join(json.dumps(t, ensure_ascii=False, indent=4) + "\n\n" for t in tools)
            out.append([(header("user") + TOOLS_PREAMBLE + schemas, False), (first, True), (EOT, False)])
        out += [self._message_pieces(m) for m in messages]
        if add_generation_prompt:
            out.append([(header("assistant"), False)])
        return out

    def _message_pieces(self, m: dict[str, Any]) -> Pieces:
        role = m["role"]
        if role == "assistant":
            return [(header("assistant") + self.assistant_body(m), False)]
        if role == "tool":
            return [(header("ipython"), False), (json.dumps(m["content"], ensure_ascii=False), True), (EOT, False)]
        if role not in ("user", "system"):
            raise ValueError(f"unknown message role {role!r}; expected system, user, assistant or tool")
        return [(header(role), False), (m["content"].strip(), True), (EOT, False)]

    def render_tool_call(self, call: dict[str, Any]) -> str:
        name = call["function"]["name"]
        return f'{{"name": "{name}", "parameters": {arguments_text(call["function"]["arguments"])}}}'

    def assistant_body(self, message: dict[str, Any]) -> str:
        calls = message.get("tool_calls") or []
        if calls:
            return "\n".join(self.render_tool_call(c) for c in calls) + EOT
        return (message.get("content") or "").strip() + EOT

    def user_reply_pieces(self, text: str) -> Pieces:
        return [(header("user"), False), (text.strip(), True), (EOT + header("assistant"), False)]

    def tool_reply_pieces(self, contents: Sequence[str]) -> Pieces:
        pieces: Pieces = []
        for c in contents:
            pieces += self._message_pieces({"role": "tool", "content": c})
        return pieces + [(header("assistant"), False)]

    def continuation_pieces(self, messages: Sequence[dict[str, Any]], closed: bool = True) -> Pieces:
        head: Pieces = [] if closed else [(EOT, False)]
        return head + [p for m in messages for p in self._message_pieces(m)] + [(header("assistant"), False)]

    def parse(self, text: str, call_id_prefix: str = "call",
              schemas: Mapping[str, dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
        text = self.strip_end(text)
        pieces = self._call_pieces(text)
        if pieces is None:
            return text, []
        calls = []
        for i, (_, payload, error) in enumerate(pieces):
            call_id = f"{call_id_prefix}_{i}"
            calls.append(ToolCall(call_id, "?", {}, error=error) if error is not None
                         else call_from_payload(payload, call_id, schemas, arguments_key="parameters"))
        return "", calls

    def call_texts(self, text: str) -> list[str]:
        return [piece for piece, _, _ in self._call_pieces(self.strip_end(text)) or []]

    @staticmethod
    def _call_pieces(text: str) -> list[tuple[str, Any, str | None]] | None:
        """The JSON objects of a turn of tool calls, each as (its text, its value, why it does not
        parse or None); None when the turn is prose. A piece that does not parse ends the list."""
        body = text.strip().removeprefix(PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return None
        decoder, pieces, at = json.JSONDecoder(), [], 0
        while at < len(body):
            start = at
            try:
                payload, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError as exc:
                pieces.append((body[start:], None, f"bad JSON in tool call: {exc.msg} at char {exc.pos}"))
                break
            except ValueError as exc:  # an integer past Python's int-string conversion limit (4,300 digits)
                pieces.append((body[start:], None, f"bad JSON in tool call: {exc}"))
                break
            pieces.append((body[start:at], payload, None))
            while at < len(body) and body[at] in " \t\n;":
                at += 1
        return pieces

    def forced_call(self, name: str | None) -> str:
        return '{"name": "' if name is None else f'{{"name": "{name}", "parameters": '

    def visible_content(self, text: str) -> str:
        text = self.strip_end(text)
        stripped = text.strip()
        return "" if not stripped or stripped.startswith(("{", PYTHON_TAG)) else text
