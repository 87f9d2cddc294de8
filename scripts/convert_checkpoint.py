"""``python scripts/convert_checkpoint.py SRC DST [--dtype bfloat16|float32]``: an HF safetensors
directory or a GGUF file -> an Orbax checkpoint directory that ``load_model`` reads without
conversion (`save_checkpoint`; the layout: `checkpoints_tools.orbax_io`). Errors: one line
``error: ...`` on stderr, exit status 2 (SRC checked before any tensor is read)."""

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer.cli_args import Parser, fail  # noqa: E402


def save_checkpoint(dst: str | os.PathLike, cfg, params, tokenizer, eos_ids) -> None:
    """Write ``params`` (one dtype, fitting ``cfg``, a `ModelConfig`), an HF ``tokenizer`` (or
    None) and the generation ``eos_ids`` as an Orbax checkpoint that `load_model` reads back, in
    a new or empty ``dst``; its ``jaxinfer_config.json`` last, atomically. FileExistsError: ``dst``
    not empty; ValueError: params misfit ``cfg``, mixed dtypes."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from checkpoints_tools import orbax_io
    from checkpoints_tools.mapping import tree_mismatches
    from jaxinfer.models import abstract_params

    dst = os.path.abspath(os.fspath(dst))
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise FileExistsError(f"destination {dst!r} exists and is not an empty directory")
    abstract = abstract_params(cfg, jax.tree_util.tree_leaves(params)[0].dtype)
    if bad := tree_mismatches(abstract, params):
        raise ValueError(f"params do not match the config: {'; '.join(bad)}")
    dtypes = {np.dtype(x.dtype).name for x in jax.tree_util.tree_leaves(params)}
    if len(dtypes) != 1:
        raise ValueError(f"params mix dtypes {sorted(dtypes)}; expected one dtype")
    os.makedirs(dst, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(dst, orbax_io.PARAMS_DIR), params)
        ckptr.wait_until_finished()
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(dst, orbax_io.TOKENIZER_DIR))
    meta = {
        "format": orbax_io.FORMAT_NAME,
        "version": orbax_io.FORMAT_VERSION,
        "model_config": cfg.to_dict(),
        "eos_token_ids": [int(t) for t in eos_ids],
        "dtype": dtypes.pop(),
    }
    tmp = os.path.join(dst, orbax_io.CONFIG_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, os.path.join(dst, orbax_io.CONFIG_FILE))


def convert(src: str, dst: str, dtype: str = "bfloat16") -> None:
    """Save SRC (HF dir or GGUF file), its tokenizer and EOS ids as an Orbax checkpoint at DST
    (removed on failure; left empty if it was). FileNotFoundError: no SRC; FileExistsError: DST
    not empty; ValueError: SRC not HF/GGUF, unsupported, bad tensors, or no tokenizer."""
    from checkpoints_tools.loader import open_checkpoint
    from jaxinfer.config import ModelConfig
    from jaxinfer.runner.loading import load_model

    ckpt = open_checkpoint(src)
    if ckpt.format == "orbax":
        raise ValueError(f"SRC {src!r} is already an Orbax checkpoint; nothing to convert")
    ModelConfig.from_checkpoint(ckpt)  # an unsupported config fails before DST is looked at
    existed = os.path.exists(dst)
    if existed and (not os.path.isdir(dst) or os.listdir(dst)):
        raise FileExistsError(f"DST {dst!r} exists and is not empty; choose a new directory")
    m = load_model(ckpt, dtype)
    try:
        save_checkpoint(dst, m.config, m.params, m.tokenizer, ckpt.generation_eos_ids)
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)
        if existed:  # it was an empty directory: leave it so
            os.makedirs(dst, exist_ok=True)
        raise


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(
        "python scripts/convert_checkpoint.py",
        "Convert an HF safetensors directory or a GGUF file "
        "(Llama / Qwen3) into an Orbax checkpoint directory that jaxinfer loads without "
        "conversion.",
    )
    ap.add_argument(
        "src",
        metavar="SRC",
        help="HF model directory (config.json + *.safetensors) or a .gguf file",
    )
    ap.add_argument("dst", metavar="DST", help="new (or empty) output directory")
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="parameter dtype stored in the checkpoint",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
        convert(args.src, args.dst, args.dtype)
    except (FileNotFoundError, FileExistsError, NotADirectoryError, ValueError) as e:
        return fail(str(e) or type(e).__name__)
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
