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
    ``openai`` package's types) and define ``choice(index, req, out, k, offset=None,
    stream=False, body=None)``: a dict of `CompletionOutput` ``out`` of `RequestOutput` ``req``
    (streamed: what is new) with its top-``k`` logprobs, ``offset`` characters of its text
    already sent (None: none, its first chunk)."""

    prefix: str

    def __init__(self, client, model_name: str, ids, loras=None) -> None:
        self.client, self.model_name, self.ids = client, model_name, ids
        self.loras = loras  # `ServedLoRAs`: a body's model may name an adapter, or None

    def opening(self, n: int, body) -> list:
        """The choices of the first streamed chunk."""
        return []

    def sent(self, choice: dict, out) -> int:
        """The characters of the text a streamed ``choice`` of ``out`` carries."""
        return len(out.text)

    def fields(self, body, outs: list) -> dict:
        """Response fields beside the choices, of the `RequestOutput`s ``outs`` (prompt order)."""
        return {}

    def check_logprobs(self, body: P._Sampling, names: tuple[str, ...]) -> None:
        """vLLM's rules (APIError, a 400 naming the field): ``prompt_logprobs`` is not streamed;
        each of the body's fields ``names`` within [0, max_logprobs] (vLLM's -1, the whole
        vocabulary, is more than any server of ours gives)."""
        if body.stream and body.prompt_logprobs:
            raise APIError(
                f"prompt_logprobs={body.prompt_logprobs} is not available with stream=true "
                "(vLLM's rule); send stream=false, or prompt_logprobs null or 0",
                param="prompt_logprobs",
            )
        m = self.client.info["max_logprobs"]
        for name in names:
            if (k := getattr(body, name)) is not None and not 0 <= k <= m:
                raise APIError(
                    f"{name}={k} is invalid: must be an integer in [0, {m}] (this server's "
                    "max_logprobs)",
                    param=name,
                )

    def sampling_params(self, body: P._Sampling, max_tokens, logprobs, **override):
        """The body's `SamplingParams` (``override``: fields set last) once its model name and
        values pass (else `APIError`); fields the server does not know are logged and ignored,
        as vLLM does."""
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
            return body.sampling_params(max_tokens, logprobs, **override)
        except ValueError as e:  # not a SamplingParams field's: the output constraint's
            raise APIError.invalid(e, body.constraint()) from None

    def _lora(self, body: P._Sampling):
        """The `LoRARequest` the body's ``model`` names, or None."""
        return None if self.loras is None else self.loras.requests.get(body.model)

    async def encode(self, prompts, sp, param: str) -> tuple[list, list[list[int]]]:
        """(texts, ids) of ``prompts()`` by `Prompts._prepare` (a thread; a text: None for a
        token-id prompt), each within the context (`check_context`; the engine core checks the
        rest at `EngineCoreClient.add`); ValueError: 400 (``param``)."""
        try:
            _, encoded, _ = await run_in_threadpool(
                lambda: self.client.prompts._prepare(prompts(), sp, True)
            )
        except ValueError as e:
            raise APIError.invalid(e, param) from None
        for _, ids in encoded:
            check_context(ids, sp, self.client.info["max_model_len"], param)
        return [t for t, _ in encoded], [ids for _, ids in encoded]

    async def respond(
        self, request: Request, body: P._Sampling, prompts, sp, param: str, texts=None
    ):
        """The whole response, or (``body.stream``) a `StreamingResponse` of its chunks, once
        the engine core took every prompt (else `APIError`: 400 naming ``param``, 503);
        ``texts``: the prompts' texts (each output's ``prompt``) or None."""
        rid, lora = f"{self.prefix}-{next(self.ids)}", self._lora(body)
        model = self.model_name if lora is None else body.model  # vLLM's: the adapter's name
        try:
            added = await self.client.add(prompts, sp, body.stream, param, lora, texts)
        except APIError as e:  # a constraint the engine core could not compile: its own field
            if "StructuredOutputsParams." in str(e):
                e.param = body.constraint()
            raise
        events = self._events(request, *added)
        if body.stream:
            return StreamingResponse(
                self._chunks(rid, events, sp, body, model), media_type="text/event-stream"
            )
        choices, usage, outs = [], _usage(), {}
        async for p, out in events:
            if isinstance(out, APIError):
                raise out
            _count(usage, out)
            outs[p] = out
            choices += [
                self.choice(p * sp.n + c.index, out, c, sp.logprobs, body=body) for c in out.outputs
            ]
        choices.sort(key=lambda c: c["index"])
        more = self.fields(body, [outs[p] for p in sorted(outs)])
        return Response(
            self.dump(self.Response, rid, choices, usage, model, **more),
            media_type="application/json",
        )

    def dump(
        self, cls, rid: str, choices: list[dict], usage: dict | None = None, model=None, **more
    ) -> bytes:
        """A response or chunk of ``cls`` (its ``openai`` type) as JSON bytes, unvalidated (vLLM's
        finish reasons, ``stop_reason``); msgspec, not pydantic: one per stream per step costs
        2 us. ``model``: the name it answers with (the request's adapter; None: the served
        model's); ``more``: fields after ``usage`` (vLLM's)."""
        obj = typing.get_args(cls.model_fields["object"].annotation)[0]
        return _ENCODE(
            dict(
                id=rid,
                object=obj,
                created=int(time.time()),
                model=model or self.model_name,
                choices=choices,
                usage=usage,
                **more,
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

        if opening := self.opening(sp.n, body):
            yield chunk(opening)
        usage, offsets, firsts = _usage(), {}, {}
        async for p, ev in events:
            if isinstance(ev, APIError):
                yield f"data: {json.dumps(ev.body())}\n\n"
                continue
            _count(usage, ev, prompt=ev.finished)
            if ev.prompt_logprobs is not None:  # in a request's first output only
                firsts.setdefault(p, ev)
            for c in ev.outputs:  # DELTA outputs: each sample's new text, its finish reason
                i = p * sp.n + c.index
                ch = self.choice(i, firsts.get(p, ev), c, sp.logprobs, offsets.get(i), True, body)
                offsets[i] = offsets.get(i, 0) + self.sent(ch, c)
                yield chunk([ch])
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
            ("suffix", body.suffix is not None),
            ("best_of", body.best_of not in (None, body.n)),
        ):
            if bad:
                raise APIError(f"{field} is not supported", param=field)
        if body.echo and self.client.prompts.tokenizer is None:
            raise APIError("echo needs a tokenizer (the prompt's text)", param="echo")
        self.check_logprobs(body, ("logprobs", "prompt_logprobs"))
        plp = body.logprobs if body.prompt_logprobs is None and body.echo else body.prompt_logprobs
        most = 1 if body.echo and body.max_tokens == 0 else body.max_tokens  # vLLM's
        sp = self.sampling_params(body, most, body.logprobs, prompt_logprobs=plp)
        if body.prompt == []:
            raise APIError("prompt must not be empty", param="prompt")
        texts, prompts = await self.encode(lambda: body.prompt, sp, "prompt")
        if body.echo:  # a token-id prompt's text: its ids decoded, as vLLM's
            texts = [self._decode(ids) if t is None else t for t, ids in zip(texts, prompts)]
        return await self.respond(
            request, body, prompts, sp, "prompt", texts if body.echo else None
        )

    def _decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens kept (HF ``decode``'s default, vLLM's); "" for
        an id outside the tokenizer's range, which the engine core then refuses (a 400)."""
        try:
            return self.client.prompts._detokenize(ids, skip_special_tokens=False)
        except OverflowError:
            return ""

    def choice(
        self, index: int, req, out, k: int | None, offset=None, stream=False, body=None
    ) -> dict:
        """With ``body.echo``, a choice's first (its whole response, or its first chunk) starts
        with the prompt's text and logprob rows (`P.prompt_rows`); ``max_tokens`` 0: the
        prompt's alone."""
        text, rows = out.text, None if k is None or out.logprobs is None else out.top_logprobs(k)
        if body.echo and body.max_tokens == 0:
            text, rows = "", None if rows is None else []
        if body.echo and offset is None:
            text = req.prompt + text
            rows = None if rows is None else [*P.prompt_rows(req, k, self._decode), *rows]
        choice = dict(
            index=index,
            text=text,
            logprobs=None if rows is None else P.rows_logprobs(rows, offset or 0),
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        return choice if stream else dict(choice, prompt_logprobs=P.prompt_logprobs(req))

    def sent(self, choice: dict, out) -> int:
        return len(choice["text"])
