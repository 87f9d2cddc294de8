"""LoRA adapters on the host (no JAX): which adapter holds which of the device pool's
``max_loras`` slots, least recently used evicted first, never one with unfinished sequences
(vLLM's ``LRUCacheWorkerLoRAManager``; a request whose adapter finds no slot waits here, ahead of
the scheduler, until one frees), the adapters' weights kept as numpy for reloads
(`jaxinfer.lora.peft`) and replaced by `LoRAManager.update` (`LLM.update_lora`)."""

import dataclasses
import itertools

from jaxinfer.engine.sequence import Sequence, SequenceStatus
from jaxinfer.lora.peft import (
    AdapterError,
    PeftAdapter,
    load_adapter,
    parse_tensors,
    slot_arrays,
)
from jaxinfer.lora.request import LoRARequest


@dataclasses.dataclass
class _Pending:
    """A request waiting for a slot: its adapter's id and its samples (not yet scheduled)."""

    lora_int_id: int
    seqs: list[Sequence]


class LoRAManager:
    """Slots of ``runner``'s LoRA pool (`ModelRunner.write_lora`) for model config ``cfg`` under
    `EngineConfig` ``ec`` (``enable_lora``, ``max_loras`` S, ``max_lora_rank`` R) and compute
    ``dtype``. An adapter is identified by ``lora_int_id`` (one id, one set of weights)."""

    def __init__(self, runner, cfg, ec, dtype: str) -> None:
        self.runner, self.cfg, self.dtype = runner, cfg, dtype
        self.enabled, self.max_rank = ec.enable_lora, ec.max_lora_rank
        self.adapters: dict[int, tuple[LoRARequest, PeftAdapter]] = {}
        self.slots: list[int | None] = [None] * (ec.max_loras if ec.enable_lora else 0)
        self.users: dict[int, list[Sequence]] = {}  # id -> its unfinished sequences
        self.last_used: dict[int, int] = {}
        self.pending: list[_Pending] = []
        self._clock = itertools.count()

    def check(self, req: LoRARequest | None) -> None:
        """Read and check ``req``'s adapter on first sight (kept for its id; an id seen before
        keeps its first adapter's weights, whatever ``lora_path`` says, as vLLM's). ValueError:
        no `LoRARequest`; `AdapterError`: LoRA is off, an id already given to another name, as
        `load_adapter` (naming ``lora_name`` and ``lora_path``: `AdapterError.named`)."""
        if req is None:
            return
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request={req!r} is invalid: must be a LoRARequest or None")
        if not self.enabled:
            raise AdapterError(
                f"lora_request={req.lora_name!r} needs an engine built with enable_lora=True"
            )
        if (known := self.adapters.get(req.lora_int_id)) is not None:
            if known[0].lora_name != req.lora_name:
                raise AdapterError(
                    f"LoRARequest.lora_int_id={req.lora_int_id} is already adapter "
                    f"{known[0].lora_name!r}; give {req.lora_name!r} another id"
                )
            return
        try:
            adapter = load_adapter(req.lora_path, self.cfg, self.max_rank)
        except AdapterError as e:  # named as the request names it
            raise e.named(req.lora_name) from None
        self.adapters[req.lora_int_id] = (req, adapter)

    def admit(self, req: LoRARequest | None, seqs: list[Sequence], enqueue) -> None:
        """Hand ``seqs`` (one request's samples) to ``enqueue`` with their adapter's slot set,
        or keep them waiting (`admit_pending`) while every slot's adapter has unfinished
        sequences. ``req`` must have passed `check`."""
        if req is None:
            return enqueue(seqs)
        for s in seqs:
            s.lora_int_id, s.lora_request = req.lora_int_id, req
        self.pending.append(_Pending(req.lora_int_id, seqs))
        self.admit_pending(enqueue)

    def admit_pending(self, enqueue) -> None:
        """Every waiting request whose adapter has or finds a slot, in arrival order, to
        ``enqueue``."""
        waiting, self.pending = self.pending, []
        for p in waiting:
            if (slot := self._slot_for(p.lora_int_id)) is None:
                self.pending.append(p)
                continue
            for s in p.seqs:
                s.lora_slot = slot
            self.users.setdefault(p.lora_int_id, []).extend(p.seqs)
            self.last_used[p.lora_int_id] = next(self._clock)
            enqueue(p.seqs)

    def _busy(self, lora_id: int) -> bool:
        users = self.users.get(lora_id, [])
        users[:] = [s for s in users if not s.is_finished]
        return bool(users)

    def _slot_for(self, lora_id: int) -> int | None:
        """The slot of ``lora_id``: where it is, else a free one, else the least recently used
        idle one (the adapter written there); None: every slot busy."""
        if lora_id in self.slots:
            return self.slots.index(lora_id)
        idle = [i for i, held in enumerate(self.slots) if held is None or not self._busy(held)]
        if not idle:
            return None
        slot = min(
            idle, key=lambda i: -1 if self.slots[i] is None else self.last_used[self.slots[i]]
        )
        self._write(slot, lora_id)
        return slot

    def _write(self, slot: int, lora_id: int) -> None:
        adapter = self.adapters[lora_id][1]
        self.runner.write_lora(slot, slot_arrays(adapter, self.cfg, self.max_rank, self.dtype))
        self.slots[slot] = lora_id

    def abort(self, request_id: str) -> None:
        """Drop waiting sample ``request_id``: finished with "abort" (never scheduled)."""
        for p in self.pending:
            for s in (s for s in p.seqs if s.request_id == request_id):
                s.status, s.finish_reason = SequenceStatus.FINISHED, "abort"
        self.pending = [p for p in self.pending if not all(s.is_finished for s in p.seqs)]

    def find(self, name_or_id) -> int:
        """The id of a known adapter by ``lora_name`` or ``lora_int_id``. ValueError: unknown."""
        for i, (req, _) in self.adapters.items():
            if name_or_id in (req.lora_name, i) and not isinstance(name_or_id, bool):
                return i
        known = [(r.lora_name, i) for i, (r, _) in self.adapters.items()]
        raise ValueError(f"no LoRA adapter {name_or_id!r} in the engine; known: {known}")

    def update(self, name_or_id, tensors: dict) -> None:
        """Replace adapter ``name_or_id``'s weights with ``tensors`` (PEFT names, its rank and
        modules: `parse_tensors`), its scaling kept; written into its slot if it has one.
        ValueError (`AdapterError` when LoRA is off): unknown adapter, as `parse_tensors`, a
        module of the adapter missing or one it does not have."""
        if not self.enabled:
            raise AdapterError(
                f"update_lora({name_or_id!r}) needs an engine built with enable_lora=True"
            )
        i = self.find(name_or_id)
        req, old = self.adapters[i]
        new = parse_tensors(tensors, self.cfg, old.rank, req.lora_name)
        have, got = set(old.weights), set(new)
        faults = [
            f"{k} modules {sorted(v)}"
            for k, v in (("missing", have - got), ("unexpected", got - have))
            if v
        ]
        if faults:
            raise ValueError(
                f"update_lora({name_or_id!r}): {'; '.join(faults)} (the adapter's modules: "
                f"{sorted(have)})"
            )
        self.adapters[i] = (req, dataclasses.replace(old, weights=new))
        if i in self.slots:
            self._write(self.slots.index(i), i)
