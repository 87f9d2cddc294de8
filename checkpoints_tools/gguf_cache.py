"""A GGUF file converted once into a directory in the user's cache, so later opens neither parse
its metadata, convert its tokenizer, dequantise its tensors nor map them onto the param tree: an
HF-style directory (config.json, generation_config.json with the GGUF's EOS ids, the tokenizer's
files) whose weights are `PARAMS_FILE`, the float32 param tree already in jaxinfer's layout
(fused, transposed; safetensors, one tensor per slash-separated tree path). Root:
$JAXINFER_GGUF_CACHE ("0": off), else $XDG_CACHE_HOME (~/.cache)/jaxinfer/gguf; an entry is keyed
by the file's path, size and mtime and `LAYOUT`, and appears whole (written aside, then renamed).
This module imports nothing from `jaxinfer`: the tree is built and checked by
`jaxinfer.runner.loading`."""

import hashlib
import json
import os
import shutil
import tempfile
import threading

MAX_BYTES = 4 << 30  # float32 tensors of larger files are not cached
PARAMS_FILE = "jaxinfer_params.safetensors"
LAYOUT = 2  # bump when the param tree's layout changes: older entries are then not read
_FORMAT = "jaxinfer-gguf-cache"


def _root() -> str:
    return os.environ.get("JAXINFER_GGUF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxinfer", "gguf"
    )


def _key(path: str, layout: int) -> str:
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    key += f"|{layout}" if layout > 1 else ""  # layout 1: model.safetensors in HF layout
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def entry(path: str) -> str | None:
    """The cache directory of GGUF file ``path`` (it may not exist yet); None: caching is off."""
    root = _root()
    return None if root == "0" else os.path.join(root, _key(path, LAYOUT))


def lookup(path: str) -> str | None:
    """``path``'s complete cache entry, or None."""
    d = entry(path)
    return d if d is not None and os.path.isfile(os.path.join(d, PARAMS_FILE)) else None


def pending(path: str) -> str | None:
    """The entry that opening ``path`` would write: a GGUF file not converted yet (caching on),
    else None (converted already, caching off, or no ``.gguf`` file)."""
    if not str(path).lower().endswith(".gguf") or not os.path.isfile(path):
        return None
    d = entry(path)
    return d if d is not None and lookup(path) is None else None


def wanted(ckpt) -> bool:
    """Whether opened, uncached GGUF `Checkpoint` ``ckpt`` gets an entry: caching on, not
    converted yet, at most `MAX_BYTES` of float32 tensors, and its config the file's own (the
    entry's tree is mapped with it; ``hf_overrides`` may change it)."""
    import numpy as np

    from checkpoints_tools.gguf_loader import gguf_hf_config

    numel = sum(int(np.prod(t.shape)) for t in ckpt.reader.tensors)
    return (
        entry(ckpt.path) is not None
        and lookup(ckpt.path) is None
        and 4 * numel <= MAX_BYTES
        and ckpt.config == gguf_hf_config(ckpt.reader)
    )


def store(ckpt, tokenizer, flat: dict, wait: bool = True) -> threading.Thread | None:
    """Write GGUF `Checkpoint` ``ckpt``'s entry: its config and EOS ids, HF ``tokenizer`` and
    ``flat`` {tree path: float32 numpy array} (`PARAMS_FILE`). The small files are written here;
    the tensors by a thread, joined unless ``wait`` is False (then returned: a non-daemon thread,
    so the interpreter waits for it at exit; the arrays must not change meanwhile). Nothing is
    stored if caching is off or an OSError occurs (no space, a read-only cache, another process
    renamed its entry first): nothing is left behind then; None when nothing is to be written."""
    from checkpoints_tools.gguf_loader import gguf_hf_config

    d = entry(ckpt.path)
    if d is None or lookup(ckpt.path):
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
        tokenizer.save_pretrained(tmp)
    except OSError:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        return None
    old = os.path.join(os.path.dirname(d), _key(ckpt.path, 1))  # the HF-layout entry it replaces
    writer = threading.Thread(target=_finish, args=(tmp, d, flat, old), name="gguf-cache")
    writer.start()
    _writers.append(writer)
    if wait:
        join()
        return None
    return writer


_writers: list[threading.Thread] = []


def join() -> None:
    """Wait for every entry this process is writing (`store` with ``wait=False``)."""
    while _writers:
        _writers.pop().join()


def _finish(tmp: str, d: str, flat: dict, old: str) -> None:
    """`write_params` into ``tmp``, then rename it to entry ``d`` and drop entry ``old``; on an
    OSError, remove ``tmp``."""
    try:
        write_params(os.path.join(tmp, PARAMS_FILE), flat)
        os.rename(tmp, d)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return
    shutil.rmtree(old, ignore_errors=True)


def write_params(file: str, flat: dict) -> None:
    """``flat`` {name: float32 numpy array} as a safetensors file (its header's metadata names
    `_FORMAT` and `LAYOUT`), written straight from the arrays' memory (no serialised copy)."""
    import numpy as np

    header: dict = {"__metadata__": {"format": _FORMAT, "layout": str(LAYOUT)}}
    offset = 0
    for name, a in flat.items():
        if a.dtype != np.float32:
            raise ValueError(f"{name}: {a.dtype}, expected float32")
        header[name] = {
            "dtype": "F32",
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for a in flat.values():
            f.write(memoryview(np.ascontiguousarray(a)).cast("B"))


def read_params(d: str) -> dict | None:
    """Entry ``d``'s {tree path: float32 numpy array} (read-only views of the mapped file), or
    None when ``d`` holds no `PARAMS_FILE` (not an entry). ValueError: a file of another format
    or `LAYOUT`, or cut short."""
    import numpy as np

    file = os.path.join(d, PARAMS_FILE)
    if not os.path.isfile(file):
        return None
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    if header.pop("__metadata__", None) != {"format": _FORMAT, "layout": str(LAYOUT)}:
        raise ValueError(f"{file} is not a layout-{LAYOUT} {_FORMAT} file: delete {d!r}")
    data = np.memmap(file, np.uint8, "r", offset=8 + size).view(np.ndarray)
    out = {}
    for name, h in header.items():
        (lo, hi), shape = h["data_offsets"], tuple(h["shape"])
        if h["dtype"] != "F32" or hi > data.size or hi - lo != 4 * int(np.prod(shape)):
            raise ValueError(f"{file}: tensor {name!r} does not fit the file: delete {d!r}")
        out[name] = data[lo:hi].view(np.float32).reshape(shape)
    return out
