"""Log-probability arrays of a step -> `Sequence` records (host side, no JAX). A record is vLLM's
per position ``{token id: (logprob, rank)}``: the chosen token first, then the top k (ranks 1..k,
overwriting the chosen token's entry when it is among them, as vLLM's dict does)."""

from __future__ import annotations

import numpy as np


def _record(tok, lp, rank, top_ids, top_lps, k: int) -> dict[int, tuple[float, int]]:
    rec = {int(tok): (float(lp), int(rank))}
    rec.update({int(t): (float(x), j + 1)
                for j, (t, x) in enumerate(zip(top_ids[:k], top_lps[:k]))})
    return rec


def record(out: dict | None, hb, seqs, grew) -> None:
    """Append to ``seqs``' (a step's rows) records from ``out`` (`jaxinfer.step.step`'s dict,
    None: no log-probabilities this step): row i's sampled token when ``grew[i]`` (its output grew
    by one) to ``logprobs`` and ``cumulative_logprob``; each scored prompt position of ``hb``
    (`jaxinfer.step_input.HostBatch`) to ``prompt_logprobs`` in order (first entry None; entries
    already recorded are skipped)."""
    for s in seqs:
        if s.prompt_logprobs == []:
            s.prompt_logprobs.append(None)
    if out is None:
        return
    a = {k: np.asarray(v) for k, v in out.items()}
    for i, (s, g) in enumerate(zip(seqs, grew)):
        if g and s.logprobs is not None:
            s.logprobs.append(_record(s.output_token_ids[-1], a["logprobs"][i], a["ranks"][i],
                                      a["top_ids"][i], a["top_logprobs"][i], s.params.logprobs))
            s.cumulative_logprob += float(a["logprobs"][i])
    if "prompt_logprobs" not in a:
        return
    pos = hb.positions.reshape(-1)[hb.prompt_lp_index]
    for j in np.flatnonzero(hb.prompt_lp_rows >= 0):
        s = seqs[hb.prompt_lp_rows[j]]
        if len(s.prompt_logprobs) == pos[j] + 1:
            s.prompt_logprobs.append(_record(
                hb.prompt_lp_next[j], a["prompt_logprobs"][j], a["prompt_ranks"][j],
                a["prompt_top_ids"][j], a["prompt_top_logprobs"][j], s.params.prompt_logprobs))
