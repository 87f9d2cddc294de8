"""Read a llama.cpp GGUF file (Llama or Qwen3) as an HF config dict (`gguf_hf_config`) and HF
tensors (`gguf_hf_tensors`: f32, renamed by `GGUF_TO_HF`, Q/K row permutation undone). Sources:
llama.cpp ``convert_hf_to_gguf.py`` (``LlamaModel.permute`` for ``llama``, not ``qwen3``; Llama 3
RoPE factors in ``rope_freqs``), ``gguf-py``, HF ``modeling_gguf_pytorch_utils.py``."""

import math
import os
import re
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

_QK_PERMUTED = {"llama": True, "qwen3": False}  # llama.cpp permutes the Q/K rows of llama's
SUPPORTED_GGUF_ARCHITECTURES = tuple(_QK_PERMUTED)

# The one GGUF -> HF tensor-name table; ``{i}`` is the layer index; None: read into the config.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_up": "mlp.up_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
}
GGUF_TO_HF: Mapping[str, str | None] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": None,
    **{f"blk.{{i}}.{g}.weight": f"model.layers.{{i}}.{h}.weight" for g, h in _LAYER_NAMES.items()},
}

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _reader_class():
    """``gguf.GGUFReader`` whose file map is read as a plain ndarray (the reader slices it once
    per metadata item, about 150,000 for a 49k-token vocabulary, and each slice of an
    ``np.memmap`` runs its Python ``__array_finalize__``) and whose little-endian arrays of
    strings or scalars are split into their items in one loop (`_array_parts`), not one
    ``_get_field_parts`` call per item. Same fields and tensors; tensor data are views of the
    same map."""
    import gguf

    class Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = value.view(np.ndarray)

        def _get_field_parts(self, offset: int, raw_type: int):
            if raw_type == gguf.GGUFValueType.ARRAY and self.byte_order == "I":
                if (parts := _array_parts(self, offset)) is not None:
                    return parts
            return super()._get_field_parts(offset, raw_type)

    return Reader


def _array_parts(reader, offset: int):
    """``GGUFReader._get_field_parts``' result (size, parts, data indices, types) for the
    little-endian array at ``offset`` of strings or scalars: its type and length, then per item
    its parts (a string: its uint64 length and its bytes; a scalar: a one-element array), all
    views of ``reader.data``; None for another item type (nested arrays). ValueError: the array
    runs past the end of the file."""
    from gguf import GGUFValueType

    data, raw = reader.data, memoryview(reader.data)
    item, n = reader._get(offset, np.uint32), reader._get(offset + 4, np.uint64)
    kind, count, at = GGUFValueType(int(item[0])), int(n[0]), offset + 12
    parts, types = [item, n], [GGUFValueType.ARRAY] + [kind] * (count > 0)  # as gguf's
    if kind == GGUFValueType.STRING:
        for _ in range(count):
            if at + 8 > data.size:
                break
            size = int.from_bytes(raw[at : at + 8], "little")
            parts += (data[at : at + 8].view(np.uint64), data[at + 8 : at + 8 + size])
            at += 8 + size
        if len(parts) < 2 + 2 * count or at > data.size:
            raise ValueError(f"the array at byte {offset} runs past the end of the file")
        return at - offset, parts, list(range(3, 2 * count + 2, 2)), types
    if (dtype := reader.gguf_scalar_to_np.get(kind)) is None:
        return None
    if (values := reader._get(at, dtype, count)).size < count:
        raise ValueError(f"the array at byte {offset} runs past the end of the file")
    parts += (values[i : i + 1] for i in range(count))
    return 12 + values.nbytes, parts, list(range(2, count + 2)), types


def open_gguf(path: str | os.PathLike):
    """``GGUFReader`` of ``path`` (`_reader_class`); FileNotFoundError: no file; ValueError: not
    GGUF or corrupt."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    try:
        return _reader_class()(path, "r")
    except (ValueError, OSError, IndexError, KeyError, TypeError, struct.error) as e:
        raise ValueError(
            f"{path!r} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from None


def _value(reader, key: str, default: Any = None) -> Any:
    """One metadata value (scalars as Python scalars, arrays as lists), or ``default``."""
    return default if (field := reader.fields.get(key)) is None else field.contents()


def gguf_eos_token_ids(reader) -> tuple[int, ...]:
    """``tokenizer.ggml.{eos,eot,eom}_token_id`` as present (llama.cpp's ``llama_vocab_is_eog``)."""
    ids = (_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
    return tuple(dict.fromkeys(int(v) for v in ids if v is not None))


def _arch_getter(reader, arch: str):
    """``get(key, default=None, required=False)``: the ``{arch}.{key}`` metadata value or
    ``default``; ValueError (named) when it is missing and ``required``."""

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        v = _value(reader, f"{arch}.{key}", default)
        if v is None and required:
            raise ValueError(f"GGUF metadata key {arch}.{key!r} is missing (architecture {arch!r})")
        return v

    return get


def _gguf_head_dim(get, arch: str, d: int, n: int) -> int:
    """The head dim: ``attention.key_length``, else ``rope.dimension_count``, else ``d // n``.
    ValueError: the value length differs from it; a rotary dimension other than it (partial)."""
    val_len, rot = get("attention.value_length"), get("rope.dimension_count")
    head_dim = int(get("attention.key_length") or rot or d // n)
    if val_len is not None and int(val_len) != head_dim:
        raise ValueError(
            f"GGUF {arch}.attention.value_length={val_len} differs from key length "
            f"{head_dim}; only equal K/V head dims are supported"
        )
    if rot is not None and int(rot) != head_dim:
        raise ValueError(
            f"GGUF {arch}.rope.dimension_count={rot} != head_dim={head_dim}: partial "
            f"rotary embeddings are not supported"
        )
    return head_dim


def _gguf_vocab(reader, get, arch: str, tensors: dict) -> int:
    """``vocab_size``, else the count of ``tokenizer.ggml.tokens``, else ``token_embd``'s rows;
    ValueError when none is there."""
    vocab = get("vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    if vocab is None and "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    if vocab is None:
        raise ValueError(
            f"GGUF has no {arch}.vocab_size, tokenizer.ggml.tokens or token_embd.weight"
        )
    return vocab


def _gguf_rope_scaling(get, arch: str, tensors: dict, theta: float, head_dim: int) -> dict | None:
    """HF ``rope_scaling`` from the Llama 3 factors in ``rope_freqs.weight`` (None: no such
    tensor, or all factors 1). ValueError: a ``rope.scaling.type`` other than none."""
    if (scaling_type := get("rope.scaling.type")) not in (None, "none"):
        raise ValueError(
            f"GGUF {arch}.rope.scaling.type={scaling_type!r} is not supported; "
            f"supported: none, or Llama 3 factors in rope_freqs.weight"
        )
    if (t := tensors.get("rope_freqs.weight")) is not None:
        import gguf

        factors = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
        return _llama3_scaling_from_factors(
            factors, theta, head_dim, get("rope.scaling.original_context_length")
        )
    return None


def gguf_hf_config(reader) -> dict:
    """An HF-style ``config.json`` dict from the GGUF ``{arch}.*`` metadata; V: ``vocab_size``, else
    ``tokenizer.ggml.tokens``, else ``token_embd``'s rows; tied iff no ``output.weight``; Llama 3
    RoPE scaling from ``rope_freqs.weight``. ValueError (named): an architecture not supported, a
    missing required key, partial rotary, K and V head dims differ, RoPE scaling not none/llama3."""
    arch = _value(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture general.architecture={arch!r}; "
            f"supported: {SUPPORTED_GGUF_ARCHITECTURES}"
        )
    get = _arch_getter(reader, arch)
    tensors = {t.name: t for t in reader.tensors}
    d, n = (int(get(k, required=True)) for k in ("embedding_length", "attention.head_count"))
    head_dim = _gguf_head_dim(get, arch, d, n)
    vocab = _gguf_vocab(reader, get, arch, tensors)
    theta = float(get("rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "model_type": arch,
        "architectures": [f"gguf:{arch}"],
        "vocab_size": int(vocab),
        "hidden_size": d,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": n,
        "num_key_value_heads": int(get("attention.head_count_kv", n)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        **{
            f"{k}_token_id": None
            if (i := _value(reader, f"tokenizer.ggml.{k}_token_id")) is None
            else int(i)
            for k in ("bos", "eos")
        },
    }
    if scaling := _gguf_rope_scaling(get, arch, tensors, theta, head_dim):
        cfg["rope_scaling"] = scaling
    return cfg


def _llama3_scaling_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, orig: int | None
) -> dict | None:
    """HF ``rope_scaling`` (llama3; None if all multipliers are 1) from llama.cpp's ``rope_freqs``
    f[H/2]: ``orig`` (None: 8192), ``low``/``high`` fitted from the smooth band or Llama 3's (1, 4),
    checked against Llama 3.1 ``apply_scaling``. ValueError: bad length; no llama3 fit."""
    if factors.shape != (head_dim // 2,):
        raise ValueError(
            f"rope_freqs.weight has shape {factors.shape}, expected ({head_dim // 2},)"
        )
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    orig, factor = int(orig or 8192), float(factors.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = orig / wavelen
    band = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    candidates = [(1.0, 4.0)]
    if band.sum() >= 2:
        s = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)  # smooth, linear in x
        slope, icpt = np.polyfit(x[band], s, 1)
        if slope > 0:
            low, high = -icpt / slope, -icpt / slope + 1 / slope
            candidates[:0] = [(round(low, 3), round(high, 3)), (float(low), float(high))]
    for low, high in (c for c in candidates if 0 < c[0] < c[1]):
        smooth = (x - low) / (high - low)
        ref = np.where(
            wavelen < orig / high,
            1.0,
            np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth)),
        )
        if np.allclose(ref, factors, rtol=1e-4, atol=1e-6):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig,
            }
    raise ValueError(
        "rope_freqs.weight does not match any Llama 3 RoPE scaling "
        f"(factor={factor}, original_context_length={orig}); unsupported RoPE scaling"
    )


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``LlamaModel.permute`` of q/k rows [n_heads*H, D]; same shape."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(
            f"cannot un-permute a tensor of {rows} rows into {n_heads} heads of even size"
        )
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_hf_tensors(reader, hf_config: Mapping[str, Any], out_dtype) -> dict[str, np.ndarray]:
    """Every weight by HF name (`GGUF_TO_HF`), dequantised, ``[out, in]``, Q/K unpermuted, cast
    singly to ``out_dtype``. ValueError: unknown name or quant type, a layer index past
    ``num_hidden_layers``, shape != header, two for one HF name."""
    import gguf

    arch, num_layers = hf_config["model_type"], int(hf_config["num_hidden_layers"])
    n, k = int(hf_config["num_attention_heads"]), int(hf_config["num_key_value_heads"])
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        m = _LAYER_RE.match(t.name)
        key, layer = (f"blk.{{i}}.{m.group(2)}", int(m.group(1))) if m else (t.name, None)
        if key not in GGUF_TO_HF:
            raise ValueError(f"unknown GGUF tensor {t.name!r}; known names: {sorted(GGUF_TO_HF)}")
        if layer is not None and layer >= num_layers:
            raise ValueError(
                f"GGUF tensor {t.name!r} has layer index {layer} >= block_count={num_layers}"
            )
        if (hf_name := GGUF_TO_HF[key]) is None:  # read into the config
            continue
        hf_name = hf_name.format(i=layer)
        if hf_name in out:
            raise ValueError(f"duplicate GGUF tensor for {hf_name!r} (from {t.name!r})")
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError as e:
            raise ValueError(
                f"GGUF tensor {t.name!r} has unsupported quantisation type "
                f"{t.tensor_type.name}: {e}"
            ) from e
        expect = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF dims are innermost-first
        if w.shape != expect:
            raise ValueError(
                f"GGUF tensor {t.name!r}: dequantised shape {w.shape} != header {expect}"
            )
        if _QK_PERMUTED[arch] and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute_qk(w, n if hf_name.endswith("q_proj.weight") else k)
        out[hf_name] = w.astype(out_dtype, copy=False)
    return out


def gguf_tokenizer(reader):
    """HF fast tokenizer of the ``tokenizer.*`` metadata (transformers' GGUF converter), or None."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        return None
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tok, config = (
        {
            name: meta[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in meta
        }
        for renames in GGUF_TOKENIZER_MAPPING.values()
    )
    if tok.get("tokenizer_type") == "llama":  # llama.cpp adds BOS unless the file says not to
        config.setdefault("add_bos_token", True)
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        config[f"{name}_token"] = None if i is None else tok["tokens"][int(i)]
    backend, extra = convert_gguf_tokenizer(_value(reader, "general.architecture"), tok)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
