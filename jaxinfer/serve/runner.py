"""The engine thread owns the `LLMEngine` and runs its step loop; the HTTP side (asyncio) queues
commands (`submit`, `abort`) and gets events on asyncio queues; new requests join between steps.
Source: vLLM's ``AsyncLLM`` / output handler, one process. Host side, no JAX."""

import asyncio
import contextlib
import logging
import queue
import sys
import threading
from dataclasses import dataclass

from jaxinfer.outputs import CompletionOutput

log = logging.getLogger("jaxinfer.serve")


@dataclass
class _Request:
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    stream: bool
    sent: list  # per sample: stream_delta's (tokens, text); None once its finish was sent


class EngineRunner:
    """Runs ``engine`` (an `LLMEngine`) on a daemon thread. Events on a request's sink, ``(request
    id, event)``: streamed, a sample's new tokens, text and logprobs as a `CompletionOutput` (finish
    reason once finished); then one `RequestOutput` (aborted: "abort") or an error str."""

    def __init__(self, engine, metrics=None) -> None:
        self.engine, self.metrics = engine, metrics
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._reqs: dict[str, _Request] = {}
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self.idle = threading.Event()  # set while no request is in the engine

    def start(self) -> None:
        """Start the thread; the process's GIL switch interval drops to 0.5 ms."""
        sys.setswitchinterval(min(sys.getswitchinterval(), 5e-4))
        self._thread.start()

    def submit(self, rid: str, prompt_token_ids: list[int], params, sink: asyncio.Queue,
               stream: bool) -> None:
        """Queue a request (from the event loop's thread); its events go to ``sink``."""
        self.idle.clear()
        req = _Request(sink, asyncio.get_running_loop(), stream, [(0, "")] * params.n)
        self._cmds.put(("add", rid, prompt_token_ids, params, req))

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
            cmds, events = [], []
            with contextlib.suppress(queue.Empty):
                cmds.append(self._cmds.get(block=not busy))
                while True:
                    cmds.append(self._cmds.get_nowait())
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
            for seq in eng.sequences(rid) if req.stream else ():
                i, sent = seq.index, req.sent[seq.index]
                d = None if sent is None else eng.outputs.stream_delta(seq, sent)
                if sent is None or d is None and not seq.is_finished:
                    continue
                ids, text, req.sent[i] = d or ([], "", sent)
                lps = eng.outputs._logprobs(None if seq.logprobs is None else
                                            seq.logprobs[sent[0]:sent[0] + len(ids)])
                if seq.is_finished:
                    req.sent[i] = None
                events.append((req, (rid, CompletionOutput(
                    i, text, tuple(ids), seq.finish_reason if seq.is_finished else None,
                    logprobs=lps))))
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
        by_loop: dict = {}
        for req, ev in events:
            by_loop.setdefault(req.loop, []).append((req.sink, ev))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
                loop.call_soon_threadsafe(lambda items=items: [s.put_nowait(e) for s, e in items])
