"""OutputProcessor (host only): stop-string matching, streamed deltas and RequestOutput text follow
vLLM's rules with toy detokenizers: token id t -> chr(t) (id 1 decodes to an incomplete character
until the next token; id 2 is a special token "<s>"), and a byte-level one (token = one UTF-8
byte, decoded as Python does with errors="replace"), where a Korean syllable takes 3 tokens and an
emoji 4."""

import pytest

from jaxinfer.engine.sequence import Sequence, SequenceStatus
from jaxinfer.outputs import OutputProcessor
from jaxinfer.sampling_params import RequestOutputKind, SamplingParams


def detok(ids, skip_special_tokens=True, spaces_between_special_tokens=True):
    text = "".join(
        "" if t == 2 and skip_special_tokens else "<s>" if t == 2 else chr(t) for t in ids if t != 1
    )
    return text + "\ufffd" if ids and ids[-1] == 1 else text


def byte_detok(ids, **_):
    return bytes(ids).decode("utf-8", errors="replace")


def _seq(text, **params):
    return Sequence(
        "r",
        [65],
        SamplingParams(max_tokens=50, **params),
        seed=0,
        output_token_ids=[ord(c) if c != "?" else 1 for c in text],
    )


def test_find_stop_string_earliest_and_only_when_allowed():
    out = OutputProcessor(detok)
    assert out.find_stop_string(_seq("hello world. end!", stop=["!", "."])) == "."
    assert out.find_stop_string(_seq("hello", stop=["."])) is None
    assert OutputProcessor(None).find_stop_string(_seq("a.", stop=["."])) is None
    done = _seq("a.", stop=["."])
    done.status, done.finish_reason = SequenceStatus.FINISHED, "length"
    assert out.find_stop_string(done) == "."  # the last allowed token completed it
    done.finish_reason = "stop"
    assert out.find_stop_string(done) is None


def test_stream_holds_back_stop_prefix_and_incomplete_utf8():
    out = OutputProcessor(detok)
    s = _seq("abcST", stop=["STOP"])
    ids, text, sent = out.stream_delta(s, (0, ""))
    assert text == "ab" and len(ids) == 5 and sent == (5, "ab")  # "cST" could start "STOP"
    assert out.stream_delta(s, sent) is None  # no new token
    assert out.stream_delta(_seq("ab?"), (0, "")) is None  # incomplete character waits
    s = _seq("abcSTOPxy", stop=["STOP"])
    s.stop_string, s.status, s.finish_reason = "STOP", SequenceStatus.FINISHED, "stop"
    ids, text, _ = out.stream_delta(s, (5, "ab"))
    assert text == "c" and len(ids) == 4  # never the stop string


def test_request_output_text_and_stop_reason():
    out = OutputProcessor(detok)
    s = _seq("hi!", stop_token_ids=[ord("!")])
    s.status, s.finish_reason = SequenceStatus.FINISHED, "stop"
    o = out.request_output([s], "p").outputs[0]
    assert (o.text, o.stop_reason, o.token_ids[-1]) == ("hi", ord("!"), ord("!"))
    s = _seq("hi. more", stop=["."])
    s.stop_string, s.status, s.finish_reason = ".", SequenceStatus.FINISHED, "stop"
    o = out.request_output([s], None).outputs[0]
    assert (o.text, o.stop_reason, o.finish_reason) == ("hi", ".", "stop")
    assert OutputProcessor(None).request_output([s], None).text == ""


def _generate(out, ids, **params):
    """Feed ``ids`` one token at a time as the engine does (`LLMEngine._complete`: stop-string
    check after each token) and stream; (final text, streamed text, stop_string)."""
    seq = Sequence("r", [65], SamplingParams(max_tokens=len(ids), **params), seed=0)
    sent, streamed = (0, ""), ""
    for t in ids:
        seq.output_token_ids.append(t)
        if (stop := out.find_stop_string(seq)) is not None:
            seq.stop_string, seq.status, seq.finish_reason = stop, SequenceStatus.FINISHED, "stop"
        if (d := out.stream_delta(seq, sent)) is not None:
            _ids, delta, sent = d
            streamed += delta
        if seq.is_finished:
            break
    return out.visible_text(seq), streamed, seq.stop_string


@pytest.mark.parametrize(
    "before, stop, after",
    [
        ("Hi ", "안녕하세요", " more"),  # 5 characters, 15 tokens > len(stop) + 8
        ("x", "😀" * 6, "y"),  # 6 characters, 24 tokens
        (
            "가나다라마바사아자차카타파하",
            "하",
            "끝",
        ),  # a short stop after many multi-token characters
    ],
)
def test_stop_string_of_many_tokens_per_character_matches(before, stop, after):
    out = OutputProcessor(byte_detok)
    ids = list((before + stop + after).encode())
    text, streamed, hit = _generate(out, ids, stop=[stop])
    assert hit == stop and text == before.split(stop)[0] and streamed == text
    text, streamed, hit = _generate(out, ids, stop=[stop], include_stop_str_in_output=True)
    assert hit == stop and text == streamed == before.split(stop)[0] + stop


@pytest.mark.parametrize(
    "text, stop", [("hello X😀 tail", "X😀"), ("ab 안녕 cd", "b 안"), ("one 😀😀 two", "😀😀")]
)
def test_stream_never_sends_text_the_final_text_drops(text, stop):
    """The stop string's last character arrives as several tokens: while it is incomplete, the
    text before it (a possible start of the stop string) is not streamed."""
    final, streamed, hit = _generate(OutputProcessor(byte_detok), list(text.encode()), stop=[stop])
    assert hit == stop and final == text[: text.find(stop)] and streamed == final


def test_include_stop_str_and_special_tokens_per_request():
    out = OutputProcessor(detok)
    s = _seq("hi. more", stop=["."], include_stop_str_in_output=True)
    s.stop_string, s.status, s.finish_reason = ".", SequenceStatus.FINISHED, "stop"
    assert out.request_output([s], None).outputs[0].text == "hi."
    s = _seq("hi!", stop_token_ids=[ord("!")], include_stop_str_in_output=True)
    s.status, s.finish_reason = SequenceStatus.FINISHED, "stop"
    assert out.request_output([s], None).outputs[0].text == "hi!"
    s = Sequence(
        "r",
        [65],
        SamplingParams(max_tokens=5, skip_special_tokens=False),
        seed=0,
        output_token_ids=[2, ord("a")],
    )
    assert out.visible_text(s) == "<s>a"
    s.params = SamplingParams(max_tokens=5)
    assert out.visible_text(s) == "a"
    assert _generate(out, [ord(c) for c in "ab. cd."], stop=["."], min_tokens=4)[0] == "ab. cd"


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_left_out_unless_include_stop_str(include):
    """vLLM's detokenizer drops the token that stopped the request (EOS, id 2 "<s>" here) even
    with skip_special_tokens=False, unless include_stop_str_in_output."""
    s = _seq("ab", skip_special_tokens=False, include_stop_str_in_output=include)
    s.output_token_ids.append(2)
    s.status, s.finish_reason = SequenceStatus.FINISHED, "stop"
    comp = OutputProcessor(detok).request_output([s], None).outputs[0]
    assert comp.text == ("ab<s>" if include else "ab") and comp.stop_reason is None
    s.finish_reason = "length"  # the same token as the last allowed one: shown
    assert OutputProcessor(detok).request_output([s], None).outputs[0].text == "ab<s>"


def test_detokenize_false_gives_ids_without_text():
    """vLLM's ``SamplingParams(detokenize=False)``: the token ids, no text, and logprobs without
    their tokens' text (``decoded_token`` None)."""
    s = _seq("hi", detokenize=False, logprobs=1)
    s.logprobs = [{104: (-0.5, 1)}, {105: (-0.25, 1), 7: (-2.0, 2)}]
    s.status, s.finish_reason = SequenceStatus.FINISHED, "length"
    o = OutputProcessor(detok).request_output([s], "p").outputs[0]
    assert (o.text, o.token_ids) == ("", [104, 105])
    assert [{t: lp.decoded_token for t, lp in pos.items()} for pos in o.logprobs] == [
        {104: None},
        {105: None, 7: None},
    ]


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_equals_the_whole_decode(skip):
    """Streamed text is decoded incrementally (vLLM's prefix/read offsets: the kept text plus a
    window from 6 ids back), so a delta costs a few ids, not the whole output. On a byte-level BPE
    tokenizer (HF ``tokenizers``, random ids: cut UTF-8 characters, special tokens) the text after
    every token equals the tokenizer's decode of all ids (the reference)."""
    import random

    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        ["héllo wörld, 한국어 text. " * 20, "emoji 🙂 and spaces  "],
        vocab_size=400,
        special_tokens=["<s>"],
    )

    def decode(ids, skip_special_tokens=True, spaces_between_special_tokens=True):  # noqa: E306
        return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    out, rng = OutputProcessor(decode), random.Random(0)
    for trial in range(5):
        s = Sequence("r", [1], SamplingParams(max_tokens=400, skip_special_tokens=skip), seed=0)
        for _ in range(200):
            s.output_token_ids.append(rng.randrange(tok.get_vocab_size()))
            assert out.visible_text(s) == decode(s.output_token_ids, skip), trial


def _kind_outputs(kind) -> list:
    """A request of two samples (stop string, logprobs) fed one token per sample per step with
    `detok`, sample 1 ending on its stop string at the last step: each step's outputs."""
    proc = OutputProcessor(detok)
    params = SamplingParams(
        max_tokens=20, n=2, stop=["STOP"], logprobs=1, output_kind=RequestOutputKind[kind]
    )
    seqs = [Sequence("r", [65], params, seed=0, index=i, arrival_time=0.0) for i in range(2)]
    proc.add("r", seqs, "p")
    steps = []
    for pair in ["ab", "cS", "d?", "eT", "fO", "gP"]:
        for s, ch in zip(seqs, pair):
            s.output_token_ids.append(1 if ch == "?" else ord(ch))
            s.logprobs.append({s.output_token_ids[-1]: (-0.5, 1)})
        if pair == "gP":
            seqs[1].stop_string = "STOP"
            for s, reason in zip(seqs, ["length", "stop"]):
                s.status, s.finish_reason, s.finish_time = SequenceStatus.FINISHED, reason, 1.0
        steps.append(proc.outputs(["r"]))
    return steps


def test_cumulative_outputs_are_the_deltas_added_up():
    """Each CUMULATIVE output (the last one with what is new joined) equals the DELTA outputs
    so far joined with `RequestOutput.add` (vLLM's rule)."""
    deltas, cumulative, whole = _kind_outputs("DELTA"), _kind_outputs("CUMULATIVE"), None
    assert [len(o) for o in deltas] == [len(o) for o in cumulative]
    for d, c in zip(deltas, cumulative):
        if d:
            whole = d[0] if whole is None else whole.add(d[0])
            assert c == [whole]
    assert whole.finished and [o.text for o in whole.outputs] == ["acdefg", "b"]
