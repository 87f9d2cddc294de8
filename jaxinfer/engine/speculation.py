"""Speculative decoding, host side (no JAX): which decode rows get drafts and from which
proposer, what a verify step emitted, and the acceptance counters. The device side is the
verify step (`jaxinfer.runner.step`, `jaxinfer.runner.rejection`). Sources: vLLM V1
``v1/spec_decode`` (proposers, ``disable_by_batch_size``, the ``spec_decode`` metrics)."""

from collections.abc import Callable

from jaxinfer.engine.batch_builder import needs_full_sampler
from jaxinfer.spec.ngram import NgramProposer
from jaxinfer.stats import EngineStats

METHODS = ("ngram", "draft_model", "eagle3")  # the proposers built


def make_proposer(spec, draft: Callable | None = None):
    """The proposer of `SpeculativeConfig` ``spec``: ``(rows, most) -> [drafts of each row]``
    over (`Sequence`, most drafts) pairs. "ngram": `NgramProposer` over each row's tokens;
    "draft_model" and "eagle3": ``draft`` (the runner's ``propose_drafts(rows, k) -> i32[n,
    k]`` over (last token, its position, block table) rows: k greedy steps of the draft model
    or the EAGLE-3 head).
    ValueError: a method not built yet (the allowed ones named)."""
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        ngram = NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        return lambda rows, most: [ngram.propose(s.all_token_ids, m) for s, m in zip(rows, most)]
    if spec.method in ("draft_model", "eagle3") and draft is not None:

        def by_draft_model(rows, most):
            got = draft([(s.last_token_id, s.num_tokens - 1, s.block_table) for s in rows], k)
            return [got[i, :m].tolist() for i, m in enumerate(most)]

        return by_draft_model
    raise ValueError(
        f"speculative_config method={spec.method!r} is not available yet; available: "
        + ", ".join(map(repr, METHODS))
    )


class Speculation:
    """Drafts for the scheduler (`propose`) and counters (`record`) of ``spec`` (a
    `SpeculativeConfig`; ``draft``: `make_proposer`'s): k = ``num_speculative_tokens`` drafts
    a row, for the rows whose sampling needs no per-position state (no penalties, bias,
    min_tokens, log-probabilities, grammar or logits processors: those rows decode one token
    a step, exactly as without speculation), while the decode rows number at most
    ``max_rows`` (``disable_by_batch_size``, resolved: `ResolvedConfig.spec_decode_rows`)."""

    def __init__(
        self, spec, max_rows: int, eos_token_ids, stats: EngineStats, draft: Callable | None = None
    ) -> None:
        self.k, self.proposer = spec.num_speculative_tokens, make_proposer(spec, draft)
        self.max_rows = max_rows
        self.eos_token_ids, self.stats = eos_token_ids, stats

    def propose(self, rows, most: list[int]) -> dict[int, list[int]]:
        """{id(seq): its drafts (up to ``most``)} for the decode ``rows`` that may speculate."""
        asked = [
            (s, m)
            for s, m in zip(rows, most)
            if s.matcher is None
            and s.rules is None
            and not needs_full_sampler(s, self.eos_token_ids)
        ]
        if not asked:
            return {}
        got = self.proposer([s for s, _ in asked], [m for _, m in asked])
        return {id(s): list(d) for (s, _), d in zip(asked, got) if len(d)}

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
