"""The API process's side of the engine core (vLLM V1's ``AsyncLLM``, ``EngineCoreClient``): starts
`core.run_core` (multiprocessing "spawn": JAX is not fork-safe), sends requests and aborts, turns
each `core.StepOutputs` into `RequestOutput`s (an `OutputProcessor` over mirrors of the core's
`Sequence`s: text, stop-string cuts, deltas) on the event loop. Host side, no JAX."""

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import shutil
import tempfile

import msgspec
import zmq
import zmq.asyncio

from jaxinfer.engine.sequence import Sequence, SequenceStatus
from jaxinfer.outputs import OutputProcessor
from jaxinfer.prompts import Prompts
from jaxinfer.sampling_params import RequestOutputKind
from jaxinfer.serve import core
from jaxinfer.serve.errors import APIError

log = logging.getLogger("jaxinfer.serve")


class EngineCoreClient:
    """Starts ``factory()`` (a picklable callable returning a `jaxinfer.LLM`) in the engine-core
    process and waits until it is ready (ValueError: it could not start, its one-line error).
    ``info``: what the core sent (`core.run_core`); ``prompts``: a `Prompts` over its tokenizer;
    ``stats``: the engine's latest `core.engine_stats`; ``metrics``: a `ServerMetrics` or None;
    ``dead``: None, or why the core is gone; ``on_death()``: called once when it dies."""

    def __init__(self, factory) -> None:
        self._dir = tempfile.mkdtemp(prefix="jaxinfer-core-")
        ctx = multiprocessing.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=core.run_core,
            args=(factory, "ipc://" + self._dir, send),
            name="jaxinfer-engine-core",
        )
        self.loop = self.dead = self.on_death = self.metrics = None
        self._closing, self._ids = False, itertools.count()
        self._open: dict = {}  # request id -> (its queue, its ack: None, or a str: rejected)
        try:
            self.proc.start()
            send.close()  # the core's end only: its exit is an EOF here
            kind, self.info = recv.recv()
            if kind == "error":
                raise ValueError(self.info)
        except BaseException as e:
            self.close()
            if isinstance(e, EOFError):
                raise ValueError(
                    f"the engine core process exited with code "
                    f"{self.proc.exitcode} while starting (traceback above)"
                ) from None
            raise
        self.prompts, self.stats = Prompts(self.info["tokenizer"]), self.info["stats"]
        self.outputs = OutputProcessor(self.prompts._detokenize if self.prompts.tokenizer else None)
        self.encode = msgspec.msgpack.Encoder().encode

    async def connect(self) -> None:
        """Open the sockets on the running loop, watch the core's process, read its messages."""
        self.loop, ctx = asyncio.get_running_loop(), zmq.asyncio.Context()
        self._in, self._out = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        self._in.connect(f"ipc://{self._dir}/in")
        self._out.connect(f"ipc://{self._dir}/out")
        self.loop.add_reader(self.proc.sentinel, self._died)
        self._reader = asyncio.create_task(self._read())

    async def add(
        self, prompts: list[list[int]], params, stream: bool, param: str, lora=None, texts=None
    ):
        """Queue one request per prompt (token ids; ``texts``: their texts, each output's
        ``prompt``, or None), wait until the core took them all. Returns
        ({request id: prompt index}, the queue of their ``(request id, event)``: `RequestOutput`s
        (``stream``: DELTA, else one FINAL_ONLY; the last ``finished``) or, last, an `APIError`
        (503: the core died)). APIError: 503, the core is gone; 400 naming ``param``, one was
        rejected (the others aborted). ``lora``: the `LoRARequest` they run with, or None."""
        if self.dead is not None:
            raise APIError(self.dead, 503)
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        params, sink = dataclasses.replace(params, output_kind=kind), asyncio.Queue()
        rids = {f"req-{next(self._ids)}": i for i in range(len(prompts))}
        try:
            for rid, i in rids.items():
                lora_args = lora and (lora.lora_name, lora.lora_int_id, lora.lora_path)
                msg = self.encode(core.Add(rid, prompts[i], params, lora_args))  # OverflowError
                seqs = [
                    Sequence(rid, prompts[i], params, 0, index=j, max_tokens=0)  # a mirror
                    for j in range(params.n)
                ]
                self.outputs.add(rid, seqs, texts and texts[i])
                self._open[rid] = sink, self.loop.create_future()
                self._in.send(msg)
            acks = await asyncio.gather(*(self._open[rid][1] for rid in rids))
        except BaseException as e:
            self.abort(rid for rid in rids if rid in self._open)
            where = f"request {i}: " if len(prompts) > 1 else ""  # which prompt of a list
            if isinstance(e, OverflowError):
                raise APIError(
                    f"{where}an integer in it is out of range (|x| < 2**63)", param=param
                ) from None
            raise
        if bad := [(i, a) for i, a in enumerate(acks) if a is not None]:
            self.abort(rids)
            i, a = bad[0]
            where = f"request {i}: " if len(prompts) > 1 else ""
            raise (a if isinstance(a, APIError) else APIError.invalid(ValueError(where + a), param))
        return rids, sink

    def abort(self, rids) -> None:
        """Abort these requests at the core's next step (their final outputs still come)."""
        if (rids := list(rids)) and self.dead is None:
            self._in.send(self.encode(core.Abort(rids)))

    def abort_all(self) -> None:
        self.abort(self._open)

    async def _read(self) -> None:
        decode = msgspec.msgpack.Decoder(core.StepOutputs).decode
        while True:
            msg = decode(await self._out.recv())
            try:
                self._apply(msg)
            except Exception:  # a bug here must not stop every stream
                log.exception("the engine core's message could not be applied")

    def _apply(self, msg: core.StepOutputs) -> None:
        """Acks, errors and new tokens into the mirrors; the outputs due into their queues."""
        self.stats = msg.stats
        for rid in msg.accepted:
            if rid in self._open and not self._open[rid][1].done():
                self._open[rid][1].set_result(None)
        for rid, err in msg.rejected.items():  # a str: 400 naming the prompt's field
            param = msg.rejected_param.get(rid)
            self._fail(rid, err if param is None else APIError(err, param=param))
        for d in (live := [d for d in msg.samples if d.request_id in self._open]):
            seqs = self.outputs.requests[d.request_id].seqs
            _merge(seqs[d.index], d)
            if d.prompt_logprobs is not None:  # the request's, where its outputs read them
                seqs[0].prompt_logprobs = d.prompt_logprobs
        touched = [d.request_id for d in live]
        seqs = {rid: self.outputs.requests[rid].seqs for rid in touched}
        for out in self.outputs.outputs(touched):
            self._open[out.request_id][0].put_nowait((out.request_id, out))
            if out.finished:
                del self._open[out.request_id]
                if self.metrics is not None:
                    self.metrics.record(seqs[out.request_id])

    def _fail(self, rid: str, err) -> None:
        """End ``rid`` with ``err`` (a str: rejected; an APIError): its ack if pending, else its
        last event."""
        if (req := self._open.pop(rid, None)) is None:
            return
        self.outputs.requests.pop(rid, None)
        if not req[1].done():
            req[1].set_result(err)
        else:
            req[0].put_nowait((rid, err))

    def _died(self) -> None:
        """The core's process ended: every open request gets a 503; `on_death`."""
        self.loop.remove_reader(self.proc.sentinel)
        if self._closing:
            return
        self.proc.join(1)
        self.dead = f"the engine core process died (exit code {self.proc.exitcode})"
        log.error("%s; failing %d open requests", self.dead, len(self._open))
        for rid in list(self._open):
            self._fail(rid, APIError(self.dead, 503))
        if self.on_death is not None:
            self.on_death()

    async def shutdown(self) -> None:
        """Stop the core (`core.Stop`; killed after 10 s) and close the sockets."""
        self._closing = True
        self.loop.remove_reader(self.proc.sentinel)
        self._reader.cancel()
        if self.proc.is_alive():
            self._in.send(self.encode(core.Stop()))
        await self.loop.run_in_executor(None, self.close, 10.0)
        for sock in (self._in, self._out):
            sock.close(linger=0)

    def close(self, timeout: float = 0.0) -> None:
        """Wait up to ``timeout`` s for the core's process to end, kill it if not; idempotent."""
        self._closing = True
        if self.proc.pid is not None:
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        shutil.rmtree(self._dir, ignore_errors=True)


def _merge(s: Sequence, d: core.SampleDelta) -> None:
    """Apply a `core.SampleDelta` to the mirror ``s``."""
    s.output_token_ids += d.token_ids
    if d.logprobs is not None:
        s.logprobs += d.logprobs
    for f in core.NOW:
        setattr(s, f, getattr(d, f))
    if d.finish_reason is not None:
        s.status = SequenceStatus.FINISHED
