"""Structured output, host side (no JAX): vLLM V1's ``StructuredOutputManager`` over llguidance
(not xgrammar: faster compiles, a NumPy i32[B, W] mask without PyTorch; timings in the README).
Under async scheduling a step holding a constrained row is split (`LLMEngine._launch`): its forward
is dispatched first, the previous step's tokens then advance the grammars, the host fills the masks
while the forward runs, then the sampling is dispatched (the bitmask applied just before the
sampler, as vLLM). Steps without a constrained row stay fused, their keys unchanged."""

import collections
import threading

import numpy as np

_FORMATS = {"json": "json_schema", "json_object": "json_schema"}  # else llguidance's own name


class StructuredOutputManager:
    """Grammars over ``tokenizer`` (an HF fast tokenizer; None: constrained requests are
    rejected), V = ``vocab_size`` logits, ``eos_token_ids`` (all a completed grammar allows).
    Compiled grammars (a matcher in its start state) are cached by (kind, spec text), the
    ``cache_size`` last used; the llguidance tokenizer (about 0.5 s) is built at first use.
    `matcher` is thread-safe (the server checks requests outside the engine's thread)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 256) -> None:
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, list(eos_token_ids)
        self.words = -(-vocab_size // 32)  # W: i32 words of a row's bitmask
        self.cache_size, self._cache = cache_size, collections.OrderedDict()
        self._ll_tokenizer, self._executor, self._lock = None, None, threading.Lock()

    def matcher(self, so):
        """A fresh ``llguidance.LLMatcher`` of ``so`` (`StructuredOutputsParams`). ValueError: no
        tokenizer, or the spec is invalid (llguidance's message: the schema, regex or grammar)."""
        with self._lock:
            return self._matcher(so).deep_copy()

    def _matcher(self, so):
        import llguidance
        import llguidance.hf

        if (m := self._cache.get(so.key)) is not None:
            self._cache.move_to_end(so.key)
            return m
        kind, spec = so.key
        if self.tokenizer is None:
            raise ValueError(
                "SamplingParams.structured_outputs needs a tokenizer, but this engine has none"
            )
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer, self.vocab_size, self.eos or None
            )
        try:
            m = llguidance.LLMatcher(
                self._ll_tokenizer,
                llguidance.grammar_from(
                    _FORMATS.get(kind, kind),
                    '{"type": "object"}' if kind == "json_object" else spec,
                ),
            )
            error = m.get_error() if m.is_error() else None
        except Exception as e:  # llguidance raises ValueError, json TypeError/ValueError, ...
            error = f"{type(e).__name__}: {e}"
        if error is not None:
            raise ValueError(
                f"StructuredOutputsParams.{kind}={spec[:80]!r} is invalid: "
                + " ".join(error.split())
            )  # llguidance's lines: one line
        self._cache[so.key] = m
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return m

    def token_rules(self, params) -> tuple | None:
        """(``allowed_token_ids`` as an i32[W] bitmask or None, bad words' ids as vLLM V1's
        ``update_from_tokenizer``: as given, and after a space if that starts with another token
        and has as many), None: neither. ValueError: no tokenizer, a word of no ids or one >= V."""
        if params.bad_words and self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer; this engine has none")
        words = []
        for w in params.bad_words or ():
            ids, sp = (
                self.tokenizer.encode(p + w.lstrip(), add_special_tokens=False) for p in ("", " ")
            )
            kept = [ids] + [sp] * bool(ids and sp[0] != ids[0] and len(sp) == len(ids))
            if not ids or max(map(max, kept)) >= self.vocab_size:
                raise ValueError(
                    f"SamplingParams.bad_words entry {w!r} is invalid: its tokens "
                    f"{kept} are none or outside [0, {self.vocab_size})"
                )
            words += kept
        allowed = (
            None
            if not params.allowed_token_ids
            else np.packbits(
                np.isin(np.arange(self.words * 32), params.allowed_token_ids), bitorder="little"
            ).view(np.int32)
        )
        return None if allowed is None and not words else (allowed, words)

    def fill(self, bitmask, rows) -> None:
        """Write each ``(row, seq)``'s allowed next ids into ``bitmask`` i32[B, W] (bit v % 32 of
        word v // 32; other rows untouched): its grammar's (stopped or failed: EOS only) AND its
        rules' (vLLM V1's bad words: a word's last id masked when the outputs end with the rest)."""
        if grammars := [(s.matcher, i) for i, s in rows if s.matcher is not None]:
            import llguidance
            import llguidance.numpy

            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, grammars, bitmask)
        for i, s in rows:
            allowed, words = s.rules or (None, ())
            if allowed is not None:
                bitmask[i] &= allowed
            for w in words:
                if (out := s.output_token_ids)[len(out) - len(w) + 1 :] == w[:-1]:
                    bitmask[i].view(np.uint32)[w[-1] // 32] &= ~np.uint32(1 << w[-1] % 32)

    @staticmethod
    def accept(matcher, token: int) -> None:
        """Advance ``matcher`` by the sampled ``token`` (vLLM's ``accept_tokens``: a stopped
        matcher takes nothing more; a token it refuses leaves it failed: EOS next)."""
        if not matcher.is_stopped():
            matcher.consume_token(token)
