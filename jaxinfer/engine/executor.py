"""The compiled steps of one model: which jit variant a step uses, ahead-of-time executables,
and the dispatch of one step.

A step is compiled per `ShapeKey` (the shape bucket and sampling mode) and GEMM back-end: one jit
entry point per back-end (`jaxinfer.step.PACKED_STEPS`), the key a static argument.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp

from jaxinfer.engine.stats import EngineStats
from jaxinfer.step import PACKED_STEPS
from jaxinfer.step_input import HostBatch, ShapeKey, empty_batch, pack

log = logging.getLogger("jaxinfer")


class StepExecutor:
    """Dispatches the steps of model ``cfg`` with ``kernels`` (`ModelKernels`); ``kc`` the
    resolved `KernelConfig`, ``max_batch`` the largest batch bucket; counts compiles in
    ``stats``."""

    def __init__(self, cfg, kernels, kc, max_batch: int, stats: EngineStats) -> None:
        self.steps = PACKED_STEPS
        self.static = dict(cfg=cfg, kernels=kernels)
        self.cublas_min_batch = kc.cublas_decode_min_batch
        self.prefill_gemm = kc.prefill_gemm
        self.stats = stats
        self.no_prev_tokens = jnp.zeros((max_batch,), jnp.int32)  # before any step: fixed shape
        self.executables: dict[ShapeKey, object] = {}  # ahead-of-time compiled steps

    def step_fn(self, key: ShapeKey):
        """The jit step for ``key``: cuBLAS GEMMs for decode buckets of at least
        ``cublas_decode_min_batch`` rows and, with ``prefill_gemm="cublas"``, prefill steps."""
        if key.packed:
            return self.steps[self.prefill_gemm]
        cublas = self.cublas_min_batch is not None and key.batch >= self.cublas_min_batch
        return self.steps["cublas" if cublas else "xla"]

    def _args(self, params, kv, hb: HostBatch, prev_tokens) -> tuple:
        prev = self.no_prev_tokens if prev_tokens is None else prev_tokens
        return params, kv, jax.device_put(pack(hb)), prev

    def run(self, params, kv, hb: HostBatch, prev_tokens=None):
        """Dispatch one step, one transfer, no wait: (token ids i32[Bmax] on the device, the
        new cache; ``kv`` is donated)."""
        exe = self.executables.get(hb.key)
        if exe is not None:
            return exe(*self._args(params, kv, hb, prev_tokens))
        if hb.key not in self.stats.compiled_shapes:
            self.stats.compiled_shapes.add(hb.key)
            self.stats.num_lazy_compiles += 1
            log.info("compiling step for shape %s (%d so far)", hb.key,
                     self.stats.num_compiles)
        return self.step_fn(hb.key)(*self._args(params, kv, hb, prev_tokens), key=hb.key,
                                    **self.static)

    def precompile(self, params, kv, keys, *, max_workers: int | None, warm: bool):
        """Compile the step for each new key ahead of time: lowering (tracing) in this thread,
        the XLA compiles in ``max_workers`` threads at once (default: min(keys, CPU count)).
        With ``warm`` each new executable runs once on `empty_batch` (every row ``seq_len`` 0,
        every write into the null page, so no sequence's KV changes), so its first real use does
        not pay for loading it onto the device.

        Returns:
            ({"shapes": compiled now, "lower_s", "warm_s", "seconds"}, the new cache).
        Raises:
            ValueError: ``max_workers`` not None or a positive integer.
        """
        if max_workers is not None and (not isinstance(max_workers, int)
                                        or isinstance(max_workers, bool) or max_workers < 1):
            raise ValueError(f"max_workers={max_workers!r} is invalid: must be None or a positive "
                             "integer")
        todo = [k for k in dict.fromkeys(keys) if k not in self.stats.compiled_shapes]
        jax.block_until_ready(params)  # weights still being built would count as tracing
        t0 = time.perf_counter()
        lower_s = 0.0
        if todo:
            with ThreadPoolExecutor(max_workers or min(len(todo), os.cpu_count() or 1)) as pool:
                futures = []
                for k in todo:
                    t = time.perf_counter()
                    args = self._args(params, kv, empty_batch(k), None)
                    lowered = self.step_fn(k).lower(*args, key=k, **self.static)
                    futures.append(pool.submit(lowered.compile))
                    lower_s += time.perf_counter() - t
                for k, f in zip(todo, futures):
                    self.executables[k] = f.result()
                    self.stats.compiled_shapes.add(k)
        t_warm = time.perf_counter()
        if warm and todo:
            for k in todo:
                tokens, kv = self.executables[k](*self._args(params, kv, empty_batch(k), None))
            tokens.block_until_ready()
        return dict(shapes=len(todo), lower_s=lower_s, warm_s=time.perf_counter() - t_warm,
                    seconds=time.perf_counter() - t0), kv
