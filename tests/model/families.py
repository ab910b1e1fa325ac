"""Tokenizers and tiny models of real model families, built here from their chat templates
(tests/model/fixtures/chat_templates) and configs: no download.

`family_tokenizer(name)` is a byte-level BPE trained on a small corpus, with the family's control
tokens as added tokens (special where the real tokenizer has them special, the Hermes markup and
Qwen's <think> as plain added tokens, as in Qwen's) and the family's real template.
`tiny_model(tokenizer, architecture)` is a randomly initialized model of that architecture
(llama, qwen2, qwen3) small enough for a CPU test.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

from flywheel.model.chat import SYSTEM_PROMPT, render_messages, tool_schemas

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HERMES_MARKUP = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
          "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_0|>"]
FAMILIES = {
    # name: (template file, special tokens, plain added tokens, eos, bos)
    "qwen2.5": ("qwen2.5.jinja", CHATML, HERMES_MARKUP, "<|im_end|>", None),
    "qwen3": ("qwen3.jinja", CHATML, [*HERMES_MARKUP, "<think>", "</think>"], "<|im_end|>", None),
    "llama3": ("llama3.1.jinja", LLAMA3, [], "<|eot_id|>", "<|begin_of_text|>"),
    "smollm2": ("smollm2.jinja", [*CHATML, "<repo_name>", "<file_sep>"], [], "<|im_end|>", "<|im_start|>"),
}
OPENING = [{"role": "system", "content": SYSTEM_PROMPT},
           {"role": "user", "content": "Fix the failing test in pkg/core.py, please."}]
CORPUS = [render_messages(OPENING, tool_schemas()),
          "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n", '{"name": "read_file", "parameters": {}}']


def family_tokenizer(name: str, vocab_size: int = 700) -> PreTrainedTokenizerFast:
    template, special, plain, eos, bos = FAMILIES[name]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS * 10, trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, bos_token=bos, pad_token=special[0],
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    return tokenizer


def tiny_model(tokenizer, architecture: str = "llama", seed: int = 0):
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[architecture](**shape)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
