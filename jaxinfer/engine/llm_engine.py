"""LLMEngine: the host loop that drives the scheduler and the jit-compiled step.

One `step()`: schedule step n+1 (host) -> pad into a bucket and pack every input into one int32
buffer (host, numpy; one host-to-device transfer) -> dispatch the compiled step with the KV cache
donated (device, asynchronous) -> read back step n's token ids -> update sequences, stop checks
(host). Reading step n's tokens after step n+1 is queued keeps the device
busy while the host works (asynchronous scheduling; `EngineConfig.async_scheduling`): a decode
row whose input is step n's token takes it from step n's device output. Rows that use a
repetition penalty need every token on the host, so a step with such rows runs synchronously.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import compile_cache
from jaxinfer.attention import make_attention_fn, resolve_backend, resolve_prefill_backend
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.batch_builder import (BucketSpec, HostBatch, build_host_batch,
                                           empty_host_batch, pack_device_inputs)
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.dry_run import dry_run
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.kv_cache import KVCache, init_kv_cache
from jaxinfer.memory import MemoryTracker, device_memory_stats
from jaxinfer.models.params import param_bytes
from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.step import make_packed_step_fn
from pallas_kernels.sizes import is_pow2

log = logging.getLogger("jaxinfer")


@dataclass
class _InFlight:
    """A dispatched step: its batch, its device token ids i32[B] and which rows are sampled."""

    batch: object            # ScheduledBatch
    tokens: jax.Array
    sample_rows: np.ndarray
    row_of: dict             # id(seq) -> row, for the next step's pending inputs
    needs_host_tokens: bool  # a row uses a repetition penalty: read back before the next step
    shape_key: tuple = ()


class StepRecord(NamedTuple):
    """One read-back step in `LLMEngine.step_log` (seconds from ``time.perf_counter``).

    ``wait_s`` is how long the host blocked on the device for this step's tokens: near 0 means
    the device finished before the host asked, so the host, not the device, set the pace. The
    other times are host work of the `LLMEngine.step` call that read this step back: scheduling
    the next step and building + transferring + dispatching it (``launch_s``), both 0 when the
    read-back came first (synchronous steps), and advancing the sequences after the read-back
    (``post_s``)."""

    shape_key: tuple
    rows: int
    t_done: float
    wait_s: float = 0.0
    schedule_s: float = 0.0
    launch_s: float = 0.0
    post_s: float = 0.0


CPU_KV_BUDGET_BYTES = 2 << 30  # KV pool cap on hosts without device memory statistics


def default_dtype(platform: str | None = None) -> str:
    """Compute dtype when `EngineConfig.dtype` is None: bfloat16 on GPU, float32 elsewhere."""
    return "bfloat16" if (platform or jax.default_backend()) == "gpu" else "float32"


@dataclass(frozen=True)
class ResolvedEngineConfig:
    """`EngineConfig` with every "auto"/None resolved for this model and device."""

    engine: EngineConfig
    max_model_len: int
    num_pages: int
    dtype: str
    attention: str
    prefill_attention: str = "reference"
    qkv_prologue: str = "xla"
    add_rms_norm: str = "xla"


def resolve_engine_config(cfg: ModelConfig, ec: EngineConfig,
                          platform: str | None = None) -> ResolvedEngineConfig:
    """Fill in max_model_len, dtype, attention back-end and the KV pool size.

    Pool size, when ``num_pages`` is None: on a device with memory statistics,
    ``memory_fraction * bytes_limit - bytes_in_use`` (weights are already resident) divided by the
    page bytes; on the CPU, enough pages for ``max_num_seqs`` full-length sequences, capped at
    2 GiB.

    Raises:
        ValueError: max_model_len above the model's max_position_embeddings, or a pool too small.
    """
    platform = platform or jax.default_backend()
    max_len = ec.max_model_len or cfg.max_position_embeddings
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"EngineConfig.max_model_len={max_len} is invalid: the model supports at "
                         f"most max_position_embeddings={cfg.max_position_embeddings}")
    dtype = ec.dtype or default_dtype(platform)
    dtype_bytes = jnp.dtype(dtype).itemsize
    page_bytes = cfg.kv_bytes_per_token(dtype_bytes) * ec.page_size
    num_pages = ec.num_pages
    if num_pages is None:
        stats = jax.local_devices()[0].memory_stats() if platform == "gpu" else None
        if stats and "bytes_limit" in stats:
            budget = ec.memory_fraction * stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        else:
            full = ec.max_num_seqs * (-(-max_len // ec.page_size)) * page_bytes
            budget = min(full, CPU_KV_BUDGET_BYTES)
        num_pages = int(budget // page_bytes) + 1
        if num_pages < 2:
            raise ValueError(f"no memory left for the KV pool (budget {budget / 2**30:.2f} GiB); "
                             "raise memory_fraction or set num_pages")
    return ResolvedEngineConfig(ec, max_len, num_pages, dtype,
                                resolve_backend(ec.attention, platform, dtype),
                                resolve_prefill_backend(ec.prefill_attention, platform),
                                *resolve_fused_kernels(cfg, ec, platform, dtype))


def check_fused_platform(name: str, value: str, platform: str) -> None:
    """Raise ValueError when the fused-kernel option ``name`` (an `EngineConfig` field) asks for
    "triton" on a host whose JAX backend ``platform`` is not a GPU (callers check this before
    loading a model)."""
    if value == "triton" and platform != "gpu":
        raise ValueError(f"EngineConfig.{name}='triton' is a GPU kernel and this host's JAX "
                         f"backend is {platform!r}; use 'auto' or 'xla'")


def resolve_fused_kernels(cfg: ModelConfig, ec: EngineConfig, platform: str,
                          dtype: str) -> tuple[str, str]:
    """(qkv_prologue, add_rms_norm) with "auto" resolved: "triton" on a GPU for a bfloat16/float16
    engine whose shapes the kernels take (head dim H with H/2 a power of 2; hidden size D a
    power of 2), else "xla".

    Raises:
        ValueError: "triton" asked for on a host without a GPU, or for a model whose shapes the
            kernel does not take.
    """
    gpu = platform == "gpu" and dtype in ("bfloat16", "float16")
    out = []
    for name, value, ok, what in (
            ("qkv_prologue", ec.qkv_prologue, is_pow2(cfg.head_dim // 2),
             f"head dim H/2 a power of 2 (this model: H={cfg.head_dim})"),
            ("add_rms_norm", ec.add_rms_norm, is_pow2(cfg.hidden_size),
             f"a power-of-2 hidden size (this model: {cfg.hidden_size})")):
        check_fused_platform(name, value, platform)
        if value == "auto":
            value = "triton" if gpu and ok else "xla"
        elif value == "triton" and not ok:
            raise ValueError(f"EngineConfig.{name}='triton' needs {what}; use 'xla' or 'auto'")
        out.append(value)
    return tuple(out)


class LLMEngine:
    """Continuous-batching engine over one model.

    Args:
        config: the model's `ModelConfig`.
        params: its parameter tree (already in the compute dtype).
        engine_config: `EngineConfig`.
        eos_token_ids: ids that end a sequence unless ``ignore_eos`` (tokenizer + generation config).
        detokenize: ``token ids -> str`` for stop strings and streaming (None: no stop strings).
    """

    def __init__(self, config: ModelConfig, params: dict, engine_config: EngineConfig, *,
                 eos_token_ids: tuple[int, ...] = (), detokenize: Callable | None = None):
        self.model_config = config
        if engine_config.compilation_cache_dir is not None:
            compile_cache.enable(engine_config.compilation_cache_dir)
        self.resolved = r = resolve_engine_config(config, engine_config)
        ec = engine_config
        self.params = params
        self.page_size = ec.page_size
        self.max_model_len = r.max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.detokenize = detokenize
        try:
            self.kv: KVCache = init_kv_cache(config, r.num_pages, ec.page_size, jnp.dtype(r.dtype))
        except jax.errors.JaxRuntimeError as e:
            raise ValueError(f"EngineConfig.num_pages={r.num_pages} is too large: the KV pool "
                             f"does not fit in device memory ({str(e).splitlines()[0][:120]})") from None
        self.block_manager = BlockManager(r.num_pages, ec.page_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=ec.max_num_seqs,
                                   max_num_batched_tokens=ec.max_num_batched_tokens,
                                   max_model_len=r.max_model_len, page_size=ec.page_size,
                                   eos_token_ids=self.eos_token_ids)
        self.buckets = BucketSpec.build(
            max_num_seqs=ec.max_num_seqs, max_num_batched_tokens=ec.max_num_batched_tokens,
            max_model_len=r.max_model_len, page_size=ec.page_size,
            batch_buckets=ec.batch_buckets, token_buckets=ec.token_buckets)
        attn = make_attention_fn(r.attention, r.prefill_attention, qkv_prologue=r.qkv_prologue,
                                 add_rms_norm=r.add_rms_norm)
        self._steps = {(g, gemm): make_packed_step_fn(config, attn, g, gemm)
                       for g in (False, True) for gemm in ("xla", "cublas")}
        self._cublas_min_batch = ec.cublas_decode_min_batch
        self._prefill_gemm = ec.prefill_gemm
        # the previous step's tokens when none is in flight (StepInput.prev_tokens: fixed shape)
        self._no_prev_tokens = jnp.zeros((self.buckets.batch[-1],), jnp.int32)
        self.compiled_shapes: set[tuple] = set()  # shapes compiled so far (ahead of time or not)
        self._executables: dict[tuple, object] = {}  # shape key -> ahead-of-time compiled step
        self.num_lazy_compiles = 0  # shapes first compiled inside step() (not by precompile)
        self._rng = np.random.default_rng(ec.seed)
        self._ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self.num_steps = 0
        self.async_scheduling = ec.async_scheduling
        self._in_flight: _InFlight | None = None
        self.num_overlapped_steps = 0  # steps dispatched while the previous one was in flight
        self.max_kv_len_seen = 0  # the largest KV length any step wrote (<= max_model_len)
        self.weight_bytes = param_bytes(config, jnp.dtype(r.dtype).itemsize)
        page_bytes = config.kv_bytes_per_token(jnp.dtype(r.dtype).itemsize) * ec.page_size
        # Memory breakdown over time (weights / KV pool / pages in use / other); snapshots are
        # taken after each step only while `trace_memory` is set (CLI: --memory-trace FILE).
        self.memory = MemoryTracker(self.weight_bytes, page_bytes, r.num_pages)
        self.trace_memory = False
        # Set to a list to log each step as it is read back (`StepRecord`). Under asynchronous
        # scheduling, while the host waits on the device, the time between two read-backs is
        # about the later step's device time (scripts/bench_throughput.py).
        self.step_log: list | None = None
        self._host_times = [0.0, 0.0]  # this step() call's schedule and launch seconds

    def step_fn(self, shape_key: tuple):
        """The jit step for a ``HostBatch.shape_key``: its sampling mode, and cuBLAS GEMMs for
        decode buckets of at least ``EngineConfig.cublas_decode_min_batch`` rows and, with
        ``EngineConfig.prefill_gemm="cublas"``, for prefill steps."""
        if shape_key[3] is not None:  # packed prefill
            return self._steps[(shape_key[-1], self._prefill_gemm)]
        decode_rows = shape_key[1][0]
        cublas = self._cublas_min_batch is not None and decode_rows >= self._cublas_min_batch
        return self._steps[(shape_key[-1], "cublas" if cublas else "xla")]

    # ----------------------------------------------------------------- requests
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Check that one request can run on this engine (nothing is queued).

        Raises:
            ValueError: a prompt or stop token id outside [0, V), an empty prompt, prompt +
                max_tokens over max_model_len, or more pages than the whole pool
                (`Scheduler.check_admissible`).
        """
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range: ids must be in [0, {vocab})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids contains {bad[0]}, out of range: ids "
                             f"must be in [0, {vocab})")
        self.scheduler.check_admissible(len(prompt_token_ids), params)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Validate (`check_request`) and queue one request.

        Raises:
            ValueError: see `check_request` (the request is not queued; the engine is unaffected).
        """
        self.check_request(prompt_token_ids, params)
        rid = request_id if request_id is not None else str(next(self._ids))
        if params.seed is not None:
            seed = params.seed
        else:
            seed = int(self._rng.integers(0, 2**31 - 1))
        seq = Sequence(request_id=rid, prompt_token_ids=[int(t) for t in prompt_token_ids],
                       params=params, seed=seed)
        self.scheduler.add(seq)  # raises ValueError before queueing
        self._seqs[rid] = seq
        return rid

    def has_unfinished(self) -> bool:
        """Requests not finished, or a dispatched step whose tokens were not read back yet."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def abort_request(self, rid: str) -> None:
        """Abort one request (no output is kept for it)."""
        self.scheduler.abort(rid)
        self._seqs.pop(rid, None)

    def abort_all(self) -> None:
        """Error recovery: abort every unfinished request, free their pages and, if a donated
        step was interrupted before it returned the cache, allocate the pools again."""
        for s in self.scheduler.abort_all():
            self._seqs.pop(s.request_id, None)
        self._seqs.clear()
        self._in_flight = None
        if self.kv.k.is_deleted() or self.kv.v.is_deleted():
            r = self.resolved
            self.kv = init_kv_cache(self.model_config, r.num_pages, self.page_size,
                                    jnp.dtype(r.dtype))

    # --------------------------------------------------------------------- step
    def _device_inputs(self, hb: HostBatch, prev_tokens: jax.Array | None = None,
                       pending_src: np.ndarray | None = None) -> tuple[tuple, tuple]:
        """The packed step's dynamic arguments ``(params, kv, buf, prev_tokens)`` for ``hb``
        (one host-to-device transfer: `pack_device_inputs`) and the static ``layout``."""
        buf, layout = pack_device_inputs(hb, pending_src)
        if prev_tokens is None:
            prev_tokens = self._no_prev_tokens
        return (self.params, self.kv, jax.device_put(buf), prev_tokens), layout

    def step(self) -> list[Sequence]:
        """Dispatch the next step and read back the previous one's tokens (with
        ``async_scheduling``; otherwise dispatch and read back the same step).

        Returns:
            The sequences that finished in the step read back here.
        """
        finished: list[Sequence] = []
        self._host_times = [0.0, 0.0]  # a step read back before scheduling records zeros
        prev = self._in_flight
        if prev is not None and (prev.needs_host_tokens or not self.async_scheduling):
            finished += self._complete(prev)
            prev = None
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = self._launch(batch, prev) if batch is not None else None
        self._host_times = [t1 - t0, time.perf_counter() - t1]
        if prev is not None and launched is not None:
            self.num_overlapped_steps += 1
        if prev is not None:
            finished += self._complete(prev)
        self._in_flight = launched
        if launched is not None and not self.async_scheduling:
            finished += self._complete(launched)
        return finished

    def _launch(self, batch, prev: _InFlight | None) -> _InFlight:
        """Build, transfer and dispatch one step (does not wait for the device)."""
        hb = build_host_batch(batch, page_size=self.page_size, buckets=self.buckets)
        exe = self._executables.get(hb.shape_key)
        if exe is None:
            if hb.shape_key not in self.compiled_shapes:
                self.compiled_shapes.add(hb.shape_key)
                self.num_lazy_compiles += 1
                log.info("compiling step for shape %s (%d so far)", hb.shape_key,
                         len(self.compiled_shapes))
        self.max_kv_len_seen = max(self.max_kv_len_seen, int(hb.seq_lens.max()))
        src = np.full(hb.pending_rows.shape, -1, np.int32)
        if hb.pending_rows.any():
            if prev is None:
                raise RuntimeError("LLMEngine: a row needs a pending token but no step is in flight")
            for i, seq in enumerate(batch.seqs):
                if hb.pending_rows[i]:
                    src[i] = prev.row_of[id(seq)]
        args, layout = self._device_inputs(hb, None if prev is None else prev.tokens, src)
        if exe is None:
            tokens, self.kv = self.step_fn(hb.shape_key)(*args, layout=layout)
        else:
            tokens, self.kv = exe(*args)
        self.num_steps += 1
        penalised = any(s.params.repetition_penalty != 1.0 for s in batch.seqs)
        return _InFlight(batch, tokens, hb.sample_rows,
                         {id(s): i for i, s in enumerate(batch.seqs)}, penalised, hb.shape_key)

    def _complete(self, done: _InFlight) -> list[Sequence]:
        """Read back a dispatched step's tokens and advance its sequences (blocks on it only)."""
        if self._in_flight is done:
            self._in_flight = None
        t0 = time.perf_counter()
        tokens = np.asarray(done.tokens)
        t1 = time.perf_counter()
        batch = done.batch
        sampled = [int(tokens[i]) if done.sample_rows[i] else None for i in range(batch.num_seqs)]
        finished = self.scheduler.postprocess(batch, sampled)
        finished += self._check_stop_strings(batch.seqs, sampled)
        if self.step_log is not None:
            self.step_log.append(StepRecord(done.shape_key, batch.num_seqs, t1, t1 - t0,
                                            *self._host_times, time.perf_counter() - t1))
        if self.trace_memory:
            self.memory_snapshot()
        return finished

    def memory_snapshot(self):
        """Record weights / KV pool / pages in use / other device bytes now (see `MemoryTracker`)."""
        bm = self.block_manager
        stats = device_memory_stats()
        return self.memory.snapshot(bm.num_usable_pages - bm.num_free_pages,
                                    device_bytes_in_use=stats[0] if stats else None)

    def _check_stop_strings(self, seqs, sampled) -> list[Sequence]:
        """Match stop strings on the decoded text of every sequence that sampled a token this
        step, including one that just finished on length (a stop string completed by the last
        allowed token still ends it with "stop", vLLM's rule). Returns the newly finished ones."""
        done = []
        for s, tok in zip(seqs, sampled):
            if tok is None or not s.params.stop or self.detokenize is None:
                continue
            if s.is_finished and s.finish_reason != "length":
                continue
            # a new match ends within the last tokens: each token decodes to >= 1 character
            # (a few more cover tokens that decode to nothing or to part of a character)
            window = max(map(len, s.params.stop)) + 8
            tail = self.detokenize(s.output_token_ids[-window:])
            if not any(stop in tail for stop in s.params.stop):
                continue
            text = self.detokenize(s.output_token_ids)
            hit = [stop for stop in s.params.stop if stop in text]
            if not hit:
                continue
            s.stop_string = min(hit, key=text.find)
            if s.is_finished:  # already off the running list and its pages freed
                s.finish_reason = "stop"
            else:
                self.scheduler.finish(s, "stop")
                done.append(s)
        return done

    # ------------------------------------------------------------- ahead of time
    def plan_shapes(self, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple]:
        """The step shapes (``HostBatch.shape_key``) that running ``requests`` on an idle engine
        visits, in first-visit order: a host-only dry run of this engine's scheduler
        (`jaxinfer.engine.dry_run`; requests run to ``max_tokens``, as with ``ignore_eos``).
        Requests that stop earlier (EOS, stop tokens or strings) change which rows share a step,
        so such a run can also visit shapes not listed here (compiled on first use).

        Raises:
            ValueError: a request the scheduler rejects.
        """
        r, ec = self.resolved, self.resolved.engine
        sched = Scheduler(BlockManager(r.num_pages, ec.page_size), max_num_seqs=ec.max_num_seqs,
                          max_num_batched_tokens=ec.max_num_batched_tokens,
                          max_model_len=r.max_model_len, page_size=ec.page_size)
        steps = dry_run(sched, requests, buckets=self.buckets,
                        async_scheduling=self.async_scheduling)
        return list(dict.fromkeys(hb.shape_key for _, hb in steps))

    def precompile(self, shape_keys, *, max_workers: int | None = None, warm: bool = True) -> dict:
        """Compile the step for each shape ahead of time, several compiles at once.

        Lowering (Python tracing) runs in this thread, one shape after another; each lowered step
        is handed to a pool of ``max_workers`` threads (default: min(shapes, CPU count)) whose XLA
        compiles run in parallel. `step` then calls these executables directly: no compile
        happens on first use. Shapes already compiled are skipped.

        With ``warm``, each new executable then runs once on an all-padding batch (every row
        ``seq_len`` 0, every write into the null page, so no sequence's KV is touched): the first
        run of an executable loads its kernels onto the device, which costs about 0.1-0.3 s for
        the 36-layer Qwen3-8B step on the H200, and would otherwise land in the first request
        that uses the shape.

        Args:
            shape_keys: ``HostBatch.shape_key`` tuples, e.g. from `plan_shapes`.
        Returns:
            {"shapes": compiled now, "lower_s": seconds tracing, "warm_s": seconds of warm runs,
            "seconds": wall seconds}.
        """
        if max_workers is not None and (not isinstance(max_workers, int)
                                        or isinstance(max_workers, bool) or max_workers < 1):
            raise ValueError(f"max_workers={max_workers!r} is invalid: must be None or a positive "
                             "integer")
        todo = [k for k in dict.fromkeys(shape_keys) if k not in self.compiled_shapes]
        jax.block_until_ready(self.params)  # weights still being built would count as tracing
        t0 = time.perf_counter()
        lower_s = 0.0
        if todo:
            workers = max_workers or min(len(todo), os.cpu_count() or 1)
            with ThreadPoolExecutor(workers) as pool:
                futures = []
                for k in todo:
                    t = time.perf_counter()
                    args, layout = self._device_inputs(empty_host_batch(k))
                    lowered = self.step_fn(k).lower(*args, layout=layout)
                    lower_s += time.perf_counter() - t
                    futures.append(pool.submit(lowered.compile))
                for k, f in zip(todo, futures):
                    self._executables[k] = f.result()
                    self.compiled_shapes.add(k)
        t_warm = time.perf_counter()
        if warm and todo:
            for k in todo:
                args, _ = self._device_inputs(empty_host_batch(k))
                tokens, self.kv = self._executables[k](*args)
            tokens.block_until_ready()
        return dict(shapes=len(todo), lower_s=lower_s, warm_s=time.perf_counter() - t_warm,
                    seconds=time.perf_counter() - t0)

    # ------------------------------------------------------------------- output
    def pop_output(self, rid: str, prompt: str | None = None) -> RequestOutput:
        """The `RequestOutput` of a finished request (removes it from the engine)."""
        s = self._seqs.pop(rid)
        ids = s.output_token_ids
        stop_reason = s.stop_string
        if s.ended_on_stop_token:
            stop_reason = ids[-1]  # vLLM: the stop token id; its text is left out
            text = self.detokenize(ids[:-1]) if self.detokenize else ""
        else:  # EOS: stop_reason None (vLLM); a stop string: cut the text where it starts
            text = self.detokenize(ids) if self.detokenize else ""
            if stop_reason is not None:
                text = text[:text.find(stop_reason)]
        comp = CompletionOutput(index=0, text=text, token_ids=tuple(s.output_token_ids),
                                finish_reason=s.finish_reason, stop_reason=stop_reason)
        metrics = RequestMetrics(s.arrival_time, s.first_token_time, s.finish_time,
                                 s.num_preemptions)
        return RequestOutput(request_id=rid, prompt=prompt,
                             prompt_token_ids=tuple(s.prompt_token_ids), outputs=[comp],
                             finished=s.is_finished, metrics=metrics)

    def sequence(self, rid: str) -> Sequence:
        return self._seqs[rid]

    @property
    def num_compiles(self) -> int:
        """Distinct compiled step shapes so far (bounded by the buckets)."""
        return len(self.compiled_shapes)
