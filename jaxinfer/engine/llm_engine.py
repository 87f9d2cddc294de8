"""LLMEngine, host side: token ids in, `RequestOutput`s out, over a `Scheduler`, a `StepLoop`, an
`OutputProcessor` and a `ModelRunner` (the device side). Its door: `add_request`, `abort_request`,
`step`, `has_unfinished`, `stats`. Imports no JAX."""

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np

from jaxinfer.engine import logprobs
from jaxinfer.engine.batch_builder import build_host_batch
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.dry_run import dry_run
from jaxinfer.engine.loop import Launched, StepLoop
from jaxinfer.engine.lora import LoRAManager
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.engine.speculation import Speculation, trim_to_stop
from jaxinfer.engine.structured import StructuredOutputManager
from jaxinfer.outputs import OutputProcessor
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.stats import EngineStats
from jaxinfer.step_input import StepShape


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded ``seed`` (index 0: ``seed`` itself)."""
    if index == 0:
        return seed
    state = np.random.SeedSequence([seed % 2**64, index]).generate_state(2, np.uint32)
    return int(state[0]) | int(state[1] & 0x7FFFFFFF) << 32


def calibration_ids(tokenizer, n: int = 512) -> np.ndarray:
    """i32[n]: the fp8 KV calibration text's tokens, the head of Python's ``pydoc_data.topics``
    in reverse key order (``scripts/eval_accuracy.py`` measures on the other end)."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics, reverse=True))
    return np.asarray(tokenizer.encode(text[: 8 * n])[:n], np.int32)


class LLMEngine:
    """The engine over ``runner`` (a `jaxinfer.runner.model_runner.ModelRunner`: its config,
    params, KV pool and compiled steps); ``eos_token_ids`` end generation; ``detokenize``: ids ->
    str (None: no text); ``tokenizer``: the HF tokenizer grammars are built over (None: no
    ``structured_outputs``). Outputs by each request's ``SamplingParams.output_kind``."""

    def __init__(
        self, runner, *, eos_token_ids=(), detokenize: Callable | None = None, tokenizer=None
    ) -> None:
        self.runner, self.resolved = runner, runner.resolved
        self.model_config, ec = runner.model_config, runner.resolved.engine
        if ec.kv_cache_dtype != "auto" and ec.calculate_kv_scales and tokenizer is not None:
            runner.calibrate_kv(calibration_ids(tokenizer))
        self.max_model_len, self.page_size = self.resolved.max_model_len, ec.page_size
        self.eos_token_ids, self._stats = tuple(eos_token_ids), runner.stats
        self.outputs = OutputProcessor(detokenize)
        self.structured = StructuredOutputManager(
            tokenizer, self.model_config.vocab_size, self.eos_token_ids
        )
        self.block_manager = BlockManager(
            runner.num_pages,
            ec.page_size,
            stats=self._stats,
            enable_prefix_caching=ec.enable_prefix_caching,
        )
        spec = ec.speculative_config
        draft = runner.propose_drafts if getattr(runner, "draft", None) is not None else None
        self.speculation = spec and Speculation(
            spec, self.resolved.spec_decode_rows, self.eos_token_ids, self._stats, draft
        )
        self.scheduler = self._scheduler(self.block_manager, self.eos_token_ids)
        self.lora = LoRAManager(runner, self.model_config, ec, self.resolved.dtype)
        self.loop = StepLoop(
            self.scheduler,
            self._launch,
            self._complete,
            sample=self._sample,
            async_scheduling=ec.async_scheduling,
            stats=self._stats,
        )
        self._rng, self._ids = np.random.default_rng(ec.seed), itertools.count()
        self._touched: list[str] = []  # request ids a step or an abort gave new output
        if ec.precompile:
            self.precompile()

    def _scheduler(self, bm: BlockManager, eos_token_ids=()) -> Scheduler:
        ec = self.resolved.engine
        return Scheduler(
            bm,
            max_num_seqs=ec.max_num_seqs,
            page_size=ec.page_size,
            max_num_batched_tokens=ec.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=eos_token_ids,
            **self._spec_args(),
        )

    def _spec_args(self) -> dict:
        """The scheduler's speculative-decoding arguments (none without a proposer)."""
        if not self.speculation:
            return {}
        return dict(
            propose=self.speculation.propose,
            spec_max_rows=self.resolved.spec_rows,
            spec_k=self.speculation.k,
        )

    async_scheduling = property(
        lambda self: self.loop.async_scheduling,
        lambda self, value: setattr(self.loop, "async_scheduling", bool(value)),
        doc="Schedule step n+1 before step n's tokens are read back (settable).",
    )

    def check_request(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], SamplingParams]:
        """(the prompt's ids, its last ``truncate_prompt_tokens`` kept (-1: max_model_len); a copy
        of ``params`` validated again: it is mutable). ValueError: a bad ``params`` value,
        logprobs above ``EngineConfig.max_logprobs``, a token id outside [0, V), as
        `StructuredOutputManager.token_rules`, `ModelRunner.check_logits_processor` or
        `StructuredOutputManager.matcher`, not `check_admissible`."""
        if isinstance(prompt_token_ids, str):
            raise ValueError(
                "prompt_token_ids must be a list of token ids, not a str: tokenize it first "
                "(llm.get_tokenizer().encode(text)), or use LLM.generate, which takes text"
            )
        params = dataclasses.replace(params)  # SamplingParams.__post_init__ checks the copy
        if (k := params.truncate_prompt_tokens) is not None:
            prompt_token_ids = prompt_token_ids[-(self.max_model_len if k == -1 else k) :]
        if (k := max(params.logprobs or 0, params.prompt_logprobs or 0)) > (
            m := self.resolved.engine.max_logprobs
        ):
            raise ValueError(
                f"{k} log-probabilities per token requested; this engine gives at "
                f"most max_logprobs={m}"
            )
        vocab = self.model_config.vocab_size
        for ids, what in (
            (prompt_token_ids, "prompt token id {} is"),
            (params.stop_token_ids, "SamplingParams.stop_token_ids contains {},"),
            (params.logit_bias, "SamplingParams.logit_bias has token id {},"),
            (params.allowed_token_ids or (), "SamplingParams.allowed_token_ids contains {},"),
        ):
            if bad := [t for t in ids if not 0 <= int(t) < vocab]:
                raise ValueError(
                    what.format(bad[0]) + f" out of range: ids must be in [0, {vocab})"
                )
        self.scheduler.check_admissible(len(prompt_token_ids), params)
        self.structured.token_rules(params)
        for fn in params.logits_processors or ():
            self.runner.check_logits_processor(fn)
        if params.structured_outputs is not None:
            self.structured.matcher(params.structured_outputs)
        return prompt_token_ids, params

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        prompt: str | None = None,
        lora_request=None,
    ) -> str:
        """`check_request`, then queue its ``params.n`` samples (sample i seeded by (seed, i));
        ``prompt``: its text, for the outputs; ``lora_request``: its `LoRARequest` or None
        (`LoRAManager`: waits for a slot). Returns the request id. Raises ValueError: as
        `check_request`, `LoRAManager.check`, or a duplicate id; RuntimeError:
        `ModelRunner.check_awake`. A constrained sample gets its own matcher."""
        self.runner.check_awake()
        prompt_token_ids, params = self.check_request(prompt_token_ids, params)
        self.lora.check(lora_request)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.outputs.requests:
            raise ValueError(
                f"request_id={rid!r} is invalid: a request with this id is in the engine"
            )
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        ids = [int(t) for t in prompt_token_ids]
        max_tokens, so = (
            params.max_tokens or self.max_model_len - len(ids),
            params.structured_outputs,
        )
        seqs = [
            Sequence(
                request_id=rid if params.n == 1 else f"{i}_{rid}",
                prompt_token_ids=ids,
                params=params,
                seed=sample_seed(seed, i),
                index=i,
                parent_id=rid,
                max_tokens=max_tokens,
                matcher=so and self.structured.matcher(so),
                rules=self.structured.token_rules(params),
            )
            for i in range(params.n)
        ]
        self.lora.admit(lora_request, seqs, self._enqueue)
        self.outputs.add(rid, seqs, prompt)
        return rid

    def _enqueue(self, seqs: list[Sequence]) -> None:
        """One request's samples into the scheduler, all or none (ValueError: as its `add`)."""
        for i, seq in enumerate(seqs):
            try:
                self.scheduler.add(seq)  # raises ValueError before queueing
            except ValueError:
                for s in seqs[:i]:
                    self.scheduler.abort(s.request_id)
                raise

    def abort_request(self, rid: str) -> None:
        """Abort request ``rid``: its unfinished samples finish with "abort", and the next `step`
        returns its final output. Unknown or finished ids are ignored."""
        if (st := self.outputs.requests.get(rid)) is not None:
            for s in (s for s in st.seqs if not s.is_finished):
                self.scheduler.abort(s.request_id) or self.lora.abort(s.request_id)
            self._touched.append(rid)

    def has_unfinished(self) -> bool:
        """Requests in the engine, a step in flight, or outputs not yet returned."""
        return self.loop.has_unfinished() or bool(self._touched or self.lora.pending)

    def step(self, raw: bool = False) -> list:
        """Run one step (launch the next, read back the previous); the `RequestOutput`s due now, by
        each request's ``output_kind``, finals of requests aborted since the last call included.
        ``raw``: instead, the samples (`Sequence`s, index order) of each request the step touched,
        no text built (vLLM's ``EngineCore.step``: the server's API process builds the outputs)."""
        self.lora.admit_pending(self._enqueue)
        self.loop.step()
        touched, self._touched = self._touched, []
        return self.outputs.outputs(touched, raw)

    def stats(self) -> EngineStats:
        """A copy of the engine's counters with its queue and KV pool sizes filled in."""
        bm, sched = self.block_manager, self.scheduler
        return dataclasses.replace(
            self._stats.copy(),
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            kv_pages_in_use=bm.num_usable_pages - bm.num_free_pages,
            kv_pages_total=bm.num_usable_pages,
        )

    def abort_all(self) -> None:
        """Abort and forget every request, no outputs; reallocate pools an interrupted step took."""
        self.scheduler.abort_all()
        self.lora.pending.clear()
        self.outputs.requests.clear()
        self._touched.clear()
        self.loop.in_flight = None
        if self.runner.recover():
            self.block_manager.reset_prefix_cache()  # the cached pages' K/V is gone

    def sleep(self, level: int = 1) -> None:
        """vLLM's ``sleep`` (`ModelRunner.sleep`), the prefix cache emptied. RuntimeError:
        unfinished requests."""
        if self.has_unfinished():
            raise RuntimeError("sleep() needs an idle engine: requests are unfinished")
        self.reset_prefix_cache()
        self.runner.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's ``wake_up`` (`ModelRunner.wake_up`)."""
        self.runner.wake_up(tags)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix page: True, or False (no change) while a request holds pages."""
        return self.block_manager.reset_prefix_cache()

    def update_params(self, params) -> None:
        """`ModelRunner.update_params` on an idle engine, then reset the prefix cache.
        ValueError: requests in flight, or as `ModelRunner.update_params`."""
        if self.has_unfinished():
            raise ValueError("update_params needs an idle engine: requests are in flight")
        self.runner.update_params(params)
        self.reset_prefix_cache()

    def update_lora(self, name_or_id, tensors: dict) -> None:
        """`LoRAManager.update` on an idle engine (its slot rewritten in place, no recompile),
        then reset the prefix cache. ValueError: requests in flight, as `LoRAManager.update`."""
        if self.has_unfinished():
            raise ValueError("update_lora needs an idle engine: requests are in flight")
        self.lora.update(name_or_id, tensors)
        self.reset_prefix_cache()

    def _launch(self, launched: Launched, prev: Launched | None) -> None:
        """`StepLoop`'s launch: build the host batch, dispatch its forward (and its prompt
        scorer) and, unless a sampled row is constrained (its mask needs the grammar advanced by
        ``prev``'s tokens: `_sample` dispatches it), its sampler."""
        batch = launched.batch
        hb = build_host_batch(
            batch,
            page_size=self.page_size,
            buckets=self.runner.buckets,
            eos_token_ids=self.eos_token_ids,
        )
        self._stats.max_kv_len_seen = max(self._stats.max_kv_len_seen, int(hb.seq_lens.max()))
        if hb.pending_rows.any():
            if prev is None:
                raise RuntimeError(
                    "LLMEngine: a row needs a pending token but no step is in flight"
                )
            row_of = {id(s): i for i, s in enumerate(prev.batch.seqs)}
            rows = np.flatnonzero(hb.pending_rows)
            hb.pending_src[rows] = [row_of[id(batch.seqs[i])] for i in rows.tolist()]
        self._stats.num_steps += 1
        launched.hb = hb
        launched.forward = self.runner.forward(hb, None if prev is None else prev.sampled[0])
        if hb.shape.prompt:
            launched.prompt = self.runner.prompt_logprobs(launched.forward, hb)
        if not self._constrained(launched):
            launched.sampled = self.runner.sample(launched.forward, hb)

    def _constrained(self, launched: Launched) -> bool:
        """Whether a sampled row of the step has a grammar or token rules (a bitmask to fill)."""
        return any(
            d and (s.matcher is not None or s.rules is not None)
            for s, d in zip(launched.batch.seqs, launched.batch.do_sample)
        )

    def _sample(self, done: Launched) -> None:
        """`StepLoop`'s sample: a constrained step's masks (`StructuredOutputManager.fill` after
        the step before it read back; rows finished since: none, tokens discarded), then its
        sampler."""
        if done.sampled is None:
            hb, batch = done.hb, done.batch
            rows = [
                (i, s) for i, s in enumerate(batch.seqs) if hb.sample_rows[i] and not s.is_finished
            ]
            self.structured.fill(hb.bitmask, rows)
            done.sampled = self.runner.sample(done.forward, hb)

    def _complete(self, done: Launched, host_times: tuple[float, float]) -> list[Sequence]:
        """`StepLoop`'s complete: read back, advance the sequences, match stop strings."""
        hb, batch = done.hb, done.batch
        tokens, lps = self.runner.read(done.sampled, done.prompt)
        sampled = self._emitted(batch, hb, tokens, lps)
        for s, tok in zip(batch.seqs, sampled):  # a row finished earlier: its token discarded
            if tok is not None and s.matcher is not None and not s.is_finished:
                self.structured.accept(s.matcher, tok)
        before = [s.num_output_tokens for s in batch.seqs]
        finished = self.scheduler.postprocess(batch, sampled)
        logprobs.record(lps or None, hb, batch.seqs, before)
        for s, tok, n in zip(batch.seqs, sampled, before):
            if tok is None or (stop := self.outputs.find_stop_string(s)) is None:
                continue
            if isinstance(tok, list):
                trim_to_stop(s, self.outputs, s.num_output_tokens - n)
            s.stop_string = stop
            if s.is_finished:  # on "length": already off the running list, its pages freed
                s.finish_reason = "stop"
            elif self.scheduler.finish(s, "stop"):
                finished.append(s)
        self._touched += [s.parent_id for s in batch.seqs]
        return finished

    def _emitted(self, batch, hb, tokens, lps: dict | None) -> list:
        """Per row: None (no token), its token id, or for a row with drafts the list of ids the
        verify step emitted (``lps``' "emitted" and "num_emitted" taken out; counted)."""
        B = batch.num_seqs
        sampled = [t if r else None for t, r in zip(tokens[:B].tolist(), hb.sample_rows.tolist())]
        if not hb.shape.sampler.spec:
            return sampled
        emitted, num = lps.pop("emitted"), lps.pop("num_emitted")
        for i, d in enumerate(batch.draft_token_ids):
            if d and sampled[i] is not None:
                sampled[i] = emitted[i, : num[i]].tolist()
        self.speculation.record(batch, sampled)
        return sampled

    def plan_shapes(self, requests: list[tuple[list[int], SamplingParams]]) -> list[StepShape]:
        """`StepShape`s ``requests`` visit on an idle engine, in order; ValueError: rejected."""
        requests = [self.check_request(ids, sp) for ids, sp in requests]
        sched = self._scheduler(self.block_manager.copy_free(), self.eos_token_ids)
        steps = dry_run(
            sched, requests, buckets=self.runner.buckets, async_scheduling=self.async_scheduling
        )
        return list(dict.fromkeys(hb.shape for _, hb in steps))

    def precompile(
        self, shapes: list[StepShape] | None = None, *, max_workers: int | None = None
    ) -> dict:
        """`ModelRunner.precompile` of ``shapes``' forwards, samplers and prompt scorers (None:
        the whole planned set, `BucketSpec.planned`): {"shapes", "lower_s", ...}."""
        planned = None
        if shapes is not None:
            planned = dict(
                forward=[s.forward for s in shapes],
                sampler=[s.sampler for s in shapes],
                prompt=[(s.forward.tokens, s.prompt) for s in shapes if s.prompt],
            )
        return self.runner.precompile(planned, max_workers=max_workers)
