"""Device-memory plan for the paged KV cache, and a host-side memory tracker.

The plan answers "how many sequences of context C fit on this device": the device memory the
engine may use (``device_bytes x utilization``) minus the weights minus a reserve for activations
and XLA workspace is the KV budget; it is cut into pages of ``page_size`` tokens. The rule of thumb
(SEEDS_DIGEST.md, "Capacity planning"): plan at ~70% of the theoretical number of sequences.

    kv_bytes_per_token = 2 (K and V) x L x K x H x kv_dtype_bytes
    page_bytes         = page_size x kv_bytes_per_token      (k and v pools [L, P, K, page_size, H])
    kv_budget          = device_bytes x utilization - weight_bytes - reserve_bytes
    num_pages          = kv_budget // page_bytes              (page 0 is the reserved null page)
    pages_per_seq      = ceil(context / page_size)
    max_concurrent     = (num_pages - 1) // pages_per_seq
    planned            = floor(planning_fraction x max_concurrent)

Source: the PagedAttention paper (Kwon et al., SOSP 2023) for the page/block-table layout; vLLM's
``gpu_memory_utilization`` profiling for the "fraction of device memory minus weights minus
activations" budget.

This module imports no JAX at module level (``device_memory_stats`` imports it when called), so the
host side and the ``jaxinfer.plan`` CLI can use it from a ``ModelConfig`` alone.
"""

from __future__ import annotations

import csv
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

from jaxinfer.config import ModelConfig, ResolvedConfig

GIB = 1 << 30
MIB = 1 << 20
PLANNING_FRACTION = 0.7
"""Plan at this fraction of the theoretical number of concurrent sequences (SEEDS_DIGEST.md)."""
RESERVE_MIN_BYTES = 1 * GIB
RESERVE_DEVICE_FRACTION = 0.05
CPU_KV_BUDGET_BYTES = 2 * GIB
"""KV pool cap where the device reports no memory statistics (the CPU)."""


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"plan_memory: {name}={value!r} is invalid: must be an integer >= {minimum}")


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters in the tree of ``jaxinfer.models.params`` (computed without JAX).

    embed V*D; per layer: attn_norm D, wqkv D*(N+2K)*H, wo N*H*D, mlp_norm D, w_gate_up D*2F,
    w_down F*D, plus q_norm and k_norm H each for Qwen3; final_norm D; lm_head D*V unless the head
    is tied to the embedding.
    """
    V, D, F, L = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = 2 * D + D * N * H + 2 * D * K * H + N * H * D + 3 * D * F
    if cfg.qk_norm:
        per_layer += 2 * H
    total = V * D + L * per_layer + D
    if not cfg.tie_word_embeddings:
        total += D * V
    return total


def default_reserve_bytes(device_bytes: int) -> int:
    """Default activation/workspace reserve: ``max(1 GiB, 5% of device_bytes)``.

    The reserve covers what the step allocates besides weights and the KV pool: activations of the
    largest prefill chunk, the ``[B, V]`` float32 logits, XLA scratch and the CUDA context.
    """
    return max(RESERVE_MIN_BYTES, int(device_bytes * RESERVE_DEVICE_FRACTION))


@dataclass(frozen=True)
class MemoryPlan:
    """A KV-cache capacity plan for one model on one device. All sizes in bytes.

    Fields:
        kv_bytes_per_token: 2 x L x K x H x kv dtype bytes (K and V, all layers).
        weight_bytes: bytes of the resident weights.
        device_bytes: device memory the plan starts from.
        utilization: fraction of ``device_bytes`` the engine may use (weights + reserve + KV pool).
        reserve_bytes: activations / workspace reserve.
        kv_pool_bytes: ``num_pages x page_bytes`` (the pool actually allocated, <= the budget).
        page_size: tokens per page.
        num_pages: P, pool size in pages including the reserved null page 0.
        context: tokens per sequence (prompt + generated) the plan is made for.
        max_concurrent_seqs: sequences of ``context`` tokens that fit at once (theoretical).
        planned_concurrent_seqs: ``floor(planning_fraction x max_concurrent_seqs)``.
        planning_fraction: the fraction used for ``planned_concurrent_seqs``.
    """

    kv_bytes_per_token: int
    weight_bytes: int
    device_bytes: int
    utilization: float
    reserve_bytes: int
    kv_pool_bytes: int
    page_size: int
    num_pages: int
    context: int
    max_concurrent_seqs: int
    planned_concurrent_seqs: int
    planning_fraction: float = PLANNING_FRACTION

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across both pools and all layers: page_size x kv_bytes_per_token."""
        return self.page_size * self.kv_bytes_per_token

    @property
    def pages_per_seq(self) -> int:
        """ceil(context / page_size)."""
        return -(-self.context // self.page_size)

    @property
    def usable_bytes(self) -> int:
        """floor(device_bytes x utilization)."""
        return int(self.device_bytes * self.utilization)

    @property
    def kv_budget_bytes(self) -> int:
        """usable_bytes - weight_bytes - reserve_bytes (the pool is the largest whole-page part)."""
        return self.usable_bytes - self.weight_bytes - self.reserve_bytes

    @property
    def max_tokens(self) -> int:
        """Tokens the pool holds, excluding the null page: (num_pages - 1) x page_size."""
        return (self.num_pages - 1) * self.page_size

    def table(self) -> str:
        """A readable two-column table of the plan (bytes also in GiB/MiB)."""
        seq_bytes = self.pages_per_seq * self.page_bytes
        rows = [
            ("device memory", f"{_gib(self.device_bytes)}  ({self.device_bytes:,} B)"),
            ("utilization", f"{self.utilization:g}  -> usable {_gib(self.usable_bytes)}"),
            ("weights", f"{_gib(self.weight_bytes)}  ({self.weight_bytes:,} B)"),
            ("reserve (activations, workspace)",
             f"{_gib(self.reserve_bytes)}  ({self.reserve_bytes:,} B)"),
            ("KV budget", f"{_gib(self.kv_budget_bytes)}  ({self.kv_budget_bytes:,} B)"),
            ("KV bytes per token",
             f"{self.kv_bytes_per_token:,} B  ({self.kv_bytes_per_token / 1024:,.1f} KiB)"),
            ("page size", f"{self.page_size} tokens  ({self.page_bytes / MIB:,.3f} MiB per page)"),
            ("KV pool", f"{self.num_pages:,} pages incl. null page 0 = {_gib(self.kv_pool_bytes)}"
                        f"  ({self.kv_pool_bytes:,} B, {self.max_tokens:,} tokens)"),
            ("context", f"{self.context:,} tokens = {self.pages_per_seq:,} pages"
                        f" = {seq_bytes / MIB:,.1f} MiB per sequence"),
            ("max concurrent sequences", f"{self.max_concurrent_seqs:,}"),
            (f"planned ({self.planning_fraction:.0%})", f"{self.planned_concurrent_seqs:,}"),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def plan_memory(cfg: ModelConfig, *, device_bytes: int, utilization: float = 0.9, context: int,
                page_size: int = 16, weight_dtype_bytes: int = 2, kv_dtype_bytes: int = 2,
                reserve_bytes: int | None = None, weight_bytes: int | None = None,
                planning_fraction: float = PLANNING_FRACTION) -> MemoryPlan:
    """Plan the paged KV pool for ``cfg`` on a device of ``device_bytes`` (formulas: module doc).

    Args:
        cfg: the model.
        device_bytes: device memory in bytes (e.g. 141 GiB-ish on an H200).
        utilization: fraction of ``device_bytes`` the engine may use, in (0, 1].
        context: tokens per sequence (prompt + generated), 1 .. cfg.max_position_embeddings.
        page_size: tokens per page, a power of two.
        weight_dtype_bytes: bytes per weight element (bf16 = 2); ignored when ``weight_bytes``
            is given.
        kv_dtype_bytes: bytes per K/V element (bf16 = 2, fp8 = 1, f32 = 4).
        reserve_bytes: activations/workspace reserve; ``None``: ``default_reserve_bytes``
            = max(1 GiB, 5% of ``device_bytes``).
        weight_bytes: resident weight bytes, overriding the count from ``cfg`` (for quantised
            checkpoints whose bytes are not elements x a whole dtype size).
        planning_fraction: fraction of the theoretical maximum to plan at, in (0, 1].

    Returns:
        A ``MemoryPlan``.

    Raises:
        ValueError: a field out of range (naming field, value and what is allowed); the weights
            and reserve do not fit in the usable memory (saying by how much); or one sequence of
            ``context`` tokens does not fit in the KV budget.
    """
    _check_int("device_bytes", device_bytes, 1)
    _check_int("context", context, 1)
    _check_int("page_size", page_size, 1)
    _check_int("weight_dtype_bytes", weight_dtype_bytes, 1)
    _check_int("kv_dtype_bytes", kv_dtype_bytes, 1)
    if page_size & (page_size - 1):
        raise ValueError(f"plan_memory: page_size={page_size!r} is invalid: "
                         "must be a power of two (8, 16, 32, 64, ...)")
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) \
            or not 0.0 < utilization <= 1.0:
        raise ValueError(f"plan_memory: utilization={utilization!r} is invalid: must be in (0, 1]")
    if isinstance(planning_fraction, bool) or not isinstance(planning_fraction, (int, float)) \
            or not 0.0 < planning_fraction <= 1.0:
        raise ValueError(f"plan_memory: planning_fraction={planning_fraction!r} is invalid: "
                         "must be in (0, 1]")
    if context > cfg.max_position_embeddings:
        raise ValueError(f"plan_memory: context={context!r} is invalid: must be <= the model's "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    if reserve_bytes is None:
        reserve_bytes = default_reserve_bytes(device_bytes)
    _check_int("reserve_bytes", reserve_bytes, 0)
    if weight_bytes is None:
        weight_bytes = param_count(cfg) * weight_dtype_bytes
    _check_int("weight_bytes", weight_bytes, 0)

    usable = int(device_bytes * utilization)
    budget = usable - weight_bytes - reserve_bytes
    if budget <= 0:
        raise ValueError(
            f"plan_memory: the weights do not fit: weights {_gib(weight_bytes)} + reserve "
            f"{_gib(reserve_bytes)} exceed device_bytes x utilization = {_gib(device_bytes)} x "
            f"{utilization:g} = {_gib(usable)} by {_gib(-budget)} ({-budget:,} B) with no room "
            "left for the KV cache; allowed: a larger device_bytes or utilization, a smaller "
            "reserve_bytes, or smaller weights")
    kv_per_token = cfg.kv_bytes_per_token(kv_dtype_bytes)
    page_bytes = page_size * kv_per_token
    num_pages = kv_pool_pages(cfg, page_size=page_size, dtype_bytes=kv_dtype_bytes,
                              usable_bytes=usable, used_bytes=weight_bytes + reserve_bytes)
    pages_per_seq = -(-context // page_size)
    max_seqs = max(num_pages - 1, 0) // pages_per_seq
    if max_seqs < 1:
        raise ValueError(
            f"plan_memory: context={context!r} is invalid: one sequence needs {pages_per_seq} "
            f"pages ({_gib(pages_per_seq * page_bytes)}) plus the null page, but the KV budget "
            f"{_gib(budget)} holds only {num_pages} pages; allowed: context <= "
            f"{max(num_pages - 1, 0) * page_size} tokens on this device")
    planned = math.floor(planning_fraction * max_seqs)
    return MemoryPlan(
        kv_bytes_per_token=kv_per_token, weight_bytes=weight_bytes, device_bytes=device_bytes,
        utilization=float(utilization), reserve_bytes=reserve_bytes,
        kv_pool_bytes=num_pages * page_bytes, page_size=page_size, num_pages=num_pages,
        context=context, max_concurrent_seqs=max_seqs, planned_concurrent_seqs=planned,
        planning_fraction=float(planning_fraction))


def kv_pool_pages(model: ModelConfig, *, page_size: int, dtype_bytes: int, usable_bytes: int,
                  used_bytes: int) -> int:
    """THE KV pool sizing formula: the pages P (the null page 0 included) of ``page_size`` tokens
    (``page_size x model.kv_bytes_per_token(dtype_bytes)`` bytes each) that fit in
    ``usable_bytes - used_bytes``.

    Raises:
        ValueError: fewer than 2 pages fit (the null page and one more).
    """
    page_bytes = page_size * model.kv_bytes_per_token(dtype_bytes)
    free = usable_bytes - used_bytes
    pages = max(int(free // page_bytes), 0)
    if pages < 2:
        raise ValueError(f"no memory left for the KV pool: usable {_gib(usable_bytes)} - used "
                         f"{_gib(used_bytes)} = {_gib(free)} holds {pages} pages of {page_bytes:,} "
                         "B, at least 2 are needed; raise memory_fraction or set num_pages")
    return pages


def engine_pool_pages(resolved: ResolvedConfig, memory_stats: dict | None) -> int:
    """The engine's KV pool size in pages: ``EngineConfig.num_pages`` if set; else, with device
    ``memory_stats`` (``Device.memory_stats()``: ``bytes_limit``, ``bytes_in_use`` with the
    weights resident), `kv_pool_pages` of ``memory_fraction x bytes_limit - bytes_in_use``;
    without (the CPU), the null page plus ``max_num_seqs`` sequences of ``max_model_len``
    tokens, capped at `CPU_KV_BUDGET_BYTES`.

    Raises:
        ValueError: fewer than 2 pages fit.
    """
    e, m = resolved.engine, resolved.model
    if e.num_pages is not None:
        return e.num_pages
    if memory_stats and "bytes_limit" in memory_stats:
        usable = int(e.memory_fraction * memory_stats["bytes_limit"])
        used = int(memory_stats.get("bytes_in_use", 0))
    else:
        page_bytes = e.page_size * m.kv_bytes_per_token(resolved.dtype_bytes)
        pages = 1 + e.max_num_seqs * -(-resolved.max_model_len // e.page_size)
        usable, used = min(pages * page_bytes, CPU_KV_BUDGET_BYTES), 0
    return kv_pool_pages(m, page_size=e.page_size, dtype_bytes=resolved.dtype_bytes,
                         usable_bytes=usable, used_bytes=used)


class MemorySnapshot(NamedTuple):
    """One row of a memory trace. Bytes, except ``time_s`` (seconds since the tracker started).

    ``other_bytes`` = device bytes in use - weights - KV pool when the caller supplied the device
    bytes in use (may be negative if the pool or weights are not yet resident), else 0.
    """

    time_s: float
    pages_in_use: int
    weights_bytes: int
    kv_pool_bytes: int
    kv_used_bytes: int
    other_bytes: int


CSV_HEADER = MemorySnapshot._fields


class MemoryTracker:
    """Host-side memory breakdown over time: weights / KV pool / pages in use / other.

    The engine calls ``snapshot`` after steps (``--memory-trace FILE``) and ``write_csv`` at the
    end. Imports no JAX; device bytes in use come from the caller (``device_memory_stats``).

    Args:
        weights_bytes: bytes of the resident weights.
        page_bytes: bytes of one page across K and V pools and all layers
            (``MemoryPlan.page_bytes``).
        num_pages: P, pages in the pool (including the null page).
        clock: seconds, monotonic; default ``time.monotonic``. Times are relative to construction.

    Raises:
        ValueError: a negative size or ``num_pages < 1``.
    """

    def __init__(self, weights_bytes: int, page_bytes: int, num_pages: int,
                 clock: Callable[[], float] | None = None) -> None:
        for name, v, lo in (("weights_bytes", weights_bytes, 0), ("page_bytes", page_bytes, 1),
                            ("num_pages", num_pages, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"MemoryTracker: {name}={v!r} is invalid: must be an integer >= {lo}")
        self.weights_bytes = weights_bytes
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.kv_pool_bytes = page_bytes * num_pages
        self._clock = clock or time.monotonic
        self._t0 = self._clock()
        self._rows: list[MemorySnapshot] = []
        self._measured: list[bool] = []  # whether each row's other_bytes came from device bytes

    @classmethod
    def from_plan(cls, plan: MemoryPlan, clock: Callable[[], float] | None = None) -> "MemoryTracker":
        """A tracker for the pool a ``MemoryPlan`` describes."""
        return cls(plan.weight_bytes, plan.page_bytes, plan.num_pages, clock=clock)

    @property
    def snapshots(self) -> tuple[MemorySnapshot, ...]:
        """All rows recorded so far, oldest first."""
        return tuple(self._rows)

    def snapshot(self, pages_in_use: int, device_bytes_in_use: int | None = None) -> MemorySnapshot:
        """Record one row: ``pages_in_use`` in [0, num_pages]; optional device bytes in use.

        Raises:
            ValueError: ``pages_in_use`` out of range or ``device_bytes_in_use`` negative.
        """
        if isinstance(pages_in_use, bool) or not isinstance(pages_in_use, int) \
                or not 0 <= pages_in_use <= self.num_pages:
            raise ValueError(f"MemoryTracker.snapshot: pages_in_use={pages_in_use!r} is invalid: "
                             f"must be an integer in [0, {self.num_pages}]")
        other = 0
        if device_bytes_in_use is not None:
            if isinstance(device_bytes_in_use, bool) or not isinstance(device_bytes_in_use, int) \
                    or device_bytes_in_use < 0:
                raise ValueError(f"MemoryTracker.snapshot: device_bytes_in_use="
                                 f"{device_bytes_in_use!r} is invalid: must be an integer >= 0")
            other = device_bytes_in_use - self.weights_bytes - self.kv_pool_bytes
        row = MemorySnapshot(self._clock() - self._t0, pages_in_use, self.weights_bytes,
                             self.kv_pool_bytes, pages_in_use * self.page_bytes, other)
        self._rows.append(row)
        self._measured.append(device_bytes_in_use is not None)
        return row

    def write_csv(self, path: str | os.PathLike) -> None:
        """Write all rows to ``path`` as CSV with the header ``CSV_HEADER``."""
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(CSV_HEADER)
            for r in self._rows:
                w.writerow([f"{r.time_s:.6f}", *r[1:]])

    @staticmethod
    def read_csv(path: str | os.PathLike) -> list[MemorySnapshot]:
        """Read a file written by ``write_csv``.

        Raises:
            ValueError: the header is not ``CSV_HEADER``.
        """
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if not rows or tuple(rows[0]) != CSV_HEADER:
            raise ValueError(f"memory trace {os.fspath(path)!r}: header={rows[0] if rows else None!r}"
                             f" is invalid: expected {list(CSV_HEADER)}")
        return [MemorySnapshot(float(r[0]), *(int(x) for x in r[1:])) for r in rows[1:]]

    def report(self) -> str:
        """One line: weights / KV pool / pages in use / other, from the latest snapshot."""
        last = self._rows[-1] if self._rows else None
        pages = last.pages_in_use if last else 0
        used = last.kv_used_bytes if last else 0
        other = _gib(last.other_bytes) if last and self._measured[-1] else "n/a (not measured)"
        return (f"weights {_gib(self.weights_bytes)} | KV pool {_gib(self.kv_pool_bytes)} "
                f"({self.num_pages:,} pages) | pages in use {pages:,}/{self.num_pages:,} "
                f"({pages / self.num_pages:.1%}, {_gib(used)}) | other {other}")


def device_memory_stats(device=None) -> tuple[int, int] | None:
    """``(bytes_in_use, bytes_limit)`` of ``device`` (default ``jax.devices()[0]``), or ``None``.

    ``bytes_limit`` is the XLA allocator's limit (on GPU a fraction of physical memory set by
    ``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 by default), not the physical size. ``None`` where
    the backend reports no statistics (the CPU). Imports JAX when called.
    """
    if device is None:
        import jax

        device = jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # backends without the API raise (e.g. NotImplementedError/RuntimeError)
        return None
    if not stats or "bytes_in_use" not in stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_in_use"]), int(stats["bytes_limit"])
