"""Output processing (host side, no JAX): detokenisation, stop strings, streaming deltas and the
`RequestOutput` of a request, named and shaped as vLLM's. One module for the library, the CLI and a
server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request timing, in ``time.perf_counter`` seconds: ``ttft_s`` arrival -> first token;
    ``decode_tokens_per_s``: tokens after the first per second of decoding (0 if < 2 tokens)."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    def decode_tokens_per_s(self, num_output_tokens: int) -> float:
        if self.first_token_time is None or self.finish_time is None or num_output_tokens < 2:
            return 0.0
        dt = self.finish_time - self.first_token_time
        return (num_output_tokens - 1) / dt if dt > 0 else 0.0


@dataclass(frozen=True)
class CompletionOutput:
    """One completion: ``finish_reason`` is "stop" (EOS, stop token or stop string), "length"
    (max_tokens or max_model_len reached) or "error" (rejected before scheduling: see ``error``).

    ``stop_reason`` (vLLM's rule): the stop string or the stop token id that ended it, None
    otherwise (EOS included). ``text`` leaves out the stop string and the stop token's text;
    ``token_ids`` keep the stop token."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class RequestOutput:
    """The result of one request, in the order the prompts were given."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = field(default=None)

    @property
    def text(self) -> str:
        """Text of the first completion (convenience)."""
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Token ids of the first completion (convenience)."""
        return self.outputs[0].token_ids if self.outputs else ()


class OutputProcessor:
    """Turns a `Sequence`'s token ids into text and outputs, with ``detokenize`` (``ids ->
    str``; None: every text is "" and there are no stop strings). vLLM's rules: a stop string
    and what follows never appear in the text; a stop token's text is left out (its id stays in
    ``token_ids``); EOS text is kept."""

    def __init__(self, detokenize: Callable[[list[int]], str] | None) -> None:
        self.detokenize = detokenize

    def _text(self, ids: list[int]) -> str:
        return self.detokenize(ids) if self.detokenize is not None else ""

    def find_stop_string(self, seq) -> str | None:
        """The stop string of ``seq.params.stop`` that its output text now contains (the one that
        starts first), or None. Call it after each sampled token; a sequence that finished on
        "length" is still checked (a stop string completed by the last allowed token ends it
        with "stop", vLLM's rule), one finished otherwise is not."""
        stops = seq.params.stop
        if not stops or self.detokenize is None:
            return None
        if seq.is_finished and seq.finish_reason != "length":
            return None
        # a new match ends within the last tokens: each token decodes to >= 1 character
        # (a few more cover tokens that decode to nothing or to part of a character)
        window = max(map(len, stops)) + 8
        tail = self.detokenize(seq.output_token_ids[-window:])
        if not any(stop in tail for stop in stops):
            return None
        text = self.detokenize(seq.output_token_ids)
        hit = [stop for stop in stops if stop in text]
        return min(hit, key=text.find) if hit else None

    def visible_text(self, seq) -> str:
        """The output text the rules above allow to be shown (of a finished or running request)."""
        ids = seq.output_token_ids
        if seq.ended_on_stop_token:
            return self._text(ids[:-1])
        text = self._text(ids)
        if seq.stop_string is not None:
            text = text[:text.find(seq.stop_string)]
        return text

    def stream_delta(self, seq, sent: tuple[int, str]
                     ) -> tuple[list[int], str, tuple[int, str]] | None:
        """(new token ids, new text, the new ``sent``) of ``seq`` since ``sent`` = (tokens
        sent, text sent); None when no token is new, or while the text of a running request ends
        in an incomplete UTF-8 character (U+FFFD). While running, text that could start a stop
        string is held back (as vLLM does)."""
        n_done, text_done = sent
        ids = seq.output_token_ids
        if len(ids) == n_done:
            return None
        text = self.visible_text(seq)
        if seq.params.stop and not seq.is_finished and seq.stop_string is None:
            text = text[:max(len(text_done), len(text) - max(map(len, seq.params.stop)) + 1)]
        if text.endswith("\ufffd") and not seq.is_finished:
            return None
        return ids[n_done:], text[len(text_done):], (len(ids), text)

    def request_output(self, seq, prompt: str | None) -> RequestOutput:
        """The `RequestOutput` of ``seq``: ``stop_reason`` is the stop token id or the stop
        string that ended it, else None (EOS included)."""
        ids = seq.output_token_ids
        stop_reason = ids[-1] if seq.ended_on_stop_token else seq.stop_string
        comp = CompletionOutput(index=0, text=self.visible_text(seq), token_ids=tuple(ids),
                                finish_reason=seq.finish_reason, stop_reason=stop_reason)
        metrics = RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time,
                                 seq.num_preemptions)
        return RequestOutput(request_id=seq.request_id, prompt=prompt,
                             prompt_token_ids=tuple(seq.prompt_token_ids), outputs=[comp],
                             finished=seq.is_finished, metrics=metrics)
