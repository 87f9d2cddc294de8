"""OpenAI's logprobs of both endpoints (vLLM's) from per-token ``{id: Logprob}`` records (the
chosen token and the top k); a token's text: its ``decoded_token``, else "token_id:N"."""

from __future__ import annotations

from jaxinfer.serve import protocol as P


def _text(t: int, rec: dict) -> str:
    return rec[t].decoded_token if rec[t].decoded_token is not None else f"token_id:{t}"


def _top(rec: dict, k: int) -> list[tuple[str, float]]:
    """(text, logprob) of the position's top ``k``, likeliest first."""
    ranked = sorted((lp.rank, t) for t, lp in rec.items() if lp.rank is not None and lp.rank <= k)
    return [(_text(t, rec), rec[t].logprob) for _, t in ranked]


def completion_logprobs(ids, recs, k: int, offset: int) -> P.CompletionLogprobs:
    """Tokens ``ids`` with their records ``recs``; ``offset``: the text offset of the first."""
    out = P.CompletionLogprobs()
    for t, rec in zip(ids, recs):
        out.tokens.append(s := _text(t, rec))
        out.token_logprobs.append(rec[t].logprob)
        out.top_logprobs.append(dict(_top(rec, k)))
        out.text_offset.append(offset)
        offset += len(s)
    return out


def chat_logprobs(ids, recs, k: int) -> P.ChatLogprobs:
    def entry(text, logprob, cls=P.TopLogprob, **kw):
        return cls(token=text, logprob=logprob, bytes=list(text.encode("utf-8", "replace")), **kw)
    return P.ChatLogprobs(content=[
        entry(_text(t, rec), rec[t].logprob, P.ChatTokenLogprob,
              top_logprobs=[entry(s, lp) for s, lp in _top(rec, k)]) for t, rec in zip(ids, recs)])
