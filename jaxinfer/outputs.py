"""Output processing (host side, no JAX) for the library, the CLI and a server: detokenisation,
stop strings, streaming deltas and `RequestOutput` (vLLM's names, shapes and rules)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request ``time.perf_counter`` seconds; ``ttft_s``: arrival -> first token."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class CompletionOutput:
    """``finish_reason``: "stop", "length" or "error" (see ``RequestOutput.error``);
    ``stop_reason``: the stop string or token id (EOS: None), left out of ``text``."""

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
        """The first completion's."""
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids if self.outputs else ()


class OutputProcessor:
    """A `Sequence`'s text and outputs with ``detokenize`` (None: "" and no stop strings); a
    stop string and what follows, and a stop token's text, never appear; EOS text does."""

    def __init__(self, detokenize: Callable[[list[int]], str] | None) -> None:
        self.detokenize = detokenize

    def find_stop_string(self, seq) -> str | None:
        """The first-starting stop string in ``seq``'s output text, or None (also on "length")."""
        stops = seq.params.stop
        if not stops or self.detokenize is None or (seq.is_finished
                                                     and seq.finish_reason != "length"):
            return None
        # a new match ends in the last tokens (+8 for tokens decoding to nothing or part of one)
        tail = self.detokenize(seq.output_token_ids[-(max(map(len, stops)) + 8):])
        if not any(stop in tail for stop in stops):
            return None
        text = self.detokenize(seq.output_token_ids)
        hit = [stop for stop in stops if stop in text]
        return min(hit, key=text.find) if hit else None

    def visible_text(self, seq) -> str:
        """The output text the rules allow to be shown."""
        ids = seq.output_token_ids[:-1] if seq.ended_on_stop_token else seq.output_token_ids
        text = self.detokenize(ids) if self.detokenize is not None else ""  # ^ no stop_string
        if seq.stop_string is not None:
            text = text[:text.find(seq.stop_string)]
        return text

    def stream_delta(self, seq, sent: tuple[int, str]
                     ) -> tuple[list[int], str, tuple[int, str]] | None:
        """(new ids, new text, new ``sent``) since ``sent`` = (tokens, text); None: nothing new,
        or running text ends in U+FFFD. Text that could start a stop string is held back."""
        (n_done, text_done), ids = sent, seq.output_token_ids
        if len(ids) == n_done:
            return None
        text = self.visible_text(seq)
        if seq.params.stop and not seq.is_finished and seq.stop_string is None:
            text = text[:max(len(text_done), len(text) - max(map(len, seq.params.stop)) + 1)]
        if text.endswith("\ufffd") and not seq.is_finished:
            return None
        return ids[n_done:], text[len(text_done):], (len(ids), text)

    def request_output(self, seq, prompt: str | None) -> RequestOutput:
        ids = seq.output_token_ids
        stop_reason = ids[-1] if seq.ended_on_stop_token else seq.stop_string
        comp = CompletionOutput(index=0, text=self.visible_text(seq), token_ids=tuple(ids),
                                finish_reason=seq.finish_reason, stop_reason=stop_reason)
        return RequestOutput(request_id=seq.request_id, prompt=prompt,
                             prompt_token_ids=tuple(seq.prompt_token_ids), outputs=[comp],
                             finished=seq.is_finished, metrics=RequestMetrics(
                                 seq.arrival_time, seq.first_token_time, seq.finish_time,
                                 seq.num_preemptions))
