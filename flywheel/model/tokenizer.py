"""The tokenizer of the embedded default: byte-level BPE trained locally on the task families.

It is saved as a `PreTrainedTokenizerFast` with the ChatML special tokens, the tool-call markup as
single tokens and the chat template, so it behaves like a Qwen tokenizer: `apply_chat_template`
renders our format, and a real Qwen3-Coder tokenizer can take its place without code changes.
Byte-level means every string round-trips exactly; nothing maps to an unknown token.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from flywheel.model.chat import (
    CHAT_TEMPLATE,
    CHAT_TEMPLATE_NO_TOOLS,
    END_OF_TEXT,
    IM_END,
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    TOOLS_IN_PROMPT,
)


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 4096,
                    tools_in_prompt: bool = True) -> PreTrainedTokenizerFast:
    """Train BPE on `corpus` (an iterable of documents). Deterministic for the same corpus.

    tools_in_prompt: whether the model's prompts list the tool schemas (`chat.tools_in_prompt`);
    saved with the tokenizer, and its chat template follows it."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.init_kwargs[TOOLS_IN_PROMPT] = tools_in_prompt
    tokenizer.chat_template = CHAT_TEMPLATE if tools_in_prompt else CHAT_TEMPLATE_NO_TOOLS
    return tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Any HF tokenizer directory; ours, or a real model's with its own chat template."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.chat_template is None:
        raise ValueError(f"tokenizer at {path} has no chat template; flywheel needs one to render episodes")
    return tokenizer


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The ids of `text` as text: a special token's string in it ("<|im_start|>" typed by a user) is
    tokenized as the characters it is, never as the control token. The tool-call markup is no special
    token and still becomes its single token (a client's earlier assistant turns render with it)."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
