"""`ScheduledBatch`: one step's rows as the scheduler chose them (host side, no JAX)."""

from dataclasses import dataclass, field

from jaxinfer.engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledBatch:
    """Row i computes positions ``[start_positions[i], + num_new_tokens[i])`` of ``seqs[i]``,
    the last ``len(draft_token_ids[i])`` of them a proposer's drafts (speculative decoding:
    the row's last token, then its drafts, all verified); snapshots: ``do_sample`` (the chunk
    reaches the end, pending included), ``pending_input`` (input token from the batch in
    flight). The scheduler orders rows decode first (one token each, or one plus drafts,
    admission order), then prefill chunks. Raises ValueError: lengths differ, a count < 1 or
    not above the row's drafts."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    draft_token_ids: list[list[int]] | None = None
    start_positions: list[int] = field(init=False)
    do_sample: list[bool] = field(init=False)
    pending_input: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        seqs, nums = list(self.seqs), [int(n) for n in self.num_new_tokens]  # own copies
        drafts = [list(map(int, d)) for d in self.draft_token_ids or [[] for _ in seqs]]
        if len(seqs) != len(nums) or len(drafts) != len(seqs):
            raise ValueError(
                f"ScheduledBatch: {len(seqs)} seqs, {len(nums)} num_new_tokens and "
                f"{len(drafts)} draft lists: one of each per row"
            )
        if any(n < 1 + len(d) for n, d in zip(nums, drafts)):
            raise ValueError(
                f"ScheduledBatch.num_new_tokens={nums} is invalid: each count must be >= 1 "
                "plus the row's drafts"
            )
        starts = [s.num_computed_tokens for s in seqs]
        ends = [st + n - len(d) for st, n, d in zip(starts, nums, drafts)]
        for name, v in dict(
            seqs=seqs,
            num_new_tokens=nums,
            draft_token_ids=drafts,
            start_positions=starts,
            do_sample=[e == s.num_tokens_with_pending for s, e in zip(seqs, ends)],
            pending_input=[st >= s.num_tokens for s, st in zip(seqs, starts)],
        ).items():
            object.__setattr__(self, name, v)

    num_seqs = property(lambda self: len(self.seqs))
    num_draft_tokens = property(lambda self: sum(map(len, self.draft_token_ids)))

    def emitted(self, sampled: list) -> list[list[int]]:
        """Each row's ids in ``sampled`` (`Scheduler.postprocess`'s; [] where none). ValueError:
        ``sampled`` does not fit the batch."""
        batch = self
        if len(sampled) != batch.num_seqs:
            raise ValueError(
                f"postprocess: sampled has {len(sampled)} entries, batch has "
                f"{batch.num_seqs} sequences"
            )
        out = []
        for i, (tok, want, d) in enumerate(zip(sampled, batch.do_sample, batch.draft_token_ids)):
            toks = _ids(tok)
            bad = bool(toks) != want
            if d or len(toks) > 1:  # a verify row's: drafts accepted in order, then one more
                bad = bad or len(toks) > len(d) + 1 or toks[:-1] != d[: len(toks) - 1]
            if bad:
                raise ValueError(
                    f"postprocess: sampled[{i}]={tok!r} is invalid: expected "
                    + (
                        f"1 to {len(d) + 1} ids, all but the last the drafts {d}"
                        if want
                        else "None (prefill chunk not at the end)"
                    )
                )
            out.append(toks)
        return out


def _ids(tok) -> list[int]:
    """A ``sampled`` entry as ids: None -> [], an id -> [id], a list -> its ids."""
    if tok is None:
        return []
    return list(map(int, tok)) if isinstance(tok, list) else [int(tok)]
