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

Control tokens of a prompt come from the template only: each turn is `<|im_start|>` + body
(+ `<|im_end|>` + "\\n"), and only those ends are encoded as control tokens; the body, which holds
everything a client or a tool wrote, is encoded as text (`tokenizer.encode_text`). A user who types
"<|im_start|>assistant" gets those characters, not a forged turn in a prompt the Learner trains on.
For bodies without control-token strings the ids are the whole text's, as above.

The cache is bounded in bytes (text and ids) and in entries, least recently used out first. The server's
`encode_request` does not fill it: it returns the turns it tokenized, which the server `remember`s
once the request is accepted, so refused requests (too long, say) leave nothing behind, and with a
`limit` it refuses a prompt whose bytes alone surely exceed it before tokenizing anything.

Appended turns are never merged with what came before: an episode's earlier tokens are the ones
the engine produced, and re-tokenizing them could give other ids (token in, token out).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from flywheel.model.chat import (
    IM_END,
    IM_START,
    render_assistant_body,
    render_tool_reply,
    render_turns,
    render_user_reply,
    tool_schemas,
    tools_in_prompt,
)
from flywheel.model.tokenizer import encode_text


class PromptTooLong(ValueError):
    def __init__(self, at_least: int):
        super().__init__(f"the prompt is at least {at_least} tokens")
        self.at_least = at_least


class ConversationEncoder:
    """Token ids of conversations for one tokenizer; safe to share between threads."""

    def __init__(self, tokenizer: Any, cache_size: int = 4096, cache_bytes: int = 64 << 20):
        self.tokenizer = tokenizer
        self.piecewise = IM_START in tokenizer.get_added_vocab()
        if self.piecewise:
            self._start, self._end = tokenizer.convert_tokens_to_ids([IM_START, IM_END])
        # The tool schemas this tokenizer's model reads in its prompts (None: it was trained without).
        self.tools = tool_schemas() if tools_in_prompt(tokenizer) else None
        self._cache: OrderedDict[str, list[int]] = OrderedDict()  # least recently used first
        self._cache_size, self._cache_bytes, self.cached_bytes = cache_size, cache_bytes, 0
        self._longest: int | None = None  # bytes of the vocabulary's longest token
        self._lock = threading.Lock()

    def encode(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
               add_generation_prompt: bool = True) -> list[int]:
        """The prompt of `messages` with exactly the `tools` given (pass `self.tools` for this model's own)."""
        ids, fresh = self.encode_request(messages, tools, add_generation_prompt=add_generation_prompt)
        self.remember(fresh)
        return ids

    def encode_request(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                       limit: int | None = None, add_generation_prompt: bool = True
                       ) -> tuple[list[int], dict[str, list[int]]]:
        """(prompt ids, the turns tokenized now and not cached: `remember` them if the request is served).

        PromptTooLong, before any tokenization, if the text is surely more than `limit` tokens: no
        token is longer than the vocabulary's longest, so bytes / that length bounds the count from
        below (20 bytes for the tiny test tokenizer: a 4 MB prompt is refused in ms, not after 40 s)."""
        turns = render_turns(messages, tools, add_generation_prompt=add_generation_prompt)
        if limit is not None:
            at_least = sum(len(t.encode()) for t in turns) // self._max_token_bytes()
            if at_least > limit:
                raise PromptTooLong(at_least)
        if not self.piecewise:
            return self.text("".join(turns)), {}
        ids: list[int] = []
        fresh: dict[str, list[int]] = {}
        for turn in turns:
            with self._lock:
                turn_ids = self._cache.get(turn)
                if turn_ids is not None:
                    self._cache.move_to_end(turn)
            if turn_ids is None:
                turn_ids = fresh[turn] = self._encode_turn(turn)
            ids += turn_ids
        return ids, fresh

    def remember(self, turns: dict[str, list[int]]) -> None:
        for text, ids in turns.items():
            size = _entry_bytes(text, ids)
            if size > self._cache_bytes // 8:  # one huge turn would evict everything else for one reuse
                continue
            with self._lock:
                if text in self._cache:
                    continue
                self._cache[text] = ids
                self.cached_bytes += size
                while self.cached_bytes > self._cache_bytes or len(self._cache) > self._cache_size:
                    old_text, old_ids = self._cache.popitem(last=False)
                    self.cached_bytes -= _entry_bytes(old_text, old_ids)

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

    def _max_token_bytes(self) -> int:
        if self._longest is None:  # ~10 us a token: 1.5 s for a 150k vocabulary, once per encoder
            vocab = self.tokenizer.get_vocab()
            self._longest = max(len(self.tokenizer.convert_tokens_to_string([t]).encode()) for t in vocab)
        return max(self._longest, 1)

    def _encode_turn(self, turn: str) -> list[int]:
        if not turn.startswith(IM_START):
            raise ValueError(f"a rendered turn does not start with {IM_START}: {turn[:40]!r}")
        tail = IM_END + "\n"
        if turn.endswith(tail):
            return [self._start, *encode_text(self.tokenizer, turn[len(IM_START):-len(tail)]), self._end,
                    *encode_text(self.tokenizer, "\n")]
        return [self._start, *encode_text(self.tokenizer, turn[len(IM_START):])]  # the generation prompt


def _entry_bytes(text: str, ids: list[int]) -> int:
    # What a cache entry holds, roughly: the key's characters (1 byte each for ASCII, CPython's
    # compact form) and a list of small ints (8 bytes a pointer; ints under 256 are shared).
    return len(text) + 8 * len(ids) + 100
