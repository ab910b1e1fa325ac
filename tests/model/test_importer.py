"""`flywheel model import`: a model folder or a GGUF file becomes a Registry version with its own
tokenizer, template and recorded chat format; what cannot be imported is refused, before anything
is written, with the reason. Real files, a real registry, tiny models built from real configs
(tests/model/families.py). The real GGUF (SmolLM2) is imported in tests/test_own_model.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors import safe_open
from transformers import AutoModelForCausalLM, T5Config

from flywheel.cli import main
from flywheel.model.formats import UnknownChatFormat, format_of
from flywheel.model.importer import CannotImport, import_model, inspect_source
from flywheel.model.registry import Registry
from flywheel.model.tokenizer import load_tokenizer
from tests.model.families import family_tokenizer, tiny_model
from tests.model.test_formats import MISTRAL_LIKE


def hf_folder(path, family="qwen2.5", architecture="qwen2", template: str | None = "keep"):
    tokenizer = family_tokenizer(family)
    if template != "keep":
        tokenizer.chat_template = template
    model = tiny_model(tokenizer, architecture)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_a_model_folder_becomes_a_version_with_its_tokenizer_template_and_format(tmp_path):
    model, tokenizer = hf_folder(tmp_path / "src")
    with Registry(tmp_path / "registry") as registry:
        checkpoint = import_model(tmp_path / "src", registry, aliases=["production"], log=lambda _: None)
        info = registry.info(checkpoint.version)
    assert checkpoint.version == 0 and checkpoint.aliases == ["production"] and checkpoint.base is None
    assert info["source"]["kind"] == "hf" and info["source"]["architecture"] == "qwen2"
    assert info["chat_format"]["name"] == "qwen2.5" and info["chat_format"]["tools_source"] == "template"
    # A plain HF folder: loads without flywheel, same weights, same tokenizer and template.
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint.path)
    ids = tokenizer("def clamp(x, lo, hi):", add_special_tokens=False)["input_ids"]
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    reloaded = load_tokenizer(checkpoint.path)
    assert reloaded.chat_template == tokenizer.chat_template
    assert format_of(reloaded).name == "qwen2.5"


def test_dtype_is_what_was_asked(tmp_path):
    hf_folder(tmp_path / "src", "llama3", "llama")
    with Registry(tmp_path / "registry") as registry:
        checkpoint = import_model(tmp_path / "src", registry, dtype="bfloat16", log=lambda _: None)
    with safe_open(checkpoint.path / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}  # noqa: SIM118
    assert registry_format(tmp_path, checkpoint.version) == "llama3"


def registry_format(root, version) -> str:
    with Registry(root / "registry") as registry:
        return registry.info(version)["chat_format"]["name"]


def test_a_model_without_a_chat_template_is_refused_unless_one_is_given(tmp_path):
    hf_folder(tmp_path / "src", template=None)
    with Registry(tmp_path / "registry") as registry:
        with pytest.raises(CannotImport, match="has no chat template.*--chat-template"):
            import_model(tmp_path / "src", registry, log=lambda _: None)
        assert registry.list() == []
        template = family_tokenizer("qwen3").chat_template
        checkpoint = import_model(tmp_path / "src", registry, chat_template=template, log=lambda _: None)
        assert registry.info(checkpoint.version)["chat_format"]["name"] == "qwen3"


def test_a_template_no_format_renders_is_refused_and_nothing_is_registered(tmp_path):
    hf_folder(tmp_path / "src", template=MISTRAL_LIKE)
    with Registry(tmp_path / "registry") as registry:
        with pytest.raises(UnknownChatFormat, match="renders like none"):
            import_model(tmp_path / "src", registry, log=lambda _: None)
        assert registry.list() == []


def write_config(path, config: dict) -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change,reason", [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantized for inference \\(gptq\\)"),
    ({"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}, "needs its own modelling code"),
])
def test_a_folder_quantized_or_with_its_own_code_is_refused_with_the_reason(tmp_path, change, reason):
    hf_folder(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CannotImport, match=reason):
        inspect_source(tmp_path / "src")


def test_an_architecture_that_is_no_causal_lm_is_refused(tmp_path):
    write_config(tmp_path / "t5", T5Config(d_model=32, num_layers=1).to_dict())
    with pytest.raises(CannotImport, match="architecture 't5'.*not a causal language model"):
        inspect_source(tmp_path / "t5")


def write_gguf(path, architecture: str, tensor_type: str) -> None:
    writer = GGUFWriter(str(path), architecture)
    if tensor_type == "F32":
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:  # Q8_K: a block of 256 values is 292 bytes
        writer.add_tensor("token_embd.weight", np.zeros((1, 292), dtype=np.uint8),
                          raw_dtype=GGMLQuantizationType[tensor_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("architecture,tensor_type,reason", [
    ("madeup", "F32", "architecture 'madeup' of m.gguf is not one transformers can read from GGUF"),
    ("llama", "Q8_K", "quantized as Q8_K, which gguf .*cannot dequantize"),
])
def test_a_gguf_of_an_unknown_architecture_or_quantization_is_refused(tmp_path, architecture, tensor_type, reason):
    write_gguf(tmp_path / "m.gguf", architecture, tensor_type)
    with pytest.raises(CannotImport, match=reason):
        inspect_source(tmp_path / "m.gguf")
    with pytest.raises(CannotImport, match="give one of them: flywheel model import .*m.gguf"):
        inspect_source(tmp_path)  # the folder holding it: the file is named


def test_the_cli_imports_and_registry_show_prints_the_source_and_format(tmp_path, capsys):
    hf_folder(tmp_path / "src", "llama3", "llama")
    root = str(tmp_path / "registry")
    assert main(["model", "import", str(tmp_path / "src"), "--root", root, "--alias", "production"]) == 0
    assert "registered v0 as production" in capsys.readouterr().out
    assert main(["registry", "show", "production", "--root", root]) == 0
    shown = capsys.readouterr().out
    assert '"chat_format"' in shown and '"llama3"' in shown and '"kind": "hf"' in shown
    assert main(["model", "import", str(tmp_path / "nothing"), "--root", root]) == 2
    assert "neither a Hugging Face model folder" in capsys.readouterr().err
