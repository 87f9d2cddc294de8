"""The engine-core process (vLLM V1's ``EngineCoreProc``): it owns JAX, the `LLM` and its
`LLMEngine` (scheduler, KV pool, step loop). `run_core` is its main, `EngineCore` its loop; the
wire messages (msgspec structs, msgpack) are defined here and shared with `client`.

Wire (ZeroMQ PUSH/PULL over ``ipc://DIR/in`` and ``ipc://DIR/out``, both bound here): the API
process sends `Add`, `Abort` and `Stop`; the core sends one `StepOutputs` per engine step that has
news: for every request the step touched, each sample's new token ids (never text) and logprob
records, and its finish; the requests added or rejected since the last message; the engine's
counters. Stop strings are matched here, not in the API process: the engine must end a sequence
on its stop string to free its slot; a finished sample carries its ``stop_string`` and the API
process cuts the text there. Times are ``time.perf_counter`` seconds (CLOCK_MONOTONIC on Linux:
one clock for both processes).

Signals: the core ignores SIGINT and SIGTERM (a terminal's or a supervisor's signal to the whole
process group); the API process drains and then sends `Stop`. The core also ends when its parent
is gone or its output cannot be sent for 2 s. Importing this module loads no JAX (the factory
does, in the child)."""

import logging
import os
import signal

import msgspec
import zmq

from jaxinfer.sampling_params import SamplingParams

log = logging.getLogger("jaxinfer.serve")
LogprobRecord = dict[int, tuple[float, int | None]] | None  # {token id: (logprob, rank)}


class Add(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Stop(msgspec.Struct, tag=True, array_like=True):
    """End the process (the API process has drained or aborted its requests)."""


class SampleDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """Sample ``index``'s news since the last message: ``token_ids`` appended (with their
    ``logprobs`` records; None: not asked); the rest as its `Sequence` now (finish: once)."""

    index: int
    token_ids: list[int]
    logprobs: list[LogprobRecord] | None = None
    cumulative_logprob: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_string: str | None = None
    finish_time: float | None = None


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    num_cached_tokens: int
    samples: list[SampleDelta]


class StepOutputs(msgspec.Struct, array_like=True):
    """One step's message: ``requests``' news; ``accepted``: request ids added; ``errors``:
    {request id: message}, rejected by `LLMEngine.add_request` (never accepted) or failed in a
    step; ``stats``: `engine_stats`."""

    requests: list[RequestDelta] = []
    accepted: list[str] = []
    errors: dict[str, str] = {}
    stats: dict[str, float] = {}


def engine_stats(engine) -> dict[str, float]:
    """`LLMEngine.stats`' numbers by name (counters, queue and KV pool sizes)."""
    s = engine.stats()
    return {"num_compiles": s.num_compiles, "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            **{k: v for k, v in vars(s).items() if type(v) in (int, float)}}


class EngineCore:
    """The step loop over ``engine`` (an `LLMEngine`, through its door) between the sockets at
    ``addr`` (``ipc://DIR``): commands are taken between steps, each step's news leaves at once."""

    def __init__(self, engine, addr: str) -> None:
        self.engine, self.parent, ctx = engine, os.getppid(), zmq.Context()
        self.inp, self.out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.SNDHWM, 0)  # never drop a step; a peer gone: Again after 2 s
        self.out.setsockopt(zmq.SNDTIMEO, 2000)
        self.inp.bind(addr + "/in")
        self.out.bind(addr + "/out")
        self.sent: dict[str, list] = {}  # request id -> per sample: tokens sent (None: finished)
        self.decode = msgspec.msgpack.Decoder(Add | Abort | Stop).decode
        self.encode = msgspec.msgpack.Encoder().encode

    def run(self) -> None:
        """Step while requests are in the engine; block on commands when idle. Returns on
        `Stop`, when the parent process is gone, or when a message cannot be sent."""
        eng = self.engine
        while os.getppid() == self.parent:
            if not eng.has_unfinished() and not self.inp.poll(500):
                continue
            msg = StepOutputs()
            while self.inp.poll(0):
                if not self._take(self.decode(self.inp.recv()), msg):
                    return
            if eng.has_unfinished():
                self._step(msg)
            if msg.requests or msg.accepted or msg.errors:
                msg.stats = engine_stats(eng)
                try:
                    self.out.send(self.encode(msg))
                except zmq.Again:
                    return

    def _take(self, cmd, msg: StepOutputs) -> bool:
        """Apply one command (False: `Stop`); an `Add` is acknowledged in ``msg``."""
        if isinstance(cmd, Stop):
            return False
        if isinstance(cmd, Abort):
            for rid in cmd.request_ids:
                self.engine.abort_request(rid)
            return True
        try:
            self.engine.add_request(cmd.prompt_token_ids, cmd.params, request_id=cmd.request_id)
        except Exception as e:  # ValueError: rejected; anything else: reported the same way
            msg.errors[cmd.request_id] = str(e)
        else:
            self.sent[cmd.request_id] = [0] * cmd.params.n
            msg.accepted.append(cmd.request_id)
        return True

    def _step(self, msg: StepOutputs) -> None:
        """One `LLMEngine.step` (raw: `Sequence`s); what is new per sample into ``msg``."""
        try:
            states = self.engine.step(raw=True)
        except Exception as e:  # never leave a client waiting: fail the requests in the engine
            log.exception("engine step failed; aborting the running requests")
            self.engine.abort_all()
            msg.errors.update({rid: f"engine error: {type(e).__name__}: {e}" for rid in self.sent})
            self.sent.clear()
            return
        for seqs in states:
            rid, news = seqs[0].parent_id, []
            sent = self.sent[rid]
            for s in seqs:
                n, done = sent[s.index], s.is_finished
                if n is None or n == s.num_output_tokens and not done:
                    continue
                news.append(SampleDelta(
                    s.index, s.output_token_ids[n:], None if s.logprobs is None else s.logprobs[n:],
                    s.cumulative_logprob, s.first_token_time, s.num_preemptions,
                    *((s.finish_reason, s.stop_string, s.finish_time) if done else ())))
                sent[s.index] = None if done else s.num_output_tokens
            if news:
                msg.requests.append(RequestDelta(rid, seqs[0].num_cached_tokens, news))
            if all(n is None for n in sent):
                del self.sent[rid]


def run_core(factory, addr: str, conn) -> None:
    """The engine-core process's main (multiprocessing "spawn"): ``llm = factory()`` (a
    `jaxinfer.LLM`), then on ``conn`` (a `multiprocessing.Pipe` end) ``("ready", info)`` or
    ``("error", message)`` (ValueError or FileNotFoundError, e.g. a bad ``--model``; any other
    exception prints its traceback and ends the process); then `EngineCore.run`. ``info``: the
    API process's needs: tokenizer, model_path, max_model_len, max_num_seqs, stats."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        llm = factory()
        core = EngineCore(llm.engine, addr)
    except (ValueError, FileNotFoundError) as e:
        conn.send(("error", str(e)))
        return
    eng = llm.engine
    conn.send(("ready", dict(tokenizer=llm.tokenizer, model_path=llm.model_path,
                             max_model_len=eng.max_model_len, stats=engine_stats(eng),
                             max_num_seqs=eng.resolved.engine.max_num_seqs)))
    conn.close()
    core.run()
