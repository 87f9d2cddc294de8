"""KV pool sizing (`kv_pool_pages`, the one formula; vLLM's ``gpu_memory_utilization``), bytes per
device under tensor parallelism, and a memory tracker; capacity plans: ``scripts/plan_memory.py``.
Imports no JAX (`device_memory_stats` imports it when called)."""

import os
import time
from typing import Callable

from jaxinfer.checks import check_int
from jaxinfer.config import ResolvedConfig
from jaxinfer.config.model import ModelConfig, tp_model_config
from jaxinfer.config.weights import device_bytes

GIB = 1 << 30
CPU_KV_BUDGET_BYTES = 2 * GIB  # KV pool cap where the device reports no memory stats (CPU)


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def param_count(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters of the model one device of ``tp`` holds (`weights.device_bytes`)."""
    return device_bytes(cfg, tp)


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


class MemoryTracker:
    """Weights / KV pool / pages in use / other bytes over time (scripts/probes/memory_trace.py):
    `rows`, one (time_s, pages_in_use, weights, KV pool, KV used, other bytes) per `snapshot`;
    ``time_s``: seconds since the tracker started; other: device bytes in use - weights - KV pool
    when measured (``measured``: the last row's was), else 0.
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
        self.measured = False

    def snapshot(self, pages_in_use: int, device_bytes_in_use: int | None = None) -> tuple:
        """Record and return one row. Raises ValueError: ``pages_in_use`` outside [0, num_pages]
        or ``device_bytes_in_use`` negative."""
        check_int("MemoryTracker.snapshot: pages_in_use", pages_in_use, 0, self.num_pages)
        if device_bytes_in_use is not None:
            check_int("MemoryTracker.snapshot: device_bytes_in_use", device_bytes_in_use, 0)
        self.measured = device_bytes_in_use is not None
        self.rows.append((self._clock() - self._t0, pages_in_use, self.weights_bytes,
                          self.kv_pool_bytes, pages_in_use * self.page_bytes,
                          device_bytes_in_use - self.weights_bytes - self.kv_pool_bytes
                          if self.measured else 0))
        return self.rows[-1]


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
