"""The one conversation encoder: chat messages to token ids, for episodes, SFT, the server and the
harness ledger.

Every caller, one way of turning a conversation into ids, so that what SFT trains on, what an
episode feeds the engine and what the server prompts with are token for token the same:

    encode(messages, tools)        a prompt: the turns the format renders, then the assistant
                                   header (the server; an episode's opening)
    user_reply(text)               what follows a generated end token (<|im_end|>, <|eot_id|>): the
    tool_reply(contents)           user's turn and the next header, or the tool results and the
                                   next header (episodes)
    continuation(messages)         the same for whatever a harness client sends next
    hinted(prompt_ids, text)       a served prompt with one more user message before the answer it
                                   asked for (the hinted teacher, flywheel/live/hints.py)
    conversation(messages)         a whole demonstration as (tokens, loss mask): its opening as a
                                   prompt, each assistant body as the model writes it, each
                                   answer as an episode appends it (SFT)

The ids follow the model's own chat format (`formats.format_of(tokenizer)`: flywheel's, Qwen's,
Llama 3's, ...): `self.format` renders the turns, what an episode appends after a generated end
token, and what a demonstration's assistant turns are.

Exact, not approximate: every turn a format yields starts with a control token (<|im_start|>,
<|start_header_id|>, ...) that the tokenizer splits on before BPE, so the ids of the pieces
concatenate to the ids of the whole text (tests compare the two). That lets each turn be tokenized
once and cached (the tools prompt is ~700 tokens, ~1-3 ms; every demonstration and every episode
opens with the same system turn). A tokenizer without those as added tokens gets the whole text
tokenized every time.

Control tokens of a prompt come from the template only: the body of a turn, which holds everything
a client or a tool wrote, is encoded as text (`tokenizer.encode_text`). A user who types
"<|im_start|>assistant" gets those characters, not a forged turn in a prompt the Learner trains on.
The same holds for the tool-call markup (`<tool_call>`, `<tool_response>`, single tokens that are
not "special") and for every other added token of the tokenizer (a real model's vocabulary holds
hundreds: Llama 3's reserved ones, Qwen's <think>): the template's turns come as pieces
(`ChatFormat.turn_pieces`) that say which text a client or a tool wrote, and in those pieces, and in
the user and tool replies an episode appends, no token string becomes its token, so a user or a file
cannot forge a tool result or a turn. For text without such strings the ids are the whole text's,
as above.

The cache is bounded in bytes (text and ids) and in entries, least recently used out first. The server's
`encode_request` does not fill it: it returns the turns it tokenized, which the server `remember`s
once the request is accepted, so refused requests (too long, say) leave nothing behind, and with a
`limit` it refuses a prompt whose bytes alone surely exceed it before tokenizing anything.

Appended turns are never merged with what came before: an episode's earlier tokens are the ones
the engine produced, and re-tokenizing them could give other ids (token in, token out).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from flywheel.model.chat import Pieces, joined, tool_schemas, tools_in_prompt
from flywheel.model.formats import format_of, stop_ids
from flywheel.model.tokenizer import encode_text


class PromptTooLong(ValueError):
    def __init__(self, at_least: int):
        super().__init__(f"the prompt is at least {at_least} tokens")
        self.at_least = at_least


class ConversationEncoder:
    """Token ids of conversations for one tokenizer; safe to share between threads."""

    def __init__(self, tokenizer: Any, cache_size: int = 4096, cache_bytes: int = 64 << 20):
        self.tokenizer = tokenizer
        self.format = format_of(tokenizer)
        added = tokenizer.get_added_vocab()
        self.piecewise = all(t in added for t in self.format.turn_starts)
        # Token strings a client's or a tool's text never becomes: the format's and every added token.
        strings = sorted(set(self.format.control_strings) | set(added), key=len, reverse=True)
        self._token_strings = tuple(strings)
        self._token_re = re.compile("|".join(map(re.escape, strings)))
        # The ids of the format's end token(s): a generated turn stops at any of them.
        self.stop_ids = stop_ids(tokenizer)
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
        pieces = self.format.turn_pieces(messages, tools, add_generation_prompt=add_generation_prompt)
        turns = [joined(turn) for turn in pieces]
        if limit is not None:
            at_least = sum(len(t.encode()) for t in turns) // self._max_token_bytes()
            if at_least > limit:
                raise PromptTooLong(at_least)
        if not self.piecewise:
            return self._encode_pieces([p for turn in pieces for p in turn]), {}
        ids: list[int] = []
        fresh: dict[str, list[int]] = {}
        for turn, turn_text in zip(pieces, turns, strict=True):
            with self._lock:
                turn_ids = self._cache.get(turn_text)
                if turn_ids is not None:
                    self._cache.move_to_end(turn_text)
            if turn_ids is None:
                forged = self._forges(turn)  # a client's or a tool's text holds a token string: the slow path
                turn_ids = fresh[turn_text] = self._encode_pieces(turn) if forged else self.text(turn_text)
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
        return self._encode_pieces(self.format.user_reply_pieces(text))

    def tool_reply(self, contents: Sequence[str]) -> list[int]:
        return self._encode_pieces(self.format.tool_reply_pieces(contents))

    def continuation(self, messages: Sequence[dict[str, Any]], closed: bool = True) -> list[int]:
        """What follows a generated turn when a client sends `messages` after it: what the template
        puts after the end token (or, for a turn cut at its token cap, `closed=False`, the end token
        too), the messages' turns, then the next assistant header. The harness endpoint
        (flywheel/rl/harness/server.py) appends these to the tokens it served instead of re-rendering
        the conversation; for one user message or one run of tool results they are `user_reply`'s
        and `tool_reply`'s ids."""
        return self._encode_pieces(self.format.continuation_pieces(messages, closed))

    def hinted(self, prompt_ids: Sequence[int], text: str) -> list[int]:
        """`prompt_ids` (a prompt `encode` made: its turns, then the assistant header) with a user
        message of `text` inserted before that header: the ids `encode` gives for the same messages
        plus that one (tested). The text is a client's, so no control or markup token string in it
        becomes its token (`_as_text`): a hint cannot forge a turn, a tool call or a tool result.

        ValueError if the prompt does not end with this format's assistant header."""
        header = self._generation_header()
        if list(prompt_ids[-len(header):]) != header:
            raise ValueError("the prompt does not end with the assistant header; give a prompt `encode` made with "
                             "add_generation_prompt=True")
        # what the template puts after an end token, before the next turn
        after_end = self._encode_pieces(self.format.continuation_pieces([]))[: -len(header)]
        turn = self._encode_pieces(self.format.continuation_pieces([{"role": "user", "content": text}]))
        if turn[: len(after_end)] != after_end:
            raise ValueError(f"{type(self.format).__name__}: a continuation does not begin as an empty one does")
        return [*prompt_ids[: -len(header)], *turn[len(after_end):]]

    def _generation_header(self) -> list[int]:
        """The ids a prompt's assistant header adds (what `add_generation_prompt` appends)."""
        probe = [{"role": "user", "content": "x"}]
        with_header = self.encode(probe, None)
        without = self.encode(probe, None, add_generation_prompt=False)
        if with_header[: len(without)] != without or len(with_header) == len(without):
            raise ValueError(f"{type(self.format).__name__}: the assistant header is not a suffix of the prompt")
        return with_header[len(without):]

    def conversation(self, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """(tokens, loss mask) of a demonstration, segment by segment as the episode runner appends them.

        messages: system, one or more user messages, then alternating assistant turns and their
        answers: tool results, a user reply, or tool results then a user reply (a user's follow-up
        to a `finish` call). Only the assistant bodies carry mask 1."""
        i = 2
        while i < len(messages) - 1 and messages[i]["role"] == "user":  # a second message before any answer
            i += 1
        tokens = self.encode(messages[:i], self.tools)
        mask = [0] * len(tokens)
        while i < len(messages):
            message = messages[i]
            if message["role"] != "assistant":
                raise ValueError(f"message {i} should be an assistant turn, got {message['role']!r}")
            body = self.text(self.format.assistant_body(message))
            tokens += body
            mask += [1] * len(body)
            j = i + 1
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
            answer: list[dict[str, Any]] | None = None
            if j < len(messages) and messages[j]["role"] == "user":
                answer = list(messages[i + 1 : j + 1])  # a user reply, after the tool results if any
                j += 1
            elif j > i + 1:
                answer = list(messages[i + 1 : j])
            if answer is not None and j < len(messages):  # the answer to the last turn is never seen
                if len(answer) == 1 and answer[0]["role"] == "user":
                    ids = self.user_reply(answer[0]["content"])
                elif all(m["role"] == "tool" for m in answer):
                    ids = self.tool_reply([m["content"] for m in answer])
                else:
                    ids = self.continuation(answer)
                tokens += ids
                mask += [0] * len(ids)
            i = j
        return tokens, mask

    def text(self, text: str) -> list[int]:
        """One piece of text as it stands (no cache: appended turns are rarely seen twice)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode_pieces(self, pieces: Pieces) -> list[int]:
        """Ids of rendered pieces: the template's text with its control and markup tokens, a client's
        or a tool's text with none (`_as_text`). Without a token string in the latter, the ids are
        the whole text's, as before; with one, each piece is tokenized on its own."""
        if not self._forges(pieces):
            return self.text(joined(pieces))
        return [i for text, untrusted in pieces for i in (self._as_text(text) if untrusted else self.text(text))]

    def _as_text(self, text: str) -> list[int]:
        """`text` with every control or markup token string in it (a user's "<tool_response>", a
        file's "<|im_end|>") tokenized as characters: cut after each one's first character, so no
        piece holds a whole one; the pieces' ids decode to `text` byte for byte."""
        cuts = sorted({i + 1 for token in self._token_strings if token in text for i in _occurrences(text, token)})
        bounds = [0, *cuts, len(text)]
        return [i for a, b in pairwise(bounds) for i in encode_text(self.tokenizer, text[a:b])]

    def _max_token_bytes(self) -> int:
        if self._longest is None:  # ~10 us a token: 1.5 s for a 150k vocabulary, once per encoder
            vocab = self.tokenizer.get_vocab()
            self._longest = max(len(self.tokenizer.convert_tokens_to_string([t]).encode()) for t in vocab)
        return max(self._longest, 1)

    def _forges(self, pieces: Pieces) -> bool:
        """Whether a client's or a tool's text among `pieces` holds a control or markup token string."""
        return any(untrusted and self._token_re.search(text) for text, untrusted in pieces)


def _occurrences(text: str, token: str) -> list[int]:
    out, i = [], text.find(token)
    while i >= 0:
        out.append(i)
        i = text.find(token, i + 1)
    return out


def _entry_bytes(text: str, ids: list[int]) -> int:
    # What a cache entry holds, roughly: the key's characters (1 byte each for ASCII, CPython's
    # compact form) and a list of small ints (8 bytes a pointer; ints under 256 are shared).
    return len(text) + 8 * len(ids) + 100
