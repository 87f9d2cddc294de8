"""ModelRunner: the device side of `jaxinfer.engine.llm_engine.LLMEngine`: the mesh, the served
params, the KV pool and the compiled steps. The engine hands it `HostBatch`es (numpy) and reads
numpy results back; nothing above the engine calls it."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from checkpoints_tools.mapping import tree_mismatches
from jaxinfer import models
from jaxinfer.config import memory
from jaxinfer.config.model import tp_model_config
from jaxinfer.config.weights import device_bytes
from jaxinfer.lora.peft import pool_bytes
from jaxinfer.models.kernels import ModelKernels, model_kernels
from jaxinfer.models.kv_cache import (
    KV_POOL_SPEC,
    KVCache,
    init_kv_cache,
    put_heads,
    stored_dtype,
)
from jaxinfer.models.quantize import quantize_params
from jaxinfer.runner import lora, parallel
from jaxinfer.runner.draft import DraftRunner, load_draft
from jaxinfer.runner.eagle3 import Eagle3Runner, load_eagle3
from jaxinfer.runner.executor import Forwarded, StepExecutor, enable_compilation_cache
from jaxinfer.stats import EngineStats
from jaxinfer.step_input import BucketSpec, HostBatch

# speculative_config methods with a drafter on the device: (its loader, its runner)
DRAFTERS = {"draft_model": (load_draft, DraftRunner), "eagle3": (load_eagle3, Eagle3Runner)}


def kv_means(
    params, cfg, ids: np.ndarray, page_size: int, mesh=None
) -> tuple[np.ndarray, np.ndarray]:
    """(k_mean, v_mean) f32[L, K, H]: per layer and KV head, the means of the post-RoPE K and of V
    over ``ids`` i32[T] (one sequence from position 0; the last T mod ``page_size`` dropped),
    from a forward pass (jnp attention) into a float32 cache. ``mesh``: the "tp" mesh ``params``
    are sharded over in the engine layout (`parallel.shard_params`), ``cfg`` the engine's
    (`tp_model_config`): the means of its K' heads, a copied head's its source head's."""
    m = len(ids) // page_size
    kv = init_kv_cache(cfg, m + 1, page_size, jnp.float32).replace(
        block_tables=jnp.arange(1, m + 1, dtype=jnp.int32)[None],
        seq_lens=jnp.asarray([m * page_size], jnp.int32),
    )
    pos = jnp.arange(m * page_size, dtype=jnp.int32)[None]
    fwd = jax.jit(models.forward, static_argnums=1, static_argnames="kernels")
    _, kv = fwd(
        params,
        cfg,
        jnp.asarray(ids[: m * page_size], jnp.int32)[None],
        pos,
        pos + page_size,
        kv,
        kernels=ModelKernels(mesh=mesh),
    )
    return tuple(np.asarray(jnp.mean(p[:, 1:], axis=(1, 3))) for p in (kv.k, kv.v))


def _enable_cache(cache) -> None:
    """JAX's persistent compilation cache at ``cache`` ("auto": JAX's own if set, else
    ``$XDG_CACHE_HOME/jaxinfer/jax``; None or "none": off)."""
    if cache == "auto":
        cache = (
            None
            if jax.config.jax_compilation_cache_dir
            else os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "jaxinfer", "jax")
        )
    if cache not in (None, "none"):
        enable_compilation_cache(cache)


def _load_drafter(spec, model_config, dtype, tp: int):
    """The loaded drafter of a model-based ``spec`` method (`DRAFTERS`' loader), or None (no
    speculation, or n-gram). ValueError: tp > 1 (one device only); the loader's ValueError or
    OSError (unreadable, not the target's vocabulary, ...) with ``speculative_config`` model and
    method named before its message."""
    if spec is None or spec.method not in DRAFTERS:
        return None
    if tp > 1:
        raise ValueError(f"speculative_config method={spec.method!r} runs on one device only")
    try:
        return DRAFTERS[spec.method][0](spec.model, model_config, dtype)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"speculative_config model={spec.model!r} (method {spec.method!r}) cannot be used: {e}"
        ) from None


class ModelRunner:
    """Serves ``params`` (compute dtype, the canonical one-device tree) of ``model_config`` under
    ``resolved`` (`jaxinfer.config.resolve`); tp > 1: on a mesh of tp devices, params resharded,
    the KV pool split over KV heads. ``stats``: compiles are counted there. ValueError: params of
    wrong shapes, a pool that does not fit, fewer than tp devices."""

    def __init__(self, model_config, params, resolved, stats: EngineStats | None = None) -> None:
        ec, kc = resolved.engine, resolved.kernels
        _enable_cache(ec.compilation_cache_dir)
        models.check_params(params, model_config, resolved.quantization)
        tp = ec.tensor_parallel_size
        self.mesh = parallel.make_mesh(tp) if tp > 1 else None
        self.model_config, self.resolved = model_config, resolved
        self.stats = stats if stats is not None else EngineStats()
        self.run_config = tp_model_config(model_config, tp)  # K' KV heads; tp = 1: model_config
        self._canonical = jax.tree.map(  # the shapes and dtypes update_params takes
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params
        )
        self.params = (
            params if self.mesh is None else parallel.shard_params(params, model_config, self.mesh)
        )
        spec = ec.speculative_config
        draft = _load_drafter(spec, model_config, resolved.dtype, tp)
        dev_stats = jax.local_devices()[0].memory_stats() if resolved.platform == "gpu" else None
        S, R = (ec.max_loras, ec.max_lora_rank) if ec.enable_lora else (0, 0)
        self.num_pages = memory.engine_pool_pages(
            resolved,
            dev_stats,
            draft and draft[0],
            pool_bytes(model_config, S, R, resolved.dtype_bytes),
        )  # the LoRA pool's bytes planned before it is allocated
        if ec.enable_lora:  # the LoRA pool rides in the params (`models.forward`)
            pool = lora.init_pool(model_config, S, R, resolved.dtype)
            self.params = {**self.params, "lora": pool}
        self.kv_means = None  # `calibrate_kv`'s (k_mean, v_mean), set on every pool
        self.kv: KVCache = self._new_kv()
        self.sleeping, self._host_params = 0, None  # `sleep`'s level (0: awake)
        self.buckets = BucketSpec.build(
            max_num_seqs=ec.max_num_seqs,
            max_num_batched_tokens=ec.max_num_batched_tokens,
            max_model_len=resolved.max_model_len,
            page_size=ec.page_size,
            vocab_size=model_config.vocab_size,
            batch_buckets=kc.batch_buckets,
            token_buckets=kc.token_buckets,
            page_buckets="reference" in (kc.decode_attention, kc.prefill_attention),
            spec=ec.speculative_config.num_speculative_tokens if resolved.spec_rows else 0,
            spec_rows=resolved.spec_rows,
        )
        self.executor = StepExecutor(
            self.run_config,
            model_kernels(kc, mesh=self.mesh),
            kc,
            self.buckets.sizes,
            ec.max_logprobs,
            self.stats,
            getattr(draft, "aux_layers", ()),  # an EAGLE-3 head's: the forwards return them
        )
        self.draft = draft and DRAFTERS[spec.method][1](
            *draft, resolved, self.num_pages, self.buckets, self.executor.kernels, self.stats
        )
        self.weight_bytes = device_bytes(
            model_config, tp, resolved.dtype_bytes, resolved.quantization
        )  # one device's

    def _new_kv(self) -> KVCache:  # ValueError: the pool does not fit on the device
        try:
            pools = None if self.mesh is None else NamedSharding(self.mesh, KV_POOL_SPEC)
            r = self.resolved
            return init_kv_cache(
                self.run_config,
                self.num_pages,
                r.engine.page_size,
                stored_dtype(r.kv_dtype, r.platform),
                pools,
                self.kv_means,
            )
        except jax.errors.JaxRuntimeError as e:
            raise ValueError(
                f"EngineConfig.num_pages={self.num_pages} is too large: the KV pool "
                f"does not fit in device memory ({str(e).splitlines()[0][:120]})"
            ) from None

    def calibrate_kv(self, ids: np.ndarray) -> None:
        """fp8 KV smoothing (SageAttention, arXiv 2410.02367): `KVCache.k_mean`, ``v_mean`` of
        this and later pools = `kv_means` over ``ids`` (under tp, of the K' heads, split over the
        devices as the pool). Before any step: pages written earlier hold K/V less other means."""
        ps = self.resolved.engine.page_size
        self.kv_means = kv_means(self.params, self.run_config, ids, ps, self.mesh)
        k_mean, v_mean = (put_heads(m, self.mesh) for m in self.kv_means)
        self.kv = self.kv.replace(k_mean=k_mean, v_mean=v_mean)

    def forward(self, hb: HostBatch, prev=None) -> Forwarded:
        """Dispatch ``hb``'s forward, no wait; ``prev``: the sampled tokens of the step in flight
        (they feed ``hb.pending_rows``). The KV pool is replaced by the step's."""
        fwd, self.kv = self.executor.forward(self.params, self.kv, hb, prev)
        if self.draft is not None:
            self.draft.mirror(hb, prev, fwd, self.params["embed"])
        return fwd

    def propose_drafts(self, rows: list, k: int) -> np.ndarray:
        """The drafter's ``propose`` (`DraftRunner`, `Eagle3Runner`): i32[len(rows), k]."""
        return self.draft.propose(rows, k, self.params["embed"])

    def sample(self, fwd: Forwarded, hb: HostBatch):
        """Dispatch ``hb``'s sampler on ``fwd`` (its sampling fields, bitmask included, read
        now), no wait: (tokens i32[max_rows], log-probability arrays or None), as `read` takes;
        the tokens feed the next step's ``prev``."""
        return self._handle(self.executor.sample(fwd, hb))

    def prompt_logprobs(self, fwd: Forwarded, hb: HostBatch) -> dict:
        """Dispatch ``hb``'s prompt scorer on ``fwd``, no wait: arrays copied back as they end."""
        return self._handle(dict(tokens=None, **self.executor.prompt(self.params, fwd, hb)))[1]

    @staticmethod
    def _handle(out):
        if not isinstance(out, dict):
            return out, None
        tokens, out = out.pop("tokens"), {k: parallel.local(a) for k, a in out.items()}
        for a in out.values():  # log-probabilities come back as soon as the step ends
            a.copy_to_host_async()
        return tokens, out

    @staticmethod
    def read(handle, prompt: dict | None = None) -> tuple[np.ndarray, dict | None]:
        """Block on a step: (i32[max_rows] tokens, its log-probability arrays, ``prompt``'s
        included, as numpy, or None)."""
        tokens, lps = handle
        lps = {**(lps or {}), **(prompt or {})} or None
        return (
            np.asarray(parallel.local(tokens)),
            None if lps is None else {k: np.asarray(a) for k, a in lps.items()},
        )

    def recover(self) -> bool:
        """After an interrupted step: reallocate a pool it took (True: the pages' K/V is gone)."""
        if self.sleeping or not (self.kv.k.is_deleted() or self.kv.v.is_deleted()):
            return False
        self.kv = self._new_kv()
        if self.draft is not None:
            self.draft.reset_kv()
        return True

    def update_params(self, params) -> None:
        """Serve ``params`` (structure, shapes, dtypes as built; fp8: quantised first) in place
        of the current leaves (resharded under tp), no recompile. An fp8 engine takes the
        canonical unquantised tree ([in, out], quantised here) or an fp8 one already in its
        layout (`quantize_params`': per-channel matrices K-major [out, in]). ValueError: other
        tree structure, a leaf (named) mismatch. The LoRA pool, if any, is kept."""
        if self.resolved.quantization is not None:
            params = quantize_params(params, self.model_config.weight_block_size)
        if (treedef := jax.tree.structure(params)) != jax.tree.structure(self._canonical):
            raise ValueError(
                f"update_params: the params tree differs from the served one: got "
                f"{treedef}, expected {jax.tree.structure(self._canonical)}"
            )
        if bad := tree_mismatches(self._canonical, params, dtypes=True):
            hint = (
                " (an fp8 tree goes in as served: quantize_params' layout, per-channel matrices "
                "[out, in]; or pass the unquantised [in, out] tree)"
                if self.resolved.quantization is not None
                else ""
            )
            raise ValueError(f"update_params: {'; '.join(bad)}{hint}")
        pool = {"lora": self.params["lora"]} if "lora" in self.params else {}
        if self.mesh is not None:
            self.params = parallel.shard_params(params, self.model_config, self.mesh)
        else:
            base = {k: v for k, v in self.params.items() if k != "lora"}
            self.params = jax.tree.map(lambda b, a: jax.device_put(b, a.sharding), params, base)
        self.params = {**self.params, **pool}

    def write_lora(self, slot: int, arrays: dict) -> None:
        """Slot ``slot`` of the LoRA pool set to ``arrays`` in place (`lora.write_slot`: no
        recompile of any step). ValueError: LoRA is off, as `lora.write_slot`."""
        if "lora" not in self.params:
            raise ValueError("write_lora: this engine has no LoRA pool (enable_lora=False)")
        self.params = {**self.params, "lora": lora.write_slot(self.params["lora"], slot, arrays)}

    def sleep(self, level: int) -> None:
        """vLLM's ``sleep``: the KV pool deleted (its pages' K/V lost) and the weights let go (their
        device memory freed unless the caller still holds them, e.g. `LLM.from_params`' tree); level
        1 copies them to pinned host memory first (`wake_up` puts them back), level 2 keeps none
        (`update_params` after `wake_up`). Asleep already: nothing. ValueError: another level."""
        if level not in (1, 2):
            raise ValueError(
                f"sleep(level={level!r}): 1 (weights kept in host memory) or 2 (weights discarded)"
            )
        if not self.sleeping:
            self._host_params = (
                jax.block_until_ready(
                    jax.device_put(
                        self.params,
                        jax.tree.map(
                            lambda a: a.sharding.with_memory_kind("pinned_host"), self.params
                        ),
                    )
                )
                if level == 1
                else None
            )  # copied before the device copy is let go
            self.params = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.params
            )
            for a in jax.tree.leaves(self.kv) + jax.tree.leaves(self.draft and self.draft.kv):
                a.delete()  # a draft model's pool too (its weights stay on the device)
            self.sleeping = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's ``wake_up``: of ``tags`` (None: both), "kv_cache" a new (empty) KV pool,
        "weights" level 1's weights back on their devices. ValueError: another tag."""
        tags = {"weights", "kv_cache"} if tags is None else set(tags)
        if bad := tags - {"weights", "kv_cache"}:
            raise ValueError(f"wake_up tags {sorted(bad)}: allowed 'weights', 'kv_cache'")
        if "weights" in tags and self._host_params is not None:
            self.params = jax.device_put(
                self._host_params, jax.tree.map(lambda a: a.sharding, self.params)
            )
            self._host_params = None
        if "kv_cache" in tags and self.kv.k.is_deleted():
            self.kv = self._new_kv()
            if self.draft is not None:
                self.draft.reset_kv()
        if self._host_params is None and not self.kv.k.is_deleted():
            self.sleeping = 0

    def check_awake(self) -> None:
        """RuntimeError: asleep, or woken from ``sleep(level=2)`` without `update_params`."""
        if self.sleeping:
            raise RuntimeError(
                f"the engine is asleep (sleep(level={self.sleeping})): call wake_up() first"
            )
        if isinstance(jax.tree.leaves(self.params)[0], jax.ShapeDtypeStruct):
            raise RuntimeError(
                "the weights were discarded by sleep(level=2): call "
                "update_params(params) after wake_up()"
            )

    def check_logits_processor(self, fn) -> None:
        """ValueError naming ``fn`` unless ``fn(i32[16], f32[V])`` traces to f32[V] (eval_shape)."""
        v = self.model_config.vocab_size
        try:
            out = jax.eval_shape(
                fn, jax.ShapeDtypeStruct((16,), jnp.int32), jax.ShapeDtypeStruct((v,), jnp.float32)
            )
            error = "" if getattr(out, "shape", None) == (v,) else f"it returns {out}"
        except Exception as e:  # anything a user's function raises while traced
            error = f"{type(e).__name__}: {str(e)[:200]}"
        if error:
            raise ValueError(
                f"SamplingParams.logits_processors entry {fn!r} is invalid: not a JAX "
                f"(output_token_ids i32[R], logits f32[V]) -> f32[V] fn; {error}"
            )

    def precompile(self, planned: dict | None = None, *, max_workers: int | None = None) -> dict:
        """`StepExecutor.precompile` of ``planned`` (default: `BucketSpec.planned`, every shape a
        step can take): {"shapes", "lower_s", "warm_s", "seconds"}."""
        info, self.kv = self.executor.precompile(
            self.params, self.kv, planned or self.buckets.planned(), max_workers=max_workers
        )
        if self.draft is not None:
            self.draft.precompile(planned, self.params["embed"], max_workers=max_workers)
        return info
