"""Speculative decoding, host side (no JAX): which decode rows get drafts and from which
proposer, what a verify step emitted, and the acceptance counters. The device side is the
verify step (`jaxinfer.runner.step`, `jaxinfer.runner.rejection`). Sources: vLLM V1
``v1/spec_decode`` (proposers, ``disable_by_batch_size``, the ``spec_decode`` metrics)."""

from jaxinfer.engine.batch_builder import needs_full_sampler
from jaxinfer.spec.ngram import NgramProposer
from jaxinfer.stats import EngineStats

METHODS = ("ngram",)  # the proposers built so far (SpeculativeConfig parses more)


def make_proposer(spec):
    """The proposer of `SpeculativeConfig` ``spec``: ``.propose(token_ids, k) -> drafts``.
    ValueError: a method not built yet (the allowed ones named)."""
    if spec.method == "ngram":
        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
    raise ValueError(
        f"speculative_config method={spec.method!r} is not available yet; available: "
        + ", ".join(map(repr, METHODS))
    )


class Speculation:
    """Drafts for the scheduler (`propose`) and counters (`record`) of ``spec`` (a
    `SpeculativeConfig`): k = ``num_speculative_tokens`` drafts a row, for the rows whose
    sampling needs no per-position state (no penalties, bias, min_tokens, log-probabilities,
    grammar or logits processors: those rows decode one token a step, exactly as without
    speculation), while the decode rows number at most ``max_rows`` (``disable_by_batch_size``,
    resolved: `ResolvedConfig.spec_decode_rows`)."""

    def __init__(self, spec, max_rows: int, eos_token_ids, stats: EngineStats) -> None:
        self.k, self.proposer = spec.num_speculative_tokens, make_proposer(spec)
        self.max_rows = max_rows
        self.eos_token_ids, self.stats = eos_token_ids, stats

    def propose(self, rows) -> dict[int, list[int]]:
        """{id(seq): its drafts (up to k)} for the decode ``rows`` that may speculate."""
        out = {}
        for s in rows:
            if (
                s.matcher is None
                and s.rules is None
                and not needs_full_sampler(s, self.eos_token_ids)
            ):
                if drafts := self.proposer.propose(s.all_token_ids, self.k):
                    out[id(s)] = list(drafts)
        return out

    def record(self, batch, emitted: list) -> None:
        """Count a verify step: rows with drafts, drafts, accepted drafts (and per position)."""
        st = self.stats
        if len(st.spec_accepted_per_pos) < self.k:
            st.spec_accepted_per_pos += [0] * (self.k - len(st.spec_accepted_per_pos))
        for d, toks in zip(batch.draft_token_ids, emitted):
            if d and toks is not None:
                accepted = len(toks) - 1
                st.spec_num_drafts += 1
                st.spec_num_draft_tokens += len(d)
                st.spec_num_accepted_tokens += accepted
                for j in range(accepted):
                    st.spec_accepted_per_pos[j] += 1


def trim_to_stop(seq, outputs, appended: int) -> None:
    """A verify step appended ``appended`` tokens to ``seq`` and its text now holds a stop
    string: drop the tokens after the one that completed it (plain decoding would have stopped
    there). ``outputs``: the `OutputProcessor` (its ``find_stop_string``)."""
    ids = seq.output_token_ids
    for _ in range(appended - 1):
        last = ids.pop()
        if outputs.find_stop_string(seq) is None:
            ids.append(last)
            return
