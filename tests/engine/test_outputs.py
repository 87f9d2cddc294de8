"""OutputProcessor (host only): stop-string matching, streamed deltas and RequestOutput text follow
vLLM's rules with a toy detokenizer (token id t -> chr(t); id 1 decodes to an incomplete
character until the next token)."""

from jaxinfer.engine.sequence import Sequence, SequenceStatus
from jaxinfer.outputs import OutputProcessor
from jaxinfer.sampling_params import SamplingParams


def detok(ids):
    text = "".join(chr(t) for t in ids if t != 1)
    return text + "\ufffd" if ids and ids[-1] == 1 else text


def _seq(text, **params):
    return Sequence("r", [65], SamplingParams(max_tokens=50, **params), seed=0,
                    output_token_ids=[ord(c) if c != "?" else 1 for c in text])


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
    assert out.stream_delta(s, sent) is None                      # no new token
    assert out.stream_delta(_seq("ab?"), (0, "")) is None         # incomplete character waits
    s = _seq("abcSTOPxy", stop=["STOP"])
    s.stop_string, s.status, s.finish_reason = "STOP", SequenceStatus.FINISHED, "stop"
    ids, text, _ = out.stream_delta(s, (5, "ab"))
    assert text == "c" and len(ids) == 4                           # never the stop string


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
