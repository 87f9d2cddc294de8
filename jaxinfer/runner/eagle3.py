"""The "eagle3" method's drafter (device side): an EAGLE-3 head (`jaxinfer.models.eagle3`) with
its own one-layer KV pool over the target's pages (the target's block tables address it, as
`DraftRunner`'s), fed the target's aux hidden states. Each target step writes the head's
entries (`mirror`: token p with h_{p-1}); `propose` runs k greedy chained steps, the first on
the target's states of the step just run, later ones on the head's own output. Source: vLLM
V1's ``EagleProposer`` with ``llama_eagle3.py``. One device only."""

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints_tools.eagle3 import read_eagle3
from jaxinfer.config import ModelConfig
from jaxinfer.models import eagle3
from jaxinfer.models.kv_cache import KVCache, init_kv_cache, stored_dtype
from jaxinfer.runner.draft import draft_batch
from jaxinfer.runner.eagle3_steps import MIRROR_STEP, PROPOSE_STEP
from jaxinfer.runner.executor import compile_lowered
from jaxinfer.step_input import BucketSpec, HostBatch, SamplerKey, StepShape, allocate, pack


class Eagle3Head(NamedTuple):
    """A loaded head: ``cfg`` (its `ModelConfig`: one Llama layer, V the target's), ``params``
    (`eagle3.params_from_leaves`), ``aux_layers`` (the target layers ``fc`` reads)."""

    cfg: ModelConfig
    params: dict
    aux_layers: tuple[int, ...]


def load_eagle3(path: str, target_cfg: ModelConfig, dtype) -> Eagle3Head:
    """The EAGLE-3 head at ``path`` (`checkpoints_tools.eagle3.read_eagle3`) for ``target_cfg``,
    floats in ``dtype``. ValueError / FileNotFoundError: `read_eagle3`'s, `from_hf_config`'s."""
    ck = read_eagle3(path, target_cfg.hidden_size, target_cfg.vocab_size, target_cfg.num_layers)
    cfg = ModelConfig.from_hf_config(
        dict(ck.config, model_type="llama", num_hidden_layers=1, tie_word_embeddings=False)
    )
    return Eagle3Head(cfg, eagle3.params_from_leaves(ck.tensors, dtype), ck.aux_layers)


class Eagle3Runner:
    """The head ``cfg``, ``params``, ``aux_layers`` (an `Eagle3Head`) beside a target served
    under ``resolved`` (k = its ``num_speculative_tokens``) with ``num_pages`` pages and
    ``buckets``; ``kernels``: the target's `ModelKernels`; compiles counted in ``stats``
    (``forward_shapes``, keys ("eagle3", ...)). State: ``kv`` (the head's pool), ``tail``
    [max_rows, k + 1, D] (h of the last step's rows' last k + 1 tokens), ``tail_at`` (slot ->
    flat index into ``tail``), ``first_logits`` (f32[R, Vd] of the last `propose`'s first
    step, for checks)."""

    def __init__(
        self, cfg, params, aux_layers, resolved, num_pages, buckets: BucketSpec, kernels, stats
    ):
        self.cfg, self.params, self.aux_layers = cfg, params, aux_layers
        self.buckets, self.kernels, self.stats = buckets, kernels, stats
        self.k = resolved.engine.speculative_config.num_speculative_tokens
        self.page_size, self.num_pages = resolved.engine.page_size, num_pages
        self.dtype = stored_dtype(resolved.dtype, resolved.platform)
        self.compute_dtype = jnp.dtype(resolved.dtype)
        self.executables: dict = {}
        self.first_logits = None
        self.no_prev = jnp.zeros((buckets.sizes.max_rows,), jnp.int32)
        self.reset_kv()

    def reset_kv(self) -> None:
        """A fresh (zeroed) pool and no remembered step: at start, after an interrupted step."""
        self.kv: KVCache = init_kv_cache(self.cfg, self.num_pages, self.page_size, self.dtype)
        D = self.cfg.hidden_size
        self.tail = jnp.zeros((self.buckets.sizes.max_rows, self.k + 1, D), self.compute_dtype)
        self.tail_at: dict[int, int] = {}

    def _add(self, key, exe):
        self.executables[key] = exe
        self.stats.forward_shapes.add(key)
        return exe

    def _run(self, key, jitted, args, static: dict):
        """``jitted`` on ``args``, compiled once per ``key`` (new keys counted as compiles)."""
        if (exe := self.executables.get(key)) is None:
            self.stats.num_lazy_compiles += 1
            t = time.perf_counter()
            exe = self._add(key, compile_lowered(jitted.lower(*args, **static)))
            self.stats.compile_s += time.perf_counter() - t
        return exe(*args)

    def _slot(self, table, pos: int) -> int:
        return int(table[pos // self.page_size]) * self.page_size + pos % self.page_size

    def _src(self, slots) -> np.ndarray:
        """i32[len(slots)]: each slot's index into ``tail`` (-1: not among the last step's)."""
        return np.array([self.tail_at.get(s, -1) for s in slots], np.int32)

    def _remember(self, hb: HostBatch) -> None:
        """``tail_at`` of step ``hb``: each row's last k + 1 tokens' slots."""
        Q, qsl = self.k + 1, hb.query_start_loc
        self.tail_at = {
            int(hb.slot_mapping[e - Q + 1 + j]): r * Q + j
            for r in range(len(qsl) - 1)
            if (e := int(qsl[r + 1]) - 1) >= qsl[r]
            for j in range(Q)
            if e - Q + 1 + j >= qsl[r]
        }

    def _mirror_call(self, hb: HostBatch, prev, aux, embed) -> tuple:
        """(key, program, args, static) of `mirror` on step ``hb``."""
        qsl, starts = hb.query_start_loc, hb.query_start_loc[:-1]
        first = [
            self._slot(hb.block_tables[r], int(hb.positions[s]) - 1)
            if qsl[r + 1] > s and hb.positions[s] > 0
            else -1
            for r, s in enumerate(starts)
        ]
        src = np.where(np.array(first) >= 0, self._src(first), -1).astype(np.int32)
        buf, key = jnp.asarray(pack(hb, "forward")), hb.shape.forward
        prev = self.no_prev if prev is None else prev
        args = (self.params, embed, self.kv, buf, prev, aux, self.tail, jnp.asarray(src))
        static = dict(key=key, sizes=self.buckets.sizes, cfg=self.cfg)
        return ("eagle3", "mirror", key), MIRROR_STEP, args, static

    def mirror(self, hb: HostBatch, prev, fwd, embed) -> None:
        """The head's entries of target step ``hb`` (``prev``: the step in flight's tokens,
        ``fwd``: its `Forwarded` with ``aux``, ``embed``: the target's embedding)."""
        self.kv, self.tail = self._run(*self._mirror_call(hb, prev, fwd.aux, embed))
        self._remember(hb)

    def _propose_args(self, hb, tables, pos, src, embed) -> tuple:
        R = hb.rows
        full = np.zeros((R, tables.shape[1]), np.int32)
        full[: len(tables)] = tables
        pad = lambda a: np.concatenate([a, np.zeros(R - len(a), np.int32)])  # noqa: E731
        arrays = (src, hb.tokens[:R], pad(pos), full)
        return (self.params, embed, self.kv, self.tail, *map(jnp.asarray, arrays))

    def _propose_call(self, rows, k: int, embed) -> tuple:
        """(key, program, args, static) of `propose` on ``rows``."""
        hb, tables, pos = draft_batch(rows, k, self.buckets, self.page_size)
        src = self._src([self._slot(t, p - 1) if p > 0 else -1 for _, p, t in rows])
        src = np.concatenate([src, np.full(hb.rows - len(rows), -1, np.int32)])
        width = hb.block_tables.shape[1]
        args = self._propose_args(hb, tables, np.maximum(pos - 1, 0), src, embed)
        static = dict(k=k, width=width, cfg=self.cfg, kernels=self.kernels)
        return ("eagle3", "propose", hb.rows, width, k), PROPOSE_STEP, args, static

    def propose(self, rows: list[tuple[int, int, list[int]]], k: int, embed) -> np.ndarray:
        """i32[n, k] greedy drafts (target ids) of ``rows`` (each: its last token, that token's
        position p, its block table): k chained steps from entry p - 1, h from the last
        step's ``tail`` (`PROPOSE_STEP`); one read back. Entries past p - 1 are written again
        when the target verifies (`mirror`)."""
        drafts, self.first_logits, self.kv = self._run(*self._propose_call(rows, k, embed))
        return np.asarray(drafts)[: len(rows)]

    def precompile(self, planned: dict | None, embed, *, max_workers: int | None = None) -> None:
        """Compile `mirror` for the target's ``planned`` forwards (None: every forward) and
        `propose` at every row and page bucket: lowered here, compiled in ``max_workers``
        threads (default: the CPUs), as `StepExecutor.precompile`. Nothing runs."""
        sizes, D, calls = self.buckets.sizes, self.cfg.hidden_size, {}
        for key in (planned or {}).get("forward") or self.buckets.forward_keys():
            hb = allocate(StepShape(key, SamplerKey(0, "greedy")), sizes)
            aux = jax.ShapeDtypeStruct((hb.tokens.shape[0], 3 * D), self.compute_dtype)
            call = self._mirror_call(hb, None, aux, embed)
            calls[call[0]] = call
        for r in self.buckets.batch:
            for m in self.buckets.pages or (0,):
                p = max(1, m * self.page_size - self.k)
                call = self._propose_call([(0, p, [0] * max(m, 1))] * r, self.k, embed)
                calls[call[0]] = call
        todo = [c for key, c in calls.items() if key not in self.executables]
        if not todo:
            return
        with ThreadPoolExecutor(max_workers or min(len(todo), os.cpu_count() or 1)) as pool:
            lowered = [jit.lower(*args, **st) for _, jit, args, st in todo]
            futures = [pool.submit(compile_lowered, low) for low in lowered]
            for (key, *_), f in zip(todo, futures):
                self._add(key, f.result())
