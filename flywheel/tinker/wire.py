"""The Tinker wire's binary half: protobuf requests and responses, as plain records and numpy arrays.

The tinker SDK (0.38) sends `forward_backward` as protobuf (`Content-Type: application/x-protobuf`,
optionally zstd-compressed) and expects the results of forward_backward and sample futures as
protobuf (it asks with `Accept: application/x-protobuf`); every other request and result is JSON
and is parsed by the SDK's own pydantic types (flywheel/tinker/server.py). The message classes
are the SDK's generated ones (`tinker.proto.tinker_public_pb2`), so the schema has one source.

    decode_forward_backward(body)   -> FwdBwdRequest (model id, loss, config, datums)
    encode_forward_backward(...)    -> bytes of a ForwardBackwardOutput (per-datum arrays + metrics)
    encode_sample(...)              -> bytes of a SampleResponse (tokens, logprobs, stop reasons)

What the decoder refuses (as `WireError`, a user error): image and audio chunks, sparse tensors,
2-D targets (top-k distillation), dtypes other than float32 / int64 / int32.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

from flywheel.extras import require

FEATURE = "flywheel tinker serve"


class WireError(ValueError):
    """A request the wire cannot carry into flywheel (what and why is the message)."""


@dataclass
class Datum:
    tokens: list[int]  # the model input, chunks concatenated
    inputs: dict[str, np.ndarray]  # loss_fn_inputs, each [len(tokens)]


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def proto() -> ModuleType:
    return require("tinker.proto.tinker_public_pb2", FEATURE)


def _array(tensor) -> np.ndarray:
    pb = proto()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if tensor.HasField("sparse_csr"):
        raise WireError("sparse loss_fn_inputs are not supported; send dense tensors")
    if tensor.dtype not in dtypes:
        raise WireError(f"tensor dtype {tensor.dtype} is not supported; send float32 or int64")
    array = np.frombuffer(tensor.dense, dtype=dtypes[tensor.dtype])
    shape = list(tensor.shape) or [array.size]
    if int(np.prod(shape)) != array.size:
        raise WireError(f"a tensor of shape {shape} carries {array.size} values")
    if len(shape) != 1:
        raise WireError(f"loss_fn_inputs must be 1-D (one value per input token), got shape {shape}")
    return array


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    pb = proto()
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as exc:  # protobuf raises its own DecodeError; anything else is the same bad body
        raise WireError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    config: dict[str, float | str] = {k: float(v) for k, v in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for i, datum in enumerate(message.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk") or "empty"
            if kind != "encoded_text":
                raise WireError(f"datum {i}: {kind} chunks are not supported; flywheel trains on text tokens")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {name: _array(tensor) for name, tensor in datum.loss_fn_inputs.items()}
        for name, array in inputs.items():
            if array.size != len(tokens):
                raise WireError(f"datum {i}: loss_fn_inputs[{name!r}] has {array.size} values for {len(tokens)} "
                                "input tokens; give one per token")
        data.append(Datum(tokens, inputs))
    return FwdBwdRequest(message.model_id, int(message.seq_id), message.loss_fn, config, bool(message.forward_only),
                         data)


def _batched(arrays: list[np.ndarray], dtype) -> object:
    pb = proto()
    flat = [np.ascontiguousarray(a, dtype=np.float32 if dtype == pb.DTYPE_FLOAT32 else np.int64) for a in arrays]
    offsets = np.cumsum([0] + [a.nbytes for a in flat], dtype=np.int64)
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in flat), offsets=offsets.tobytes(), dtype=dtype)


def encode_forward_backward(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """outputs: per datum, {field: float32 array [tokens]} (the same fields for every datum)."""
    pb = proto()
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    if outputs:
        record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
        for name in outputs[0]:
            record.fields[name].CopyFrom(_batched([o[name] for o in outputs], pb.DTYPE_FLOAT32))
    return message.SerializeToString()


def encode_sample(sequences: list[tuple[list[int], list[float], str]], prompt_logprobs: list[float] | None) -> bytes:
    """sequences: (tokens, their logprobs, "stop" | "length"); prompt_logprobs: NaN where not computed."""
    pb = proto()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    message = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        message.sequences.add(stop_reason=reasons[reason], tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
                              logprobs=np.asarray(logprobs, dtype=np.float32).tobytes())
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return message.SerializeToString()
