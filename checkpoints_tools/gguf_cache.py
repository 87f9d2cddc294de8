"""A GGUF file converted once into an HF model directory in the user's cache, so that later opens
neither parse the GGUF's metadata nor convert its tokenizer: ``config.json`` (`gguf_hf_config`),
``generation_config.json`` (the GGUF's EOS ids), ``model.safetensors`` (the dequantised tensors,
float32, HF names) and the tokenizer's files. Root: ``$JAXINFER_GGUF_CACHE`` ("0": no cache), else
``$XDG_CACHE_HOME/jaxinfer/gguf`` (``~/.cache``). An entry is keyed by the file's absolute path,
size and modification time, and appears whole (written aside, then renamed)."""

import hashlib
import json
import os
import shutil
import tempfile

MAX_BYTES = 4 << 30  # float32 tensors of larger files are not cached


def entry(path: str) -> str | None:
    """The cache directory of GGUF file ``path`` (it may not exist yet); None: caching is off."""
    root = os.environ.get("JAXINFER_GGUF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxinfer", "gguf")
    if root == "0":
        return None
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()
    return os.path.join(root, hashlib.sha256(key).hexdigest()[:20])


def lookup(path: str) -> str | None:
    """``path``'s complete cache entry, or None."""
    d = entry(path)
    return d if d is not None and os.path.isfile(os.path.join(d, "model.safetensors")) else None


def store(ckpt, tokenizer) -> str | None:
    """Write the entry of opened GGUF `Checkpoint` ``ckpt`` with HF ``tokenizer`` (its tensors
    dequantised again); None: caching off, the tensors over `MAX_BYTES`, or the write failed
    (OSError: nothing is left behind, the GGUF stays the source)."""
    import numpy as np
    from safetensors.numpy import save_file

    from checkpoints_tools.gguf_loader import gguf_hf_config, gguf_hf_tensors

    d = entry(ckpt.path)
    if d is None or lookup(ckpt.path) or 4 * sum(
            int(np.prod(t.shape)) for t in ckpt.reader.tensors) > MAX_BYTES:
        return None
    tmp = None
    try:
        os.makedirs(os.path.dirname(d), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(d))
        config = gguf_hf_config(ckpt.reader)  # not ckpt.config: that may carry hf_overrides
        for name, obj in (("config.json", config),
                          ("generation_config.json", {"eos_token_id": list(ckpt.generation_eos_ids)})):
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(obj, f)
        save_file(gguf_hf_tensors(ckpt.reader, config, "float32"),
                  os.path.join(tmp, "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, d)
        return d
    except OSError:  # no space, read-only cache, or another process renamed its entry first
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        return None
