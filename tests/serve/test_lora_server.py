"""The server's LoRA adapters, as vLLM's (issue 48 item 1, stretch): ``--lora-modules``
adapters named by a request's ``model`` (outputs as `LLM.generate` with the same `LoRARequest`
on an in-process engine of the same configuration; tests/e2e/test_lora_engine.py checks that
against merged weights), responses naming the adapter in ``model``, /v1/models listing them,
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` with vLLM's messages and statuses (a
bad adapter_config.json or weights file refused there), adapter errors of a request naming
``model``, and the CLI's option errors (an adapter named as the served model, a bad adapter:
exit code 2)."""

import json
import shutil

import pytest
from lora_adapters import write_adapter

from jaxinfer import LoRARequest, SamplingParams

from .conftest import KEY, MODEL, PROMPTS, SERVE_ENGINE, SERVER_COMPILES, serve

LORA_ENGINE = dict(SERVE_ENGINE, enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def paths(tmp_path_factory, tiny_text_cfg):
    root = tmp_path_factory.mktemp("served")
    for i, name in enumerate(("a1", "a2")):
        write_adapter(root / name, tiny_text_cfg, 4, 10 + i, ("q_proj", "v_proj", "down_proj"))
    return {n: str(root / n) for n in ("a1", "a2")}


@pytest.fixture(scope="module")
def lora_server(tiny_llm, paths):
    llm = tiny_llm(max_compiles=8, **LORA_ENGINE)
    yield from serve(llm, LORA_ENGINE, lora_modules={"a1": paths["a1"]})


def test_served_adapters(lora_server, paths):
    import openai

    client = openai.OpenAI(base_url=lora_server.url, api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL, "a1"]
    sp = SamplingParams(temperature=0, max_tokens=8)

    def want(lora):
        return lora_server.llm.generate(PROMPTS[0], sp, lora_request=lora)[0].outputs[0].text

    def got(model):
        r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        return r.choices[0].text

    assert got("a1") == want(LoRARequest("a1", 1, paths["a1"])) != got(MODEL) == want(None)
    post = client.post
    msg = post("/load_lora_adapter", body=dict(lora_name="a2", lora_path=paths["a2"]), cast_to=str)
    assert msg == "Success: LoRA adapter 'a2' added successfully."
    assert got("a2") == want(LoRARequest("a2", 2, paths["a2"]))
    with pytest.raises(openai.BadRequestError, match="'a2' has already been loaded"):
        post("/load_lora_adapter", body=dict(lora_name="a2", lora_path=paths["a2"]), cast_to=str)
    msg = post("/unload_lora_adapter", body=dict(lora_name="a2"), cast_to=str)
    assert msg == "Success: LoRA adapter 'a2' removed successfully."
    with pytest.raises(openai.NotFoundError, match="'a2' cannot be found"):
        post("/unload_lora_adapter", body=dict(lora_name="a2"), cast_to=str)
    with pytest.raises(openai.NotFoundError, match=f"`a2` does not exist.*`{MODEL}`, `a1`"):
        got("a2")  # the served names listed, adapters too
    with pytest.raises(openai.BadRequestError, match="lora_name"):  # a 400, not a 500
        post("/load_lora_adapter", body=dict(lora_name="", lora_path=paths["a2"]), cast_to=str)
    with pytest.raises(openai.BadRequestError, match="is the served model's name") as e:
        post("/load_lora_adapter", body=dict(lora_name=MODEL, lora_path=paths["a2"]), cast_to=str)
    assert e.value.body["param"] == "lora_name"
    assert got(MODEL) == want(None)  # the server still answers


def test_without_enable_lora_the_endpoints_say_so(client):
    """A server started without --enable-lora: /v1/load_lora_adapter and
    /v1/unload_lora_adapter answer OpenAI's error JSON, a 400 naming --enable-lora (not a bare
    404 "Not Found")."""
    import openai

    for path, body in (
        ("/load_lora_adapter", dict(lora_name="a1", lora_path="/x")),
        ("/unload_lora_adapter", dict(lora_name="a1")),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.post(path, body=body, cast_to=str)
        err = e.value.body
        assert err["type"] == "invalid_request_error", err
        assert "the server was started without --enable-lora" in err["message"], err


def test_lora_modules_option():
    from jaxinfer.serve.lora import parse_lora_modules

    spec = json.dumps({"name": "b", "path": "/p/b"})
    assert parse_lora_modules(["a=/p/a", spec]) == {"a": "/p/a", "b": "/p/b"}
    with pytest.raises(ValueError, match="--lora-modules 'a' is invalid"):
        parse_lora_modules(["a"])
    with pytest.raises(ValueError, match="empty or repeated name"):
        parse_lora_modules(["a=/x", "a=/y"])


def test_responses_name_the_adapter(lora_server):
    """vLLM's echo: the ``model`` of completions and chat, streamed and not, is the adapter the
    request named (the base model's name for the base model)."""
    import openai

    client = openai.OpenAI(base_url=lora_server.url, api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    for model in ("a1", MODEL):
        args = dict(model=model, max_tokens=2, temperature=0)
        assert client.completions.create(prompt="Hi", **args).model == model
        assert client.chat.completions.create(messages=msgs, **args).model == model
        chunks = [*client.completions.create(prompt="Hi", stream=True, **args)]
        chunks += [*client.chat.completions.create(messages=msgs, stream=True, **args)]
        assert len(chunks) > 2 and {c.model for c in chunks} == {model}


def test_load_checks_the_adapter_config(lora_server, tiny_text_cfg, tmp_path):
    """/v1/load_lora_adapter answers 400 with the reason (param lora_path, the path in the
    message) and serves none of: a rank above --max-lora-rank (8), a malformed
    adapter_config.json, weights whose rank is not the config's r, a corrupt weights file,
    weights shaped for another model (its hidden size, its layer count), weights of a module
    target_modules does not name (read in the API process, as the engine core's first use
    does). An adapter whose weights break after a good load: a request naming it is a 400
    whose param is "model" (the engine core's read) and the server still answers."""
    import dataclasses

    import openai

    client = openai.OpenAI(base_url=lora_server.url, api_key=KEY, max_retries=0)
    write_adapter(tmp_path / "big", tiny_text_cfg, 16, 3, ("q_proj",))
    write_adapter(tmp_path / "bad", tiny_text_cfg, 4, 3, ("q_proj",))
    (tmp_path / "bad" / "adapter_config.json").write_text('{"r": 4,')
    write_adapter(tmp_path / "mis", tiny_text_cfg, 4, 3, ("q_proj",))
    config = tmp_path / "mis" / "adapter_config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), r=2)))
    write_adapter(tmp_path / "torn", tiny_text_cfg, 4, 3, ("q_proj",))
    (tmp_path / "torn" / "adapter_model.safetensors").write_bytes(b"\xff" * 64)  # corrupt
    wide = dataclasses.replace(tiny_text_cfg, hidden_size=tiny_text_cfg.hidden_size * 2)
    write_adapter(tmp_path / "wide", wide, 4, 3, ("q_proj",))
    deep = dataclasses.replace(tiny_text_cfg, num_layers=tiny_text_cfg.num_layers + 1)
    write_adapter(tmp_path / "deep", deep, 4, 3, ("q_proj",))
    write_adapter(tmp_path / "extra", tiny_text_cfg, 4, 3, ("q_proj", "v_proj"))
    config = tmp_path / "extra" / "adapter_config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), target_modules=["q_proj"])))
    L = tiny_text_cfg.num_layers
    for name, fault in (
        ("big", "r=16 is invalid"),
        ("bad", "is not valid JSON"),
        ("mis", "has shape"),
        ("torn", "cannot be read"),
        ("wide", r"q_proj.lora_A.weight' has shape"),
        ("deep", f"layer {L} >= the model's {L} layers"),
        ("extra", r"holds modules \['v_proj'\] that .* target_modules \['q_proj'\]"),
    ):
        body = dict(lora_name=name, lora_path=str(tmp_path / name))
        with pytest.raises(openai.BadRequestError, match=fault) as e:
            client.post("/load_lora_adapter", body=body, cast_to=str)
        assert e.value.body["param"] == "lora_path"
        assert e.value.body["message"].startswith(f"LoRA adapter '{name}' ('{tmp_path / name}'): ")
    assert [m.id for m in client.models.list().data] == [MODEL, "a1"]
    write_adapter(tmp_path / "later", tiny_text_cfg, 4, 3, ("q_proj",))
    body = dict(lora_name="later", lora_path=str(tmp_path / "later"))
    client.post("/load_lora_adapter", body=body, cast_to=str)
    (tmp_path / "later" / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    try:
        with pytest.raises(openai.BadRequestError, match="cannot be read") as e:
            client.completions.create(model="later", prompt="Hi", max_tokens=2)
        assert e.value.body["param"] == "model"
        later = f"LoRA adapter 'later' ('{tmp_path / 'later'}'): adapter_model.safetensors cannot"
        assert e.value.body["message"].startswith(later)
    finally:
        client.post("/unload_lora_adapter", body=dict(lora_name="later"), cast_to=str)
    assert client.completions.create(model="a1", prompt="Hi", max_tokens=2).choices[0].text


def test_adapter_named_as_the_model_or_bad_is_refused_at_start(
    paths, tiny_text_cfg, tmp_path, capsys
):
    """``--lora-modules`` with the served model's name (it would hide the base model), or an
    adapter of rank above --max-lora-rank: one line, exit code 2, before any model loads
    (`check_lora_modules`); `ServedLoRAs` refuses the name too (the name known once the core
    is up)."""
    from jaxinfer.serve.__main__ import main
    from jaxinfer.serve.lora import ServedLoRAs

    base = ["--enable-lora", "--served-model-name", MODEL, "--max-lora-rank", "8"]
    assert main([*base, "--lora-modules", f"{MODEL}={paths['a1']}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --lora-modules {MODEL}=")
    assert "the served model's name" in err[0]
    write_adapter(tmp_path / "big", tiny_text_cfg, 16, 0, ("q_proj",))
    assert main([*base, "--lora-modules", f"big={tmp_path / 'big'}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "r=16 is invalid" in err[0] and "max_lora_rank=8" in err[0]
    with pytest.raises(ValueError, match="the served model's name"):
        ServedLoRAs(MODEL, {MODEL: paths["a1"]}, 8)


def test_lora_modules_weights_checked_at_start(tiny_text_cfg, tmp_path, capsys):
    """A ``--lora-modules`` adapter whose config passes but whose weights are not the served
    model's (one layer too many): refused once the engine core is up and has said the model's
    shape (its ``lora_model``), before the server serves: one line, exit code 2."""
    import dataclasses
    import functools

    from tiny_model import tiny_serve_llm

    from jaxinfer.serve.__main__ import main

    deep = dataclasses.replace(tiny_text_cfg, num_layers=tiny_text_cfg.num_layers + 1)
    write_adapter(tmp_path / "deep", deep, 4, 3, ("q_proj",))
    factory = functools.partial(tiny_serve_llm, LORA_ENGINE, " ".join(PROMPTS), SERVER_COMPILES)
    argv = ["--enable-lora", "--served-model-name", MODEL, "--max-lora-rank", "8"]
    assert main([*argv, "--lora-modules", f"deep={tmp_path / 'deep'}"], factory) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    L = tiny_text_cfg.num_layers
    assert len(err) == 1 and err[0].startswith(f"error: --lora-modules deep={tmp_path}"), err
    assert f"layer {L} >= the model's {L} layers" in err[0], err


def test_cli_lora_path(
    lora_server, paths, tiny_text_cfg, tiny_text_params, monkeypatch, capsys, tmp_path
):
    """``python -m jaxinfer.generate --lora-path PATH``: every prompt runs with the adapter (its
    texts as `LLM.generate` with the same adapter, unlike the base model's), enable_lora is on;
    a bad adapter is one line and exit code 2 (before the model loads; a corrupt weights file
    with the first request). The CLI's engine: a new
    one of the server test's configuration (its steps from the run's compilation cache), whose
    id 1 is free for the CLI's LoRARequest("cli", 1, PATH)."""
    from tiny_model import TINY_ENGINE

    import jaxinfer.llm
    from jaxinfer import LLM, generate

    seen, tok = {}, lora_server.llm.tokenizer

    def fresh(*_, **kwargs):
        seen.update(kwargs)
        args = dict(TINY_ENGINE, **LORA_ENGINE)
        return LLM.from_params(tiny_text_cfg, tiny_text_params, tokenizer=tok, **args)

    monkeypatch.setattr(jaxinfer.llm, "LLM", fresh)
    argv = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-tokens", "8", "--json"]
    assert generate.main([*argv, "--lora-path", paths["a1"], "--max-lora-rank", "8"]) == 0
    texts = [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()]
    sp, a1 = SamplingParams(temperature=0, max_tokens=8), LoRARequest("a1", 1, paths["a1"])
    outs = lora_server.llm.generate(PROMPTS[:2], sp, lora_request=a1)
    assert texts == [o.outputs[0].text for o in outs]
    assert texts != [o.outputs[0].text for o in lora_server.llm.generate(PROMPTS[:2], sp)]
    assert seen["enable_lora"] is True and seen["max_lora_rank"] == 8
    seen.clear()
    assert generate.main([*argv, "--lora-path", "/no/such/adapter"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: LoRA adapter '/no/such/adapter': no such directory"] and not seen
    torn = tmp_path / "torn"  # its config passes; its weights are read with the first request
    shutil.copytree(paths["a1"], torn)
    (torn / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    assert generate.main([*argv, "--lora-path", str(torn), "--max-lora-rank", "8"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and "cannot be read" in err[0] and str(torn) in err[0]


def test_cli_lora_path_flags(paths, monkeypatch, capsys):
    """Before the model loads, one line and exit code 2: an invalid --max-lora-rank (not the
    adapter's r measured against it), --no-enable-lora with --lora-path, --lora-path twice."""
    import jaxinfer.llm
    from jaxinfer import generate

    def no_model(*_, **kwargs):
        raise AssertionError("the model loads")

    monkeypatch.setattr(jaxinfer.llm, "LLM", no_model)
    argv = ["--prompt", PROMPTS[0], "--lora-path", paths["a1"]]
    for extra, want in (
        (["--max-lora-rank", "-1"], "EngineConfig.max_lora_rank=-1 is invalid: must be a positive"),
        (["--no-enable-lora"], f"--lora-path {paths['a1']!r} needs LoRA on: drop --no-enable-lora"),
        (
            ["--lora-path", paths["a2"]],
            f"argument --lora-path: given twice ({paths['a1']!r}, {paths['a2']!r}): allowed once",
        ),
    ):
        assert generate.main([*argv, *extra]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {want}"), err
