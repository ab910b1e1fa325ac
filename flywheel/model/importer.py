"""Bring your own model: a Hugging Face model folder or a GGUF file, registered as a Registry version.

    flywheel model import PATH [--dtype bfloat16] [--chat-template FILE] [--alias production]

A team's first act is to point flywheel at its own model. This module does what that took by hand:
read the source, check it, dequantize a GGUF, clear the quantizer's flag so the weights save as
plain safetensors, and register the result with its own tokenizer and chat template, so that every
later command (`eval`, `train`, `serve`, the gate) loads it as any other version.

What is checked before anything is written, in this order (`inspect_source`), each refusal naming
the reason and the fix:

1. the source: a folder holding config.json, or a .gguf file;
2. the architecture: a causal LM built into `transformers` (no `trust_remote_code`); for a GGUF,
   one of the architectures `transformers` can read from GGUF;
3. the quantization: a GGUF's tensors must be of types `gguf` can dequantize (they are
   dequantized to `dtype`: flywheel trains full-precision weights); an HF folder quantized for
   inference (bitsandbytes, GPTQ, AWQ, FP8, ...) is refused: give the unquantized checkpoint;
4. the chat template: the tokenizer's own, or `chat_template` given here (a Jinja file); a model
   without one is refused, since episodes, SFT and the server render through it;
5. the chat format: the template is matched against the formats flywheel renders and parses
   (`flywheel.model.formats`), and refused with the first difference when none matches.

The version's flywheel.json records where it came from (`source`: path, kind, architecture, the
GGUF's tensor types, dtype) and the detected chat format; the format also travels on the
tokenizer (`formats.FORMAT_KEY` in tokenizer_config.json), so a copy of the folder knows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from flywheel.extras import require
from flywheel.model.registry import Checkpoint, Registry

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = ("float32", "bfloat16", "float16")
DType = Literal["float32", "bfloat16", "float16"]
# Tensor types a GGUF may hold that are already plain floating point (no dequantization step).
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


class CannotImport(ValueError):
    """A source flywheel cannot import; the message names the reason and what to give instead."""


class SourceInfo(BaseModel):
    """What `inspect_source` found: recorded in the version's flywheel.json as `source`."""

    model_config = ConfigDict(extra="forbid")
    path: str
    kind: Literal["hf", "gguf"]
    architecture: str  # the transformers model_type (llama, qwen2, ...)
    tensor_types: list[str] = []  # a GGUF's tensor types (Q4_1, Q8_0, F32, ...); dequantized on import
    dtype: DType = "float32"


def inspect_source(source: str | Path, dtype: DType = "float32") -> SourceInfo:
    """Checks 1-3 of the module docstring, reading only headers (no weights are loaded)."""
    path = Path(source)
    if dtype not in DTYPES:
        raise CannotImport(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if path.is_file() and path.suffix == ".gguf":
        return _inspect_gguf(path, dtype)
    if path.is_dir() and (path / "config.json").is_file():
        return _inspect_hf(path, dtype)
    if path.is_dir() and (ggufs := sorted(path.glob("*.gguf"))):
        raise CannotImport(f"{path} holds no config.json but GGUF files ({', '.join(p.name for p in ggufs[:3])}); "
                           "give one of them: flywheel model import " + str(ggufs[0]))
    raise CannotImport(f"{path} is neither a Hugging Face model folder (with config.json) nor a .gguf file")


def _inspect_hf(path: Path, dtype: DType) -> SourceInfo:
    from transformers import AutoConfig  # noqa: PLC0415  (torch stays out of `flywheel --help`)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: PLC0415

    raw = _json(path / "config.json")
    if raw.get("auto_map"):
        raise CannotImport(f"{path} needs its own modelling code (auto_map in config.json, trust_remote_code); "
                           "flywheel loads only architectures built into transformers")
    model_type = raw.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise CannotImport(f"architecture {model_type!r} ({', '.join(raw.get('architectures') or ['?'])}) is not a "
                           "causal language model transformers can load (AutoModelForCausalLM); flywheel trains "
                           "decoder-only LMs, e.g. llama, qwen2, qwen3, mistral")
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise CannotImport(f"{path} is quantized for inference ({method}); flywheel trains and serves "
                           "full-precision weights: give the unquantized checkpoint, or a GGUF file, which is "
                           "dequantized on import")
    AutoConfig.from_pretrained(str(path))  # the config must also parse, before any weight is read
    return SourceInfo(path=str(path.resolve()), kind="hf", architecture=model_type, dtype=dtype)


def _inspect_gguf(path: Path, dtype: DType) -> SourceInfo:
    gguf = require("gguf", "importing a GGUF file")
    from gguf.quants import _type_traits  # noqa: PLC0415  (the types gguf can dequantize)
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES  # noqa: PLC0415

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    if field is None:
        raise CannotImport(f"{path} has no general.architecture; it is not a model GGUF")
    architecture = bytes(field.parts[field.data[0]]).decode()
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise CannotImport(f"architecture {architecture!r} of {path.name} is not one transformers can read from "
                           f"GGUF (it reads: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}); convert the "
                           "model to a Hugging Face folder and import that")
    types = sorted({t.tensor_type.name for t in reader.tensors})
    dequantizable = _FLOAT_TYPES | {t.name for t in _type_traits}
    unknown = [t for t in types if t not in dequantizable]
    if unknown:
        raise CannotImport(f"{path.name} holds tensors quantized as {', '.join(unknown)}, which gguf "
                           f"{gguf.__version__ if hasattr(gguf, '__version__') else ''} cannot dequantize; "
                           "give a GGUF of another quantization (Q4_K, Q8_0, F16, ...) or the HF checkpoint")
    return SourceInfo(path=str(path.resolve()), kind="gguf", architecture=architecture, tensor_types=types,
                      dtype=dtype)


def load_source(info: SourceInfo,
                chat_template: str | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (plain weights in `info.dtype`, no quantizer attached) and its tokenizer with a
    chat template (check 4: `chat_template` text wins over the tokenizer's own)."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    path = Path(info.path)
    where = {"gguf_file": path.name} if info.kind == "gguf" else {}
    folder = str(path.parent if info.kind == "gguf" else path)
    tokenizer = AutoTokenizer.from_pretrained(folder, **where)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not tokenizer.chat_template:
        raise CannotImport(f"{path.name} has no chat template; flywheel renders episodes, demonstrations and "
                           "served prompts through the model's own: pass --chat-template FILE (the Jinja template "
                           "the model was trained with), or import the instruct variant of the model")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, info.dtype), **where)
    if info.kind == "gguf":
        # Dequantized in memory; without this the saved config.json would still name the GGUF
        # quantizer and every later load would look for the .gguf file.
        model.config.quantization_config = None
        del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
    return model.eval(), tokenizer


def import_model(source: str | Path, registry: Registry, dtype: DType = "float32",
                 chat_template: str | None = None, aliases: Sequence[str] = (), note: str = "",
                 log: Any = print) -> Checkpoint:
    """Checks 1-5 of the module docstring, then register the model as the Registry's next version."""
    info = inspect_source(source, dtype)
    log(f"{Path(info.path).name}: {info.kind}, architecture {info.architecture}"
        + (f", tensors {'/'.join(info.tensor_types)} dequantized to {dtype}" if info.tensor_types else f", {dtype}"))
    model, tokenizer = load_source(info, chat_template)
    from flywheel.model.formats import record_format  # noqa: PLC0415

    chat_format = record_format(tokenizer)  # check 5: refuses a template no format renders
    log(f"chat format: {chat_format.name} ({chat_format.describe()})")
    parameters = sum(p.numel() for p in model.parameters())
    return registry.register(
        model, tokenizer, aliases=aliases,
        note=note or f"imported from {Path(info.path).name} ({parameters / 1e6:.0f}M parameters)",
        metadata={"source": info.model_dump(), "chat_format": chat_format.record()})


def _json(path: Path) -> dict[str, Any]:
    import json  # noqa: PLC0415

    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CannotImport(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); is the download whole?") \
            from None
