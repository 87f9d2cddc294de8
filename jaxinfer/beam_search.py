"""vLLM's ``LLM.beam_search`` (its algorithm and result shape) over `LLM.generate`: each step is
one `generate` call (the jitted step untouched); the prefix cache serves the beams' shared pages."""

from dataclasses import dataclass, field

from jaxinfer.outputs import PositionLogprobs
from jaxinfer.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's): ``tokens``: prompt + generated ids (a finishing EOS included);
    ``logprobs``: per generated token, that step's candidates {id: `Logprob`} (the 2 x
    beam_width likeliest and the chosen one); ``cum_logprob``: their chosen tokens' sum;
    ``text``: ``tokens`` decoded, special tokens shown, a final EOS only with
    ``include_stop_str_in_output`` (None without a tokenizer); ``finish_reason``: "stop" (EOS,
    ``stop_reason`` its id) or "length" (``max_tokens`` or ``max_model_len`` reached)."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's result: its ``beam_width`` best sequences, best first (vLLM's)."""

    sequences: list[BeamSearchSequence]


def beam_search_score(seq: BeamSearchSequence, eos: set, length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: ``cum_logprob / seq_len ** length_penalty``, with
    ``seq_len`` = len(tokens), the prompt included, less one when the last token is an EOS."""
    return seq.cum_logprob / (len(seq.tokens) - (seq.tokens[-1] in eos)) ** length_penalty


def beam_search(llm, prompts, params: BeamSearchParams,
                use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """vLLM's ``LLM.beam_search`` on ``llm``: each step every live beam is a request of one token
    with ``2 * beam_width`` logprobs (temperature ``params.temperature``); each candidate extends
    its beam, one ending in EOS (unless ``ignore_eos``) is finished and kept aside, and the
    ``beam_width`` best-scoring others (`beam_search_score`) live on, for ``max_tokens`` steps or
    until none lives. A beam at ``max_model_len`` finishes ("length"; vLLM drops it). Returns one
    `BeamSearchOutput` per prompt, in order: the ``beam_width`` best of finished and live beams.
    ValueError: a prompt `LLM.generate` refuses, ``params`` not a `BeamSearchParams`."""
    from tqdm import tqdm

    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams; got {type(params).__name__}")
    step = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, detokenize=False,
                          temperature=params.temperature)
    _, encoded, _ = llm._prepare(prompts, step, True, llm.engine.check_request)
    eos = set(llm.engine.eos_token_ids)
    stops = set() if params.ignore_eos else eos  # tokens that finish a beam

    def score(b: BeamSearchSequence) -> float:
        return beam_search_score(b, eos, params.length_penalty)

    live, done = [[BeamSearchSequence(list(ids))] for _, ids in encoded], [[] for _ in encoded]
    for _ in tqdm(range(params.max_tokens), desc="beam search", disable=not use_tqdm):
        if not (beams := [(i, b) for i, bs in enumerate(live) for b in bs]):
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in beams], step,
                            on_error="return")
        live = [[] for _ in encoded]
        for (i, beam), out in zip(beams, outs):
            if out.error is not None:  # the beam is at max_model_len: it ends ("length")
                done[i].append(beam)
                continue
            cands = out.outputs[0].logprobs[0]
            for t, lp in cands.items():
                new = BeamSearchSequence(beam.tokens + [t], beam.logprobs + [cands],
                                         beam.cum_logprob + lp.logprob)
                if t in stops:
                    new.finish_reason, new.stop_reason = "stop", t
                (done[i] if t in stops else live[i]).append(new)
        live = [sorted(bs, key=score, reverse=True)[:params.beam_width] for bs in live]
    results = []  # per prompt: the best of its finished and live beams
    for finished, bs in zip(done, live):
        best = sorted(finished + bs, key=score, reverse=True)[:params.beam_width]
        for b in best:
            b.finish_reason = b.finish_reason or "length"
            cut = b.stop_reason is not None and not params.include_stop_str_in_output
            b.text = None if llm.tokenizer is None else llm._detokenize(
                b.tokens[:len(b.tokens) - cut], skip_special_tokens=False)
        results.append(BeamSearchOutput(best))
    return results
