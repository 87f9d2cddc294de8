"""Convert an HF safetensors directory or a GGUF file into an Orbax checkpoint directory.

    python -m checkpoints_tools.convert SRC DST [--dtype bfloat16|float32]

DST then loads with ``checkpoints_tools.loader.load_model(DST)`` without any conversion work.
Errors (missing SRC, DST not empty, unsupported format or architecture, bad tensors) print one line
``error: ...`` on stderr and exit with status 2, without a traceback. SRC is checked (format, config,
architecture) before JAX is imported, so those errors are fast.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

EXIT_USAGE = 2


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def check_source(src: str) -> str:
    """Validate SRC without importing JAX; return its format ("hf" | "gguf").

    Raises:
        FileNotFoundError: SRC missing.
        ValueError: SRC is not HF/GGUF (an Orbax dir needs no conversion), or its architecture or
            config is unsupported.
    """
    from checkpoints_tools.loader import detect_format
    from jaxinfer.config import ModelConfig

    fmt = detect_format(src)
    if fmt == "orbax":
        raise ValueError(f"SRC {src!r} is already an Orbax checkpoint; nothing to convert")
    if fmt == "gguf":
        from checkpoints_tools.gguf_loader import gguf_hf_config, open_gguf

        ModelConfig.from_hf_config(gguf_hf_config(open_gguf(src)))
    else:
        ModelConfig.from_hf_dir(src)
    return fmt


def check_destination(dst: str) -> None:
    """Raises FileExistsError when DST exists and is not an empty directory."""
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise FileExistsError(f"DST {dst!r} exists and is not empty; choose a new directory")


def convert(src: str, dst: str, dtype: str = "bfloat16") -> None:
    """Load SRC (HF dir or GGUF file) with its tokenizer and save it as an Orbax checkpoint at DST.

    On failure DST is removed again if this call created it (or emptied if it was an empty dir).

    Raises:
        FileNotFoundError, FileExistsError, ValueError: see `check_source`, `check_destination`,
            and the loaders.
    """
    fmt = check_source(src)
    check_destination(dst)
    from checkpoints_tools import orbax_io
    from checkpoints_tools.loader import load_params, load_tokenizer

    tokenizer, gen_eos = load_tokenizer(src)
    cfg, params = load_params(src, dtype, fmt)
    created = not os.path.exists(dst)
    try:
        orbax_io.save(dst, cfg, params, tokenizer, gen_eos)
    except BaseException:
        if created:
            shutil.rmtree(dst, ignore_errors=True)
        elif os.path.isdir(dst):
            for name in os.listdir(dst):
                q = os.path.join(dst, name)
                shutil.rmtree(q, ignore_errors=True) if os.path.isdir(q) else os.remove(q)
        raise


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m checkpoints_tools.convert",
        description="Convert an HF safetensors directory or a GGUF file (Llama / Qwen3) into an "
                    "Orbax checkpoint directory that jaxinfer loads without conversion.")
    ap.add_argument("src", metavar="SRC", help="HF model directory (config.json + *.safetensors) "
                    "or a .gguf file")
    ap.add_argument("dst", metavar="DST", help="new (or empty) output directory")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="parameter dtype stored in the checkpoint (default: bfloat16)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        convert(args.src, args.dst, args.dtype)
    except (FileNotFoundError, FileExistsError, NotADirectoryError, ValueError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
