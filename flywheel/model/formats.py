"""Which chat format a model speaks, decided from its own chat template and recorded on its tokenizer.

    format_of(tokenizer)      the recorded format (tokenizer_config.json's `flywheel_chat_format`),
                              or, for a tokenizer without one, the format detected and recorded now
    record_format(tokenizer)  detect, refuse a template no format renders, record (`flywheel model import`)

Detection renders probe conversations (flywheel's own tools; a system prompt or none; a tool call
and its result; a user's follow-up) with the model's Jinja template and with each candidate format
in Python, and takes the first candidate that renders every probe to the same text:

    flywheel   flywheel's own (the embedded default's CHAT_TEMPLATE)
    qwen2.5    ChatML + Hermes <tool_call>, Qwen2.5's tools header and default system prompt
    qwen3      the same with Qwen3's header (no default system prompt)
    llama3     Llama 3.1-3.3: JSON tool calls, tools in the first user message
    chatml     a ChatML template without tools (SmolLM2's): the probes without tools must agree;
               flywheel's tools header is added to the system turn and tool calls are Hermes-style,
               which the record says (`tools_source = "flywheel"`)

A template none of them matches is refused with each family's first difference, so the fix (a
template of a known family, `flywheel model import --chat-template FILE`) is a reading away. The
default system prompt a ChatML template writes when a conversation has none (SmolLM2's,
Qwen2.5's) is read from the template by rendering a conversation without one.

Only the probes' text is compared; where a template rewrites what a model wrote (Qwen3 drops the
reasoning of earlier turns), flywheel keeps the tokens as sampled (flywheel/model/chat.py).
"""

from __future__ import annotations

from typing import Any

from flywheel.model.chat import (
    CHAT_TEMPLATE,
    CHAT_TEMPLATE_NO_TOOLS,
    FLYWHEEL,
    FLYWHEEL_TOOLS_INTRO,
    IM_END,
    IM_START,
    SYSTEM_PROMPT,
    ChatFormat,
    HermesFormat,
    tool_schemas,
)
from flywheel.model.chat_llama3 import Llama3Format

FORMAT_KEY = "flywheel_chat_format"  # the record on the tokenizer, saved in tokenizer_config.json

QWEN_TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
QWEN_TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
                    '"arguments": <args-json-object>}\n</tool_call>')


def candidates(default_system: str | None) -> list[ChatFormat]:
    """The formats a template is matched against, in order; `default_system` as read from it."""
    return [
        FLYWHEEL,
        HermesFormat(name="qwen2.5", tools_intro=QWEN_TOOLS_INTRO, tools_outro=QWEN_TOOLS_OUTRO,
                     default_system=default_system),
        HermesFormat(name="qwen3", tools_intro=QWEN_TOOLS_INTRO, tools_outro=QWEN_TOOLS_OUTRO,
                     default_system=default_system, tools_lead="none"),
        Llama3Format(),
        HermesFormat(name="chatml", tools_intro=FLYWHEEL_TOOLS_INTRO, tools_outro="\n</tools>",
                     default_system=default_system, tools_source="flywheel"),
    ]


class UnknownChatFormat(ValueError):
    """A chat template no format renders the way it does; the message says where each one differs."""


def format_from_record(record: dict[str, Any]) -> ChatFormat:
    """The format a record (`ChatFormat.record()`) names."""
    name = record.get("name")
    for candidate in candidates(record.get("default_system")):
        if candidate.name == name:
            return candidate
    raise UnknownChatFormat(f"the recorded chat format {name!r} is not one this flywheel knows "
                            f"({', '.join(c.name for c in candidates(None))}); re-import the model")


def format_of(tokenizer: Any) -> ChatFormat:
    """The chat format of `tokenizer`'s model: recorded, or detected and recorded on it now."""
    kwargs = getattr(tokenizer, "init_kwargs", {})
    record = kwargs.get(FORMAT_KEY)
    if record is not None:
        return format_from_record(record)
    return record_format(tokenizer)


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids of the tokens that end a generated assistant turn in `tokenizer`'s chat format."""
    return tuple(tokenizer.convert_tokens_to_ids(list(format_of(tokenizer).stop_tokens)))


def record_format(tokenizer: Any) -> ChatFormat:
    """Detect the format of `tokenizer`'s template (module docstring), record it on the tokenizer
    (saved with it), and return it. UnknownChatFormat when none matches."""
    chat_format = detect_format(tokenizer)
    tokenizer.init_kwargs[FORMAT_KEY] = chat_format.record()
    return chat_format


def detect_format(tokenizer: Any) -> ChatFormat:
    template = template_text(tokenizer)
    if template in (CHAT_TEMPLATE, CHAT_TEMPLATE_NO_TOOLS):
        return FLYWHEEL  # ours: no probing needed
    default_system = _default_system(tokenizer, template)
    differences = []
    for candidate in candidates(default_system):
        difference = first_difference(tokenizer, template, candidate)
        if difference is None:
            return candidate
        differences.append(f"{candidate.name}: {difference}")
    raise UnknownChatFormat("the model's chat template renders like none of the chat formats flywheel knows, so "
                            "its prompts and tool calls cannot be made token for token: "
                            + "; ".join(differences)
                            + ". Give a template of a known family (--chat-template FILE)")


def template_text(tokenizer: Any) -> str:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the one for tool use, if the model has one
        template = template.get("tool_use") or template.get("default")
    if not template:
        raise UnknownChatFormat("the tokenizer has no chat template; flywheel renders prompts through the model's "
                                "own: pass --chat-template FILE")
    return template


def probes(chat_format: ChatFormat) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """(messages, tools) conversations a template and a format must render alike; only those
    without tools for a format that adds flywheel's header (its template lists none)."""
    tools = tool_schemas(["read_file", "grep"])
    call = {"id": "call_0", "type": "function",
            "function": {"name": "read_file", "arguments": {"path": "pkg/core.py"}}}
    system = {"role": "system", "content": SYSTEM_PROMPT}
    user = {"role": "user", "content": "The test test_clamp fails. Fix it."}
    plain = [
        ([system, user], None),
        ([user], None),
        ([system, user, {"role": "assistant", "content": "Which file?"}, {"role": "user", "content": "core.py"}],
         None),
    ]
    if chat_format.tools_source == "flywheel":
        return plain
    return plain + [
        ([system, user], tools),
        ([user], tools),
        ([system, user, {"role": "assistant", "content": "", "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "call_0", "content": "def clamp(x, lo, hi):\n    return x"}], tools),
    ]


def first_difference(tokenizer: Any, template: str, chat_format: ChatFormat) -> str | None:
    """Where the template's rendering of the probes first differs from `chat_format`'s (None: nowhere)."""
    for messages, tools in probes(chat_format):
        try:
            theirs = _apply(tokenizer, template, messages, tools, chat_format)
        except Exception as exc:  # noqa: BLE001 - a template's own error (raise_exception) is the difference
            return f"the template fails on it ({type(exc).__name__}: {exc})"
        ours = chat_format.render(messages, tools, add_generation_prompt=True)
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b),
                      min(len(theirs), len(ours)))
            return f"at char {at}, the template writes {theirs[at:at + 40]!r}, the format {ours[at:at + 40]!r}"
    if chat_format.tools_source == "flywheel":
        # A template that does list tools, in a way no format knows, is not one without tools.
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix it."}]
        with_tools = _apply(tokenizer, template, messages, tool_schemas(["grep"]), chat_format)
        if with_tools != _apply(tokenizer, template, messages, None, chat_format):
            return "the template lists tools, in a way no known format does"
    return None


def _apply(tokenizer: Any, template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
           chat_format: ChatFormat) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                         add_generation_prompt=True, **chat_format.template_kwargs())


def _default_system(tokenizer: Any, template: str) -> str | None:
    """The system text a ChatML template writes for a conversation without a system message."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template,
                                             tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that needs a system message: it has no default
        return None
    head = f"{IM_START}system\n"
    if not text.startswith(head) or IM_END not in text:
        return None
    return text[len(head):text.index(IM_END)]
