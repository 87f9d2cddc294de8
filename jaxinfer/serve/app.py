"""The FastAPI application: OpenAI's ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions`` (streamed as server-sent events or not), ``/health`` and ``/metrics``,
over an `EngineRunner`. Errors are OpenAI's JSON (`protocol.error_body`): 400 bad parameter or
prompt, 401 missing or wrong API key, 404 unknown model or path, 413 body too large. Source:
vLLM's ``vllm/entrypoints/openai/api_server.py`` and ``serving_*.py``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from jaxinfer.outputs import RequestOutput
from jaxinfer.serve import protocol as P
from jaxinfer.serve.metrics import ServerMetrics
from jaxinfer.serve.runner import Delta, EngineRunner


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class _BodyLimit:
    """ASGI middleware: 413 for a declared Content-Length over ``limit`` bytes."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        size = dict(scope.get("headers", ())).get(b"content-length", b"0") if scope["type"] == \
            "http" else b"0"
        if size.isdigit() and int(size) > self.limit:
            msg = f"request body of {int(size)} bytes exceeds the limit of {self.limit} bytes"
            return await JSONResponse(P.error_body(msg, 413), 413)(scope, receive, send)
        await self.app(scope, receive, send)


def _param_of(message: str) -> str | None:
    m = re.search(r"SamplingParams\.(\w+)=", message)
    return m.group(1) if m else None


def create_app(llm, *, served_model_name: str | None = None, api_key: str | None = None,
               max_request_bytes: int = 8 << 20) -> FastAPI:
    """The app over ``llm`` (a `jaxinfer.LLM`: its engine, tokenizer and chat template); the
    engine thread starts and stops with the app (lifespan). ``api_key``: when set, /v1 requests
    need ``Authorization: Bearer KEY``. ``app.state.runner``: the `EngineRunner`."""
    engine = llm.engine
    name = served_model_name or "jaxinfer"
    metrics = ServerMetrics(engine)
    runner = EngineRunner(engine, metrics)
    ids = itertools.count()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        runner.start()
        yield
        await run_in_threadpool(runner.stop)

    app = FastAPI(title="jaxinfer", lifespan=lifespan)
    app.state.runner, app.state.metrics = runner, metrics
    app.add_middleware(_BodyLimit, limit=max_request_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(P.error_body(str(e), e.status, e.param, e.code), e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        err = e.errors()[0]
        if err.get("type") == "json_invalid":  # loc is ("body", offset): not a parameter
            return JSONResponse(P.error_body(f"the request body is not valid JSON: "
                                             f"{err.get('msg')}", 400), 400)
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return JSONResponse(P.error_body(f"{param or 'body'}: {err.get('msg')}", 400, param), 400)

    @app.exception_handler(HTTPException)
    async def _http(_, e: HTTPException):
        return JSONResponse(P.error_body(str(e.detail), e.status_code), e.status_code)

    def auth(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError("invalid or missing API key: send 'Authorization: Bearer KEY'", 401,
                           code="invalid_api_key")

    def check_model(body: P._Sampling) -> None:
        if body.model is not None and body.model != name:
            raise APIError(f"The model `{body.model}` does not exist; this server serves "
                           f"`{name}`", 404, "model", "model_not_found")

    def params(body: P._Sampling, max_tokens, logprobs):
        if not 1 <= body.n <= engine.resolved.engine.max_num_seqs:
            raise APIError(f"n={body.n} is invalid: must be in [1, max_num_seqs="
                           f"{engine.resolved.engine.max_num_seqs}]", param="n")
        try:
            sp = body.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise APIError(str(e).replace("SamplingParams.", ""), param=_param_of(str(e))) from None
        if sp.stop and llm.tokenizer is None:
            raise APIError("stop strings need a tokenizer; this model has none", param="stop")
        return sp

    def encode(text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(f"prompt is not valid Unicode text: {e.reason}",
                           param="prompt") from None
        try:
            return llm.encode(text)
        except ValueError as e:
            raise APIError(str(e), param="prompt") from None

    def check_prompt(ids: list[int], sp, param: str) -> None:
        try:
            engine.check_request(ids, sp)
        except ValueError as e:
            raise APIError(str(e), param=param) from None

    async def run(request: Request, prompts: list[list[int]], sp, stream: bool):
        """Yield ``(prompt index, event)`` until every prompt's request finished; abort those
        left when the client goes away (the generator is closed)."""
        sink: asyncio.Queue = asyncio.Queue()
        rids = {f"req-{next(ids)}": i for i in range(len(prompts))}
        for rid, i in rids.items():
            runner.submit(rid, prompts[i], sp, sink, stream)
        left = set(rids)
        try:
            while left:
                try:
                    rid, ev = await asyncio.wait_for(sink.get(), 1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if not isinstance(ev, Delta):
                    left.discard(rid)
                yield rids[rid], ev
        finally:
            for rid in left:
                runner.abort(rid)

    def token_text(t: int) -> str:
        return llm.tokenizer.decode([t]) if llm.tokenizer is not None else f"token_id:{t}"

    def top(rec: dict, k: int) -> list[tuple[str, float]]:
        items = sorted(((_lp(v), t) for t, v in rec.items()), key=lambda x: x[0][1] or 0)
        return [(token_text(t), lp) for (lp, rank), t in items if rank is not None and rank <= k]

    def completion_logprobs(ids, recs, k: int, offset: int) -> P.CompletionLogprobs:
        out = P.CompletionLogprobs()
        for t, rec in zip(ids, recs):
            out.tokens.append(s := token_text(t))
            out.token_logprobs.append(_lp(rec[t])[0])
            out.top_logprobs.append(dict(top(rec, k)))
            out.text_offset.append(offset)
            offset += len(s)
        return out

    def chat_logprobs(ids, recs, k: int) -> P.ChatLogprobs:
        def entry(tok, lp, cls=P.TopLogprob, **kw):
            return cls(token=tok, logprob=lp, bytes=list(tok.encode("utf-8", "replace")), **kw)
        return P.ChatLogprobs(content=[
            entry(token_text(t), _lp(rec[t])[0], P.ChatTokenLogprob,
                  top_logprobs=[entry(s, lp) for s, lp in top(rec, k)])
            for t, rec in zip(ids, recs)])

    async def respond(request, body, prompts, sp, chat: bool):
        rid, n, k = f"{'chatcmpl' if chat else 'cmpl'}-{next(ids)}", sp.n, sp.logprobs
        usage = P.UsageInfo()
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            Chunk = P.ChatCompletionChunk if chat else P.CompletionResponse

            def chunk(choices) -> str:
                return f"data: {Chunk(id=rid, model=name, choices=choices).model_dump_json()}\n\n"

            async def events():
                if chat:
                    yield chunk([P.ChatStreamChoice(index=i, delta=P.DeltaMessage(
                        role="assistant", content="")) for i in range(n)])
                offsets = [0] * (n * len(prompts))
                async for p, ev in run(request, prompts, sp, True):
                    if isinstance(ev, str):
                        yield f"data: {json.dumps(P.error_body(ev, 400))}\n\n"
                    elif isinstance(ev, RequestOutput):
                        usage.prompt_tokens += len(ev.prompt_token_ids)
                        usage.completion_tokens += sum(len(c.token_ids) for c in ev.outputs)
                        for c in ev.outputs:  # aborted samples: their finish reason
                            if c.finish_reason == "abort":
                                yield chunk([_choice(chat, p * n + c.index, "", None, "abort")])
                    else:
                        i = p * n + ev.index
                        lps = None if ev.logprobs is None or k is None else (
                            chat_logprobs(ev.token_ids, ev.logprobs, k) if chat else
                            completion_logprobs(ev.token_ids, ev.logprobs, k, offsets[i]))
                        offsets[i] += len(ev.text)
                        yield chunk([_choice(chat, i, ev.text, lps, ev.finish_reason)])
                if include_usage:
                    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                    last = Chunk(id=rid, model=name, choices=[], usage=usage)
                    yield f"data: {last.model_dump_json()}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        choices = []
        async for p, out in run(request, prompts, sp, False):
            if isinstance(out, str):
                raise APIError(out)
            usage.prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                usage.completion_tokens += len(c.token_ids)
                lps = None if k is None or c.logprobs is None else (
                    chat_logprobs(c.token_ids, c.logprobs, k) if chat
                    else completion_logprobs(c.token_ids, c.logprobs, k, 0))
                msg = P.DeltaMessage(role="assistant", content=c.text)
                choices.append(P.ChatChoice(index=p * n + c.index, message=msg, logprobs=lps,
                                            finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason) if chat else
                               P.CompletionChoice(index=p * n + c.index, text=c.text,
                                                  logprobs=lps, finish_reason=c.finish_reason,
                                                  stop_reason=c.stop_reason))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        Resp = P.ChatCompletionResponse if chat else P.CompletionResponse
        return Resp(id=rid, model=name, choices=sorted(choices, key=lambda c: c.index), usage=usage)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models() -> P.ModelList:
        return P.ModelList(data=[P.ModelCard(id=name, max_model_len=engine.max_model_len)])

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(body: P.CompletionRequest, request: Request):
        check_model(body)
        for field, bad in (("echo", body.echo), ("suffix", body.suffix is not None),
                           ("best_of", body.best_of not in (None, body.n))):
            if bad:
                raise APIError(f"{field} is not supported", param=field)
        sp = params(body, body.max_tokens, body.logprobs)
        p = body.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        prompts = [await run_in_threadpool(encode, x) if isinstance(x, str) else x for x in p]
        for x in prompts:
            check_prompt(x, sp, "prompt")
        return await respond(request, body, prompts, sp, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        check_model(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        sp = params(body, body.max_completion_tokens or body.max_tokens,
                    (body.top_logprobs or 0) if body.logprobs else None)
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = await run_in_threadpool(llm.apply_chat_template, msgs)
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        check_prompt(prompt, sp, "messages")
        return await respond(request, body, [prompt], sp, chat=True)

    return app


def _lp(v) -> tuple[float, int | None]:
    """(logprob, rank) of a ``(logprob, rank)`` record or a `jaxinfer.outputs.Logprob`."""
    return (v.logprob, v.rank) if hasattr(v, "logprob") else (float(v[0]), v[1])


def _choice(chat: bool, index: int, text: str, lps, finish_reason):
    if chat:
        return P.ChatStreamChoice(index=index, delta=P.DeltaMessage(content=text), logprobs=lps,
                                  finish_reason=finish_reason)
    return P.CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=finish_reason)
