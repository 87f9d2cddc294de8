"""SpeculativeConfig (vLLM's ``speculative_config``): validation and vLLM's defaults, every error
naming its value; `from_value`'s forms; EngineConfig and the CLI/server flag; the counters
(`EngineStats`) and where they show (`LLM.get_metrics`, the server's `/metrics`, the CLI's
statistics line), on stand-ins: no model is loaded, nothing compiles."""

import dataclasses
import json
from types import SimpleNamespace

import pytest

from jaxinfer.config import EngineConfig, SpeculativeConfig, engine_config
from jaxinfer.stats import EngineStats

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
_SPEC_NAMES = ("drafts", "draft_tokens", "accepted_tokens")  # vllm:spec_decode_num_NAME


@pytest.mark.parametrize(
    "lookup, expect",
    [({}, (5, 5)), ({"prompt_lookup_max": 3}, (3, 3)), ({"prompt_lookup_min": 2}, (2, 2))],
)
def test_ngram_lookup_defaults_are_vllms(lookup, expect):
    """vLLM's ``SpeculativeConfig.__post_init__``: neither bound -> 5 and 5; one -> both."""
    sc = SpeculativeConfig(**NGRAM, **lookup)
    assert (sc.prompt_lookup_min, sc.prompt_lookup_max) == expect
    assert sc.model is None and sc.disable_by_batch_size is None


def test_model_methods(tmp_path):
    """A model without a method is a draft model (vLLM's default); eagle3 takes a file too."""
    sc = SpeculativeConfig(num_speculative_tokens=2, model=tmp_path)
    assert sc.method == "draft_model" and sc.model == str(tmp_path)
    (head := tmp_path / "head.safetensors").write_bytes(b"")
    sc = SpeculativeConfig(method="eagle3", num_speculative_tokens=3, model=str(head))
    assert sc.prompt_lookup_min is None and sc.prompt_lookup_max is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        sc.num_speculative_tokens = 1


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(NGRAM, method="medusa"), "method='medusa' is invalid: allowed: 'ngram', 'draft"),
        ({"num_speculative_tokens": 4}, "method=None is invalid: give method ('ngram'"),
        (
            {"method": "ngram"},
            "num_speculative_tokens=None is invalid: must be an integer >= 1 (required",
        ),
        (dict(NGRAM, num_speculative_tokens=0), "num_speculative_tokens=0 is invalid"),
        (dict(NGRAM, num_speculative_tokens=True), "num_speculative_tokens=True is invalid"),
        (dict(NGRAM, num_speculative_tokens="4"), "num_speculative_tokens='4' is invalid"),
        (dict(NGRAM, model="m"), "model='m' is invalid: method 'ngram'"),
        (dict(NGRAM, prompt_lookup_max=0), "prompt_lookup_max=0 is invalid: must be None or"),
        (dict(NGRAM, prompt_lookup_min=-1), "prompt_lookup_min=-1 is invalid"),
        (
            dict(NGRAM, prompt_lookup_min=4, prompt_lookup_max=3),
            "prompt_lookup_min=4 is invalid: must be <= prompt_lookup_max=3",
        ),
        (dict(NGRAM, disable_by_batch_size=0), "disable_by_batch_size=0 is invalid"),
        (dict(NGRAM, disable_by_batch_size=2.5), "disable_by_batch_size=2.5 is invalid"),
        (dict(NGRAM, draft_tensor_parallel_size=2), "draft_tensor_parallel_size=2 is invalid"),
        (dict(NGRAM, draft_tensor_parallel_size=True), "draft_tensor_parallel_size=True is"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2},
            "model=None is invalid: method 'draft_model' needs model",
        ),
        (
            {"method": "eagle3", "num_speculative_tokens": 2, "model": "/no/such/eagle3"},
            "model='/no/such/eagle3' is invalid: no such local directory or file",
        ),
        ({"num_speculative_tokens": 2, "model": 7}, "model=7 is invalid"),
    ],
)
def test_bad_values_name_the_field_and_value(kwargs, needle):
    with pytest.raises(ValueError, match="SpeculativeConfig") as e:
        SpeculativeConfig(**kwargs)
    assert needle in str(e.value), e.value


def test_lookup_bounds_are_ngram_only(tmp_path):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig(num_speculative_tokens=2, model=tmp_path, prompt_lookup_min=2)
    assert "prompt_lookup_min=2 is invalid: applies to method 'ngram' only" in str(e.value)


def test_from_value_forms():
    sc = SpeculativeConfig(**NGRAM)
    assert SpeculativeConfig.from_value(None) is None
    assert SpeculativeConfig.from_value(sc) is sc
    assert SpeculativeConfig.from_value(dict(NGRAM)) == sc
    assert SpeculativeConfig.from_value(json.dumps(NGRAM)) == sc


@pytest.mark.parametrize(
    "value, needle",
    [
        ("{bad", "speculative_config='{bad' is not valid JSON"),
        ("ngram", "speculative_config='ngram' is not valid JSON"),
        ("[1, 2]", "speculative_config='[1, 2]' is invalid: must be None, a dict, a JSON object"),
        (4, "speculative_config=4 is invalid"),
        (
            dict(NGRAM, draft_model_revision="main"),
            "unknown key(s) 'draft_model_revision'; allowed: method, num_speculative_tokens",
        ),
        (json.dumps(dict(NGRAM, method="suffix")), "method='suffix' is invalid: allowed:"),
    ],
)
def test_from_value_errors_name_the_value(value, needle):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_value(value)
    assert needle in str(e.value), e.value


def test_engine_config_normalises_it():
    """`LLM(speculative_config=...)`'s path (`engine_config`) and EngineConfig itself: a dict or
    a JSON string becomes a SpeculativeConfig; None stays None; replace keeps it."""
    sc = SpeculativeConfig(**NGRAM)
    assert EngineConfig().speculative_config is None
    assert engine_config(speculative_config=dict(NGRAM)).speculative_config == sc
    ec = EngineConfig(speculative_config=json.dumps(NGRAM))
    assert ec.speculative_config == sc
    assert dataclasses.replace(ec, seed=1).speculative_config == sc
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        EngineConfig(speculative_config=dict(NGRAM, num_speculative_tokens=0))


@pytest.mark.parametrize("module", ["jaxinfer.generate", "jaxinfer.serve.__main__"])
def test_cli_flag_round_trip(module):
    """``--speculative-config JSON`` on the CLI's and the server's parsers -> the EngineConfig the
    engine options build (`cli_args.make_llm` hands the same options to `LLM`); a bad value is
    the parser's one-line error naming the flag and the value."""
    import importlib

    from jaxinfer.cli_args import ENGINE_OPTIONS

    parser = importlib.import_module(module).build_parser()
    text = json.dumps(dict(NGRAM, prompt_lookup_max=3, disable_by_batch_size=8))
    args = parser.parse_args(["--speculative-config", text])
    ec = EngineConfig(**{n: v for n in ENGINE_OPTIONS if (v := getattr(args, n)) is not None})
    assert ec.speculative_config == SpeculativeConfig(
        **NGRAM, prompt_lookup_min=3, prompt_lookup_max=3, disable_by_batch_size=8
    )
    assert parser.parse_args([]).speculative_config is None
    with pytest.raises(ValueError) as e:
        parser.parse_args(["--speculative-config", '{"method": "ngram"'])
    msg = str(e.value)
    assert msg.startswith('argument --speculative-config: speculative_config=\'{"method"')
    assert "is not valid JSON" in msg and "\n" not in msg


def test_engine_stats_counters():
    s = EngineStats()
    assert s.spec_mean_acceptance_length == 1.0  # vLLM's compute_acceptance_len, no drafts
    assert s.accepted_per_pos(3) == [0, 0, 0]
    s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens = 4, 12, 6
    s.spec_accepted_per_pos = [3, 2, 1]
    assert s.spec_mean_acceptance_length == 2.5
    c = s.copy()
    c.spec_accepted_per_pos[0] += 1
    assert s.spec_accepted_per_pos == [3, 2, 1] and c.spec_num_drafts == 4
    assert s.accepted_per_pos(2) == [3, 2, 1]


def _engine(k: int | None, **counts):
    """A stand-in `LLMEngine`: ``resolved.engine.speculative_config`` with ``k`` drafts (None:
    none) and `stats()` holding ``counts``."""
    spec = None if k is None else SpeculativeConfig(**dict(NGRAM, num_speculative_tokens=k))
    stats = EngineStats(**counts)
    resolved = SimpleNamespace(engine=EngineConfig(speculative_config=spec))
    return SimpleNamespace(resolved=resolved, stats=stats.copy)


@pytest.mark.parametrize("k", [None, 3])
def test_get_metrics_names(k):
    """vLLM's four spec_decode names, at zero, with and without speculation; the per-position
    Vector has k values (padded: the engine may not have sized its list yet)."""
    from jaxinfer.llm import LLM, Counter, Vector

    counts = dict(spec_num_drafts=2, spec_num_draft_tokens=6, spec_num_accepted_tokens=3)
    for engine, per_pos in (
        (_engine(k), [0, 0, 0] if k else []),
        (_engine(k, **counts, spec_accepted_per_pos=[2, 1]), [2, 1, 0] if k else [2, 1]),
    ):
        got = {m.name: m for m in LLM.get_metrics(SimpleNamespace(engine=engine))}
        for name in _SPEC_NAMES:
            m = got[f"vllm:spec_decode_num_{name}"]
            assert isinstance(m, Counter) and m.value == getattr(engine.stats(), f"spec_num_{name}")
        m = got["vllm:spec_decode_num_accepted_tokens_per_pos"]
        assert isinstance(m, Vector) and m.labels == {} and m.values == per_pos


def test_server_metrics_spec_decode():
    """`core.engine_stats` carries the per-position counts as flat keys; /metrics exposes them
    as ``jaxinfer:spec_decode_*`` counters, the per-position one labelled ``position``."""
    pytest.importorskip("prometheus_client")
    pytest.importorskip("zmq")
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from jaxinfer.serve.core import engine_stats
    from jaxinfer.serve.metrics import ServerMetrics

    def scrape(engine) -> dict:
        text = generate_latest(ServerMetrics(SimpleNamespace(stats=engine_stats(engine))).registry)
        families = list(text_string_to_metric_families(text.decode()))
        return {
            f.name: {tuple(s.labels.items()): s.value for s in f.samples}
            for f in families
            if f.name.startswith("jaxinfer:spec_decode_")
        }

    off = scrape(_engine(None))
    assert off.pop("jaxinfer:spec_decode_num_accepted_tokens_per_pos") == {}
    assert off == {f"jaxinfer:spec_decode_num_{n}": {(): 0.0} for n in _SPEC_NAMES}
    on = scrape(
        _engine(
            3,
            spec_num_drafts=2,
            spec_num_draft_tokens=6,
            spec_num_accepted_tokens=3,
            spec_accepted_per_pos=[2, 1],
        )
    )
    assert on["jaxinfer:spec_decode_num_accepted_tokens_per_pos"] == {
        (("position", "0"),): 2.0,
        (("position", "1"),): 1.0,
        (("position", "2"),): 0.0,
    }
    assert [on[f"jaxinfer:spec_decode_num_{n}"][()] for n in _SPEC_NAMES] == [2.0, 6.0, 3.0]


@pytest.mark.parametrize("spec", [None, SpeculativeConfig(**NGRAM)])
def test_statistics_line(capsys, spec):
    """The CLI's statistics line ends with the mean acceptance length only with speculation."""
    from jaxinfer.generate import _print_stats

    stats = EngineStats(spec_num_drafts=4, spec_num_accepted_tokens=5)
    llm = SimpleNamespace(engine=SimpleNamespace(stats=stats.copy))
    args = SimpleNamespace(speculative_config=spec, verbose=False)
    out = SimpleNamespace(
        outputs=[SimpleNamespace(token_ids=[1, 2])], prompt_token_ids=[1], metrics=None
    )
    _print_stats(args, llm, [out], 1.0, (0.0, 0.0, 0.0))
    line = capsys.readouterr().err.strip()
    assert line.startswith("prompt tokens: 1, generated tokens: 2")
    assert line.endswith(", mean acceptance length: 2.25") == (spec is not None), line


def test_k_must_fit_the_token_budget_and_context():
    """k + 1 tokens a verified row: above min(max_num_batched_tokens, max_model_len) is refused
    when the engine's configuration is resolved (a huge k once ran out of memory at the step)."""
    from jaxinfer.config import ModelConfig, resolve

    model = ModelConfig("llama", 256, 64, 96, 2, 4, 2, 16, max_position_embeddings=128)
    spec = dict(NGRAM, num_speculative_tokens=100000)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=100000 .* = 128"):
        resolve(model, EngineConfig(speculative_config=spec), "cpu")
    ok = EngineConfig(speculative_config=dict(NGRAM, num_speculative_tokens=127))
    assert resolve(model, ok, "cpu").spec_decode_rows > 0
