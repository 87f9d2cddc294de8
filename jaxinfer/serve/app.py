"""The FastAPI app (vLLM's ``api_server.py``): routes to `completions` and `chat`, /v1/models,
/health, /metrics; the engine core's client in its lifespan; 401 without the API key, 413 over
the limit. Host side, no JAX."""

import contextlib
import itertools
import time

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jaxinfer.serve.chat import ServingChat
from jaxinfer.serve.completions import ServingCompletion
from jaxinfer.serve.errors import APIError, add_exception_handlers
from jaxinfer.serve.lora import ServedLoRAs, lora_off_routes
from jaxinfer.serve.metrics import ServerMetrics


class _BodyLimit:
    """ASGI middleware: 413 for a declared Content-Length over ``limit`` bytes."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers", ())) if scope["type"] == "http" else {}
        size = headers.get(b"content-length", b"0")
        if size.isdigit() and int(size) > self.limit:
            msg = f"request body of {int(size)} bytes exceeds the limit of {self.limit} bytes"
            return await APIError(msg, 413).response()(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(
    client,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_request_bytes: int = 8 << 20,
    lora_modules: dict[str, str] | None = None,
) -> FastAPI:
    """The app over ``client`` (a started `EngineCoreClient`, ``app.state.client``; its sockets
    open and close with the app's lifespan, which stops the core); ``api_key``: /v1 needs
    ``Authorization: Bearer KEY``. /health answers 503 once the core is gone. ``lora_modules``
    ({name: path}; None: LoRA off): served adapters, and vLLM's load/unload endpoints (LoRA off:
    a 400 saying so).
    ValueError: as `ServedLoRAs`."""
    name, ids = served_model_name or "jaxinfer", itertools.count()
    client.metrics = metrics = ServerMetrics(client)
    loras = None
    if lora_modules is not None:  # {}: none yet, the load endpoint on
        info = client.info
        loras = ServedLoRAs(name, lora_modules, info["max_lora_rank"], info.get("lora_model"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await client.connect()
        yield
        await client.shutdown()

    def auth(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(
                "invalid or missing API key: send 'Authorization: Bearer KEY'",
                401,
                code="invalid_api_key",
            )

    async def health() -> Response:
        return Response(status_code=200 if client.dead is None else 503)

    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models() -> dict:
        n, now = client.info["max_model_len"], int(time.time())
        card = dict(id=name, object="model", created=now, owned_by="jaxinfer", max_model_len=n)
        return {"object": "list", "data": [card, *(loras.cards(n) if loras else ())]}

    app = FastAPI(title="jaxinfer", lifespan=lifespan)
    app.state.client, app.state.metrics = client, metrics
    app.add_middleware(_BodyLimit, limit=max_request_bytes)
    add_exception_handlers(app)
    app.add_api_route("/health", health)
    app.add_api_route("/metrics", prometheus)
    for path, endpoint, method in (
        ("/models", models, "GET"),
        ("/completions", ServingCompletion(client, name, ids, loras).create, "POST"),
        ("/chat/completions", ServingChat(client, name, ids, loras).create, "POST"),
        *(loras.routes() if loras else lora_off_routes()),
    ):
        app.add_api_route("/v1" + path, endpoint, methods=[method], dependencies=[Depends(auth)])
    return app
