"""A GGUF file converted once into an HF model directory in the user's cache (config.json,
generation_config.json with the GGUF's EOS ids, float32 model.safetensors, the tokenizer's files),
so later opens neither parse its metadata nor convert its tokenizer. Root: $JAXINFER_GGUF_CACHE
("0": off), else $XDG_CACHE_HOME (~/.cache)/jaxinfer/gguf; an entry is keyed by the file's path,
size and mtime, and appears whole (written aside, then renamed)."""

import hashlib
import json
import os
import shutil
import tempfile

MAX_BYTES = 4 << 30  # float32 tensors of larger files are not cached


def entry(path: str) -> str | None:
    """The cache directory of GGUF file ``path`` (it may not exist yet); None: caching is off."""
    root = os.environ.get("JAXINFER_GGUF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxinfer", "gguf"
    )
    if root == "0":
        return None
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()
    return os.path.join(root, hashlib.sha256(key).hexdigest()[:20])


def lookup(path: str) -> str | None:
    """``path``'s complete cache entry, or None."""
    d = entry(path)
    return d if d is not None and os.path.isfile(os.path.join(d, "model.safetensors")) else None


def pending(path: str) -> str | None:
    """The entry that opening ``path`` would write: a GGUF file not converted yet (caching on),
    else None (converted already, caching off, or no ``.gguf`` file)."""
    if not str(path).lower().endswith(".gguf") or not os.path.isfile(path):
        return None
    d = entry(path)
    return d if d is not None and lookup(path) is None else None


def store(ckpt, tokenizer) -> str | None:
    """Write opened GGUF `Checkpoint` ``ckpt``'s entry with HF ``tokenizer`` (tensors dequantised
    again) -> its path; None: caching off, over `MAX_BYTES`, or an OSError (nothing left behind)."""
    import numpy as np
    from safetensors.numpy import save_file

    from checkpoints_tools.gguf_loader import gguf_hf_config, gguf_hf_tensors

    d = entry(ckpt.path)
    if (
        d is None
        or lookup(ckpt.path)
        or 4 * sum(int(np.prod(t.shape)) for t in ckpt.reader.tensors) > MAX_BYTES
    ):
        return None
    tmp = None
    try:
        os.makedirs(os.path.dirname(d), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(d))
        config = gguf_hf_config(ckpt.reader)  # not ckpt.config: that may carry hf_overrides
        for name, obj in (
            ("config.json", config),
            ("generation_config.json", {"eos_token_id": list(ckpt.generation_eos_ids)}),
        ):
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(obj, f)
        save_file(
            gguf_hf_tensors(ckpt.reader, config, "float32"), os.path.join(tmp, "model.safetensors")
        )
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, d)
        return d
    except OSError:  # no space, read-only cache, or another process renamed its entry first
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        return None
