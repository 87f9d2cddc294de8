"""``POST /v1/completions`` (vLLM's ``serving_completion.py``): choice ``i * n + j`` is sample j of
prompt i; and `OpenAIServing`, what the endpoints share (vLLM's ``serving_engine.py``)."""

import asyncio
import json
import logging
import time
import typing

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from openai.types import Completion
from starlette.concurrency import run_in_threadpool

from jaxinfer.outputs import RequestOutput
from jaxinfer.serve import protocol as P
from jaxinfer.serve.errors import APIError


class OpenAIServing:
    """An endpoint over ``client`` (an `EngineCoreClient`) serving ``model_name``: checks,
    `SamplingParams`, choices and usage, streamed (server-sent events) or not; ``ids``: the shared
    response-id counter. Subclasses set ``prefix`` (of ids), ``Response``, ``Chunk`` (the
    ``openai`` package's types) and define ``choice(index, out, k, offset=0, stream=False,
    body=None)``: a dict of a `CompletionOutput` (streamed: what is new) with its top-``k``
    logprobs, ``offset`` characters of its text already sent."""

    prefix: str

    def __init__(self, client, model_name: str, ids, loras=None) -> None:
        self.client, self.model_name, self.ids = client, model_name, ids
        self.loras = loras  # `ServedLoRAs`: a body's model may name an adapter, or None

    def opening(self, n: int) -> list:
        """The choices of the first streamed chunk."""
        return []

    def sampling_params(self, body: P._Sampling, max_tokens, logprobs):
        """The body's `SamplingParams` once its model name and values pass (else `APIError`);
        fields the server does not know are logged and ignored, as vLLM does."""
        if body.model_extra:
            logging.getLogger("jaxinfer.serve").warning(
                "The following fields were present in the request but ignored: %s",
                sorted(body.model_extra),
            )
        if body.model not in (None, self.model_name) and self._lora(body) is None:
            served = [self.model_name, *(self.loras.requests if self.loras else ())]
            raise APIError(
                f"The model `{body.model}` does not exist; this server serves "
                + ", ".join(f"`{m}`" for m in served),
                404,
                "model",
                "model_not_found",
            )
        limit = self.client.info["max_num_seqs"]
        if not 1 <= body.n <= limit:
            raise APIError(
                f"n={body.n} is invalid: must be in [1, max_num_seqs={limit}]", param="n"
            )
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ValueError as e:  # not a SamplingParams field's: the output constraint's
            raise APIError.invalid(e, body.constraint()) from None

    def _lora(self, body: P._Sampling):
        """The `LoRARequest` the body's ``model`` names, or None."""
        return None if self.loras is None else self.loras.requests.get(body.model)

    async def encode(self, prompts, sp, param: str) -> list[list[int]]:
        """Ids of ``prompts()`` by `Prompts._prepare` (a thread), each within the context
        (`check_context`; the engine core checks the rest at `EngineCoreClient.add`);
        ValueError: 400 (``param``)."""
        try:
            _, encoded, _ = await run_in_threadpool(
                lambda: self.client.prompts._prepare(prompts(), sp, True)
            )
        except ValueError as e:
            raise APIError.invalid(e, param) from None
        for _, ids in encoded:
            check_context(ids, sp, self.client.info["max_model_len"], param)
        return [ids for _, ids in encoded]

    async def respond(self, request: Request, body: P._Sampling, prompts, sp, param: str):
        """The whole response, or (``body.stream``) a `StreamingResponse` of its chunks, once
        the engine core took every prompt (else `APIError`: 400 naming ``param``, 503)."""
        rid, lora = f"{self.prefix}-{next(self.ids)}", self._lora(body)
        model = self.model_name if lora is None else body.model  # vLLM's: the adapter's name
        try:
            added = await self.client.add(prompts, sp, body.stream, param, lora)
        except APIError as e:  # a constraint the engine core could not compile: its own field
            if "StructuredOutputsParams." in str(e):
                e.param = body.constraint()
            raise
        events = self._events(request, *added)
        if body.stream:
            return StreamingResponse(
                self._chunks(rid, events, sp, body, model), media_type="text/event-stream"
            )
        choices, usage = [], _usage()
        async for p, out in events:
            if isinstance(out, APIError):
                raise out
            _count(usage, out)
            choices += [
                self.choice(p * sp.n + c.index, c, sp.logprobs, body=body) for c in out.outputs
            ]
        return Response(
            self.dump(self.Response, rid, sorted(choices, key=lambda c: c["index"]), usage, model),
            media_type="application/json",
        )

    def dump(
        self, cls, rid: str, choices: list[dict], usage: dict | None = None, model=None
    ) -> bytes:
        """A response or chunk of ``cls`` (its ``openai`` type) as JSON bytes, unvalidated (vLLM's
        finish reasons, ``stop_reason``); msgspec, not pydantic: one per stream per step costs
        2 us. ``model``: the name it answers with (the request's adapter; None: the served
        model's)."""
        obj = typing.get_args(cls.model_fields["object"].annotation)[0]
        return _ENCODE(
            dict(
                id=rid,
                object=obj,
                created=int(time.time()),
                model=model or self.model_name,
                choices=choices,
                usage=usage,
            )
        )

    async def _events(self, request: Request, rids: dict[str, int], sink: asyncio.Queue):
        """Yield ``(prompt index, event)`` until all finish; abort the rest if the client leaves.
        Events queued meanwhile are joined per request (`RequestOutput.add`, as vLLM's
        ``RequestOutputCollector``): a slow reader gets fewer, longer chunks, never a backlog."""
        left = set(rids)
        try:
            while left:
                try:
                    first = await asyncio.wait_for(sink.get(), 1.0)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                joined: dict = {}
                for rid, ev in [first, *(sink.get_nowait() for _ in range(sink.qsize()))]:
                    joined[rid] = (
                        ev if rid not in joined or isinstance(ev, APIError) else joined[rid].add(ev)
                    )  # an APIError is a request's last event
                for rid, ev in joined.items():
                    if isinstance(ev, APIError) or ev.finished:
                        left.discard(rid)
                    yield rids[rid], ev
        finally:
            self.client.abort(left)

    async def _chunks(self, rid: str, events, sp, body, model: str):
        def chunk(choices, usage=None) -> bytes:
            return b"data: " + self.dump(self.Chunk, rid, choices, usage, model) + b"\n\n"

        if opening := self.opening(sp.n):
            yield chunk(opening)
        usage, offsets = _usage(), {}
        async for p, ev in events:
            if isinstance(ev, APIError):
                yield f"data: {json.dumps(ev.body())}\n\n"
                continue
            _count(usage, ev, prompt=ev.finished)
            for c in ev.outputs:  # DELTA outputs: each sample's new text, its finish reason
                i = p * sp.n + c.index
                yield chunk([self.choice(i, c, sp.logprobs, offsets.get(i, 0), True, body)])
                offsets[i] = offsets.get(i, 0) + len(c.text)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage)
        yield "data: [DONE]\n\n"


def check_context(ids: list[int], sp, max_model_len: int, param: str) -> None:
    """vLLM's context-length 400 (its ``_validate_input`` wording, an API contract) naming
    ``param``, when the prompt ``ids`` and ``sp.max_tokens`` together exceed ``max_model_len``,
    or with max_tokens None the prompt leaves no room. The engine itself (offline) generates
    until the context is full instead."""
    n = len(ids)
    head = f"This model's maximum context length is {max_model_len} tokens. However, you requested"
    if sp.max_tokens is None and n >= max_model_len:
        raise APIError(
            f"{head} {n} tokens in the messages, Please reduce the length of the messages.",
            param=param,
        )
    if sp.max_tokens is not None and n + sp.max_tokens > max_model_len:
        raise APIError(
            f"{head} {n + sp.max_tokens} tokens ({n} in the messages, {sp.max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            param=param,
        )


_ENCODE = msgspec.json.Encoder().encode
_usage = lambda: dict(prompt_tokens=0, completion_tokens=0, total_tokens=0)  # noqa: E731


def _count(usage: dict, out: RequestOutput, prompt: bool = True) -> None:
    usage["prompt_tokens"] += len(out.prompt_token_ids) if prompt else 0
    usage["completion_tokens"] += sum(len(c.token_ids) for c in out.outputs)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]


class ServingCompletion(OpenAIServing):
    prefix, Response, Chunk = "cmpl", Completion, Completion

    async def create(self, body: P.CompletionRequest, request: Request):
        for field, bad in (
            ("echo", body.echo),
            ("suffix", body.suffix is not None),
            ("best_of", body.best_of not in (None, body.n)),
        ):
            if bad:
                raise APIError(f"{field} is not supported", param=field)
        sp = self.sampling_params(body, body.max_tokens, body.logprobs)
        if body.prompt == []:
            raise APIError("prompt must not be empty", param="prompt")
        prompts = await self.encode(lambda: body.prompt, sp, "prompt")
        return await self.respond(request, body, prompts, sp, "prompt")

    def choice(
        self, index: int, out, k: int | None, offset: int = 0, stream: bool = False, body=None
    ):
        return dict(
            index=index,
            text=out.text,
            logprobs=P.completion_logprobs(out, k, offset),
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
