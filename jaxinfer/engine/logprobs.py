"""Step log-probabilities -> `Sequence` records (host side, no JAX): vLLM's per position ``{token
id: (logprob, rank)}``, the chosen token, then the top k (ranks 1..k, overwriting it)."""

import numpy as np


def _record(tok: int, a: dict, i: int, k: int, pre: str = "") -> dict[int, tuple[float, int]]:
    lp, rank, ids, lps = (a[pre + f][i] for f in ("logprobs", "ranks", "top_ids", "top_logprobs"))
    return {tok: (lp, rank), **{ids[j]: (lps[j], j + 1) for j in range(k)}}


def record(out: dict | None, hb, seqs, before: list[int] | None) -> None:
    """Append records from ``out`` (the sampler's and prompt scorer's arrays,
    `jaxinfer.runner.step`; None: none) to ``seqs`` (the step's rows): row i's sampled token,
    if its output grew past ``before[i]``, to ``logprobs`` and ``cumulative_logprob``; ``hb``'s
    scored prompt positions to ``prompt_logprobs`` (first None)."""
    for s in (s for s in seqs if s.prompt_logprobs == []):
        s.prompt_logprobs.append(None)
    if out is None:
        return
    a = {k: np.asarray(v).tolist() for k, v in out.items()}  # Python scalars: fast per row
    for i, (s, n) in enumerate(zip(seqs, before)):
        if s.logprobs is not None and s.num_output_tokens > n:
            s.logprobs.append(_record(s.output_token_ids[-1], a, i, s.params.logprobs))
            s.cumulative_logprob += a["logprobs"][i]
    if "prompt_logprobs" not in a:
        return
    pos = hb.positions.reshape(-1)[hb.prompt_lp_index].tolist()
    rows, nxt = hb.prompt_lp_rows.tolist(), hb.prompt_lp_next.tolist()
    for j, row in enumerate(rows):
        if row >= 0 and len((s := seqs[row]).prompt_logprobs) == pos[j] + 1:
            s.prompt_logprobs.append(_record(nxt[j], a, j, s.params.prompt_logprobs, "prompt_"))
