"""The test suite's model definitions, importable from any test module (``from tiny_model import
TINY``: pytest puts ``tests/`` on ``sys.path``): the tiny random model for mechanics and the one
engine configuration of every SmolLM2 engine. Fixtures over them: tests/conftest.py."""

# V, D, F, L, N, K, H (`ModelConfig` field order): 2 layers, GQA 2, compiles in about a second
TINY = dict(
    architecture="qwen3",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
# every SmolLM2 engine of the run (in this process or a CLI subprocess) has this pool and these
# buckets, so a step shape compiles once and later engines load it from the run-wide cache
SMOLLM_ENGINE = dict(
    dtype="float32",
    max_model_len=512,
    page_size=16,
    num_pages=160,
    max_num_seqs=8,
    kernels="batch_buckets=8",
)  # one decode batch: fewer compiles
# the engine every tiny_llm starts from: float32, pages of 16 tokens, 8 rows, one batch bucket
TINY_ENGINE = dict(
    dtype="float32",
    max_model_len=256,
    page_size=16,
    num_pages=96,
    max_num_seqs=8,
    max_num_batched_tokens=128,
    kernels="batch_buckets=8,token_buckets=32:128",
)


def tiny_params_of(cfg, seed: int = 0):
    """Random float32 params of ``cfg`` with decisive logits: matrices N(0, 1/in), embedding
    N(0, 1), norms 1 (the HF init's N(0, 0.02) gives near-uniform logits, whose argmax can
    flip between batch compositions)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import models

    params = models.init_params(cfg, jax.random.key(seed), jnp.float32)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = [
        x
        if x.ndim < 2
        else jax.random.normal(k, x.shape, x.dtype)
        * (1.0 if x.shape[0] == cfg.vocab_size else x.shape[0] ** -0.5)
        for k, x in zip(keys, leaves)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


# ChatML, as SmolLM2's and Qwen's templates lay out a conversation
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A character-level HF fast tokenizer of 100 tokens, so that the tiny model's logits are
    small (sampling sorts the whole vocabulary every step): "<unk>" (0, any byte outside the
    vocabulary), "<|im_start|>" (1), "<|im_end|>" (2, EOS), then printable ASCII, space, newline
    and tab, one token each (byte-level, so decoding is exact), and the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(b) for b in range(0x21, 0x7F)] + ["Ġ", "Ċ", "ĉ"]  # ByteLevel's space, \n, \t
    vocab = {
        "<unk>": 0,
        "<|im_start|>": 1,
        "<|im_end|>": 2,
        **{c: i + 3 for i, c in enumerate(chars)},
    }
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    )


def tiny_text_config(tok):
    """`TINY` over the tiny tokenizer ``tok``'s vocabulary and EOS (Llama architecture)."""
    from jaxinfer.config import ModelConfig

    return ModelConfig(
        **dict(TINY, architecture="llama", vocab_size=len(tok), eos_token_ids=(tok.eos_token_id,))
    )


def tiny_serve_llm(engine_args: dict, text: str, compiles: int):
    """The server tests' engine, built in the engine-core process: the tiny text model (the
    ``tiny_text_cfg`` and ``tiny_text_params`` of tests/conftest.py, its tokenizer) over
    `TINY_ENGINE` updated with ``engine_args``, with the whole planned set precompiled
    (`LLM.precompile()`) and the prompt scorer (``prompt_logprobs``, ``echo``) at every (token
    bucket, prompt bucket): ``compiles`` programs. ``text``: a prompt the server tests send."""
    from jaxinfer import LLM

    tok = tiny_tokenizer()
    cfg = tiny_text_config(tok)
    llm = LLM.from_params(
        cfg, tiny_params_of(cfg), tokenizer=tok, **dict(TINY_ENGINE, **engine_args)
    )
    assert len(llm.get_tokenizer().encode(text)) > 0
    llm.precompile()
    b = llm.engine.runner.buckets
    llm.engine.runner.precompile({"prompt": [(t, p) for t in b.tokens for p in b.prompt if p <= t]})
    assert llm.engine.stats().num_compiles == compiles, llm.engine.stats().compiled_shapes
    return llm
