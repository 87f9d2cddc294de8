"""LoRA adapters in the server, as vLLM's (``--enable-lora``, ``--lora-modules``,
``serving_models.py``): the served adapters by name (`ServedLoRAs`; a request's ``model`` names
one), their /v1/models cards, and ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``.
An adapter is checked when it is given or loaded, its config and weights read on the host here
(numpy, `_check`) against the served model's shape (the engine core's ``lora_model``); the engine
core reads it again when a request first uses it and writes it into a slot then. No JAX."""

import asyncio
import itertools
import json
import os
import time
from types import SimpleNamespace

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from jaxinfer.lora.peft import AdapterError, check_adapter, load_adapter
from jaxinfer.lora.request import LoRARequest
from jaxinfer.serve.errors import APIError


def parse_lora_modules(specs: list[str] | None) -> dict[str, str]:
    """vLLM's ``--lora-modules``: each ``name=path`` or a JSON object ``{"name", "path"}`` ->
    {name: path}. ValueError naming the entry: another form, a name given twice."""
    out = {}
    for spec in specs or ():
        try:
            d = json.loads(spec) if spec.lstrip().startswith("{") else None
            name, path = (d["name"], d["path"]) if d is not None else spec.split("=", 1)
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"--lora-modules {spec!r} is invalid: give name=path or "
                '\'{"name": ..., "path": ...}\''
            ) from None
        if not name or name in out:
            raise ValueError(f"--lora-modules {spec!r} is invalid: empty or repeated name")
        out[name] = os.fspath(path)
    return out


def _check(path: str, max_rank: int, model, name: str | None = None) -> None:
    """The adapter at ``path`` as the engine core reads it on first use: `load_adapter` against
    ``model`` (a namespace of `jaxinfer.lora.peft.model_shape`'s fields: modules, shapes, layer
    count; rank up to ``max_rank``), the result dropped; ``model`` None (the model not known
    yet): its config only (`check_adapter`). ValueError: as those (`AdapterError`s naming the
    adapter's ``name`` too where given: `AdapterError.named`)."""
    try:
        if model is None:
            check_adapter(path, max_rank)
        else:
            load_adapter(path, model, max_rank)
    except AdapterError as e:
        if name is None:
            raise
        raise e.named(name) from None


def check_lora_modules(
    modules: dict[str, str], base: str | None, max_rank: int, model=None
) -> None:
    """ValueError naming the ``--lora-modules`` entry and what is allowed: its name is ``base``,
    the served model's (the adapter would hide the base model; None: not known yet), it does
    not pass `_check` (rank up to ``max_rank``: EngineConfig.max_lora_rank; its weights against
    ``model`` once the engine core is up)."""
    for name, path in modules.items():
        if name == base:
            raise ValueError(
                f"--lora-modules {name}={path} is invalid: {name!r} is the served model's name "
                "(the adapter would hide the base model); give the adapter another name, or "
                "the model another --served-model-name"
            )
        try:
            _check(path, max_rank, model)
        except ValueError as e:
            raise ValueError(f"--lora-modules {name}={path} is invalid: {e}") from None


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class ServedLoRAs:
    """The adapters served under ``base`` (the model name): {name: `LoRARequest`}, ids from 1
    in the order given or loaded (an adapter loaded again gets a new id: its files are read
    again); each adapter is checked (`_check`: config and weights against ``model``, the engine
    core's ``lora_model`` dict; rank up to ``max_rank``: EngineConfig.max_lora_rank) when it is
    given or loaded, and read again by the engine core when a request first uses it.
    ValueError: as `check_lora_modules`."""

    def __init__(
        self, base: str, modules: dict[str, str], max_rank: int, model: dict | None = None
    ) -> None:
        self.model = model and SimpleNamespace(**model)
        check_lora_modules(modules, base, max_rank, self.model)
        self.base, self.max_rank, self._ids, self.requests = base, max_rank, itertools.count(1), {}
        for name, path in modules.items():
            self.requests[name] = LoRARequest(name, next(self._ids), path)

    def cards(self, max_model_len: int) -> list[dict]:
        """/v1/models entries of the adapters (vLLM's: ``root`` the path, ``parent`` the base)."""
        now = int(time.time())
        return [
            dict(id=n, object="model", created=now, owned_by="jaxinfer", root=r.lora_path)
            | dict(parent=self.base, max_model_len=max_model_len)
            for n, r in self.requests.items()
        ]

    def routes(self) -> list[tuple]:
        """(path under /v1, endpoint, method) of the load and unload endpoints."""
        return [
            ("/load_lora_adapter", self.load, "POST"),
            ("/unload_lora_adapter", self.unload, "POST"),
        ]

    async def load(self, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """vLLM's ``/v1/load_lora_adapter``. APIError 400: the name is the served model's
        (``param`` "lora_name"), is served already or is not a valid `LoRARequest` name, the
        path has no adapter_config.json, it does not pass `_check` (a rank above
        max_lora_rank, a malformed or unsupported config, a missing or corrupt weights file,
        weights not the served model's: the reason naming lora_name and lora_path, ``param``
        "lora_path"); nothing is
        registered then. The files are read in a worker thread (the event loop keeps serving)."""
        if body.lora_name == self.base:
            raise APIError(
                f"The lora adapter name '{body.lora_name}' is the served model's name; choose "
                "another",
                param="lora_name",
            )
        if body.lora_name in self.requests:
            raise APIError(f"The lora adapter '{body.lora_name}' has already been loaded.")
        if not os.path.isfile(os.path.join(body.lora_path, "adapter_config.json")):
            raise APIError(
                f"No adapter found for {body.lora_path}", param="lora_path", code="not_found"
            )
        try:
            await asyncio.to_thread(
                _check, body.lora_path, self.max_rank, self.model, body.lora_name
            )
        except ValueError as e:
            raise APIError(str(e), param="lora_path") from None
        if body.lora_name in self.requests:  # loaded by another request while this one read
            raise APIError(f"The lora adapter '{body.lora_name}' has already been loaded.")
        try:
            req = LoRARequest(body.lora_name, next(self._ids), body.lora_path)
        except ValueError as e:  # e.g. an empty name
            raise APIError(str(e), param="lora_name") from None
        self.requests[body.lora_name] = req
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """vLLM's ``/v1/unload_lora_adapter``. APIError 404: no such adapter."""
        if self.requests.pop(body.lora_name, None) is None:
            raise APIError(
                f"The lora adapter '{body.lora_name}' cannot be found.", 404, code="not_found"
            )
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _lora_off() -> None:
    raise APIError(
        "LoRA is off: the server was started without --enable-lora; restart it with "
        "--enable-lora to load or unload adapters"
    )


def lora_off_routes() -> list[tuple]:
    """`ServedLoRAs.routes`' paths on a server without ``--enable-lora``: APIError 400 saying
    so (not a bare 404 "Not Found")."""
    return [("/load_lora_adapter", _lora_off, "POST"), ("/unload_lora_adapter", _lora_off, "POST")]
