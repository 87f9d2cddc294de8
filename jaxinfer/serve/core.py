"""The engine-core process (vLLM V1's ``EngineCoreProc``): it owns JAX, the `LLM` and its step loop;
`run_core` is its main. Wire: ZeroMQ PUSH/PULL on ``ipc://DIR/in`` and ``ipc://DIR/out`` (bound
here), msgspec msgpack; in: `Add`, `Abort`, `Stop`; out: one `StepOutputs` per step with news. Stop
strings are matched here (to free the slot); the API process cuts the text at the ``stop_string``.
Times: ``time.perf_counter`` (one clock for both processes on Linux). SIGINT and SIGTERM are ignored
(the API process drains, then sends `Stop`); the core ends with its parent, or on an exception in a
step (vLLM's ``EngineDeadError``: the API process fails open requests). Imports no JAX."""

import functools
import os
import signal
import sys
import time

import msgspec
import zmq

from jaxinfer.lora.peft import AdapterError, model_shape
from jaxinfer.lora.request import LoRARequest
from jaxinfer.sampling_params import SamplingParams


class Add(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: tuple[str, int, str] | None = None  # its `LoRARequest`'s (name, id, path), or None


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Stop(msgspec.Struct, tag=True, array_like=True):
    """End the process."""


_Records = list[dict[int, tuple[float, int | None]] | None]  # per position {id: (logprob, rank)}


class SampleDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """Sample ``index`` of ``request_id``: its new ``token_ids`` (never text) since the last
    message, their ``logprobs`` records (None: not asked); ``prompt_logprobs``: the request's
    prompt records (first None), once, in its first delta (None: not asked, or sent); the
    rest (`NOW`) as its `Sequence`'s now."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: _Records | None = None
    prompt_logprobs: _Records | None = None
    cumulative_logprob: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_string: str | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0


NOW = SampleDelta.__struct_fields__[5:]  # the fields a delta carries as the `Sequence`'s now


class StepOutputs(msgspec.Struct, array_like=True):
    """One step's news: the ``samples`` it touched; ``accepted`` request ids; ``rejected``
    {request id: `LLMEngine.add_request`'s error}; ``stats``: `engine_stats`; ``rejected_param``
    {request id: the request field its rejection names, where not the prompt: "model" for its
    LoRA adapter's error}."""

    samples: list[SampleDelta] = []
    accepted: list[str] = []
    rejected: dict[str, str] = {}
    stats: dict[str, float] = {}
    rejected_param: dict[str, str] = {}


def engine_stats(engine) -> dict[str, float]:
    """`LLMEngine.stats`' numbers by name (counters, queue and KV pool sizes); the accepted draft
    tokens per position as ``spec_accepted_per_pos.{i}``, i < num_speculative_tokens (none
    without ``speculative_config``)."""
    s, spec = engine.stats(), engine.resolved.engine.speculative_config
    per_pos = s.accepted_per_pos(spec.num_speculative_tokens if spec else 0)
    return {
        "num_compiles": s.num_compiles,
        "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
        **{f"spec_accepted_per_pos.{i}": n for i, n in enumerate(per_pos)},
        **{k: v for k, v in vars(s).items() if type(v) in (int, float)},
    }


def _add_request_id(raw: bytes) -> str | None:
    """The request id of a malformed `Add` (to reject it by name), or None: another message."""
    try:
        fields = msgspec.msgpack.decode(raw)
    except msgspec.MsgspecError:
        return None
    ok = isinstance(fields, list) and len(fields) > 1 and fields[0] == "Add"
    return fields[1] if ok and isinstance(fields[1], str) else None


class EngineCore:
    """The step loop over ``engine`` (an `LLMEngine`, through its door) between the sockets at
    ``addr`` (``ipc://DIR``): commands are taken between steps, each step's news leaves at once."""

    def __init__(self, engine, addr: str) -> None:
        self.engine, self.parent, ctx = engine, os.getppid(), zmq.Context()
        self.inp, self.out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        self.out.sndhwm, self.out.sndtimeo = 0, 2000  # never drop a step; no peer: Again, 2 s
        self.inp.bind(addr + "/in")
        self.out.bind(addr + "/out")
        self.sent: dict[str, list] = {}  # request id -> per sample: tokens sent (None: finished)
        self.prompt_due: set[str] = set()  # request ids whose prompt logprobs are not sent yet
        self.decode = msgspec.msgpack.Decoder(Add | Abort | Stop).decode
        self.encode = msgspec.msgpack.Encoder().encode

    def run(self) -> None:
        """Step while requests are in the engine, taking commands between steps (an `Add` is
        acknowledged in the step's message); block on commands when idle. Returns on `Stop`, when
        the parent process is gone, or when a message cannot be sent for 2 s."""
        eng = self.engine
        while os.getppid() == self.parent:
            if not eng.has_unfinished() and not self.inp.poll(500):
                continue
            msg = StepOutputs()
            while self.inp.poll(0):
                try:
                    cmd = self.decode(raw := self.inp.recv())
                except msgspec.MsgspecError as e:  # a message our types refuse: never fatal
                    if (rid := _add_request_id(raw)) is not None:
                        msg.rejected[rid] = f"the request is invalid: {e}"
                    else:
                        print(f"jaxinfer-serve: malformed message dropped: {e}", file=sys.stderr)
                    continue
                if isinstance(cmd, Stop):
                    return
                for rid in cmd.request_ids if isinstance(cmd, Abort) else ():
                    eng.abort_request(rid)
                if isinstance(cmd, Add):
                    self._add(cmd, msg)
            if eng.has_unfinished():
                self._step(msg)
            if msg.samples or msg.accepted or msg.rejected:
                msg.stats = engine_stats(eng)
                try:
                    self.out.send(self.encode(msg))
                except zmq.Again:
                    return

    def _add(self, cmd: Add, msg: StepOutputs) -> None:
        """`LLMEngine.add_request` of ``cmd``: accepted, or rejected with its error in ``msg``
        (an `AdapterError`'s names "model", the field that chose the adapter)."""
        rid = cmd.request_id
        try:
            lora = cmd.lora and LoRARequest(*cmd.lora)
            self.engine.add_request(
                cmd.prompt_token_ids, cmd.params, request_id=rid, lora_request=lora
            )
        except Exception as e:  # ValueError: rejected; anything else: the same way
            msg.rejected[rid] = str(e)
            if isinstance(e, AdapterError):
                msg.rejected_param[rid] = "model"
            return
        self.sent[rid] = [0] * cmd.params.n
        if cmd.params.prompt_logprobs is not None:
            self.prompt_due.add(rid)
        msg.accepted.append(rid)

    def _step(self, msg: StepOutputs) -> None:
        """One `LLMEngine.step` (raw: `Sequence`s); what is new per sample into ``msg``, a
        request's prompt logprobs with its first delta (its prefill is done by then)."""
        for seqs in self.engine.step(raw=True):
            sent = self.sent[rid := seqs[0].parent_id]
            for s in seqs:
                if (n := sent[s.index]) is None or n == s.num_output_tokens and not s.is_finished:
                    continue
                plp = None
                if rid in self.prompt_due:
                    self.prompt_due.discard(rid)
                    plp = s.prompt_logprobs
                msg.samples.append(
                    SampleDelta(
                        rid,
                        s.index,
                        s.output_token_ids[n:],
                        s.logprobs and s.logprobs[n:],
                        plp,
                        *(getattr(s, f) for f in NOW),
                    )
                )
                sent[s.index] = None if s.is_finished else s.num_output_tokens
            if all(n is None for n in sent):
                del self.sent[rid]
                self.prompt_due.discard(rid)


def run_core(factory, addr: str, conn) -> None:
    """The engine-core process's main: ``llm = factory()`` (a `jaxinfer.LLM`), then on ``conn`` (a
    `multiprocessing.Pipe` end) ``("ready", info)`` (tokenizer, model_path, max_model_len,
    max_num_seqs, max_lora_rank, max_logprobs, stats, lora_model: the model's `model_shape` with
    LoRA on, for the API process's adapter checks, else None) or ``("error", message)``
    (ValueError or FileNotFoundError; any other exception prints its traceback and ends the
    process); then `EngineCore.run`. The start-up precompile says what it does on stderr."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    say = functools.partial(print, "jaxinfer-serve:", file=sys.stderr, flush=True)
    try:
        t = time.perf_counter()
        llm = factory()
        if llm.engine.resolved.engine.precompile:
            stats = llm.engine.stats()
            say(
                f"compiled or loaded {len(stats.forward_shapes)} forward and "
                f"{len(stats.sampler_shapes)} sampler shapes; ready in "
                f"{time.perf_counter() - t:.0f} s (a restart loads them from the compilation cache)"
            )
        core = EngineCore(llm.engine, addr)
    except (ValueError, FileNotFoundError) as e:
        conn.send(("error", str(e)))
        return
    eng = llm.engine
    conn.send(
        (
            "ready",
            dict(
                tokenizer=llm.tokenizer,
                model_path=llm.model_path,
                max_model_len=eng.max_model_len,
                stats=engine_stats(eng),
                max_num_seqs=eng.resolved.engine.max_num_seqs,
                max_lora_rank=eng.resolved.engine.max_lora_rank,
                max_logprobs=eng.resolved.engine.max_logprobs,
                lora_model=model_shape(eng.model_config) if eng.lora.enabled else None,
            ),
        )
    )
    conn.close()
    core.run()
