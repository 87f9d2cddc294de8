"""LLMEngine: token ids in, `RequestOutput`s out; over `Scheduler`, `StepExecutor`, `StepLoop`."""

import itertools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from checkpoints_tools.mapping import tree_mismatches
from jaxinfer import memory, models, parallel
from jaxinfer.model_config import tp_model_config
from jaxinfer.engine import logprobs
from jaxinfer.engine.batch_builder import BucketSpec, build_host_batch
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.dry_run import dry_run
from jaxinfer.engine.loop import Launched, StepLoop
from jaxinfer.engine.scheduler import ScheduledBatch, Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.engine.stats import EngineStats, StepRecord
from jaxinfer.kernels import model_kernels
from jaxinfer.kv_cache import KV_POOL_SPEC, KVCache, init_kv_cache
from jaxinfer.outputs import OutputProcessor, RequestOutput
from jaxinfer.quantize import quantize_params
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.step import StepExecutor, enable_compilation_cache
from jaxinfer.step_input import ShapeKey


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded ``seed`` (index 0: ``seed`` itself)."""
    if index == 0:
        return seed
    state = np.random.SeedSequence([seed % 2**64, index]).generate_state(2, np.uint32)
    return int(state[0]) | int(state[1] & 0x7FFFFFFF) << 32


class LLMEngine:
    """Engine over ``params`` (compute dtype, the canonical one-device tree) and ``resolved``
    (`jaxinfer.config.resolve`); ``detokenize``: ids -> str (None: no text). tp =
    ``tensor_parallel_size`` > 1: ``tp_model_config`` on a `jaxinfer.parallel.make_mesh` of tp
    devices, params resharded (the canonical tree not kept), the KV pool split over KV heads. Raises
    ValueError: params of wrong shapes, a pool that does not fit, fewer than tp devices."""

    def __init__(self, model_config, params, resolved, *, eos_token_ids=(),
                 detokenize: Callable | None = None) -> None:
        ec, kc = resolved.engine, resolved.kernels
        if ec.compilation_cache_dir is not None:
            enable_compilation_cache(ec.compilation_cache_dir)
        models.check_params(params, model_config, resolved.quantization)
        tp = ec.tensor_parallel_size
        self.mesh = parallel.make_mesh(tp) if tp > 1 else None
        self.model_config, self.resolved = model_config, resolved
        self.run_config = tp_model_config(model_config, tp)  # K' KV heads; tp = 1: model_config
        self._canonical = jax.tree.map(  # the shapes and dtypes update_params takes
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        self.params = params if self.mesh is None else parallel.shard_params(
            params, model_config, self.mesh)
        self.max_model_len, self.page_size = resolved.max_model_len, ec.page_size
        self.eos_token_ids, self.stats = tuple(eos_token_ids), EngineStats()
        self.outputs = OutputProcessor(detokenize)
        dev_stats = jax.local_devices()[0].memory_stats() if resolved.platform == "gpu" else None
        self.num_pages = memory.engine_pool_pages(resolved, dev_stats)
        self.kv: KVCache = self._new_kv()
        self.block_manager = BlockManager(self.num_pages, ec.page_size, stats=self.stats,
                                          enable_prefix_caching=ec.enable_prefix_caching)
        self.scheduler = self._scheduler(self.block_manager, self.eos_token_ids)
        self.buckets = BucketSpec.build(
            max_num_seqs=ec.max_num_seqs, max_num_batched_tokens=ec.max_num_batched_tokens,
            max_model_len=self.max_model_len, page_size=ec.page_size,
            batch_buckets=kc.batch_buckets, token_buckets=kc.token_buckets)
        self.executor = StepExecutor(self.run_config, model_kernels(kc, mesh=self.mesh), kc,
                                     self.buckets.batch[-1], self.stats)
        self.loop = StepLoop(self.scheduler, self._launch, self._complete,
                             async_scheduling=ec.async_scheduling, stats=self.stats)
        self._rng, self._ids = np.random.default_rng(ec.seed), itertools.count()
        self._groups: dict[str, list[Sequence]] = {}  # request id -> its samples
        weight_bytes = (sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
                        if resolved.quantization else
                        memory.param_count(model_config, tp) * resolved.dtype_bytes)
        self.memory = memory.MemoryTracker(  # bytes of one device; snapshots while trace_memory
            weight_bytes,
            memory.kv_bytes_per_token(model_config, resolved.kv_dtype_bytes, tp) * ec.page_size,
            self.num_pages)
        self.trace_memory = False

    def _scheduler(self, bm: BlockManager, eos_token_ids=()) -> Scheduler:
        ec = self.resolved.engine
        return Scheduler(bm, max_num_seqs=ec.max_num_seqs, page_size=ec.page_size,
                         max_num_batched_tokens=ec.max_num_batched_tokens,
                         max_model_len=self.max_model_len, eos_token_ids=eos_token_ids)

    def _new_kv(self) -> KVCache:  # ValueError: the pool does not fit on the device
        try:
            pools = None if self.mesh is None else NamedSharding(self.mesh, KV_POOL_SPEC)
            return init_kv_cache(self.run_config, self.num_pages, self.page_size,
                                 jnp.dtype(self.resolved.kv_dtype), pools)
        except jax.errors.JaxRuntimeError as e:
            raise ValueError(f"EngineConfig.num_pages={self.num_pages} is too large: the KV pool "
                             f"does not fit in device memory ({str(e).splitlines()[0][:120]})"
                             ) from None

    @property
    def async_scheduling(self) -> bool:
        """Schedule step n+1 before step n's tokens are read back (settable)."""
        return self.loop.async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, value: bool) -> None:
        self.loop.async_scheduling = bool(value)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError: a token id outside [0, V), or not `Scheduler.check_admissible`."""
        vocab = self.model_config.vocab_size
        for ids, what in ((prompt_token_ids, "prompt token id {} is"),
                          (params.stop_token_ids, "SamplingParams.stop_token_ids contains {},"),
                          (params.logit_bias, "SamplingParams.logit_bias has token id {},")):
            if bad := [t for t in ids if not 0 <= int(t) < vocab]:
                raise ValueError(what.format(bad[0]) + f" out of range: ids must be in [0, {vocab})")
        self.scheduler.check_admissible(len(prompt_token_ids), params)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """`check_request`, then queue its ``params.n`` samples (sample i seeded by (seed, i));
        returns the request id. Raises ValueError: as `check_request`, or a duplicate id."""
        self.check_request(prompt_token_ids, params)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._groups:
            raise ValueError(f"request_id={rid!r} is invalid: a request with this id is in the "
                             "engine")
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        ids = [int(t) for t in prompt_token_ids]
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        seqs = [Sequence(request_id=rid if params.n == 1 else f"{i}_{rid}", prompt_token_ids=ids,
                         params=params, seed=sample_seed(seed, i), index=i, parent_id=rid,
                         max_tokens=max_tokens) for i in range(params.n)]
        for i, seq in enumerate(seqs):
            try:
                self.scheduler.add(seq)  # raises ValueError before queueing
            except ValueError:
                for s in seqs[:i]:
                    self.scheduler.abort(s.request_id)
                raise
        self._groups[rid] = seqs
        return rid

    def has_unfinished(self) -> bool:
        return self.loop.has_unfinished()

    def abort_request(self, rid: str) -> None:
        """Abort request ``rid`` (all its samples) and forget it; unknown ids are ignored."""
        for s in self._groups.pop(rid, ()):
            self.scheduler.abort(s.request_id)

    def abort_all(self) -> None:
        """Abort every unfinished request; reallocate pools an interrupted step took."""
        self.scheduler.abort_all()
        self._groups.clear()
        self.loop.in_flight = None
        if self.kv.k.is_deleted() or self.kv.v.is_deleted():
            self.kv = self._new_kv()
            self.block_manager.reset_prefix_cache()  # the cached pages' K/V is gone

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix page: True, or False (no change) while a request holds pages."""
        return self.block_manager.reset_prefix_cache()

    def update_params(self, params) -> None:
        """Serve ``params`` (structure, shapes, dtypes as built; fp8 engine: quantised first) in
        place of the current leaves (resharded under tp), no recompile; resets the prefix cache.
        ValueError: requests in flight, other tree structure, a leaf (named) mismatch."""
        if self.has_unfinished():
            raise ValueError("update_params needs an idle engine: requests are in flight")
        if self.resolved.quantization is not None:
            params = quantize_params(params, self.model_config.weight_block_size)
        if (treedef := jax.tree.structure(params)) != jax.tree.structure(self._canonical):
            raise ValueError(f"update_params: the params tree differs from the served one: got "
                             f"{treedef}, expected {jax.tree.structure(self._canonical)}")
        if bad := tree_mismatches(self._canonical, params, dtypes=True):
            raise ValueError(f"update_params: {'; '.join(bad)}")
        if self.mesh is not None:
            self.params = parallel.shard_params(params, self.model_config, self.mesh)
        else:
            self.params = jax.tree.map(lambda b, a: jax.device_put(b, a.sharding), params,
                                       self.params)
        self.reset_prefix_cache()

    def sequences(self, rid: str) -> list[Sequence]:
        """Request ``rid``'s samples, index order. Raises KeyError: no such request."""
        return self._groups[rid]

    def sequence(self, rid: str) -> Sequence:
        """Sample 0 of request ``rid``."""
        return self._groups[rid][0]

    def pop_output(self, rid: str, prompt: str | None = None) -> RequestOutput:
        """The `RequestOutput` of request ``rid`` (removed from the engine)."""
        return self.outputs.request_output(self._groups.pop(rid), prompt)

    def step(self) -> list[str]:
        """Run one step; the ids of the requests whose every sample finished in it."""
        done = dict.fromkeys(s.parent_id for s in self.loop.step())
        return [rid for rid in done
                if rid in self._groups and all(s.is_finished for s in self._groups[rid])]

    def _launch(self, batch: ScheduledBatch, prev: Launched | None):
        """`StepLoop`'s launch: build, transfer, dispatch (no wait)."""
        hb = build_host_batch(batch, page_size=self.page_size, buckets=self.buckets,
                              eos_token_ids=self.eos_token_ids)
        self.stats.max_kv_len_seen = max(self.stats.max_kv_len_seen, int(hb.seq_lens.max()))
        if hb.pending_rows.any():
            if prev is None:
                raise RuntimeError("LLMEngine: a row needs a pending token but no step is in flight")
            row_of = {id(s): i for i, s in enumerate(prev.batch.seqs)}
            for i in np.flatnonzero(hb.pending_rows):
                hb.pending_src[i] = row_of[id(batch.seqs[i])]
        out, self.kv = self.executor.run(self.params, self.kv, hb,
                                         None if prev is None else prev.handle[0])
        self.stats.num_steps += 1
        if not isinstance(out, dict):
            return out, hb, None
        tokens, out = out.pop("tokens"), {k: parallel.local(a) for k, a in out.items()}
        for a in out.values():  # log-probabilities come back as soon as the step ends
            a.copy_to_host_async()
        return tokens, hb, out

    def _complete(self, done: Launched, host_times: tuple[float, float]) -> list[Sequence]:
        """`StepLoop`'s complete: read back, advance the sequences, match stop strings."""
        (tokens, hb, lps), batch, t0 = done.handle, done.batch, time.perf_counter()
        tokens = np.asarray(parallel.local(tokens))
        t1 = time.perf_counter()
        sampled = [int(tokens[i]) if hb.sample_rows[i] else None for i in range(batch.num_seqs)]
        before = None if lps is None else [s.num_output_tokens for s in batch.seqs]
        finished = self.scheduler.postprocess(batch, sampled)
        logprobs.record(lps, hb, batch.seqs, before)
        for s, tok in zip(batch.seqs, sampled):
            if tok is None or (stop := self.outputs.find_stop_string(s)) is None:
                continue
            s.stop_string = stop
            if s.is_finished:  # on "length": already off the running list, its pages freed
                s.finish_reason = "stop"
            elif self.scheduler.finish(s, "stop"):
                finished.append(s)
        if self.stats.step_log is not None:
            self.stats.step_log.append(StepRecord(hb.key, batch.num_seqs, t1, t1 - t0,
                                                  *host_times, time.perf_counter() - t1))
        if self.trace_memory:
            self.memory_snapshot()
        return finished

    def memory_snapshot(self):
        """`MemoryTracker.snapshot` of now."""
        bm, stats = self.block_manager, memory.device_memory_stats()
        return self.memory.snapshot(bm.num_usable_pages - bm.num_free_pages,
                                    device_bytes_in_use=stats[0] if stats else None)

    def plan_shapes(self, requests: list[tuple[list[int], SamplingParams]]) -> list[ShapeKey]:
        """`ShapeKey`s ``requests`` visit on an idle engine, in order; ValueError: rejected."""
        sched = self._scheduler(self.block_manager.copy_free(), self.eos_token_ids)  # the prefix cache as now
        steps = dry_run(sched, requests, buckets=self.buckets, async_scheduling=self.async_scheduling)
        return list(dict.fromkeys(hb.key for _, hb in steps))

    def precompile(self, shape_keys, *, max_workers: int | None = None, warm: bool = True) -> dict:
        """`StepExecutor.precompile`: {"shapes", "lower_s", "warm_s", "seconds"}."""
        info, self.kv = self.executor.precompile(self.params, self.kv, shape_keys,
                                                 max_workers=max_workers, warm=warm)
        return info
