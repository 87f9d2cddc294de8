"""The server's LoRA adapters, as vLLM's (issue 48 item 1, stretch): ``--lora-modules``
adapters named by a request's ``model`` (outputs as `LLM.generate` with the same `LoRARequest`
on an in-process engine of the same configuration; tests/e2e/test_lora_engine.py checks that
against merged weights), /v1/models listing them, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` with vLLM's messages and statuses, and the CLI's option errors."""

import json

import pytest
from lora_adapters import write_adapter

from jaxinfer import LoRARequest, SamplingParams

from .conftest import KEY, MODEL, PROMPTS, SERVE_ENGINE, serve

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
    with pytest.raises(openai.NotFoundError, match="The model `a2` does not exist"):
        got("a2")
    with pytest.raises(openai.BadRequestError, match="lora_name"):  # a 400, not a 500
        post("/load_lora_adapter", body=dict(lora_name="", lora_path=paths["a2"]), cast_to=str)
    assert got(MODEL) == want(None)  # the server still answers


def test_lora_modules_option():
    from jaxinfer.serve.lora import parse_lora_modules

    spec = json.dumps({"name": "b", "path": "/p/b"})
    assert parse_lora_modules(["a=/p/a", spec]) == {"a": "/p/a", "b": "/p/b"}
    with pytest.raises(ValueError, match="--lora-modules 'a' is invalid"):
        parse_lora_modules(["a"])
    with pytest.raises(ValueError, match="empty or repeated name"):
        parse_lora_modules(["a=/x", "a=/y"])
