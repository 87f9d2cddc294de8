"""The engine thread owns the `LLMEngine` and runs its step loop; the HTTP side (asyncio) queues
commands (`submit`, `abort`) and gets events on asyncio queues; new requests join between steps.
Source: vLLM's ``AsyncLLM`` / output handler, one process. Host side, no JAX."""

import asyncio
import contextlib
import dataclasses
import logging
import queue
import sys
import threading
from dataclasses import dataclass

from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import RequestOutputKind

log = logging.getLogger("jaxinfer.serve")


@dataclass
class _Request:
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    acc: RequestOutput | None = None  # streamed: the deltas so far, for the metrics


class EngineRunner:
    """Runs ``engine`` (an `LLMEngine`) on a daemon thread, through its door only. Events on a
    request's sink, ``(request id, event)``: `RequestOutput`s (streamed: DELTA outputs, else one
    FINAL_ONLY output; the last has ``finished``; aborted samples: "abort"), or an error str."""

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
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        self._cmds.put(("add", rid, prompt_token_ids, dataclasses.replace(params, output_kind=kind),
                        _Request(sink, asyncio.get_running_loop())))

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
                    for rid in self._reqs:
                        eng.abort_request(rid)
                    self._step(events)
                    self._deliver(events)
                    return
                if cmd[0] == "abort":
                    eng.abort_request(cmd[1])
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
        for out in self.engine.step():
            if (req := self._reqs.get(out.request_id)) is None:
                continue
            events.append((req, (out.request_id, out)))
            if out.finished:
                del self._reqs[out.request_id]
                if self.metrics is not None:
                    self.metrics.record(out if req.acc is None else req.acc.add(out))
            else:
                req.acc = out if req.acc is None else req.acc.add(out)

    @staticmethod
    def _deliver(events: list) -> None:
        by_loop: dict = {}
        for req, ev in events:
            by_loop.setdefault(req.loop, []).append((req.sink, ev))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
                loop.call_soon_threadsafe(lambda items=items: [s.put_nowait(e) for s, e in items])
