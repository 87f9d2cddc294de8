"""Output processing (host side, no JAX) for the library, the CLI and a server: detokenisation,
stop strings, streaming deltas and `RequestOutput` (vLLM's names, shapes and rules)."""

import dataclasses
from collections.abc import Callable
from operator import attrgetter

from jaxinfer.sampling_params import RequestOutputKind


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Per-request ``time.perf_counter`` seconds; ``ttft_s``: arrival -> first token."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0
    ttft_s = property(
        lambda self: (
            None if self.first_token_time is None else self.first_token_time - self.arrival_time
        )
    )


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the raw model distribution (vLLM's ``Logprob``); rank:
    1 = the likeliest token; decoded_token: its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]  # the chosen token and the top k (vLLM's SampleLogprobs)


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """Sample ``index`` of a request. ``finish_reason``: "stop", "length", "abort" or "error"
    (``RequestOutput.error``); ``stop_reason``: the stop string or token id (EOS: None);
    ``logprobs``: one dict per token, ``cumulative_logprob`` their sum (None: not asked)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finished = lambda self: self.finish_reason is not None  # noqa: E731 (vLLM's method)

    def _joined(self, c: "CompletionOutput") -> "CompletionOutput":
        """``c`` (the same sample's later delta) with this output's text, ids and logprobs
        before its own."""
        return CompletionOutput(
            index=c.index,
            text=self.text + c.text,
            token_ids=self.token_ids + c.token_ids,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            cumulative_logprob=c.cumulative_logprob,
            logprobs=None if c.logprobs is None else (self.logprobs or []) + c.logprobs,
        )

    def top_logprobs(self, k: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
        """Per token: (its text, its log-probability, the top ``k`` as (text, log-probability),
        likeliest first); a token without text is "token_id:N" (vLLM's). []: none asked."""

        def text(t: int, lp: Logprob) -> str:
            return lp.decoded_token if lp.decoded_token is not None else f"token_id:{t}"

        return [
            (
                text(t, rec[t]),
                rec[t].logprob,
                [
                    (text(u, lp), lp.logprob)
                    for u, lp in sorted(rec.items(), key=lambda x: x[1].rank or 0)
                    if lp.rank is not None and lp.rank <= k
                ],
            )
            for t, rec in zip(self.token_ids, self.logprobs or ())
        ]


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """The result of one request, in the order the prompts were given; ``lora_request``: the
    `LoRARequest` it ran with (None: the base model), as vLLM's; ``encoder_prompt``,
    ``encoder_prompt_token_ids``, ``kv_transfer_params``: vLLM's, always None."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # first position: None
    num_cached_tokens: int = 0
    lora_request: object = None  # a `jaxinfer.lora.request.LoRARequest` or None
    encoder_prompt = encoder_prompt_token_ids = kv_transfer_params = None

    text = property(lambda self: self.outputs[0].text if self.outputs else "")  # the first sample's
    token_ids = property(lambda self: self.outputs[0].token_ids if self.outputs else [])

    def add(self, delta: "RequestOutput") -> "RequestOutput":
        """This output with the request's later DELTA output appended (vLLM's ``add``): text, ids
        and logprobs joined per sample index; the rest from ``delta``."""
        return RequestOutput(  # the fields of ``delta`` (dataclasses.replace, without its cost)
            request_id=delta.request_id,
            prompt=delta.prompt,
            prompt_token_ids=delta.prompt_token_ids,
            outputs=self._joined_outputs(delta.outputs),
            finished=delta.finished,
            metrics=delta.metrics,
            error=delta.error,
            prompt_logprobs=self.prompt_logprobs or delta.prompt_logprobs,
            num_cached_tokens=delta.num_cached_tokens,
            lora_request=delta.lora_request,
        )

    def _joined_outputs(self, deltas: list[CompletionOutput]) -> list[CompletionOutput]:
        """This output's samples with ``deltas`` (the same request's later ones) appended per
        sample index, in index order."""
        if len(deltas) == len(self.outputs) == 1 and deltas[0].index == self.outputs[0].index:
            return [self.outputs[0]._joined(deltas[0])]  # one sample (n = 1)
        outs = {c.index: c for c in self.outputs}
        for c in deltas:
            old = outs.get(c.index)
            outs[c.index] = c if old is None else old._joined(c)
        return sorted(outs.values(), key=attrgetter("index"))


@dataclasses.dataclass
class RequestState:
    """A request: its samples (index order), prompt text, output kind, and per sample what was
    sent, `OutputProcessor.stream_delta`'s (tokens, text); None: finish sent."""

    seqs: list
    prompt: str | None
    kind: RequestOutputKind
    sent: list
    acc: RequestOutput | None = None  # CUMULATIVE: the output so far


class OutputProcessor:
    """A `Sequence`'s text and outputs with ``detokenize(ids, skip_special_tokens=...,
    spaces_between_special_tokens=...)`` (None: "" and no stop strings). A stop string and what
    follows, and a stop token's or EOS's text, are hidden unless ``include_stop_str_in_output``."""

    def __init__(self, detokenize: Callable[..., str] | None) -> None:
        self.detokenize = detokenize
        self.requests: dict[str, RequestState] = {}  # request id -> its state

    def add(self, rid: str, seqs: list, prompt: str | None) -> None:
        """Track request ``rid``'s samples ``seqs``; its kind is ``seqs[0].params.output_kind``."""
        self.requests[rid] = RequestState(
            seqs, prompt, seqs[0].params.output_kind, [(0, "")] * len(seqs)
        )

    def outputs(self, rids, raw: bool = False) -> list:
        """The outputs due for requests ``rids`` (those a step touched or aborted), by each one's
        kind (``raw``: its ``seqs``); a finished request's last output is final, then forgotten."""
        outs = []
        for rid in dict.fromkeys(rids):
            if (st := self.requests.get(rid)) is None:
                continue
            done = all(s.is_finished for s in st.seqs)
            if raw:
                out = st.seqs
            elif st.kind is RequestOutputKind.FINAL_ONLY:
                out = self.request_output(st.seqs, st.prompt) if done else None
            elif st.acc is not None:  # CUMULATIVE, after its first output
                out = self._cumulative_output(st)
            elif (
                out := self._delta_output(st)
            ) is not None and st.kind is RequestOutputKind.CUMULATIVE:
                st.acc = out
            if done:
                del self.requests[rid]
            if out is not None:
                outs.append(out)
        return outs

    def _delta_output(self, st: RequestState) -> RequestOutput | None:
        """What is new in ``st``'s samples since the last output (`_new_completions`; prompt
        logprobs in the first); None: nothing new."""
        first = st.sent.count((0, "")) == len(st.sent)  # nothing sent yet
        comps = self._new_completions(st)
        return None if not comps else self.request_output(st.seqs, st.prompt, comps, first)

    def _cumulative_output(self, st: RequestState) -> RequestOutput | None:
        """A CUMULATIVE request's next output: ``st.acc`` (its last) with `_new_completions`
        joined, the values of ``st.acc.add(self._delta_output(st))`` without building the delta
        (not the first output: no prompt logprobs of its own); None: nothing new."""
        if not (comps := self._new_completions(st)):
            return None
        plp = st.acc.prompt_logprobs or None  # the first output's
        st.acc = self._output(st.seqs, st.prompt, st.acc._joined_outputs(comps), plp)
        return st.acc

    def _new_completions(self, st: RequestState) -> list[CompletionOutput]:
        """Each of ``st``'s samples' output since the last one (`stream_delta`), a finished
        sample's finish reason once; ``st.sent`` advanced."""
        comps = []
        for seq in st.seqs:
            i, sent = seq.index, st.sent[seq.index]
            d = None if sent is None else self.stream_delta(seq, sent)
            if sent is None or d is None and not seq.is_finished:
                continue
            ids, text, new = d or ([], "", sent)
            st.sent[i] = None if seq.is_finished else new
            comps.append(self.completion(seq, (ids, text, sent[0])))
        return comps

    def _decode(self, ids, params) -> str:
        return self.detokenize(
            list(ids),
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )

    def find_stop_string(self, seq) -> str | None:
        """The first-starting stop string in ``seq``'s output text, or None (also on "length", and
        up to ``min_tokens`` tokens, as vLLM); call after each new token."""
        stops, ids = seq.params.stop, seq.output_token_ids
        if (
            not stops
            or self.detokenize is None
            or len(ids) <= seq.params.min_tokens
            or (seq.is_finished and seq.finish_reason != "length")
        ):
            return None
        window = 8 + (need := max(map(len, stops)) + len(self._decode(ids[-1:], seq.params)) + 2)
        while True:  # leading U+FFFD: a character cut by the window's start
            tail = self._decode(ids[-window:], seq.params)
            if window >= len(ids) or len(tail.lstrip("\ufffd")) >= need:
                break
            window *= 2
        if not any(stop in tail for stop in stops):
            return None
        text = self._decode(ids, seq.params)
        hit = [(at, stop) for stop in stops if (at := self._stop_at(seq, text, stop)) >= 0]
        return min(hit)[1] if hit else None

    def _stop_at(self, seq, text: str, stop: str) -> int:
        """Where ``stop`` first ends past the first ``min_tokens`` tokens' text (-1: nowhere)."""
        m = seq.params.min_tokens
        start = len(self._decode(seq.output_token_ids[:m], seq.params)) - len(stop) + 1 if m else 0
        return text.find(stop, max(start, 0))

    def visible_text(self, seq) -> str:
        """The output text the rules allow to be shown."""
        p, ids = seq.params, seq.output_token_ids
        stopped_by_token = seq.finish_reason == "stop" and seq.stop_string is None and ids
        if stopped_by_token and seq.is_finished and not p.include_stop_str_in_output:
            ids = ids[:-1]  # a stop token or EOS
        text = self._incremental(seq, ids) if self.detokenize and p.detokenize else ""  # no stop ^
        if seq.stop_string is not None:
            end = self._stop_at(seq, text, seq.stop_string)
            text = text[: end + len(seq.stop_string) if p.include_stop_str_in_output else end]
        return text

    def _incremental(self, seq, ids: list[int]) -> str:
        """Text of ``ids`` (``seq``'s first): ``seq.decoded`` + from 6 before on (vLLM's
        offsets)."""
        m, text, p = seq.decoded
        m, text = (m, text) if p is seq.params and m <= len(ids) else (0, "")
        old, new = (self._decode(ids[k:n], seq.params) for k in [max(m - 6, 0)] for n in (m, None))
        full = text + new[len(old) :] if new.startswith(old) else self._decode(ids, seq.params)
        if not full.endswith("\ufffd"):  # a character cut at the end: not kept
            seq.decoded = (len(ids), full, seq.params)
        return full

    def stream_delta(
        self, seq, sent: tuple[int, str]
    ) -> tuple[list[int], str, tuple[int, str]] | None:
        """(new ids, new text, new ``sent``) since ``sent`` = (tokens, text); None: nothing new, or
        the text ends in U+FFFD (an incomplete character). Text that could start a stop string is
        held back (vLLM: ``len(stop) - 1`` characters, none with ``include_stop_str_in_output``)."""
        (n_done, text_done), ids = sent, seq.output_token_ids
        if len(ids) == n_done:
            return None
        text, p = self.visible_text(seq), seq.params
        if text.endswith("\ufffd") and not seq.is_finished:
            return None
        if p.stop and not (p.include_stop_str_in_output or seq.is_finished or seq.stop_string):
            text = text[: max(len(text_done), len(text) - max(map(len, p.stop)) + 1)]
        return ids[n_done:], text[len(text_done) :], (len(ids), text)

    def _logprobs(self, entries, params) -> list[PositionLogprobs | None] | None:
        """``{id: (logprob, rank)}`` records as `Logprob` dicts (None kept), text if detokenized."""
        if entries is None:
            return None
        text = (
            (lambda t: self.detokenize([t], skip_special_tokens=False))
            if self.detokenize and params.detokenize
            else (lambda t: None)
        )
        return [
            None if e is None else {t: Logprob(lp, rank, text(t)) for t, (lp, rank) in e.items()}
            for e in entries
        ]

    def completion(self, seq, delta: tuple | None = None) -> CompletionOutput:
        """``seq``'s output so far, or ``delta`` = (new ids, new text, tokens sent before) only."""
        ids, text, start = delta or (seq.output_token_ids, self.visible_text(seq), 0)
        lps = None if seq.logprobs is None else seq.logprobs[start : start + len(ids)]
        stop = seq.output_token_ids[-1] if seq.ended_on_stop_token else seq.stop_string
        return CompletionOutput(
            seq.index,
            text,
            list(ids),
            seq.finish_reason,
            stop,
            seq.cumulative_logprob,
            self._logprobs(lps, seq.params),
        )

    def request_output(
        self, seqs, prompt: str | None, outputs: list | None = None, prompt_logprobs: bool = True
    ) -> RequestOutput:
        """The `RequestOutput` of a request's samples ``seqs`` (index order): ``outputs`` (None:
        each sample's `completion`); metrics once all finished."""
        first = seqs[0]
        plp = self._logprobs(first.prompt_logprobs if prompt_logprobs else None, first.params)
        outputs = [self.completion(s) for s in seqs] if outputs is None else outputs
        return self._output(seqs, prompt, outputs, plp)

    def _output(self, seqs, prompt: str | None, outputs: list, plp) -> RequestOutput:
        """`request_output` with the prompt logprobs ``plp`` made (`Logprob` dicts, or None)."""
        first, finished = seqs[0], all(s.is_finished for s in seqs)
        metrics = (
            RequestMetrics(
                first.arrival_time,
                min((s.first_token_time for s in seqs if s.first_token_time), default=None),
                max((s.finish_time for s in seqs if s.finish_time), default=None),
                sum(s.num_preemptions for s in seqs),
            )
            if finished
            else None
        )
        return RequestOutput(
            first.parent_id,
            prompt,
            list(first.prompt_token_ids),
            outputs,
            finished,
            metrics,
            None,
            plp,
            first.num_cached_tokens,
            first.lora_request,
        )
