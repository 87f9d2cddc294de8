"""The jit entry point: a step is ``(params, kv, inputs) -> (next_tokens i32[Bmax], kv')``
(logprobs: a dict), KV donated, compiled per `ShapeKey` and GEMM back-end (`packed_step`,
`StepExecutor`)."""

import dataclasses
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.checks import check_int
from jaxinfer.config import ModelConfig
from jaxinfer.models.kernels import ModelKernels
from jaxinfer.models.kv_cache import KVCache
from jaxinfer.runner.parallel import gather_logits, replicated
from jaxinfer.runner.sampling import (
    SamplingMetadata,
    apply_logits_processors,
    apply_token_bitmask,
    logprobs,
    pytree_dataclass,
    sample,
)
from jaxinfer.step_input import HostBatch, ShapeKey, allocate, covers, layout, names, pack

log = logging.getLogger("jaxinfer")


_INPUT = names("input")[0]  # tokens, positions, slot_mapping, logits_indices, pending_src
StepInput = pytree_dataclass(
    __name__,
    "StepInput",
    [*_INPUT[:4], "sampling"],
    ["packing", "prev_tokens", *_INPUT[4:], *names("input")[1]],
    doc="""Device inputs
    (`jaxinfer.step_input.FIELDS`): tokens, positions, slot_mapping i32[B, T] (with ``packing``,
    a `models.Packing`: i32[1, Tp]); logits_indices i32[B]; sampling: `SamplingMetadata`;
    prev_tokens i32[Bmax]: the previous step's output (None: unused); pending_src i32[B]: row
    b's input token's row in it, or -1; prompt_lp_index i32[P]: flat token index (into [Bt * T])
    of each scored prompt position, prompt_lp_next i32[P]: the prompt token after it (None: no
    prompt log-probabilities).""",
)


def forward(
    params: dict,
    kv: KVCache,
    inp: StepInput,
    *,
    cfg: ModelConfig,
    kernels: ModelKernels,
    num_logprobs: int = 0,
) -> tuple[jax.Array, dict, KVCache]:
    """Forward, KV write, logits of one token per row -> (f32[B, V], whole on every device;
    with ``prompt_lp_index`` and ``num_logprobs`` K > 0 (static), `logprobs` of each scored
    prompt position (for ``prompt_lp_next``) under keys prefixed ``prompt_``, else {}; kv')."""
    tokens, src = inp.tokens, inp.pending_src
    if inp.prev_tokens is not None and inp.packing is None:  # tokens[b, 0] = prev[src[b]], src >= 0
        picked = inp.prev_tokens[jnp.maximum(src, 0)]
        tokens = tokens.at[:, 0].set(jnp.where(src >= 0, picked, tokens[:, 0]))
    hidden, kv = models.forward(
        params,
        cfg,
        tokens,
        inp.positions,
        inp.slot_mapping,
        kv,
        kernels=kernels,
        packing=inp.packing,
    )
    with jax.named_scope("lm_head"):
        last = (
            hidden[0][inp.logits_indices]
            if inp.packing is not None  # packed: [R, D]
            else jnp.take_along_axis(hidden, inp.logits_indices[:, None, None], axis=1)[:, 0]
        )
        logits = gather_logits(models.compute_logits(params, cfg, last), cfg, kernels.mesh)
    if not (num_logprobs and inp.prompt_lp_index is not None):
        return logits, {}, kv
    with jax.named_scope("logprobs"):
        flat = hidden.reshape(-1, hidden.shape[-1])[inp.prompt_lp_index]
        lp = logprobs(models.compute_logits(params, cfg, flat), inp.prompt_lp_next, num_logprobs)
    return logits, {f"prompt_{k}": a for k, a in lp.items()}, kv


def sample_logits(
    logits: jax.Array,
    inp: StepInput,
    *,
    all_greedy: bool,
    num_logprobs: int = 0,
    processors: tuple = (),
) -> jax.Array | dict:
    """``logits`` f32[B, V] -> ids i32[B] (zero-padded to i32[Bmax] with ``prev_tokens``): static
    ``processors`` (`apply_logits_processors`), ``sampling.bitmask`` (vLLM: sampling, logprobs see
    both), `sample`; K = ``num_logprobs`` > 0 (static): a dict of ``tokens``, rows' `logprobs`."""
    logits = apply_logits_processors(logits, inp.sampling, processors)
    if inp.sampling.bitmask is not None:
        logits = apply_token_bitmask(logits, inp.sampling.bitmask)
    with jax.named_scope("sample"):
        tokens = sample(logits, inp.sampling, all_greedy=all_greedy)
    out = {}
    if num_logprobs:
        with jax.named_scope("logprobs"):
            out = logprobs(logits, tokens, num_logprobs)
    if inp.prev_tokens is not None:
        tokens = jnp.zeros_like(inp.prev_tokens).at[: tokens.shape[0]].set(tokens)
    return dict(tokens=tokens, **out) if out else tokens


GEMM_COMPILER_OPTIONS = {"xla": None, "cublas": {"xla_gpu_enable_triton_gemm": False}}


def unpack(buf: jax.Array, key: ShapeKey) -> tuple[jax.Array, jax.Array, StepInput]:
    """Inverse of `pack` (``key`` static): (block_tables, seq_lens, `StepInput`, no prev_tokens)."""
    groups, off = {"input": {}, "kv": {}, "sampling": {}, "packing": {}}, 0
    for f, shape in layout(key):
        n = math.prod(shape)
        x = buf[off : off + n].reshape(shape)
        if jnp.dtype(f.dtype) != jnp.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(f.dtype))
        groups[f.group][f.name] = x
        off += n
    inp = StepInput(
        **groups["input"],
        sampling=SamplingMetadata(**groups["sampling"]),
        packing=models.Packing(**groups["packing"]) if key.packed else None,
    )
    return groups["kv"]["block_tables"], groups["kv"]["seq_lens"], inp


def packed_step(
    params: dict,
    kv: KVCache,
    buf: jax.Array,
    prev_tokens: jax.Array,
    *,
    key: ShapeKey,
    cfg: ModelConfig,
    kernels: ModelKernels,
    phase: str = "step",
):
    """One step on ``buf`` i32[S] (`pack`), ``prev_tokens`` i32[Bmax]; ``kv`` tables: placeholders.
    ``phase`` "step": `forward` then `sample_logits`, fused: (ids, or with K > 0 a dict, the prompt
    log-probabilities included; the cache); "forward": `forward` only: ((logits f32[B, V], prompt
    dict), the cache); "sample": `sample_logits` of ``params``, the forward's logits (``kv`` None),
    read from a fresh ``buf`` of the same ``key`` (the bitmask filled since): ids or dict."""
    tables, lens, inp = unpack(buf, key)
    inp = dataclasses.replace(inp, prev_tokens=prev_tokens)
    kw = dict(all_greedy=key.all_greedy, num_logprobs=key.logprobs, processors=key.processors)
    if phase == "sample":
        return sample_logits(params, inp, **kw)
    logits, prompt, new = forward(
        params,
        kv.replace(block_tables=tables, seq_lens=lens),
        inp,
        cfg=cfg,
        kernels=kernels,
        num_logprobs=key.logprobs,
    )
    out = (logits, prompt) if phase == "forward" else sample_logits(logits, inp, **kw)
    if phase == "step" and prompt:
        out = {**out, **prompt}
    return out, new.replace(block_tables=kv.block_tables, seq_lens=kv.seq_lens)


PACKED_STEPS = {
    gemm: jax.jit(
        packed_step,
        donate_argnums=(1,),
        compiler_options=options,
        static_argnames=("key", "cfg", "kernels", "phase"),
    )
    for gemm, options in GEMM_COMPILER_OPTIONS.items()
}
PHASES = {False: ("step",), True: ("forward", "sample")}  # by split: fused, or two calls


def _name(phase: str, key: ShapeKey):  # an executable's `EngineStats.compiled_shapes` entry
    return key if phase == "step" else (phase, key)


def enable_compilation_cache(path) -> str:
    """Point JAX's persistent compilation cache at ``path`` (created; every compile cached);
    returns the absolute path. Raises ValueError: not a directory or cannot be created."""
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"compilation_cache_dir={path!r} is invalid: it exists and is not a directory"
        )
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"compilation_cache_dir={path!r} cannot be created: {e.strerror}"
        ) from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


class StepExecutor:
    """The compiled steps of ``cfg`` with ``kernels``, resolved `KernelConfig` ``kc``, the
    largest batch bucket ``max_batch``; counts compiles in ``stats`` (`EngineStats`);
    ``background``: `runnable` compiles missing shapes in a thread. ``split``: a step compiled
    and run as its "forward" and "sample" phases (`PHASES`), else fused ("step")."""

    def __init__(self, cfg, kernels, kc, max_batch: int, stats, background: bool = False) -> None:
        self.steps, self.static, self.stats = PACKED_STEPS, dict(cfg=cfg, kernels=kernels), stats
        self.cublas_min_batch, self.prefill_gemm = kc.cublas_decode_min_batch, kc.prefill_gemm
        self.inputs = replicated(kernels.mesh)  # step inputs: whole on every device of a mesh
        self.no_prev_tokens = jax.device_put(np.zeros((max_batch,), np.int32), self.inputs)
        self.executables: dict = {}  # `_name` -> executable
        self.pool = ThreadPoolExecutor(1) if background else None
        self.pending: dict = {}  # `_name` -> Future of its executable

    def runnable(self, key: ShapeKey, params, kv, split: bool = False) -> ShapeKey:
        """The shape to run a batch of shape ``key`` under: ``key`` once compiled (or without
        ``background``); else the cheapest compiled shape that `covers` it, ``key`` itself
        compiling meanwhile in the background from ``params``' and ``kv``'s avals; else ``key``
        (`run` compiles it: a stall)."""
        for k in [k for k, f in self.pending.items() if f.done()]:
            self._add(k, self.pending.pop(k).result())
        ready = lambda k: all(_name(p, k) in self.executables for p in PHASES[split])  # noqa: E731
        if ready(key) or self.pool is None:
            return key
        keys = {k if isinstance(k, ShapeKey) else k[1] for k in self.executables}
        cover = min(
            (k for k in keys if ready(k) and covers(k, key)),
            default=None,  # the cheapest
            key=lambda k: (k.batch * k.tokens, k.pages, k.query or 0, not k.all_greedy),
        )
        for phase in PHASES[split] if cover is not None else ():
            if (name := _name(phase, key)) not in self.pending:
                avals = jax.tree.map(
                    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                    self._padding_args(phase, params, kv, key),
                )
                self.pending[name] = self.pool.submit(
                    lambda p=phase, a=avals: self._lower(p, key, a).compile()
                )
        return key if cover is None else cover

    def step_fn(self, key: ShapeKey):
        """The jit step for ``key`` (cuBLAS: decode buckets >= ``cublas_min_batch`` rows)."""
        if key.packed:
            return self.steps[self.prefill_gemm]
        cublas = self.cublas_min_batch is not None and key.batch >= self.cublas_min_batch
        return self.steps["cublas" if cublas else "xla"]

    def _args(self, params, kv, hb: HostBatch, prev_tokens) -> tuple:
        prev = self.no_prev_tokens if prev_tokens is None else prev_tokens
        return params, kv, jax.device_put(pack(hb), self.inputs), prev

    def _padding_args(self, phase: str, params, kv, key: ShapeKey) -> tuple:
        if phase == "sample":  # the avals of the forward's logits
            params, kv = (
                jax.ShapeDtypeStruct(
                    (key.batch, self.static["cfg"].vocab_size), jnp.float32, sharding=self.inputs
                ),
                None,
            )
        return self._args(params, kv, allocate(key), None)

    def _add(self, name, exe):
        self.executables[name] = exe
        self.stats.compiled_shapes.add(name)
        return exe

    def run(self, params, kv, hb: HostBatch, prev_tokens=None, phase: str = "step"):
        """Dispatch ``phase`` of a step, no wait (`packed_step`): "step": (i32[Bmax] tokens, or
        `step`'s dict if logprobs; the cache); "forward" and "sample" as `packed_step`'s."""
        args = self._args(params, kv, hb, prev_tokens)
        if (exe := self.executables.get(name := _name(phase, hb.key))) is None:
            self.stats.num_lazy_compiles += 1
            log.info("compiling %s for %s (%d so far)", phase, hb.key, self.stats.num_compiles + 1)
            t = time.perf_counter()
            exe = self._add(name, self._lower(phase, hb.key, args).compile())
            self.stats.compile_s += time.perf_counter() - t
        return exe(*args)

    def _lower(self, phase: str, key: ShapeKey, args):
        return self.step_fn(key).lower(*args, key=key, phase=phase, **self.static)

    def precompile(self, params, kv, keys, *, max_workers: int | None, split: bool = False):
        """Compile each new key ahead of time (``split``: a key with a bitmask as its phases) in
        ``max_workers`` threads (default min(executables, CPUs)), then run each once on an
        all-padding batch (`allocate`). Returns ({"shapes" (executables), "lower_s", "warm_s",
        "seconds"}, the new cache). Raises ValueError: bad ``max_workers``."""
        if max_workers is not None:
            check_int("max_workers", max_workers, 1)
        todo = [
            (p, k)
            for k in dict.fromkeys(keys)
            for p in PHASES[split and bool(k.bitmask)]
            if _name(p, k) not in self.stats.compiled_shapes
        ]
        jax.block_until_ready(params)  # weights still being built would count as tracing
        t0, lower_s = time.perf_counter(), 0.0
        if todo:
            with ThreadPoolExecutor(max_workers or min(len(todo), os.cpu_count() or 1)) as pool:
                futures = []
                for p, k in todo:
                    t = time.perf_counter()
                    low = self._lower(p, k, self._padding_args(p, params, kv, k))
                    futures.append(pool.submit(low.compile))
                    lower_s += time.perf_counter() - t
                for (p, k), f in zip(todo, futures):
                    self._add(_name(p, k), f.result())
        t_warm, out = time.perf_counter(), None
        for p, k in [t for t in todo if t[0] != "sample"]:  # sampling: small, not warmed
            out, kv = self.executables[_name(p, k)](*self._padding_args(p, params, kv, k))
        jax.block_until_ready(out)
        return dict(
            shapes=len(todo),
            lower_s=lower_s,
            warm_s=time.perf_counter() - t_warm,
            seconds=time.perf_counter() - t0,
        ), kv
