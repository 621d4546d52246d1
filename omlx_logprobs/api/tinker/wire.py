"""Tinker's protobuf bodies, through the SDK's own message classes: a forward_backward request
in (`Content-Type: application/x-protobuf`), a ForwardBackwardOutput and a SampleResponse out
(what the SDK reads when it polls with `Accept: application/x-protobuf`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.training.calls import DatumResult

PROTO = "application/x-protobuf"
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class Datum:
    tokens: np.ndarray  # [N] int32, the model_input's tokens
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # loss_fn_inputs, flat


@dataclass
class PassRequest:
    """A forward or forward_backward request as the engine takes it."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    data: list[Datum]
    forward_only: bool


def _tensor(name: str, t: pb.Tensor) -> np.ndarray:
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise APIError(f"loss_fn_inputs[{name!r}] has a dtype other than float32 or int64")
    shape = [int(s) for s in t.shape]
    if t.HasField("sparse_csr"):
        if len(shape) != 2:
            raise APIError(f"loss_fn_inputs[{name!r}]: a sparse tensor must be 2-D")
        values = np.frombuffer(t.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(t.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(t.sparse_csr.col_indices, dtype=np.int64)
        dense = np.zeros(shape, dtype=dtype)
        for r in range(shape[0]):
            dense[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
        return dense
    data = np.frombuffer(t.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != data.size:
        raise APIError(
            f"loss_fn_inputs[{name!r}] declares shape {shape} but holds {data.size} values"
        )
    return data.reshape(shape) if shape else data


def parse_pass(body: bytes) -> PassRequest:
    """A ForwardBackwardRequest; a 400 for one that is not, or that holds other than text."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception:
        raise APIError("the body is not a Tinker ForwardBackwardRequest (protobuf)") from None
    data = []
    for i, d in enumerate(msg.data):
        parts = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise APIError(
                    f"datum {i}: forward and forward_backward take encoded_text chunks only, not"
                    f" {kind} (images are sampled, not trained yet)"
                )
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        inputs = {k: _tensor(k, v) for k, v in d.loss_fn_inputs.items()}
        data.append(Datum(tokens, inputs))
    config = {
        k: float(v.number)
        for k, v in msg.loss_fn_config_v2.items()
        if v.WhichOneof("value") == "number"
    }
    for k, v in msg.loss_fn_config.items():
        config.setdefault(k, float(v))
    return PassRequest(msg.model_id, msg.seq_id, msg.loss_fn, config, data, msg.forward_only)


def _batched(arrays: list[np.ndarray]) -> pb.BatchedTensor:
    flat = [a.astype(np.float32).ravel() for a in arrays]
    offsets = np.cumsum([0] + [a.nbytes for a in flat], dtype=np.int64)
    return pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in flat),
        offsets=offsets.tobytes(),
        dtype=pb.DTYPE_FLOAT32,
    )


def pass_output(results: list[DatumResult], metrics: dict[str, float]) -> bytes:
    """ForwardBackwardOutput: per datum its `logprobs` and `elementwise_loss`, and metrics."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(results))
    record.fields["logprobs"].CopyFrom(_batched([r.logprobs for r in results]))
    record.fields["elementwise_loss"].CopyFrom(_batched([r.elementwise_loss for r in results]))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    out.loss_fn_outputs.append(record)
    return bytes(out.SerializeToString())


@dataclass
class Sequence:
    tokens: np.ndarray  # int32
    logprobs: np.ndarray | None  # float32
    stopped: bool  # by a stop token or string (else: max_tokens)
    top: tuple[np.ndarray, np.ndarray] | None = None  # [n, k] ids and logprobs, when asked


def topk(ids: np.ndarray, logprobs: np.ndarray) -> pb.TopkLogprobs:
    n, k = ids.shape
    return pb.TopkLogprobs(
        token_ids=ids.astype(np.int32).tobytes(),
        logprobs=logprobs.astype(np.float32).tobytes(),
        k=k,
        length=n,
    )


def sample_output(
    seqs: list[Sequence],
    prompt_logprobs: np.ndarray | None,
    prompt_topk: tuple[np.ndarray, np.ndarray] | None,
    cached: int,
) -> bytes:
    out = pb.SampleResponse(prompt_cache_hit_tokens=cached)
    for s in seqs:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH
        seq.tokens = s.tokens.astype(np.int32).tobytes()
        if s.logprobs is not None:
            seq.logprobs = s.logprobs.astype(np.float32).tobytes()
        if s.top is not None:
            seq.topk_sampled_logprobs.CopyFrom(topk(*s.top))
    if prompt_logprobs is not None:
        out.prompt_logprobs = prompt_logprobs.astype(np.float32).tobytes()
    if prompt_topk is not None:
        out.topk_prompt_logprobs.CopyFrom(topk(*prompt_topk))
    return bytes(out.SerializeToString())
