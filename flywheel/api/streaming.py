"""Server-sent events of a streamed chat completion, as OpenAI's clients read them.

    data: {chat.completion.chunk}\n\n   ... one per delta: the role, content, each tool call, the finish
    data: {... "choices": [], "usage"}  when the request set stream_options.include_usage
    data: [DONE]\n\n

`sse` frames one chunk, `DONE` ends the stream. `stream_message` streams an answer that is already
whole (the harness server answers each turn at once); the live server streams tokens as the engine
samples them and frames each chunk with `sse` (flywheel/live/openai_routes.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

DONE = b"data: [DONE]\n\n"


def sse(chunk: dict[str, Any]) -> bytes:
    """One server-sent event holding `chunk` as JSON."""
    return f"data: {json.dumps(chunk)}\n\n".encode()


def stream_message(head: dict[str, Any], message: dict[str, Any], finish: str, logprobs: dict[str, Any] | None,
                   usage: dict[str, int] | None) -> Iterator[bytes]:
    """A whole assistant `message` as a stream: the role, its content, each tool call, the finish
    reason, the usage when given, [DONE]. `head`: the fields every chunk carries (id, model, ...)."""
    base = {**head, "object": "chat.completion.chunk"}

    def event(delta: dict[str, Any], finish_reason: str | None = None, lp: dict[str, Any] | None = None) -> bytes:
        return sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]})

    yield event({"role": "assistant", "content": ""})
    if message["content"] or logprobs is not None:
        yield event({"content": message["content"] or ""}, lp=logprobs)
    for i, call in enumerate(message.get("tool_calls", [])):
        yield event({"tool_calls": [{"index": i, **call}]})
    yield event({}, finish)
    if usage is not None:
        yield sse({**base, "choices": [], "usage": usage})
    yield DONE
