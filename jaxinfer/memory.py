"""KV pool sizing (`kv_pool_pages`, the one formula), capacity plans and a memory tracker
(PagedAttention, Kwon et al. 2023; vLLM's ``gpu_memory_utilization``). Imports no JAX.
num_pages = (usable - used) // (page_size x kv_bytes_per_token), null page 0 included. A plan:
usable = device_bytes x utilization, used = weight_bytes + reserve_bytes (all per device under
tensor parallelism: weights and KV heads split over the devices); max_concurrent =
(num_pages - 1) // ceil(context / page_size), planned = floor(PLANNING_FRACTION x that)."""

from __future__ import annotations

import csv
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

from jaxinfer.checks import check_int, is_number
from jaxinfer.config import ResolvedConfig
from jaxinfer.model_config import ModelConfig, check_tp, tp_model_config

GIB, MIB = 1 << 30, 1 << 20
PLANNING_FRACTION = 0.7  # plan at this fraction of the theoretical concurrent sequences
CPU_KV_BUDGET_BYTES = 2 * GIB  # KV pool cap where the device reports no memory stats (CPU)


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def param_count(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters of the `jaxinfer.models` tree: embed V*D; per layer attn_norm D, wqkv
    D*(N+2K)*H, wo N*H*D, mlp_norm D, w_gate_up D*2F, w_down F*D (+ q_norm, k_norm H each for
    Qwen3); final_norm D; lm_head D*V unless tied. ``tp`` > 1: those one device holds under
    tensor parallelism (`jaxinfer.parallel.param_specs`; K' = max(K, tp) KV heads)."""
    V, D, F, L = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    N, K, H = cfg.num_heads, tp_model_config(cfg, tp).num_kv_heads, cfg.head_dim
    split = 2 * D + (D * (N + 2 * K) * H + N * H * D + 3 * D * F) // tp
    per_layer = split + (2 * H if cfg.qk_norm else 0)
    vocab = V * D // (tp if V % tp == 0 else 1)
    return vocab + L * per_layer + D + (0 if cfg.tie_word_embeddings else vocab)


def fp8_weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of the tree with fp8 weights (`jaxinfer.quantize`, one device): the layers'
    matrices at 1 byte plus an f32 scale per output channel; embedding, lm_head and norms at
    ``dtype_bytes`` (the compute dtype)."""
    D, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    matrices = D * (N + 2 * K) * H + N * H * D + 3 * D * F
    scales = (N + 2 * K) * H + 2 * D + 2 * F
    return param_count(cfg) * dtype_bytes - L * matrices * (dtype_bytes - 1) + L * scales * 4


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    """KV bytes per token one device holds: `ModelConfig.kv_bytes_per_token` of the K' =
    max(K, tp) KV heads (`tp_model_config`), divided by ``tp``."""
    return tp_model_config(cfg, tp).kv_bytes_per_token(dtype_bytes) // tp


def default_reserve_bytes(device_bytes: int) -> int:
    """Activation/workspace reserve: ``max(1 GiB, 5% of device_bytes)``."""
    return max(GIB, int(device_bytes * 0.05))


def kv_pool_pages(model: ModelConfig, *, page_size: int, dtype_bytes: int, usable_bytes: int,
                  used_bytes: int, tp: int = 1) -> int:
    """THE KV pool sizing formula: pages (null page 0 included) of ``page_size`` tokens that fit
    in ``usable_bytes - used_bytes`` of one device (`kv_bytes_per_token` at ``tp``). Raises
    ValueError: fewer than 2 fit."""
    page_bytes = page_size * kv_bytes_per_token(model, dtype_bytes, tp)
    free = usable_bytes - used_bytes
    pages = max(int(free // page_bytes), 0)
    if pages < 2:
        raise ValueError(f"no memory left for the KV pool: usable {_gib(usable_bytes)} - used "
                         f"{_gib(used_bytes)} = {_gib(free)} holds {pages} pages of {page_bytes:,} "
                         "B, at least 2 are needed; raise memory_fraction or set num_pages")
    return pages


XLA_MEM_FRACTION_ENV, XLA_DEFAULT_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75


def card_bytes_usable(utilization: float, bytes_limit: int) -> int:
    """Bytes for weights + KV pool under vLLM's ``gpu_memory_utilization``: ``utilization`` x
    the card's bytes (JAX's ``bytes_limit`` / its fraction, `XLA_MEM_FRACTION_ENV`, default
    0.75), less `default_reserve_bytes` for activations. Raises ValueError: more than
    ``bytes_limit``, the most JAX's allocator may use."""
    card = bytes_limit / float(os.environ.get(XLA_MEM_FRACTION_ENV, XLA_DEFAULT_MEM_FRACTION))
    if utilization * card > bytes_limit * 1.001:
        raise ValueError(f"EngineConfig.gpu_memory_utilization={utilization} is invalid: JAX's "
                         f"allocator may use only {bytes_limit / card:.2f} of the card "
                         f"({_gib(bytes_limit)}); set {XLA_MEM_FRACTION_ENV}={utilization} before "
                         "JAX starts, or lower gpu_memory_utilization")
    return min(int(utilization * card), bytes_limit) - default_reserve_bytes(int(card))


def engine_pool_pages(resolved: ResolvedConfig, memory_stats: dict | None) -> int:
    """``EngineConfig.num_pages`` if set; else with ``memory_stats`` (``Device.memory_stats()``,
    weights resident) `kv_pool_pages` of ``memory_fraction x bytes_limit - bytes_in_use`` (with
    ``gpu_memory_utilization``: `card_bytes_usable` - bytes_in_use); else
    (CPU) the null page + ``max_num_seqs`` sequences of ``max_model_len`` tokens, at most
    `CPU_KV_BUDGET_BYTES`; bytes per device under tensor parallelism. Raises ValueError: fewer
    than 2 pages fit."""
    e, m = resolved.engine, resolved.model
    tp = e.tensor_parallel_size
    if e.num_pages is not None:
        return e.num_pages
    if memory_stats and "bytes_limit" in memory_stats:
        usable = int(e.memory_fraction * memory_stats["bytes_limit"])
        if e.gpu_memory_utilization is not None:
            usable = card_bytes_usable(e.gpu_memory_utilization, memory_stats["bytes_limit"])
        used = int(memory_stats.get("bytes_in_use", 0))
    else:
        page_bytes = e.page_size * kv_bytes_per_token(m, resolved.kv_dtype_bytes, tp)
        pages = 1 + e.max_num_seqs * -(-resolved.max_model_len // e.page_size)
        usable, used = min(pages * page_bytes, CPU_KV_BUDGET_BYTES), 0
    return kv_pool_pages(m, page_size=e.page_size, dtype_bytes=resolved.kv_dtype_bytes,
                         usable_bytes=usable, used_bytes=used, tp=tp)


@dataclass(frozen=True)
class MemoryPlan:
    """A KV capacity plan (module doc). Bytes of one device (of ``tensor_parallel_size``);
    ``num_pages`` includes the null page."""

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
    tensor_parallel_size: int = 1

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.kv_bytes_per_token

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)

    def table(self) -> str:
        """A two-column text table of the plan."""
        def b(n: int) -> str:
            return f"{_gib(n)}  ({n:,} B)"

        usable, kvt = int(self.device_bytes * self.utilization), self.kv_bytes_per_token
        tp = self.tensor_parallel_size
        rows = [
            ("tensor parallel", f"{tp} device(s); the bytes below are per device"),
            ("device memory", b(self.device_bytes)),
            ("utilization", f"{self.utilization:g}  -> usable {_gib(usable)}"),
            ("weights", b(self.weight_bytes)),
            ("reserve (activations, workspace)", b(self.reserve_bytes)),
            ("KV budget", b(usable - self.weight_bytes - self.reserve_bytes)),
            ("KV bytes per token", f"{kvt:,} B  ({kvt / 1024:,.1f} KiB)"),
            ("page size", f"{self.page_size} tokens  ({self.page_bytes / MIB:,.3f} MiB per page)"),
            ("KV pool", f"{self.num_pages:,} pages incl. null page 0 = {_gib(self.kv_pool_bytes)}"
                        f"  ({self.kv_pool_bytes:,} B, {(self.num_pages - 1) * self.page_size:,} "
                        "tokens)"),
            ("context", f"{self.context:,} tokens = {self.pages_per_seq:,} pages"
                        f" = {self.pages_per_seq * self.page_bytes / MIB:,.1f} MiB per sequence"),
            ("max concurrent sequences", f"{self.max_concurrent_seqs:,}"),
            (f"planned ({self.planning_fraction:.0%})", f"{self.planned_concurrent_seqs:,}"),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def plan_memory(cfg: ModelConfig, *, device_bytes: int, utilization: float = 0.9, context: int,
                page_size: int = 16, weight_dtype_bytes: int = 2, kv_dtype_bytes: int = 2,
                reserve_bytes: int | None = None, weight_bytes: int | None = None,
                planning_fraction: float = PLANNING_FRACTION,
                tensor_parallel_size: int = 1) -> MemoryPlan:
    """The KV plan of ``cfg`` on ``tensor_parallel_size`` devices of ``device_bytes`` each
    (module doc; weights and KV bytes per device). ``context``: tokens per sequence;
    ``*_dtype_bytes``: bytes per element; None ``reserve_bytes``: `default_reserve_bytes`,
    ``weight_bytes`` (per device): ``param_count x weight_dtype_bytes``. Raises ValueError: an
    argument out of range; a model tp cannot split (`check_tp`); weights that do not fit (by how
    much); a ``context`` one sequence of which does not fit (the largest that does)."""
    for name, v, hi in (("device_bytes", device_bytes, None), ("page_size", page_size, None),
                        ("context", context, cfg.max_position_embeddings),
                        ("weight_dtype_bytes", weight_dtype_bytes, None),
                        ("kv_dtype_bytes", kv_dtype_bytes, None),
                        ("tensor_parallel_size", tensor_parallel_size, None)):
        check_int(f"plan_memory: {name}", v, 1, hi)
    tp = tensor_parallel_size
    check_tp(cfg, tp)
    if page_size & (page_size - 1):
        raise ValueError(f"plan_memory: page_size={page_size!r} is invalid: must be a power of two")
    for name, v in (("utilization", utilization), ("planning_fraction", planning_fraction)):
        if not (is_number(v) and 0.0 < v <= 1.0):
            raise ValueError(f"plan_memory: {name}={v!r} is invalid: must be in (0, 1]")
    reserve_bytes = default_reserve_bytes(device_bytes) if reserve_bytes is None else reserve_bytes
    if weight_bytes is None:
        weight_bytes = param_count(cfg, tp) * weight_dtype_bytes
    for name, v in (("reserve_bytes", reserve_bytes), ("weight_bytes", weight_bytes)):
        check_int(f"plan_memory: {name}", v, 0)
    usable = int(device_bytes * utilization)
    budget = usable - weight_bytes - reserve_bytes
    if budget <= 0:
        raise ValueError(
            f"plan_memory: the weights do not fit: weights {_gib(weight_bytes)} + reserve "
            f"{_gib(reserve_bytes)} exceed device_bytes x utilization = {_gib(usable)} by "
            f"{_gib(-budget)} ({-budget:,} B); allowed: a larger device_bytes or utilization, a "
            "smaller reserve_bytes, or smaller weights")
    kv_per_token = kv_bytes_per_token(cfg, kv_dtype_bytes, tp)
    page_bytes, pages_per_seq = page_size * kv_per_token, -(-context // page_size)
    num_pages = kv_pool_pages(cfg, page_size=page_size, dtype_bytes=kv_dtype_bytes,
                              usable_bytes=usable, used_bytes=weight_bytes + reserve_bytes, tp=tp)
    max_seqs = (num_pages - 1) // pages_per_seq
    if max_seqs < 1:
        raise ValueError(
            f"plan_memory: context={context!r} is invalid: one sequence needs {pages_per_seq} "
            f"pages ({_gib(pages_per_seq * page_bytes)}) plus the null page, but the KV budget "
            f"{_gib(budget)} holds only {num_pages} pages; allowed: context <= "
            f"{(num_pages - 1) * page_size} tokens on this device")
    return MemoryPlan(kv_per_token, weight_bytes, device_bytes, float(utilization), reserve_bytes,
                      num_pages * page_bytes, page_size, num_pages, context, max_seqs,
                      math.floor(planning_fraction * max_seqs), float(planning_fraction), tp)


CSV_HEADER = ("time_s", "pages_in_use", "weights_bytes", "kv_pool_bytes", "kv_used_bytes",
              "other_bytes")


class MemoryTracker:
    """Weights / KV pool / pages in use / other bytes over time (``--memory-trace FILE``): `rows`,
    one tuple of `CSV_HEADER` per `snapshot`, bytes; ``time_s``: seconds since the tracker
    started; ``other_bytes``: device bytes in use - weights - KV pool when measured, else 0.
    ``page_bytes``: one page of K and V, all layers; ``num_pages`` includes the null page;
    ``clock``: seconds (default ``time.monotonic``). Raises ValueError: a size out of range."""

    def __init__(self, weights_bytes: int, page_bytes: int, num_pages: int,
                 clock: Callable[[], float] | None = None) -> None:
        for name, v, lo in (("weights_bytes", weights_bytes, 0), ("page_bytes", page_bytes, 1),
                            ("num_pages", num_pages, 1)):
            check_int(f"MemoryTracker: {name}", v, lo)
        self.weights_bytes, self.page_bytes, self.num_pages = weights_bytes, page_bytes, num_pages
        self.kv_pool_bytes, self._clock = page_bytes * num_pages, clock or time.monotonic
        self._t0, self.rows = self._clock(), []
        self._measured = False  # whether the last row's other_bytes was measured

    def snapshot(self, pages_in_use: int, device_bytes_in_use: int | None = None) -> tuple:
        """Record and return one row. Raises ValueError: ``pages_in_use`` outside [0, num_pages]
        or ``device_bytes_in_use`` negative."""
        check_int("MemoryTracker.snapshot: pages_in_use", pages_in_use, 0, self.num_pages)
        if device_bytes_in_use is not None:
            check_int("MemoryTracker.snapshot: device_bytes_in_use", device_bytes_in_use, 0)
        self._measured = device_bytes_in_use is not None
        self.rows.append((self._clock() - self._t0, pages_in_use, self.weights_bytes,
                          self.kv_pool_bytes, pages_in_use * self.page_bytes,
                          device_bytes_in_use - self.weights_bytes - self.kv_pool_bytes
                          if self._measured else 0))
        return self.rows[-1]

    def write_csv(self, path: str | os.PathLike) -> None:
        """All rows as CSV under the header `CSV_HEADER`."""
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([CSV_HEADER, *([f"{r[0]:.6f}", *r[1:]] for r in self.rows)])

    def report(self) -> str:
        """One line: weights / KV pool / pages in use / other, from the latest snapshot."""
        _, used, _, _, used_bytes, other = self.rows[-1] if self.rows else (0.0, 0, 0, 0, 0, 0)
        other = _gib(other) if self.rows and self._measured else "n/a (not measured)"
        return (f"weights {_gib(self.weights_bytes)} | KV pool {_gib(self.kv_pool_bytes)} "
                f"({self.num_pages:,} pages) | pages in use {used:,}/{self.num_pages:,}"
                f" ({used / self.num_pages:.1%}, {_gib(used_bytes)}) | other {other}")


def device_memory_stats(device=None) -> tuple[int, int] | None:
    """``(bytes_in_use, bytes_limit)`` (the XLA allocator's limit) of ``device`` (default
    ``jax.devices()[0]``), or None where the backend reports none (the CPU)."""
    if device is None:
        import jax

        device = jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # backends without the API raise (NotImplementedError, RuntimeError)
        return None
    keys = ("bytes_in_use", "bytes_limit")
    return tuple(int(stats[k]) for k in keys) if all(k in stats for k in keys) else None
