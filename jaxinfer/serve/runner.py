"""The engine thread: one thread owns the `LLMEngine` and runs its step loop; the HTTP side
(asyncio) only queues commands (`submit`, `abort`) and receives events on asyncio queues. New
requests join the running batch between steps (continuous batching; async scheduling kept).
Source: vLLM's ``AsyncLLM`` / output handler, in one process. Host side, no JAX."""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

log = logging.getLogger("jaxinfer.serve")


class Delta(NamedTuple):
    """New output of sample ``index``: token ids, text (stop strings never shown), their
    ``{id: (logprob, rank)}`` records (None: not asked), and its finish reason once finished."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list | None
    finish_reason: str | None


@dataclass
class _Request:
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    stream: bool
    sent: list = field(default_factory=list)  # per sample: stream_delta's (tokens, text)
    reported: set = field(default_factory=set)  # samples whose finish was sent


class EngineRunner:
    """Runs ``engine`` (an `LLMEngine`) on a daemon thread. Events put on a request's sink, as
    ``(request id, event)``: a `Delta` (streaming requests only), then one final
    `jaxinfer.outputs.RequestOutput` (finish reason "abort" when aborted) or an error str.
    ``metrics``: a `ServerMetrics` told of every finished request."""

    def __init__(self, engine, metrics=None) -> None:
        self.engine, self.metrics = engine, metrics
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._reqs: dict[str, _Request] = {}
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self.idle = threading.Event()  # set while no request is in the engine

    def start(self) -> None:
        """Start the thread; the process's GIL switch interval drops to 0.5 ms, so a step's
        Python work waits at most that long for the HTTP side (the default 5 ms slows steps)."""
        sys.setswitchinterval(min(sys.getswitchinterval(), 5e-4))
        self._thread.start()

    def submit(self, rid: str, prompt_token_ids: list[int], params, sink: asyncio.Queue,
               stream: bool) -> None:
        """Queue a request (from the event loop's thread); its events go to ``sink``."""
        self.idle.clear()
        self._cmds.put(("add", rid, prompt_token_ids, params,
                        _Request(sink, asyncio.get_running_loop(), stream)))

    def abort(self, rid: str) -> None:
        """Abort ``rid`` at the next step (its pages return to the pool); unknown ids ignored."""
        self._cmds.put(("abort", rid))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every request (each gets its final output) and end the thread."""
        if self._thread.is_alive():
            self._cmds.put(("stop",))
            self._thread.join(timeout)

    def _run(self) -> None:
        eng = self.engine
        while True:
            busy = eng.has_unfinished()
            if not busy and not self._reqs:
                self.idle.set()
            cmds: list = []
            try:
                cmds.append(self._cmds.get(block=not busy))
                while True:
                    cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                pass
            events: list = []
            for cmd in cmds:
                if cmd[0] == "stop":
                    for rid in list(self._reqs):
                        self._finish(rid, events, abort=True)
                    self._deliver(events)
                    return
                if cmd[0] == "abort":
                    if cmd[1] in self._reqs:
                        self._finish(cmd[1], events, abort=True)
                    continue
                _, rid, ids, params, req = cmd
                try:
                    eng.add_request(ids, params, request_id=rid)
                    self._reqs[rid] = req
                    req.sent = [(0, "")] * params.n
                except Exception as e:  # ValueError: rejected; anything else: reported too
                    events.append((req, (rid, str(e))))
            if eng.has_unfinished():
                try:
                    self._step(events)
                except Exception as e:  # never leave a client waiting: fail the requests in it
                    log.exception("engine step failed; aborting the running requests")
                    eng.abort_all()
                    events += [(r, (rid, f"engine error: {type(e).__name__}: {e}"))
                               for rid, r in self._reqs.items()]
                    self._reqs.clear()
            self._deliver(events)

    def _step(self, events: list) -> None:
        eng = self.engine
        finished = eng.step()
        for rid, req in self._reqs.items():
            if not req.stream:
                continue
            for seq in eng.sequences(rid):
                d = eng.outputs.stream_delta(seq, req.sent[seq.index])
                done = seq.is_finished and seq.index not in req.reported
                if d is None and not done:
                    continue
                n0 = req.sent[seq.index][0]
                if d is None:
                    d = ([], "", req.sent[seq.index])
                ids, text, req.sent[seq.index] = d
                lps = None if seq.logprobs is None else seq.logprobs[n0:n0 + len(ids)]
                if done:
                    req.reported.add(seq.index)
                events.append((req, (rid, Delta(seq.index, ids, text, lps,
                                                seq.finish_reason if done else None))))
        for rid in finished:
            self._finish(rid, events)

    def _finish(self, rid: str, events: list, abort: bool = False) -> None:
        if abort:
            for s in self.engine.sequences(rid):
                if not s.is_finished:
                    self.engine.scheduler.abort(s.request_id)
        out = self.engine.pop_output(rid)
        if self.metrics is not None:
            self.metrics.record(out)
        events.append((self._reqs.pop(rid), (rid, out)))

    @staticmethod
    def _deliver(events: list) -> None:
        """Hand the events to their event loops, one wake-up per loop."""
        by_loop: dict = {}
        for req, ev in events:
            by_loop.setdefault(req.loop, []).append((req.sink, ev))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(lambda items=items: [s.put_nowait(e) for s, e in items])
            except RuntimeError:  # the loop is closed: nobody is waiting
                pass
