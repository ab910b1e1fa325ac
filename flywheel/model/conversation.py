"""The one conversation encoder: chat messages to token ids, for episodes, SFT and the server.

Three callers, one way of turning a conversation into ids, so that what SFT trains on, what an
episode feeds the engine and what the server prompts with are token for token the same:

    encode(messages, tools)        a prompt: the turns `chat.render_turns` yields, then the
                                   assistant header (the server; an episode's opening)
    user_reply(text)               what follows a generated <|im_end|>: the user's turn and the
    tool_reply(contents)           next header, or the tool results and the next header (episodes)
    conversation(messages)         a whole demonstration as (tokens, loss mask): its opening as a
                                   prompt, each assistant body as the model writes it, each
                                   answer as an episode appends it (SFT)

Exact, not approximate: every turn `render_turns` yields starts with <|im_start|>, an added token
the tokenizer splits on before BPE, so the ids of the pieces concatenate to the ids of the whole
text (tests compare the two). That lets each turn be tokenized once and cached (the tools prompt is
~700 tokens, ~1-3 ms; every demonstration and every episode opens with the same system turn). A
tokenizer without <|im_start|> as an added token gets the whole text tokenized every time.

Appended turns are never merged with what came before: an episode's earlier tokens are the ones
the engine produced, and re-tokenizing them could give other ids (token in, token out).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from flywheel.model.chat import (
    IM_START,
    render_assistant_body,
    render_tool_reply,
    render_turns,
    render_user_reply,
    tool_schemas,
    tools_in_prompt,
)


class ConversationEncoder:
    """Token ids of conversations for one tokenizer; safe to share between threads."""

    def __init__(self, tokenizer: Any, cache_size: int = 4096):
        self.tokenizer = tokenizer
        self.piecewise = IM_START in tokenizer.get_added_vocab()
        # The tool schemas this tokenizer's model reads in its prompts (None: it was trained without).
        self.tools = tool_schemas() if tools_in_prompt(tokenizer) else None
        self._cache: OrderedDict[str, list[int]] = OrderedDict()  # least recently used first
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def encode(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
               add_generation_prompt: bool = True) -> list[int]:
        """The prompt of `messages` with exactly the `tools` given (pass `self.tools` for this model's own)."""
        turns = render_turns(messages, tools, add_generation_prompt=add_generation_prompt)
        if not self.piecewise:
            return self.text("".join(turns))
        ids: list[int] = []
        for turn in turns:
            ids += self._turn(turn)
        return ids

    def user_reply(self, text: str) -> list[int]:
        return self.text(render_user_reply(text))

    def tool_reply(self, contents: Sequence[str]) -> list[int]:
        return self.text(render_tool_reply(contents))

    def conversation(self, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """(tokens, loss mask) of a demonstration, segment by segment as the episode runner appends them.

        messages: system, user, then alternating assistant turns and their answers (tool results or
        a user reply). Only the assistant bodies carry mask 1."""
        tokens = self.encode(messages[:2], self.tools)
        mask = [0] * len(tokens)
        i = 2
        while i < len(messages):
            message = messages[i]
            if message["role"] != "assistant":
                raise ValueError(f"message {i} should be an assistant turn, got {message['role']!r}")
            body = self.text(render_assistant_body(message))
            tokens += body
            mask += [1] * len(body)
            j = i + 1
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
            answer = None
            if j > i + 1:
                answer = [m["content"] for m in messages[i + 1 : j]]
            elif j < len(messages) and messages[j]["role"] == "user":
                answer = messages[j]["content"]
                j += 1
            if answer is not None and j < len(messages):  # the answer to the last turn is never seen
                ids = self.tool_reply(answer) if isinstance(answer, list) else self.user_reply(answer)
                tokens += ids
                mask += [0] * len(ids)
            i = j
        return tokens, mask

    def text(self, text: str) -> list[int]:
        """One piece of text as it stands (no cache: appended turns are rarely seen twice)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _turn(self, text: str) -> list[int]:
        with self._lock:
            ids = self._cache.get(text)
            if ids is not None:
                self._cache.move_to_end(text)
                return ids
        ids = self.text(text)
        with self._lock:
            self._cache[text] = ids
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return ids
