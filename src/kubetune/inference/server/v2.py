"""The open inference protocol v2 (KServe's v2, Triton's HTTP/REST protocol) for a model of texts: the
request (one BYTES input of texts, as JSON ``data`` or with the binary tensor data extension, whose
``Inference-Header-Content-Length`` header says where the JSON ends and the tensors' bytes begin), the
response (the engine's outputs, e.g. a classifier's ``label`` and ``score``, each as JSON or as binary
where the request asks for it, as Triton's reference client does by default), and the server and model
metadata.

Why our own codec: KServe's (``kserve.protocol.infer_type``) comes with the whole KServe model server
and its dependencies; the part a BYTES input and two outputs need is the length-prefixed encoding below.
"""

from __future__ import annotations

import json
import math
import struct

from pydantic import Field, ValidationError

from kubetune.inference.server.protocol import Body, Strict, describe

BINARY_HEADER = "Inference-Header-Content-Length"
INPUT = "text"
OUTPUTS = {"label": "BYTES", "score": "FP32"}  # a classifier's (an engine without ``outputs`` has these)
EXTENSIONS = ["binary_tensor_data"]
# The protocol's fixed-size datatypes an output may have, as little-endian struct codes (binary tensor data);
# BYTES is the other: length-prefixed strings.
NUMERIC = {
    "BOOL": "?",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "FP32": "f",
    "FP64": "d",
}


class ProtocolError(ValueError):
    """A request the protocol cannot take: one line, answered 400."""


class Tensor(Strict):
    name: str
    shape: list[int]
    datatype: str
    data: list | None = None
    parameters: dict | None = None


class RequestedOutput(Strict):
    name: str
    parameters: dict | None = None


class InferRequest(Body):
    """An inference request: one BYTES input of texts; which outputs, and which of them as binary."""

    id: str | None = None
    inputs: list[Tensor] = Field(min_length=1)
    outputs: list[RequestedOutput] | None = None
    parameters: dict | None = None


def parse(body: bytes, json_length: str | None, outputs: dict[str, str] = OUTPUTS) -> tuple[InferRequest, list[str]]:
    """An inference request's JSON and its texts; ``json_length``: the binary extension's header, if sent;
    ``outputs``: the model's output names and datatypes.

    Raises:
        ProtocolError: what is wrong with the request, with where.
    """
    head, raw = body, b""
    if json_length is not None:
        if not json_length.strip().isdigit() or int(json_length) > len(body):
            raise ProtocolError(
                f"{BINARY_HEADER}: {json_length[:40]!r} is not a length within the body's {len(body)} bytes; "
                "give the length of the JSON part"
            )
        head, raw = body[: int(json_length)], body[int(json_length) :]
    try:
        obj = json.loads(head)
    except json.JSONDecodeError as e:
        raise ProtocolError(f"body: not valid JSON ({e.msg} at character {e.pos})") from None
    except (UnicodeDecodeError, RecursionError):
        raise ProtocolError("body: not valid JSON (not UTF-8, or nested too deeply)") from None
    try:
        request = InferRequest.model_validate(obj)
    except ValidationError as e:
        raise ProtocolError(describe(e.errors())) from None
    unknown = [o.name for o in request.outputs or () if o.name not in outputs]
    if unknown:
        raise ProtocolError(
            f"outputs: this model has no output {_names(unknown)}; its outputs are {', '.join(map(repr, outputs))}"
        )
    return request, _texts(request, raw)


def _texts(request: InferRequest, raw: bytes) -> list[str]:
    chosen = next((k for k, t in enumerate(request.inputs) if t.name == INPUT), 0)
    extra = [t.name for k, t in enumerate(request.inputs) if k != chosen]
    if extra:
        raise ProtocolError(f"inputs: this model takes one BYTES input ('{INPUT}'); remove {_names(extra)}")
    tensor, where = request.inputs[chosen], f"inputs[{chosen}] ({request.inputs[chosen].name})"
    if tensor.datatype != "BYTES":
        raise ProtocolError(f"{where}: datatype {tensor.datatype[:40]!r}; this model takes texts, datatype BYTES")
    size = (tensor.parameters or {}).get("binary_data_size")
    if size is not None:
        if tensor.data is not None or not isinstance(size, int) or size != len(raw):
            raise ProtocolError(
                f"{where}: binary_data_size {size!r} with {len(raw)} bytes after the JSON"
                + (" and JSON data as well" if tensor.data is not None else "")
                + "; give the size of the tensor's bytes, which follow the JSON, and no data"
            )
        texts = _unpack_bytes(raw, where)
    elif tensor.data is None:
        raise ProtocolError(f"{where}: no data; give data, or binary_data_size and the bytes after the JSON")
    else:
        if raw:
            raise ProtocolError(f"{len(raw)} bytes after the JSON, but no input has binary_data_size")
        texts = _flat_strings(tensor.data, where)
    if any(d < 0 for d in tensor.shape) or math.prod(tensor.shape) != len(texts):
        raise ProtocolError(
            f"{where}: shape {tensor.shape} does not hold the data's {len(texts)} elements; give shape [{len(texts)}]"
        )
    if not texts:
        raise ProtocolError(f"{where}: no texts given")
    return texts


def _flat_strings(data: list, where: str) -> list[str]:
    """A tensor's JSON data, row-major (nested lists flattened), each element a string."""
    out: list[str] = []
    todo = [(data, "data")]
    while todo:
        value, at = todo.pop()
        if isinstance(value, list):
            todo.extend((x, f"{at}[{k}]") for k, x in reversed(list(enumerate(value))))
        elif isinstance(value, str):
            out.append(value)
        else:
            raise ProtocolError(f"{where}.{at}: a BYTES element is a string, not {type(value).__name__}")
    return out


def _unpack_bytes(raw: bytes, where: str) -> list[str]:
    """The binary extension's BYTES tensor: each element a 4-byte little-endian length and its bytes."""
    out: list[str] = []
    at = 0
    while at < len(raw):
        if at + 4 > len(raw) or at + 4 + (n := struct.unpack_from("<I", raw, at)[0]) > len(raw):
            raise ProtocolError(f"{where}: element {len(out)} runs past the tensor's bytes; send whole elements")
        try:
            out.append(raw[at + 4 : at + 4 + n].decode("utf-8"))
        except UnicodeDecodeError:
            raise ProtocolError(f"{where}: element {len(out)} is not UTF-8 text") from None
        at += 4 + n
    return out


def response(
    name: str, request: InferRequest, results: list[dict], outputs: dict[str, str] = OUTPUTS
) -> tuple[bytes, int | None]:
    """The response body for ``results`` (one dict per text, a value for each of ``outputs``), and the length
    of its JSON part where outputs follow as binary (None: the body is JSON only)."""
    n = len(results)
    values = {key: [r[key] for r in results] for key in outputs}
    binary_default = bool((request.parameters or {}).get("binary_data_output", False))
    wanted = request.outputs or [RequestedOutput(name=x) for x in outputs]
    tensors, tail = [], []
    for out in wanted:
        tensor: dict[str, object] = {"name": out.name, "datatype": outputs[out.name], "shape": [n]}
        if (out.parameters or {}).get("binary_data", binary_default):
            data = _pack(outputs[out.name], values[out.name])
            tensor["parameters"] = {"binary_data_size": len(data)}
            tail.append(data)
        else:
            tensor["data"] = values[out.name]
        tensors.append(tensor)
    head = json.dumps({"model_name": name, "id": request.id or "", "outputs": tensors}).encode()
    return (head + b"".join(tail), len(head)) if tail else (head, None)


def _pack(datatype: str, values: list) -> bytes:
    if datatype in NUMERIC:
        return struct.pack(f"<{len(values)}{NUMERIC[datatype]}", *values)
    return b"".join(struct.pack("<I", len(b)) + b for b in (v.encode() for v in values))


def _names(names: list[str]) -> str:
    return ", ".join(repr(x[:60]) for x in names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")


def server_metadata(version: str) -> dict:
    return {"name": "kubetune", "version": version, "extensions": EXTENSIONS}


def model_metadata(name: str, outputs: dict[str, str] = OUTPUTS) -> dict:
    return {
        "name": name,
        "platform": "kubetune",
        "inputs": [{"name": INPUT, "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": x, "datatype": t, "shape": [-1]} for x, t in outputs.items()],
    }
