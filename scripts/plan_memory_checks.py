"""`plan_memory`'s checks (scripts/plan_memory.py): its arguments, the LoRA pool's (and its
bytes), that the weights fit, that one sequence of the context fits; each raises ValueError with
one line saying what is allowed."""

from __future__ import annotations

from jaxinfer.checks import check_int, is_number
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.config.memory import GIB, _gib
from jaxinfer.config.model import check_tp
from jaxinfer.config.resolved import _check_lora
from jaxinfer.lora.peft import pool_bytes


def check_plan_args(cfg: ModelConfig, ints: dict, utilization, planning_fraction) -> None:
    """`plan_memory`'s argument checks, in its order: each of ``ints`` (name -> value, in
    `plan_memory`'s order) an integer >= 1 (``context`` at most ``cfg.max_position_embeddings``),
    a model ``tensor_parallel_size`` can split (`check_tp`), a power-of-two ``page_size``,
    ``utilization`` and ``planning_fraction`` in (0, 1]. Raises ValueError."""
    for name, v in ints.items():
        hi = cfg.max_position_embeddings if name == "context" else None
        check_int(f"plan_memory: {name}", v, 1, hi)
    check_tp(cfg, ints["tensor_parallel_size"])
    page_size = ints["page_size"]
    if page_size & (page_size - 1):
        raise ValueError(f"plan_memory: page_size={page_size!r} is invalid: must be a power of two")
    for name, v in (("utilization", utilization), ("planning_fraction", planning_fraction)):
        if not (is_number(v) and 0.0 < v <= 1.0):
            raise ValueError(f"plan_memory: {name}={v!r} is invalid: must be in (0, 1]")


def lora_pool_bytes(cfg: ModelConfig, lora: tuple[int, int] | None, tp: int, dtype_bytes: int):
    """Bytes (one device) of the LoRA pool an engine with ``enable_lora`` and ``lora`` =
    (``max_loras``, ``max_lora_rank``) allocates for ``cfg``, ``dtype_bytes`` an element (the
    compute dtype): `jaxinfer.lora.peft.pool_bytes`, the count the engine takes from the KV
    budget; 0 for ``lora`` None (LoRA off). Raises ValueError as the engine's checks do:
    max_loras or max_lora_rank not an integer >= 1 (`EngineConfig`), ``tp`` > 1 or a
    mixture-of-experts model (`jaxinfer.config.resolved._check_lora`)."""
    if lora is None:
        return 0
    S, R = lora
    ec = EngineConfig(enable_lora=True, max_loras=S, max_lora_rank=R, tensor_parallel_size=tp)
    _check_lora(cfg, ec)
    return pool_bytes(cfg, S, R, dtype_bytes)


def kv_budget(device_bytes, utilization, weight_bytes, reserve_bytes, lora_bytes=0):
    """``(usable, budget)``: usable = ``int(device_bytes x utilization)``, the KV budget = usable -
    weight_bytes - reserve_bytes - lora_bytes (the LoRA pool's). Raises ValueError: either of
    the first two bytes not an integer >= 0; they do not fit (by how much, and what would
    help)."""
    for name, v in (("reserve_bytes", reserve_bytes), ("weight_bytes", weight_bytes)):
        check_int(f"plan_memory: {name}", v, 0)
    usable = int(device_bytes * utilization)
    budget = usable - weight_bytes - reserve_bytes - lora_bytes
    if budget <= 0:
        lora = f" + LoRA pool {_gib(lora_bytes)}" if lora_bytes else ""
        what = "the weights and the LoRA pool" if lora else "the weights"
        raise ValueError(
            f"plan_memory: {what} do not fit: weights {_gib(weight_bytes)} + reserve "
            f"{_gib(reserve_bytes)}{lora} exceed device_bytes x utilization = {_gib(usable)} by "
            f"{_gib(-budget)} ({-budget:,} B); allowed: a larger device_bytes or utilization, a "
            f"smaller reserve_bytes, or smaller weights{' or LoRA pool' if lora else ''}"
        )
    return usable, budget


def max_sequences(context: int, page_size: int, page_bytes: int, num_pages: int, budget: int):
    """How many sequences of ``context`` tokens the pool's ``num_pages`` (null page included)
    hold. Raises ValueError (the largest context that fits) when not even one does."""
    pages_per_seq = -(-context // page_size)
    max_seqs = (num_pages - 1) // pages_per_seq
    if max_seqs < 1:
        raise ValueError(
            f"plan_memory: context={context!r} is invalid: one sequence needs {pages_per_seq} "
            f"pages ({_gib(pages_per_seq * page_bytes)}) plus the null page, but the KV budget "
            f"{_gib(budget)} holds only {num_pages} pages; allowed: context <= "
            f"{(num_pages - 1) * page_size} tokens on this device"
        )
    return max_seqs


def gib_to_bytes(flag: str, value: float | None, allow_zero: bool = True) -> int | None:
    """Bytes of ``value`` GiB (a CLI option ``flag``), None for None. Raises ValueError naming
    ``flag`` and the value: not finite, negative (or 0 unless ``allow_zero``)."""
    if value is not None and (
        not (value > 0 or allow_zero and value == 0) or value == float("inf")
    ):
        raise ValueError(
            f"{flag}={value!r} is invalid: must be finite and {'>= 0' if allow_zero else '> 0'}"
        )
    return None if value is None else int(round(value * GIB))
