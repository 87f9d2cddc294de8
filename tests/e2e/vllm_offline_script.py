"""A vLLM user's offline-inference script, as written for vLLM, with only its imports changed
(``vllm`` -> ``jaxinfer``, ``vllm.inputs`` -> ``jaxinfer.inputs``). tests/e2e/test_vllm_api.py
runs `main` on the tiny model, adding jaxinfer's bucket choice (``engine_args``) so that its
steps share the compiled shapes of the other tiny engines; ``python
tests/e2e/vllm_offline_script.py MODEL_DIR`` runs it alone."""

import sys

from jaxinfer import LLM, SamplingParams
from jaxinfer.inputs import TextPrompt, TokensPrompt


def make_llm(model: str, **engine_args) -> LLM:
    """The `LLM` as a vLLM user builds it, with vLLM's arguments (``engine_args`` added)."""
    return LLM(
        model=model,
        task="generate",
        dtype="float32",
        trust_remote_code=False,
        seed=0,
        block_size=16,
        num_gpu_blocks_override=160,
        swap_space=4,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        pipeline_parallel_size=1,
        tensor_parallel_size=1,
        max_logprobs=5,
        tokenizer_mode="auto",
        disable_log_stats=True,
        hf_overrides={"max_position_embeddings": 512},
        compilation_config=None,
        enforce_eager=True,
        **engine_args,
    )


def chat_twice(llm: LLM, sampled: SamplingParams) -> tuple[list, list]:
    """``(chat, continued)``: a one-message chat, then the same chat continuing an assistant
    message "I"; each output printed as prompt -> text."""
    conversation = [{"role": "user", "content": "Hi!"}]
    chat = llm.chat(
        conversation, sampled, use_tqdm=False, chat_template_kwargs={"enable_thinking": False}
    )
    continued = llm.chat(
        conversation + [{"role": "assistant", "content": "I"}],
        sampled,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    for output in chat + continued:
        print(repr(output.prompt), "->", repr(output.outputs[0].text))
    return chat, continued


def main(model: str, **engine_args) -> dict:
    """Run the script on ``model``: the engine, its default sampling parameters, the greedy and
    sampled parameters, the outputs of a text and a token-id prompt and of the two chats."""
    llm = make_llm(model, **engine_args)
    defaults = llm.get_default_sampling_params()
    print("default sampling params:", defaults)

    greedy = SamplingParams(temperature=0.0, max_tokens=16, stop=None, stop_token_ids=None)
    greedy.max_tokens = 8
    sampled = greedy.clone()
    sampled.temperature, sampled.top_p, sampled.seed, sampled.logprobs = 0.8, 0.95, 1234, 2

    tokenizer = llm.get_tokenizer()
    prompts = [
        TextPrompt(prompt="Hello, my name is"),
        TokensPrompt(prompt_token_ids=tokenizer.encode("def add(a, b):")),
    ]
    outputs = llm.generate(prompts, [greedy, sampled], use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        print(
            f"{output.prompt!r} -> {completion.text!r} {completion.token_ids} "
            f"finish={completion.finish_reason} finished={completion.finished()}"
        )

    chat, continued = chat_twice(llm, sampled)
    return dict(
        llm=llm,
        defaults=defaults,
        greedy=greedy,
        sampled=sampled,
        outputs=outputs,
        chat=chat,
        continued=continued,
    )


if __name__ == "__main__":
    main(sys.argv[1])
