"""`StepExecutor`: compiles the step's programs (`jaxinfer.runner.step`) once per key, ahead of
time (`precompile`, the planned set in threads) or on first use, and dispatches them."""

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.checks import check_int
from jaxinfer.runner.eagle3_steps import forward_aux_step
from jaxinfer.runner.parallel import replicated
from jaxinfer.runner.step import forward_step, prompt_step, sample_step
from jaxinfer.step_input import ForwardKey, HostBatch, SamplerKey, StepShape, allocate, pack

log = logging.getLogger("jaxinfer")

GEMM_COMPILER_OPTIONS = {"xla": None, "cublas": {"xla_gpu_enable_triton_gemm": False}}
FORWARD_STEPS = {
    gemm: jax.jit(
        forward_step,
        donate_argnums=(1,),
        compiler_options=options,
        static_argnames=("key", "sizes", "cfg", "kernels"),
    )
    for gemm, options in GEMM_COMPILER_OPTIONS.items()
}
FORWARD_AUX_STEPS = {  # `forward_step` with aux hidden states: only with an EAGLE-3 head
    gemm: jax.jit(
        forward_aux_step,
        donate_argnums=(1,),
        compiler_options=options,
        static_argnames=("key", "sizes", "cfg", "kernels", "aux_layers"),
    )
    for gemm, options in GEMM_COMPILER_OPTIONS.items()
}
SAMPLE_STEP = jax.jit(sample_step, static_argnames=("key", "sizes", "num_logprobs"))
PROMPT_STEP = jax.jit(
    prompt_step, static_argnames=("prompt", "sizes", "cfg", "kernels", "num_logprobs")
)
STATS_SETS = {"forward": "forward_shapes", "sampler": "sampler_shapes", "prompt": "prompt_shapes"}
# Compiler options of every step program on XLA's CPU back-end (LLVM at -O0: faster compiles,
# slower steps at large batches); other back-ends keep their defaults. A level the user gives in
# XLA_FLAGS (``--xla_backend_optimization_level=2``) wins.
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def compile_lowered(lowered):
    """``lowered.compile()``, with `CPU_COMPILER_OPTIONS` when JAX's default back-end is the CPU
    and XLA_FLAGS sets no back-end optimization level."""
    cpu = jax.default_backend() == "cpu"
    user_level = "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
    return lowered.compile(
        compiler_options=CPU_COMPILER_OPTIONS if cpu and not user_level else None
    )


class Forwarded(NamedTuple):
    """A dispatched forward: logits f32[R, V], hidden [T, D] and, with an EAGLE-3 head, aux
    [T, 3D] (the target's aux hidden states; else None) (device arrays)."""

    logits: Any
    hidden: Any
    aux: Any = None


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
    """The compiled programs of ``cfg`` with ``kernels`` under resolved `KernelConfig` ``kc``,
    for `Sizes` ``sizes``; log-probabilities at K = ``num_logprobs``; compiles counted in
    ``stats`` (`EngineStats`: ``forward_shapes``, ``sampler_shapes``, ``prompt_shapes``);
    ``aux_layers`` (an EAGLE-3 head's): the forwards also return those layers' input streams
    (`forward_aux_step`; empty: `forward_step`, unchanged)."""

    def __init__(self, cfg, kernels, kc, sizes, num_logprobs: int, stats, aux_layers=()) -> None:
        self.cfg, self.kernels, self.sizes, self.stats = cfg, kernels, sizes, stats
        self.aux_layers = tuple(aux_layers)
        self.num_logprobs = num_logprobs
        self.cublas_min_batch, self.prefill_gemm = kc.cublas_decode_min_batch, kc.prefill_gemm
        self.inputs = replicated(kernels.mesh)  # step inputs: whole on every device of a mesh
        self.no_prev_tokens = self.put(np.zeros((sizes.max_rows,), np.int32))
        self.executables: dict = {}  # (program, key) -> executable

    def put(self, a: np.ndarray):
        return jax.device_put(a, self.inputs)

    def _aval(self, shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.inputs)

    def gemm(self, key: ForwardKey) -> str:
        """The GEMM back-end (`GEMM_COMPILER_OPTIONS`) of forward ``key``: cuBLAS for decode
        steps of ``cublas_decode_min_batch`` rows or more, else XLA's; ``prefill_gemm`` for
        ragged steps."""
        if not key.decode:
            return self.prefill_gemm
        cublas = self.cublas_min_batch is not None and key.tokens >= self.cublas_min_batch
        return "cublas" if cublas else "xla"

    def _lower(self, program: str, key, args):
        """The lowered program for ``key`` on ``args`` (arrays or avals)."""
        if program == "forward":
            static = dict(key=key, sizes=self.sizes, cfg=self.cfg, kernels=self.kernels)
            if self.aux_layers:
                static["aux_layers"] = self.aux_layers
                return FORWARD_AUX_STEPS[self.gemm(key)].lower(*args, **static)
            return FORWARD_STEPS[self.gemm(key)].lower(*args, **static)
        if program == "sampler":
            static = dict(key=key, sizes=self.sizes, num_logprobs=self.num_logprobs)
            return SAMPLE_STEP.lower(*args, **static)
        static = dict(sizes=self.sizes, cfg=self.cfg, kernels=self.kernels)
        return PROMPT_STEP.lower(*args, prompt=key[1], num_logprobs=self.num_logprobs, **static)

    def _add(self, program: str, key, exe):
        self.executables[(program, key)] = exe
        getattr(self.stats, STATS_SETS[program]).add(key)
        return exe

    def _call(self, program: str, key, args):
        """Run ``program`` for ``key``, compiling it first if it is new (counted as lazy)."""
        if (exe := self.executables.get((program, key))) is None:
            self.stats.num_lazy_compiles += 1
            log.info("compiling the %s for %s", program, key)
            t = time.perf_counter()
            exe = self._add(program, key, compile_lowered(self._lower(program, key, args)))
            self.stats.compile_s += time.perf_counter() - t
        return exe(*args)

    def forward(self, params, kv, hb: HostBatch, prev_tokens=None):
        """Dispatch ``hb``'s forward, no wait; ``prev_tokens``: the sampled tokens of the step in
        flight. Returns (`Forwarded`, the new KV cache)."""
        prev = self.no_prev_tokens if prev_tokens is None else prev_tokens
        args = (params, kv, self.put(pack(hb, "forward")), prev)
        out, kv = self._call("forward", hb.shape.forward, args)
        return Forwarded(*out), kv

    def sample(self, fwd: Forwarded, hb: HostBatch):
        """Dispatch ``hb``'s sampler on ``fwd``'s logits: tokens i32[max_rows], or a dict."""
        return self._call("sampler", hb.shape.sampler, (fwd.logits, self.put(pack(hb, "sampling"))))

    def prompt(self, params, fwd: Forwarded, hb: HostBatch) -> dict:
        """Dispatch ``hb``'s prompt scorer on ``fwd``'s hidden states: a dict of arrays. Keyed
        by (T, P): small programs compiled on first use (not in the planned set)."""
        buf = self.put(pack(hb, "prompt"))
        key = (hb.shape.forward.tokens, hb.shape.prompt)
        return self._call("prompt", key, (params, fwd.hidden, buf))

    def _avals(self, program: str, key, params, kv) -> tuple:
        """Arguments of ``program`` for ``key``: arrays or avals of an all-padding batch."""
        if program == "forward":
            hb = allocate(StepShape(key, SamplerKey(0, "greedy")), self.sizes)
            return params, kv, self.put(pack(hb, "forward")), self.no_prev_tokens
        if program == "sampler":
            hb = allocate(StepShape(ForwardKey(key.rows, True), key), self.sizes)
            rows = key.rows * (key.spec + 1)  # a verify step's: each row's k + 1 positions
            logits = self._aval((rows, self.cfg.vocab_size), jnp.float32)
            return logits, self.put(pack(hb, "sampling"))
        tokens, prompt = key  # the forward's T, the scored positions P
        hb = allocate(StepShape(ForwardKey(1, True), SamplerKey(0, "greedy"), prompt), self.sizes)
        hidden = self._aval((tokens, self.cfg.hidden_size), _leaf_dtype(params))
        return params, hidden, self.put(pack(hb, "prompt"))

    def precompile(self, params, kv, planned: dict, *, max_workers: int | None = None):
        """Compile each new key of ``planned`` ({program: [keys]}) in ``max_workers`` threads
        (default: the CPUs), lowering in this thread; then run each new forward once on an
        all-padding batch. Returns ({"shapes", "lower_s", "warm_s", "seconds"}, the new
        cache). Raises ValueError: bad ``max_workers``."""
        if max_workers is not None:
            check_int("max_workers", max_workers, 1)
        todo = [
            (p, k)
            for p, keys in planned.items()
            for k in dict.fromkeys(keys)
            if (p, k) not in self.executables
        ]
        jax.block_until_ready(params)  # weights still being built would count as tracing
        t0, lower_s = time.perf_counter(), 0.0
        if todo:
            with ThreadPoolExecutor(max_workers or min(len(todo), os.cpu_count() or 1)) as pool:
                futures = []
                for p, k in todo:
                    t = time.perf_counter()
                    low = self._lower(p, k, self._avals(p, k, params, kv))
                    futures.append(pool.submit(compile_lowered, low))
                    lower_s += time.perf_counter() - t
                for (p, k), f in zip(todo, futures):
                    self._add(p, k, f.result())
        t_warm, out = time.perf_counter(), None
        for p, k in todo:
            if p == "forward":
                out, kv = self.executables[(p, k)](*self._avals(p, k, params, kv))
        jax.block_until_ready(out)
        info = dict(shapes=len(todo), lower_s=lower_s, warm_s=time.perf_counter() - t_warm)
        return dict(info, seconds=time.perf_counter() - t0), kv


def _leaf_dtype(params) -> jnp.dtype:
    """The compute dtype: the embedding's (the hidden states' dtype)."""
    return jnp.dtype(params["embed"].dtype)
