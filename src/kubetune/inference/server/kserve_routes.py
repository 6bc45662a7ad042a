"""KServe's v1 (``/v1/models/NAME:predict``) and the open inference protocol v2 (``/v2``, ``/v2/models/NAME``,
``.../ready``, ``.../infer``) for an engine that maps texts to named outputs (a classifier's label and score,
or a task engine's own ``outputs``). A body is read as JSON whatever its Content-Type says, as
KServe's model server reads it (its examples send ``curl -d``, Triton's client sends none)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from kubetune.errors import KubetuneError
from kubetune.inference.server import protocol as api
from kubetune.inference.server import v2
from kubetune.inference.server.compute import HTTPError, Runner, check_model
from kubetune.version import __version__


def add_routes(app: FastAPI, engine, name: str, runner: Runner) -> None:
    """KServe's v1 and v2 routes for ``engine`` (its ``run`` maps texts to one dict of outputs each; its
    ``outputs``, the v2 names and datatypes, default to a classifier's)."""
    outputs = getattr(engine, "outputs", v2.OUTPUTS)
    unknown = {name: kind for name, kind in outputs.items() if kind != "BYTES" and kind not in v2.NUMERIC}
    if unknown:
        raise KubetuneError(
            f"the model's engine declares outputs {unknown} of datatypes the open inference protocol has no "
            f"binary form for here",
            field="outputs",
            fix=f"declare each output as BYTES or one of {', '.join(v2.NUMERIC)}",
        )

    @app.get("/v1/models/{model}")
    async def v1_ready(model: str):
        check_model(model, name)
        return {"name": name, "ready": True}

    @app.post("/v1/models/{model}:predict")
    async def v1_predict(model: str, request: Request):
        check_model(model, name)
        req = _v1_request(await request.body())
        try:
            texts = req.texts()
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        return {"predictions": await _classify(texts, runner, request)}

    @app.get("/v2")
    async def v2_server():
        return v2.server_metadata(__version__)

    @app.get("/v2/models/{model}")
    async def v2_metadata(model: str):
        check_model(model, name)
        return v2.model_metadata(name, outputs)

    @app.get("/v2/models/{model}/ready")
    async def v2_ready(model: str):
        check_model(model, name)
        return {"name": name, "ready": True}

    @app.post("/v2/models/{model}/infer")
    async def v2_infer(model: str, request: Request):
        check_model(model, name)
        if request.headers.get("content-encoding", "identity") != "identity":
            raise HTTPError(415, "Content-Encoding: send the request body uncompressed")
        try:
            req, texts = v2.parse(await request.body(), request.headers.get(v2.BINARY_HEADER), outputs)
        except v2.ProtocolError as e:
            raise HTTPError(400, str(e)) from None
        body, json_length = v2.response(name, req, await _classify(texts, runner, request), outputs)
        if json_length is None:
            return Response(body, media_type="application/json")
        return Response(body, media_type="application/octet-stream", headers={v2.BINARY_HEADER: str(json_length)})


def _v1_request(body: bytes) -> api.V1Request:
    try:
        return api.V1Request.model_validate(json.loads(body))
    except json.JSONDecodeError as e:
        raise HTTPError(400, f"body: not valid JSON ({e.msg} at character {e.pos})") from None
    except (UnicodeDecodeError, RecursionError):
        raise HTTPError(400, "body: not valid JSON (not UTF-8, or nested too deeply)") from None
    except ValidationError as e:
        raise HTTPError(400, api.describe(e.errors())) from None


async def _classify(texts: list[str], runner: Runner, request: Request) -> list[dict[str, Any]]:
    if not texts:
        raise HTTPError(400, "no texts given: give instances (v1) or a BYTES input (v2)")
    return await runner.compute([(t, "classify") for t in texts], "texts", request.receive)
