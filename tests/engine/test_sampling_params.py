"""SamplingParams: vLLM names/defaults, validation messages, normalisation (CASES.md C5)."""

import dataclasses
import json
import math

import pytest

from jaxinfer.sampling_params import SamplingParams


def test_defaults_match_vllm():
    # vLLM SamplingParams defaults for the fields we support.
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        1.0,
        1.0,
        -1,
        0.0,
        1.0,
    )
    assert (p.seed, p.max_tokens, p.stop, p.stop_token_ids) == (None, 16, (), ())
    assert (p.ignore_eos, p.skip_special_tokens) == (False, True)
    assert not p.greedy


@pytest.mark.parametrize(
    "t,greedy",
    [
        (0.0, True),
        (1e-6, True),
        (9.99e-6, True),
        (1e-5, False),
        (1e-4, False),
        (0.6, False),
        (2.0, False),
    ],
)
def test_greedy_threshold(t, greedy):
    assert SamplingParams(temperature=t).greedy is greedy


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("temperature", -0.1, ">= 0"),
        ("temperature", math.nan, ">= 0"),
        ("temperature", math.inf, ">= 0"),
        ("top_p", 0, "(0, 1]"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", -0.5, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_p", math.nan, "(0, 1]"),
        ("top_k", -2, ">= 1"),
        ("top_k", 2.5, ">= 1"),
        ("top_k", True, ">= 1"),
        ("min_p", -0.01, "[0, 1]"),
        ("min_p", 1.5, "[0, 1]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", -1.3, "> 0"),
        ("seed", 1.5, "integer"),
        ("seed", 2**63, "integer"),
        ("seed", "42", "integer"),
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", -3, ">= 1"),
        ("max_tokens", 4.0, ">= 1"),
        ("stop", "", "non-empty"),
        ("stop", ["ok", ""], "non-empty"),
        ("stop", [3], "non-empty"),
        ("stop_token_ids", [1, -2], ">= 0"),
        ("stop_token_ids", 5, ">= 0"),
        ("ignore_eos", 1, "bool"),
        ("skip_special_tokens", "yes", "bool"),
        ("n", 0, ">= 1"),
        ("min_tokens", -1, ">= 0"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3, "[-2, 2]"),
        ("logprobs", 21, "[0, 20]"),
        ("prompt_logprobs", -1, "[0, 20]"),
        ("logit_bias", {"a": 1.0}, "token id"),
        ("logit_bias", {5: float("inf")}, "finite"),
        ("include_stop_str_in_output", 1, "bool"),
    ],
)
def test_invalid_values_name_field_value_and_range(field, value, allowed):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    msg = str(e.value)
    assert f"SamplingParams.{field}={value!r} is invalid" in msg
    assert allowed in msg


def test_top_p_zero_message_exact():
    with pytest.raises(
        ValueError, match=r"^SamplingParams\.top_p=0 is invalid: must be in \(0, 1\]$"
    ):
        SamplingParams(top_p=0)


def test_case_c5_filters_that_keep_a_candidate_are_accepted():
    # CASES.md C5: top_p 0 rejected (above); these are valid and normalised.
    assert SamplingParams(temperature=0.6, top_k=1000, top_p=1e-9).top_p == 1e-9
    assert SamplingParams(top_k=1).top_k == 1
    assert SamplingParams(top_k=-1).top_k == -1


def test_boundaries_accepted():
    p = SamplingParams(
        temperature=0, top_p=1, min_p=1, repetition_penalty=1e-3, max_tokens=1, seed=-(2**63)
    )
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.min_p == 1.0 and p.seed == -(2**63)
    assert SamplingParams(min_p=0, seed=2**63 - 1).seed == 2**63 - 1


def test_stop_normalisation_and_mutability():
    """vLLM's SamplingParams is mutable (a msgspec Struct, unhashable): fields can be set after
    construction, ``clone()`` is a deep copy, ``dataclasses.replace`` validates again; stop=None
    and stop_token_ids=None (vLLM's defaults passed explicitly) mean none."""
    p = SamplingParams(stop="###", stop_token_ids=[7, 9])
    assert p.stop == ("###",) and p.stop_token_ids == (7, 9)
    q = SamplingParams(stop=["a", "bc"], stop_token_ids=(7, 9))
    assert q.stop == ("a", "bc") and q.stop_token_ids == (7, 9)
    assert p == SamplingParams(stop=("###",), stop_token_ids=(7, 9))
    assert SamplingParams(stop=None, stop_token_ids=None) == SamplingParams()
    p.top_p, p.extra_args = 0.5, {"k": [1]}
    c = p.clone()
    assert c == p and c is not p and c.extra_args is not p.extra_args
    c.extra_args["k"].append(2)
    assert p.extra_args == {"k": [1]}
    with pytest.raises(TypeError):
        hash(p)
    assert dataclasses.replace(p, top_p=0.25).top_p == 0.25
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=0)


def test_structured_outputs_params_one_constraint_normalised():
    from jaxinfer import StructuredOutputsParams as S

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert S(json=schema).json == json.dumps(schema) and S(json=schema).key == (
        "json",
        S(json=json.dumps(schema)).json,
    )
    assert S(choice=["x", "y"]).choice == ("x", "y") and S(choice=["x"]).key == ("choice", '["x"]')
    assert S(json_object=True).key == ("json_object", "True")
    p = SamplingParams(structured_outputs=S(regex="[0-9]+"))
    assert p == SamplingParams(structured_outputs=S(regex="[0-9]+"))
    for kw, msg in (
        ({}, "got none"),
        (dict(regex="a", grammar="b"), r"\['regex', 'grammar'\]"),
        (dict(choice=[]), "choice=.*non-empty list of non-empty strings"),
        (dict(choice=["a", 1]), "non-empty list of non-empty strings"),
        (dict(choice="yes"), "choice='yes' is invalid: must be a non-empty list"),
        (dict(choice=[""]), "non-empty list of non-empty strings"),
        (dict(json=3), "json=3 is invalid: must be a dict or a JSON string"),
        (dict(json_object="yes"), "json_object='yes' is invalid: must be True"),
        (dict(regex=b"a"), "regex=b'a' is invalid: must be a string"),
    ):
        with pytest.raises(ValueError, match=msg):
            S(**kw)
    with pytest.raises(ValueError, match="structured_outputs=.*StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
