"""vLLM's ``LLM.beam_search`` (its algorithm and result shape) over `LLM.generate`: each step is
one `generate` call (the jitted step untouched); the prefix cache serves the beams' shared pages."""

from dataclasses import dataclass, field

from tqdm import tqdm

from jaxinfer.lora.request import per_prompt
from jaxinfer.outputs import PositionLogprobs
from jaxinfer.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's): ``tokens``: prompt + generated ids (an ending EOS included); ``logprobs``:
    per generated token, its step's candidates; ``text``: ``tokens`` decoded, an ending EOS only
    with ``include_stop_str_in_output`` (None: no tokenizer); ``finish_reason``: "stop" (EOS,
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
    """vLLM's ``get_beam_search_score``: ``cum_logprob / seq_len ** length_penalty``, ``seq_len``
    = len(tokens), the prompt included, less one when the last token is an EOS."""
    return seq.cum_logprob / (len(seq.tokens) - (seq.tokens[-1] in eos)) ** length_penalty


def beam_search(
    llm, prompts, params: BeamSearchParams, lora_request=None, use_tqdm=False
) -> list[BeamSearchOutput]:
    """vLLM's ``LLM.beam_search`` on ``llm``: each step every live beam is a request of one token
    with ``2 * beam_width`` logprobs; each candidate extends its beam, those ending in EOS (unless
    ``ignore_eos``) finish, the ``beam_width`` best others (`beam_search_score`) live on. A beam at
    ``max_model_len`` ends ("length"; vLLM drops it). Per prompt, in order: the ``beam_width``
    best of finished and live beams. ``lora_request``: as `LLM.generate`'s (one `LoRARequest`
    for every prompt, or one or None per prompt), each beam's steps run with its prompt's.
    ValueError: a prompt or ``lora_request`` `LLM.generate` refuses."""
    step = SamplingParams(
        max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature
    )
    _, encoded, _ = llm._prepare(prompts, step, True, llm.engine.check_request)
    loras = per_prompt(lora_request, len(encoded))
    eos = set(llm.engine.eos_token_ids)
    stops = set() if params.ignore_eos else eos  # tokens that finish a beam

    def best(beams: list[BeamSearchSequence]) -> list[BeamSearchSequence]:
        return sorted(
            beams, key=lambda b: beam_search_score(b, eos, params.length_penalty), reverse=True
        )[: params.beam_width]

    live, done = [[BeamSearchSequence(list(ids))] for _, ids in encoded], [[] for _ in encoded]
    for _ in tqdm(range(params.max_tokens), desc="beam search", disable=not use_tqdm):
        beams = [(i, b) for i, bs in enumerate(live) for b in bs]  # none: nothing runs
        outs = llm.generate(
            [{"prompt_token_ids": b.tokens} for _, b in beams],
            step,
            on_error="return",
            lora_request=[loras[i] for i, _ in beams],
        )
        live = [[] for _ in encoded]
        for (i, beam), out in zip(beams, outs):
            if out.error is not None:  # the beam is at max_model_len: it ends ("length")
                done[i].append(beam)
                continue
            for t, lp in (cands := out.outputs[0].logprobs[0]).items():
                (done[i] if t in stops else live[i]).append(
                    BeamSearchSequence(
                        beam.tokens + [t],
                        beam.logprobs + [cands],
                        beam.cum_logprob + lp.logprob,
                        stop_reason=t if t in stops else None,
                    )
                )
        live = [best(bs) for bs in live]
    results = [BeamSearchOutput(best(finished + bs)) for finished, bs in zip(done, live)]
    for b in (b for r in results for b in r.sequences):
        b.finish_reason = "length" if b.stop_reason is None else "stop"
        cut = b.stop_reason is not None and not params.include_stop_str_in_output
        b.text = (
            None
            if llm.tokenizer is None
            else llm._detokenize(b.tokens[: len(b.tokens) - cut], skip_special_tokens=False)
        )
    return results
